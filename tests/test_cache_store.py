"""ShmCache in one process: the API, MinIO and pass-through policies, accounting, corruption."""

from __future__ import annotations

import os
import pickle

import pytest

from hpcstagger.cache import ShmCache
from hpcstagger.cache import store
from hpcstagger.errors import CacheError
from support.cache_util import check_consistent, sample


def test_put_get_contains_get_or_load(shm_root):
    cache = ShmCache("c", 1 << 20)
    assert cache.root == shm_root
    assert cache.get("a") is None and "a" not in cache
    assert cache.put("a", b"hello") is True
    v = cache.get("a")
    assert isinstance(v, memoryview) and v.readonly and bytes(v) == b"hello"
    assert "a" in cache
    calls = []
    assert bytes(cache.get_or_load(7, lambda: calls.append(1) or b"seven")) == b"seven"
    assert bytes(cache.get_or_load(7, lambda: calls.append(1) or b"other")) == b"seven"
    assert calls == [1]
    assert cache.put("empty", b"") and bytes(cache.get("empty")) == b""
    # str and int keys never collide; numpy-style integers are ints
    assert cache.put("7", b"str-seven") and bytes(cache.get(7)) == b"seven"
    assert bytes(cache.get("7")) == b"str-seven"
    import numpy as np

    assert bytes(cache.get(np.int64(7))) == b"seven"
    with pytest.raises(TypeError):
        cache.get(1.5)
    # any bytes-like object is accepted
    arr = np.arange(10, dtype=np.int32)
    assert cache.put("arr", arr) and bytes(cache.get("arr")) == arr.tobytes()
    assert cache.put("arr2d", arr.reshape(2, 5)) and bytes(cache.get("arr2d")) == arr.tobytes()
    cache.close()


def test_minio_fills_then_never_changes(shm_root):
    data = {k: sample(k, 1000, 1000) for k in range(30)}
    cache = ShmCache("m", 10_000)
    results = [cache.put(k, data[k]) for k in range(30)]
    assert results == [True] * 10 + [False] * 20
    assert cache.put(0, data[0]) is True  # already there: a duplicate, not a refusal
    assert all(k in cache for k in range(10)) and not any(k in cache for k in range(10, 30))
    for _ in range(3):  # misses of other keys never displace the contents
        for k in range(10, 30):
            assert bytes(cache.get_or_load(k, lambda k=k: data[k])) == data[k]
    assert all(bytes(cache.get(k)) == data[k] for k in range(10))
    s = cache.stats()
    assert (s["entries"], s["bytes_used"], s["inserts"], s["duplicates"]) == (10, 10_000, 10, 1)
    assert s["refused"] == 20 + 60
    assert cache.put("huge", bytes(10_001)) is False  # larger than the whole cache
    check_consistent(cache, data)


def test_max_entries_caps_the_index(shm_root):
    cache = ShmCache("e", 1 << 20, max_entries=5)
    assert [cache.put(k, b"x") for k in range(8)] == [True] * 5 + [False] * 3
    assert cache.stats()["entries"] == 5


def test_stats_add_up(shm_root):
    cache = ShmCache("s", 50_000)
    data = {k: sample(k, 1000, 3000) for k in range(60)}
    gets = puts = 0
    for _round in range(3):
        for k in range(60):
            v = cache.get(k)
            gets += 1
            if v is None:
                cache.put(k, data[k])
                puts += 1
            else:
                assert bytes(v) == data[k]
    s = cache.stats()
    assert s["hits"] + s["misses"] == s["lookups"] == gets
    assert s["inserts"] + s["refused"] + s["duplicates"] == puts
    assert s["hits"] == 2 * s["inserts"]  # everything inserted in round 1 hit in rounds 2 and 3
    assert s["insert_bytes"] == s["bytes_used"]
    assert abs(s["hit_rate"] - s["hits"] / s["lookups"]) < 1e-12
    check_consistent(cache, data)


