"""One read per sample on the node: concurrent misses of a sample across real processes are one read
(``ShmCache.read_through``), and a waiter reads the sample itself when the reader cannot deliver."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
from torch.utils.data import DataLoader

from hpcstagger.cache import CachedDataset, ShmCache
from hpcstagger.cache import _claims
from hpcstagger.cache._layout import MAX_CLAIMS
from hpcstagger.cache.throttle import ThrottledSource

FORK = mp.get_context("fork")


def _slow(data: bytes, seconds: float, started=None):
    def read() -> bytes:
        if started is not None:
            started.set()
        time.sleep(seconds)
        return data
    return read


def _reader(name: str, key, data: bytes, seconds: float, started, out) -> None:
    """A process that misses ``key`` and reads it in ``seconds`` through the cache; it puts
    (result, read_here) on ``out``."""
    cache = ShmCache(name, None)
    got, _, here = cache.read_through(key, _slow(data, seconds, started))
    out.put((bytes(got), here))


def _second(cache: ShmCache, key, started, read_calls: list):
    """Once another process has begun reading ``key``: this process's miss of it."""
    assert started.wait(30)
    t = time.monotonic()
    got, cached, here = cache.read_through(key, lambda: read_calls.append(1) or b"mine")
    return bytes(got), cached, here, time.monotonic() - t


@pytest.mark.timeout(60)
def test_a_second_process_waits_for_the_read_in_flight_instead_of_reading(shm_root):
    cache = ShmCache("w", 1 << 20)
    started, out = FORK.Event(), FORK.Queue()
    proc = FORK.Process(target=_reader, args=("w", "k", b"theirs", 0.5, started, out))
    proc.start()
    calls: list = []
    got, cached, here, waited = _second(cache, "k", started, calls)
    assert (got, cached, here, calls) == (b"theirs", True, False, [])
    assert 0.2 < waited < 5
    assert out.get(timeout=30) == (b"theirs", True)
    proc.join(30)
    s = cache.stats()
    assert (s["coalesced"], s["inserts"], s["duplicates"]) == (1, 1, 0)


def _die_reading(name: str, key, started) -> None:
    cache = ShmCache(name, None)

    def read() -> bytes:
        started.set()
        time.sleep(0.3)
        os._exit(3)  # killed in the middle of its read: the claim stays in the table
    cache.read_through(key, read)


@pytest.mark.timeout(60)
def test_a_waiter_reads_the_sample_itself_when_the_reader_dies(shm_root):
    cache = ShmCache("d", 1 << 20)
    started = FORK.Event()
    proc = FORK.Process(target=_die_reading, args=("d", 7, started))
    proc.start()
    calls: list = []
    got, cached, here, waited = _second(cache, 7, started, calls)
    proc.join(30)
    assert proc.exitcode == 3
    assert (got, cached, here, calls) == (b"mine", True, True, [1])
    assert waited < 5
    assert bytes(cache.get(7)) == b"mine"
    assert cache.stats()["coalesced"] == 0


@pytest.mark.timeout(60)
def test_a_refused_insert_sends_the_waiter_to_the_source(shm_root):
    cache = ShmCache("r", 2)  # smaller than any sample: every insert is refused
    started, out = FORK.Event(), FORK.Queue()
    proc = FORK.Process(target=_reader, args=("r", "big", b"x" * 64, 0.3, started, out))
    proc.start()
    calls: list = []
    got, cached, here, _ = _second(cache, "big", started, calls)
    assert (got, cached, here, calls) == (b"mine", False, True, [1])
    assert out.get(timeout=30) == (b"x" * 64, True)
    proc.join(30)


@pytest.mark.timeout(60)
def test_a_full_cache_reads_its_misses_unclaimed_until_cleared(shm_root):
    cache = ShmCache("full", 152)
    assert cache.put("a", b"x" * 150) and not cache.put("b", b"y" * 100)  # full for samples of this size
    started, out = FORK.Event(), FORK.Queue()
    proc = FORK.Process(target=_reader, args=("full", "c", b"theirs", 2.0, started, out))
    proc.start()
    calls: list = []
    got, cached, here, waited = _second(cache, "c", started, calls)
    assert (got, cached, here, calls) == (b"mine", False, True, [1])
    assert waited < 1.5  # did not wait for the other process's read, whose insert would be refused
    assert out.get(timeout=30) == (b"theirs", True)  # read there too, and refused
    proc.join(30)
    assert cache.get("c") is None and cache.stats()["coalesced"] == 0
    cache.clear()  # room again: misses are claimed, and a second process waits for the first's read
    started, out = FORK.Event(), FORK.Queue()
    proc = FORK.Process(target=_reader, args=("full", "c", b"theirs", 0.5, started, out))
    proc.start()
    got, cached, here, waited = _second(cache, "c", started, calls)
    assert (got, cached, here, calls) == (b"theirs", True, False, [1])
    assert out.get(timeout=30) == (b"theirs", True)
    proc.join(30)


