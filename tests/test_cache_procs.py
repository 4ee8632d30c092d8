"""ShmCache across real processes: killed writers, concurrent stress, node-wide stats, fork."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest

from hpcstagger.cache import ShmCache
from support import cache_util
from support.cache_util import check_consistent, sample

FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")


def _kill(proc: mp.Process) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


def _kill_a_writer_after(shm_root, name: str, seconds: float) -> None:
    """Start a process that puts into cache ``name`` without end, and SIGKILL it ``seconds`` in."""
    ready = FORK.Event()
    proc = FORK.Process(target=cache_util.put_forever, args=(shm_root, name, ready))
    proc.start()
    assert ready.wait(30)
    time.sleep(seconds)
    _kill(proc)


@pytest.mark.timeout(60)
def test_writer_killed_mid_put_leaves_no_partial_entry(shm_root):
    cache = ShmCache("k", 1 << 20)
    for k in range(5):
        cache.put(k, sample(k))
    top_before = cache.stats()["arena_top"]
    started = FORK.Event()
    proc = FORK.Process(target=cache_util.slow_put_then_hang, args=(shm_root, "k", 99, started))
    proc.start()
    assert started.wait(30), "the writer never started writing"
    s = cache.stats()
    assert s["reserved_bytes"] == 50_000 and s["processes"] == 2  # in flight...
    assert 99 not in cache and cache.get(99) is None  # ...and invisible
    _kill(proc)
    assert cache.get(99) is None  # still invisible: a half-written entry is never published
    reopened = ShmCache("k", None)  # the next opener reclaims the dead writer's reservation
    s = reopened.stats()
    assert s["reserved_bytes"] == 0 and s["arena_top"] == top_before and s["processes"] == 1
    assert reopened.put(99, sample(99, 50_000, 50_000))
    assert bytes(cache.get(99)) == sample(99, 50_000, 50_000)
    check_consistent(reopened, {k: sample(k) for k in range(5)} | {99: sample(99, 50_000, 50_000)})


@pytest.mark.timeout(60)
def test_writer_killed_inside_the_lock_is_recovered(shm_root):
    cache = ShmCache("d", 1 << 20)
    cache.put(1, sample(1))
    proc = FORK.Process(target=cache_util.die_inside_publish, args=(shm_root, "d", 2))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    assert cache._led.w[13] == 1  # H_DIRTY: it died holding the lock
    assert cache.put(3, sample(3))  # the next locker recounts from the index
    assert cache._led.w[13] == 0
    s = cache.stats()
    # the entry it published before dying is complete and counted; its reservation is gone
    assert bytes(cache.get(2)) == sample(2)
    assert s["entries"] == 3 and s["reserved_bytes"] == 0
    check_consistent(cache, {k: sample(k) for k in (1, 2, 3)})


@pytest.mark.timeout(120)
def test_writers_killed_at_random_moments_never_expose_bad_bytes(shm_root):
    cache = ShmCache("r", 8 << 20)
    rng = random.Random(5)
    for _ in range(6):
        _kill_a_writer_after(shm_root, "r", rng.uniform(0.02, 0.3))
        again = ShmCache("r", None)
        check_consistent(again, {k: sample(k, 20_000, 200_000) for k in range(1000, 1400)})
        again.close()
    assert cache.stats()["inserts"] > 0


@pytest.mark.timeout(180)
def test_stress_small_zero_wrong_bytes_and_stats_add_up(shm_root):
    """The suite's version of the benchmark's stress run: 4 processes x 2,000 random
    get / get_or_load / put calls on 300 overlapping keys, a capacity of about 40% of the data,
    and occasional clear()s so that the cache fills under contention several times."""
    nkeys, nops = 300, 2000
    total = sum(len(sample(k)) for k in range(nkeys))
    cache = ShmCache("s", int(total * 0.4))
    with FORK.Pool(4) as pool:
        outs = pool.starmap(cache_util.stress_worker,
                            [(shm_root, "s", seed, nops, nkeys, 400) for seed in range(4)])
    assert sum(o["wrong"] for o in outs) == 0
    assert sum(o["returned"] for o in outs) > nops  # plenty of samples were compared
    s = cache.stats()
    assert s["lookups"] == s["hits"] + s["misses"] == sum(o["gets"] for o in outs)
    assert s["inserts"] + s["refused"] + s["duplicates"] == sum(o["puts"] for o in outs)
    assert s["hits"] > 0 and s["refused"] > 0 and s["generation"] > 1
    check_consistent(cache, {k: sample(k) for k in range(nkeys)})


@pytest.mark.timeout(120)
def test_stats_are_node_wide_across_spawned_processes(shm_root):
    keys = list(range(40))
    cache = ShmCache("n", 1 << 20)
    with SPAWN.Pool(3) as pool:
        outs = pool.starmap(cache_util.count_stats_worker, [(shm_root, "n", keys)] * 3)
    s = cache.stats()
    loads = sum(o[1] for o in outs)
    assert s["lookups"] == sum(o[0] for o in outs) == 120
    assert s["misses"] == loads + s["coalesced"]  # every miss went to the loader, or waited for another's load
    assert s["inserts"] == 40 and s["hits"] == 120 - s["misses"]
    assert s["inserts"] + s["duplicates"] == loads  # racing loaders of one key: one insert


@pytest.mark.timeout(60)
def test_cache_survives_fork_and_each_child_counts_in_its_own_slot(shm_root):
    cache = ShmCache("f", 1 << 20)
    cache.put("p", b"parent")
    assert bytes(cache.get("p")) == b"parent"

    def child(i: int) -> None:
        for _ in range(50):
            assert bytes(cache.get("p")) == b"parent"
        assert cache.put(f"c{i}", b"child")
        os._exit(0)

    procs = [FORK.Process(target=child, args=(i,)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    s = cache.stats()
    assert s["hits"] == 1 + 150 and s["inserts"] == 4
    assert all(bytes(cache.get(f"c{i}")) == b"child" for i in range(3))


@pytest.mark.timeout(180)
def test_stress_while_a_writer_is_killed_again_and_again(shm_root):
    """Three stress workers (with clear()s) while a fourth process inserts large entries and is
    SIGKILLed at random moments, over and over: dead reservations are reclaimed and their space
    reused under contention, and still no wrong byte is ever returned."""
    nkeys = 300
    total = sum(len(sample(k)) for k in range(nkeys))
    rng = random.Random(11)
    with ShmCache("chaos", int(total * 0.6)):  # creates it with its capacity; attached to the end
        with FORK.Pool(3) as pool:
            result = pool.starmap_async(cache_util.stress_worker,
                                        [(shm_root, "chaos", seed, 10_000, nkeys, 300) for seed in range(3)])
            kills = during = 0
            while not result.ready() or kills < 3:
                _kill_a_writer_after(shm_root, "chaos", rng.uniform(0.005, 0.1))
                kills += 1
                during += not result.ready()
            outs = result.get(120)
        assert sum(o["wrong"] for o in outs) == 0 and sum(o["returned"] for o in outs) > 1000
        # how many kills land while the stress runs depends on the machine's speed; a few suffice
        assert during >= 3, (during, kills)
        again = ShmCache("chaos", None)  # reclaims the last victim's reservation
        check_consistent(again, {k: sample(k) for k in range(nkeys)}
                         | {k: sample(k, 20_000, 200_000) for k in range(1000, 1300)})
