"""ShmCache.get_many and the hit path of get: the same answers and the same counted lookups as
single gets, for hits, misses, duplicates, long probe chains, corrupt entries and other processes."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from hpcstagger.cache import ShmCache
from hpcstagger.cache import _reads, store
from hpcstagger.cache._base import LoadThrough
from hpcstagger.errors import CacheError
from support.cache_util import check_consistent, sample

FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")

COUNTED = ("hits", "misses", "lookups", "corrupt", "inserts", "refused", "duplicates")


def _counted(cache: ShmCache) -> dict[str, int]:
    s = cache.stats()
    return {k: s[k] for k in COUNTED}


def _fill(cache: ShmCache, keys) -> dict:
    data = {k: sample(k if isinstance(k, int) else len(k) * 31 + 7) for k in keys}
    for k, d in data.items():
        assert cache.put(k, d)
    return data


def _home(index_slots: int, key) -> int:
    return store.key_hash(key)[1] & (index_slots - 1)


def _same_home_keys(index_slots: int, count: int, start: int = 0) -> list[int]:
    """``count`` int keys that share one home slot in an index of ``index_slots`` slots."""
    by_home: dict[int, list[int]] = {}
    k = start
    while True:
        keys = by_home.setdefault(_home(index_slots, k), [])
        keys.append(k)
        if len(keys) == count:
            return keys
        k += 1


def _corrupt_payload(cache: ShmCache, root: str, key) -> None:
    """Flip one payload byte of ``key``'s entry in the arena file (the index still points at it)."""
    i, state = cache._probe(*store.key_hash(key))
    assert state == store.LIVE
    _, _, off, _ = store.SLOT.unpack_from(cache._led.imv, i << 5)
    gen = cache.stats()["generation"]
    with open(os.path.join(root, cache.name, f"arena.{gen}"), "r+b") as f:
        f.seek(off + store.ENTRY_HDR + 3)
        byte = f.read(1)
        f.seek(off + store.ENTRY_HDR + 3)
        f.write(bytes([byte[0] ^ 0x40]))


def test_get_many_answers_as_get_does(shm_root):
    cache = ShmCache("m", 1 << 20)
    data = _fill(cache, [0, 1, 2, 7, "7", "a", "ü-ключ", ""])
    batch = [0, "a", 99, 7, "7", 0, "missing", np.int64(2), "ü-ключ", "", True]
    got = cache.get_many(batch)
    assert isinstance(got, list) and len(got) == len(batch)
    expect = [data[0], data["a"], None, data[7], data["7"], data[0], None, data[2], data["ü-ключ"], data[""], data[1]]
    assert [None if v is None else bytes(v) for v in got] == expect
    assert all(v is None or (isinstance(v, memoryview) and v.readonly) for v in got)
    assert got[0] is not got[5]  # a key given twice is looked up twice
    s = cache.stats()
    assert (s["hits"], s["misses"], s["lookups"]) == (9, 2, 11)
    assert cache.get_many([]) == [] and cache.get_many(iter([1, 99])) == [cache.get(1), None]
    assert [bytes(v) for v in cache.get_many(k for k in (2, 7))] == [data[2], data[7]]


def test_counters_equal_those_of_single_gets(shm_root):
    keys = list(range(40)) + [f"s{i}" for i in range(10)]
    batches = [[3, 3, "s1", 100, 5], list(range(0, 60, 3)), ["s9", "nope", 39, 40], []]
    caches = []
    for name in ("one", "many"):
        cache = ShmCache(name, 1 << 20)
        _fill(cache, keys)
        caches.append(cache)
    one, many = caches
    for batch in batches:
        singles = [one.get(k) for k in batch]
        batched = many.get_many(batch)
        assert [None if v is None else bytes(v) for v in singles] == [None if v is None else bytes(v) for v in batched]
    assert _counted(one) == _counted(many)
    assert _counted(many)["misses"] == 1 + 6 + 2  # 100; 42 to 57; "nope" and 40


def test_long_probe_chains_hit_and_miss_on_both_paths(shm_root):
    """Keys sharing one home slot, more of them than the hit path probes: every one is found (the
    later ones by the careful path), an absent key with that home is a miss, and get and get_many
    agree."""
    cache = ShmCache("chain", 1 << 20, max_entries=64)
    slots = cache._led.index_slots
    chain = _same_home_keys(slots, _reads.FAST_PROBES + 4)
    present, absent = chain[:-1], chain[-1]
    data = _fill(cache, present)
    homes = {_home(slots, k) for k in chain}
    assert len(homes) == 1
    for k in present:
        assert bytes(cache.get(k)) == data[k]
    assert cache.get(absent) is None
    got = cache.get_many(chain)
    assert [None if v is None else bytes(v) for v in got] == [data[k] for k in present] + [None]
    s = cache.stats()
    assert (s["hits"], s["misses"], s["corrupt"]) == (2 * len(present), 2, 0)
    check_consistent(cache, data)


@pytest.mark.parametrize("where", ["home", "chain"])
def test_corrupt_entry_in_the_middle_of_a_batch(shm_root, where):
    cache = ShmCache("c", 1 << 20, max_entries=64)
    chain = _same_home_keys(cache._led.index_slots, 3, start=1000)
    keys = list(range(10)) + chain
    data = _fill(cache, keys)
    bad = 5 if where == "home" else chain[1]  # chain[1] lies in the slot after its home
    if where == "chain":
        i, _ = cache._probe(*store.key_hash(bad))
        assert i != _home(cache._led.index_slots, bad)
    _corrupt_payload(cache, shm_root, bad)
    batch = [0, 1, bad, 2, bad, chain[2], 3]
    got = cache.get_many(batch)
    assert [None if v is None else bytes(v) for v in got] == [
        data[0], data[1], None, data[2], None, data[chain[2]], data[3]]
    s = cache.stats()
    assert (s["hits"], s["misses"], s["corrupt"]) == (5, 2, 1)  # dropped once, a miss both times
    assert bad not in cache and s["entries"] == len(keys) - 1
    assert bytes(cache.get_or_load(bad, lambda: data[bad])) == data[bad]  # replaced...
    assert bytes(cache.get_many([bad])[0]) == data[bad]  # ...and served again
    check_consistent(cache, data)