def test_a_failed_read_releases_its_claim(shm_root):
    cache = ShmCache("f", 1 << 20)

    def fail() -> bytes:
        raise OSError("source gone")
    with pytest.raises(OSError, match="source gone"):
        cache.read_through("k", fail)
    got, cached, here = cache.read_through("k", lambda: b"second try")
    assert (bytes(got), cached, here) == (b"second try", True, True)


def test_a_full_claim_table_reads_unclaimed_and_claims_end_with_their_reads(shm_root):
    cache = ShmCache("t", 1 << 20)
    led = cache._led
    base, pid = led.claim_slot(), os.getpid()
    held = [_claims.claim(led, 1, 1000 + k, base, pid) for k in range(MAX_CLAIMS)]
    assert all(how == _claims.OWN for how, _ in held)
    assert _claims.claim(led, 1, 5, base, pid) == (_claims.NONE, -1)
    assert bytes(cache.read_through("k", lambda: b"unclaimed")[0]) == b"unclaimed"
    for k, (_, i) in enumerate(held):
        _claims.release(led, i, 1, 1000 + k)
    assert not any(_claims.state(led, i, 1, 1000 + k, False) for k, (_, i) in enumerate(held))
    how, i = _claims.claim(led, 1, 5, base, pid)
    assert how == _claims.OWN and _claims.state(led, i, 1, 5, True)


class _Rows:
    """A map-style source of ``n`` distinct 3,000-byte samples."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def key(self, i: int) -> int:
        return i

    def __getitem__(self, i: int) -> bytes:
        return i.to_bytes(4, "little") * 750


def _first_word(b) -> torch.Tensor:
    return torch.tensor(int.from_bytes(bytes(b[:4]), "little"))


def _job(name: str, state_dir: str, workers: int, out) -> None:
    """A user-style job: a shuffled DataLoader (seed 0) over the cache and an emulated source."""
    src = ThrottledSource(_Rows(512), [4e6, 2e6], shared_name="claims-src", state_dir=state_dir)
    ds = CachedDataset(src, ShmCache(name, None), transform=_first_word)
    g = torch.Generator()
    g.manual_seed(0)
    seen = [int(x) for batch in DataLoader(ds, batch_size=32, shuffle=True, generator=g, num_workers=workers)
            for x in batch]
    out.put(seen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_two_jobs_of_one_order_started_together_read_each_sample_once(shm_root, tmp_path, workers):
    cache = ShmCache("jobs", 4 << 20)
    out = FORK.Queue()
    procs = [FORK.Process(target=_job, args=("jobs", str(tmp_path), workers, out)) for _ in range(2)]
    for p in procs:
        p.start()
    seen = [out.get(timeout=100) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert seen[0] == seen[1] and sorted(seen[0]) == list(range(512))  # the same order, every sample right
    s = cache.stats()
    assert s["read_bytes"] == 512 * 3000  # each sample from the source once, for both jobs
    assert s["duplicates"] == 0 and s["inserts"] == 512
    assert s["coalesced"] > 100  # level with each other, the jobs missed the same samples
    assert s["coalesced"] + s["inserts"] == s["misses"]


def _read_file_slowly(name: str, path: str, started, out) -> None:
    from hpcstagger.cache import wholefile
    plain = wholefile._read_whole

    def slow(p):
        started.set()
        time.sleep(0.5)
        return plain(p)
    wholefile._read_whole = slow  # this process only: it reads the file in 0.5 s
    out.put(bytes(ShmCache(name, None).read_file(path)))


@pytest.mark.timeout(60)
def test_a_whole_file_being_read_by_another_process_is_waited_for(shm_root, tmp_path, monkeypatch):
    from hpcstagger.cache import wholefile

    path = tmp_path / "img.jpg"
    path.write_bytes(b"jpeg" * 1000)
    cache = ShmCache("files", 1 << 20)
    started, out = FORK.Event(), FORK.Queue()
    proc = FORK.Process(target=_read_file_slowly, args=("files", str(path), started, out))
    proc.start()
    assert started.wait(30)
    plain, calls = wholefile._read_whole, []
    monkeypatch.setattr(wholefile, "_read_whole", lambda p: calls.append(p) or plain(p))
    assert bytes(cache.read_file(path)) == b"jpeg" * 1000
    assert out.get(timeout=30) == b"jpeg" * 1000
    proc.join(30)
    s = cache.stats()
    assert calls == [] and (s["coalesced"], s["inserts"], s["read_bytes"]) == (1, 1, 4000)