def test_policy_none_is_pass_through(shm_root):
    cache = ShmCache("n", 1 << 20, policy="none")
    assert cache.put("a", b"x") is False and cache.get("a") is None and "a" not in cache
    assert cache.get_or_load("a", lambda: b"y") == b"y"
    s = cache.stats()
    assert (s["hits"], s["misses"], s["inserts"], s["refused"], s["bytes_used"]) == (0, 2, 0, 2, 0)
    assert sorted(os.listdir(os.path.join(shm_root, "n"))) == ["ledger"]  # nothing stored
    with pytest.raises(CacheError, match="unknown cache policy 'lru'; valid policies: minio, none"):
        ShmCache("p", 1 << 20, policy="lru")


def test_clear_keeps_handed_out_views_and_counters(shm_root):
    cache = ShmCache("c", 1 << 20)
    other = ShmCache("c", 1 << 20)  # a second handle sees the same cache
    cache.put("a", b"A" * 100)
    view = other.get("a")
    cache.clear()
    assert cache.get("a") is None and other.get("a") is None and "a" not in other
    assert bytes(view) == b"A" * 100  # the old generation stays mapped while the view lives
    assert other.put("a", b"B" * 50) and bytes(cache.get("a")) == b"B" * 50
    s = cache.stats()
    assert s["generation"] == 2 and s["entries"] == 1 and s["bytes_used"] == 50
    assert s["inserts"] == 2 and s["hits"] == 2
    assert sorted(os.listdir(os.path.join(shm_root, "c"))) == ["arena.2", "index.2", "ledger"]


def test_reopen_attach_and_mismatch(shm_root):
    cache = ShmCache("r", 1 << 20)
    cache.put("k", b"v")
    cache.close()
    again = ShmCache("r", None)  # attach by name
    assert bytes(again.get("k")) == b"v" and again.capacity_bytes == 1 << 20
    with pytest.raises(CacheError, match=r"already exists with capacity_bytes=1048576.*cache clear r"):
        ShmCache("r", 2 << 20)
    with pytest.raises(CacheError, match="policy='minio'"):
        ShmCache("r", 1 << 20, policy="none")
    with pytest.raises(CacheError, match="max_entries=256"):
        ShmCache("r", 1 << 20, max_entries=100)
    from hpcstagger import config

    with config.override(cache_min_sample_bytes=100):  # only an explicit max_entries must match
        ShmCache("r", 1 << 20).close()
    with pytest.raises(CacheError, match="no cache named 'nope'"):
        ShmCache("nope", None)
    assert not os.path.exists(os.path.join(shm_root, "nope"))
    clone = pickle.loads(pickle.dumps(again))  # reattaches by name
    assert bytes(clone.get("k")) == b"v"
    assert again.stats()["hits"] == 2


def test_bad_arguments(shm_root):
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(CacheError, match="capacity_bytes must be a non-negative int"):
            ShmCache("x", bad)
    with pytest.raises(CacheError, match="max_entries must be a positive int"):
        ShmCache("x", 100, max_entries=0)