def test_corrupt_entry_in_a_chain_is_caught_by_get(shm_root):
    cache = ShmCache("g", 1 << 20, max_entries=64)
    chain = _same_home_keys(cache._led.index_slots, 3, start=500)
    data = _fill(cache, chain)
    _corrupt_payload(cache, shm_root, chain[2])
    assert cache.get(chain[2]) is None
    assert [bytes(cache.get(k)) for k in chain[:2]] == [data[k] for k in chain[:2]]
    s = cache.stats()
    assert (s["hits"], s["misses"], s["corrupt"]) == (2, 1, 1)


def test_a_header_that_names_another_key_is_a_miss(shm_root):
    """An index slot pointed at another key's intact entry: the header check refuses it."""
    cache = ShmCache("h", 1 << 20)
    data = _fill(cache, [1, 2])
    led = cache._led
    i1, _ = cache._probe(*store.key_hash(1))
    i2, _ = cache._probe(*store.key_hash(2))
    _, _, off2, meta2 = store.SLOT.unpack_from(led.imv, i2 << 5)
    os.pwrite(led.index_fd, store.SLOT.pack(0, 0, off2, meta2)[16:], (i1 << 5) + 16)
    assert cache.get_many([1, 2])[0] is None
    assert cache.get(1) is None and bytes(cache.get(2)) == data[2]
    assert cache.stats()["corrupt"] == 1


def test_clear_by_another_handle_and_views_handed_out(shm_root):
    cache = ShmCache("x", 1 << 20)
    other = ShmCache("x", None)
    data = _fill(cache, range(5))
    views = cache.get_many(range(5))
    other.clear()
    assert cache.get_many(range(5)) == [None] * 5
    assert [bytes(v) for v in views] == [data[k] for k in range(5)]  # the old generation stays mapped
    assert other.put(3, b"new") and bytes(cache.get_many([3])[0]) == b"new"


def test_bad_keys_pass_through_policy_and_closed_cache(shm_root):
    cache = ShmCache("b", 1 << 20)
    _fill(cache, [1])
    with pytest.raises(TypeError, match="cache keys are str or int, not float"):
        cache.get_many([1, 99, 1.5, 1])
    s = cache.stats()
    assert (s["hits"], s["misses"]) == (1, 1)  # the keys before the bad one are counted
    none = ShmCache("n", 1 << 20, policy="none")
    assert none.get_many([1, "a", 1]) == [None] * 3
    assert (none.stats()["hits"], none.stats()["misses"]) == (0, 3)
    with pytest.raises(TypeError):
        none.get_many([b"bytes"])
    cache.close()
    with pytest.raises(CacheError, match="was closed"):
        cache.get_many([1])
    with pytest.raises(CacheError, match="was closed"):
        cache.get_many([])


def test_the_default_get_many_loops_over_get():
    class Dict(LoadThrough):
        def __init__(self):
            self.d: dict = {}
            self.calls: list = []

        def get(self, key):
            self.calls.append(key)
            v = self.d.get(key)
            return None if v is None else memoryview(v)

        def put(self, key, data):
            self.d[key] = bytes(data)
            return True

    c = Dict()
    c.put(1, b"one")
    got = c.get_many([1, 2, 1])
    assert [None if v is None else bytes(v) for v in got] == [b"one", None, b"one"]
    assert c.calls == [1, 2, 1]


# ---- other processes ---------------------------------------------------------------------------

BATCHES = [[0, 1, 2, 3, 50, 51], [5, 5, 5, "k"], list(range(0, 30, 2)), ["k", "nope", 29]]


def _child(root: str, name: str, batched: bool, q) -> None:
    cache = ShmCache(name, None, root=root)
    wrong = 0
    for batch in BATCHES:
        got = cache.get_many(batch) if batched else [cache.get(k) for k in batch]
        for k, v in zip(batch, got, strict=True):
            expect = None if k in (50, 51, "nope") else _expected(k)
            wrong += (None if v is None else bytes(v)) != expect
    q.put(wrong)


def _expected(k) -> bytes:
    return sample(k if isinstance(k, int) else 77)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ctx", [FORK, SPAWN], ids=["fork", "spawn"])
def test_counts_from_other_processes_add_up(shm_root, ctx):
    caches = {}
    for name in ("single", "batched"):
        cache = ShmCache(name, 1 << 20)
        for k in list(range(30)) + ["k"]:
            assert cache.put(k, _expected(k))
        cache.get_many([0, 99])  # the parent's own lookups count too (a process slot claimed before fork)
        caches[name] = cache
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(shm_root, name, name == "batched", q))
             for name in ("single", "batched") for _ in range(2)]
    for p in procs:
        p.start()
    wrong = [q.get(timeout=100) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert wrong == [0] * len(procs)
    single, batched = (_counted(caches[n]) for n in ("single", "batched"))
    assert single == batched
    lookups = 2 * sum(map(len, BATCHES)) + 2
    misses = 2 * 3 + 1  # 50, 51 and "nope" in each child, 99 in the parent
    assert (batched["lookups"], batched["misses"], batched["hits"]) == (lookups, misses, lookups - misses)
