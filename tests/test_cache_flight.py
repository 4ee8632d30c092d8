"""Source reads in flight, counted exactly across processes (hpcstagger.cache._flight)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from hpcstagger.cache import CachedDataset, ShmCache
from hpcstagger.errors import CacheError

FORK = mp.get_context("fork")


def _hold(name: str, start, stop, held) -> None:
    cache = ShmCache(name, None)
    with cache.reading():
        start.set()
        t = time.perf_counter()
        stop.wait(30)
        held.put(time.perf_counter() - t)
    cache.close()


def _read_and_hang(name: str, started) -> None:
    cache = ShmCache(name, None)
    with cache.reading():
        started.set()
        time.sleep(600)


def _grown(before: list[float], after: list[float]) -> list[float]:
    return [b - a for a, b in zip(before, after, strict=True)]


@pytest.mark.timeout(60)
def test_reads_of_two_processes_are_integrated_at_each_count(shm_root):
    cache = ShmCache("fl", 1 << 20)
    cache.watch(60)
    start, stop, held = FORK.Event(), FORK.Event(), FORK.Queue()
    before = cache.flight_seconds()
    with cache.reading():
        time.sleep(0.15)
        child = FORK.Process(target=_hold, args=("fl", start, stop, held))
        child.start()
        assert start.wait(30)
        time.sleep(0.2)
        stop.set()
        both = held.get(timeout=30)
        child.join(30)
        time.sleep(0.15)
    spent = _grown(before, cache.flight_seconds())
    assert spent[1] == pytest.approx(both, abs=0.05)  # two in flight while the child read
    assert 0.3 <= spent[0] < 0.3 + 1.0  # one in flight before and after
    assert sum(spent[2:]) == 0
    idle = cache.flight_seconds()
    time.sleep(0.1)
    assert cache.flight_seconds() == idle  # nothing in flight: nothing grows


@pytest.mark.timeout(60)
def test_a_process_killed_mid_read_stops_counting(shm_root):
    cache = ShmCache("fk", 1 << 20)
    cache.watch(60)
    with cache.reading():  # this process sweeps now, so its next sweep is half a second away
        pass
    started = FORK.Event()
    child = FORK.Process(target=_read_and_hang, args=("fk", started))
    child.start()
    assert started.wait(30)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    with cache.reading():  # still counts the dead reader: no sweep yet
        time.sleep(0.6)
    # leaving swept: the dead process no longer counts
    before = cache.flight_seconds()
    with cache.reading():
        time.sleep(0.2)
    spent = _grown(before, cache.flight_seconds())
    assert spent[0] == pytest.approx(0.2, abs=0.05) and spent[1] == 0


class _Slow:
    """A source whose every read takes 20 ms."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> bytes:
        time.sleep(0.02)
        return bytes([i]) * 1000

    def key(self, i: int) -> int:
        return i


@pytest.mark.timeout(120)
def test_a_dataloader_s_workers_reads_are_counted_in_flight(shm_root):
    import torch

    cache = ShmCache("dlf", 1 << 20)
    cache.watch(60)
    loader = torch.utils.data.DataLoader(CachedDataset(_Slow(), cache, lambda b: len(b)), batch_size=4,
                                         num_workers=2, multiprocessing_context="fork")
    assert sum(int(b.sum()) for b in loader) == 24 * 1000
    spent = cache.flight_seconds()
    read_s = cache.stats()["read_seconds"]
    # every read was in flight (read-seconds match), never more than the two workers' at once
    assert sum(k * t for k, t in enumerate(spent, 1)) == pytest.approx(read_s, rel=0.2)
    assert spent[0] > 0 and spent[1] > 0 and sum(spent[2:]) == 0


@pytest.mark.timeout(60)
def test_reads_are_counted_only_while_watched(shm_root):
    cache = ShmCache("fw", 1 << 20)
    before = cache.flight_seconds()
    with cache.reading():  # nobody watches: not counted, and no lock taken
        time.sleep(0.1)
    assert cache.flight_seconds() == before
    cache.watch(0.3)
    other = ShmCache("fw", None)
    other.watch(0.05)  # a shorter request never cuts another watcher's short
    with other.reading():  # counted: watched, from another handle (any process of the cache)
        time.sleep(0.1)
        with cache.reading():  # two in flight, and still counted to its end after the watch lapses
            time.sleep(0.3)
    spent = _grown(before, cache.flight_seconds())
    assert spent[0] == pytest.approx(0.1, abs=0.05) and spent[1] == pytest.approx(0.3, abs=0.05)
    assert sum(spent[2:]) == 0
    time.sleep(0.05)
    after = cache.flight_seconds()
    with cache.reading():  # the watch has lapsed: not counted again
        time.sleep(0.05)
    assert cache.flight_seconds() == after
    other.close()
    cache.close()
    with pytest.raises(CacheError, match="closed"):
        cache.watch(1.0)