@pytest.mark.parametrize("damage", ["payload", "checksum", "length", "magic", "zeroed", "index-length"])
def test_corrupt_entry_is_a_miss_and_is_replaced(shm_root, damage):
    cache = ShmCache("k", 1 << 20)
    data = {k: sample(k, 5000, 5000) for k in range(5)}
    for k, d in data.items():
        cache.put(k, d)
    led = cache._led
    i, _ = cache._probe(*store.key_hash(3))
    _, _, off, meta = store.SLOT.unpack_from(led.imv, i << 5)
    arena = os.path.join(shm_root, "k", "arena.1")
    with open(arena, "r+b") as f:
        if damage == "payload":
            f.seek(off + store.ENTRY_HDR + 1234)
            byte = f.read(1)
            f.seek(off + store.ENTRY_HDR + 1234)
            f.write(bytes([byte[0] ^ 1]))
        elif damage == "checksum":
            f.seek(off + 32)
            f.write(b"\0" * 8)
        elif damage == "length":
            f.seek(off + 24)
            f.write((4000).to_bytes(8, "little"))
        elif damage == "magic":
            f.seek(off)
            f.write(b"NOTMAGIC")
        elif damage == "zeroed":  # lost bytes, as if the entry had been truncated
            f.seek(off)
            f.write(bytes(store.ENTRY_HDR + 5000))
    if damage == "index-length":  # the index claims more bytes than the entry holds
        os.pwrite(led.index_fd, ((store.LIVE << 56) | 9000).to_bytes(8, "little"), (i << 5) + 24)
    assert cache.get(3) is None  # detected: a miss, never wrong bytes
    s = cache.stats()
    assert s["corrupt"] == 1 and s["misses"] == 1 and 3 not in cache
    assert s["entries"] == 4 and s["bytes_used"] == 4 * 5000
    assert bytes(cache.get_or_load(3, lambda: data[3])) == data[3]  # replaced...
    assert bytes(cache.get(3)) == data[3] and cache.stats()["hits"] == 1  # ...and served again
    assert cache.stats()["wasted_bytes"] > 0  # the bad region is abandoned, not reused
    check_consistent(cache, data)


def test_full_shm_is_a_refused_insert(tmp_path):
    """A really full tmpfs: mounts a 2 MiB tmpfs (needs root); without root, injects ENOSPC by
    subclassing the write step instead."""
    import errno
    import subprocess

    from hpcstagger import config

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True, timeout=30).returncode == 0
    try:
        with config.override(shm_root=str(mnt / "root")):
            if mounted:
                cache = ShmCache("full", 64 << 20)  # far more than the file system holds
            else:
                class NoSpace(ShmCache):
                    def _write_entry(self, fd, header, view, off):
                        if self.stats()["entries"] >= 5:
                            raise OSError(errno.ENOSPC, "No space left on device")
                        super()._write_entry(fd, header, view, off)

                cache = NoSpace("full", 64 << 20)
            data = {k: sample(k, 200_000, 200_000) for k in range(20)}
            results = []
            for k, d in data.items():
                got = cache.get_or_load(k, lambda d=d: d)
                assert bytes(got) == d  # the caller always gets its bytes
                results.append(k in cache)
            assert results[0] and not results[-1], results
            s = cache.stats()
            assert s["refused"] >= 1 and s["inserts"] == sum(results)
            assert s["reserved_bytes"] == 0
            check_consistent(cache, data)
            cache.close()
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], timeout=30, check=True)


def test_closed_cache_raises_and_dropped_cache_detaches(shm_root):
    cache = ShmCache("z", 1 << 20)
    cache.put("a", b"x")
    view = cache.get("a")
    cache.close()
    cache.close()  # idempotent
    for call in (lambda: cache.get("a"), lambda: cache.put("b", b"y"), cache.stats):
        with pytest.raises(CacheError, match="was closed"):
            call()
    assert bytes(view) == b"x"  # views outlive the handle
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        c = ShmCache("z", None)
        c.get("a")
        del c  # the finalizer releases the slot and the descriptors
    assert len(os.listdir("/proc/self/fd")) <= fds + 1
    c = ShmCache("z", None)
    assert c.stats()["processes"] == 0 and c.stats()["hits"] == 21
    c.destroy()
    assert os.listdir(shm_root) == []


def test_importing_and_using_the_cache_imports_neither_torch_nor_h5py(shm_root):
    import json
    import subprocess
    import sys

    probe = f"""
import json, sys
import hpcstagger.cache as c
from hpcstagger import ShmCache, DirectorySource
from hpcstagger.cache import ThrottledSource
cache = ShmCache("probe", 1 << 20, root={shm_root!r})
cache.put("a", b"x"); cache.get("a"); cache.stats(); cache.close()
print(json.dumps({{m: m in sys.modules for m in ("torch", "h5py", "numpy")}}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"torch": False, "h5py": False, "numpy": False}
