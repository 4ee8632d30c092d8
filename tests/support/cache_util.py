"""Utilities for the cache tests: sample data, invariant checks, and worker functions that child
processes (fork or spawn) import by name. The private shm root is the ``shm_root`` fixture
(fixtures.py)."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any


def sample(key: int, lo: int = 100, hi: int = 8000) -> bytes:
    """The deterministic bytes of sample ``key`` (the 'source' every test compares against)."""
    rng = random.Random(key * 7919 + 17)
    return rng.randbytes(rng.randint(lo, hi))


def check_consistent(cache: Any, expected: dict[Any, bytes]) -> None:
    """Every visible entry is exactly its source bytes, and the byte accounting matches them."""
    present = 0
    for k, data in expected.items():
        if k in cache:
            v = cache.get(k)
            assert v is not None and bytes(v) == data, f"wrong bytes for key {k!r}"
            present += len(data)
    s = cache.stats()
    assert s["bytes_used"] == present, (s, present)
    assert s["bytes_used"] <= s["capacity_bytes"]
    assert s["reserved_bytes"] == 0, s


# ---- child-process workers ---------------------------------------------------------------------

def stress_worker(root: str, name: str, seed: int, nops: int, nkeys: int, clear_every: int) -> dict[str, int]:
    """Random get/get_or_load/put on overlapping keys; every returned sample compared to the source."""
    from hpcstagger.cache import ShmCache

    cache = ShmCache(name, None, root=root)
    data = {k: sample(k) for k in range(nkeys)}
    rng = random.Random(seed)
    out = dict(wrong=0, gets=0, puts=0, returned=0, clears=0)
    for _ in range(nops):
        k = rng.randrange(nkeys)
        op = rng.random()
        if op < 0.5:
            out["gets"] += 1
            loaded = []

            def loader(k=k, loaded=loaded):
                loaded.append(1)
                return data[k]

            v = cache.get_or_load(k, loader)
            out["puts"] += len(loaded)
            out["returned"] += 1
            out["wrong"] += bytes(v) != data[k]
        elif op < 0.8:
            out["gets"] += 1
            v = cache.get(k)
            if v is not None:
                out["returned"] += 1
                out["wrong"] += bytes(v) != data[k]
        else:
            out["puts"] += 1
            cache.put(k, data[k])
        if clear_every and rng.randrange(clear_every) == 0:
            cache.clear()
            out["clears"] += 1
    cache.close()
    return out


def put_forever(root: str, name: str, ready: Any) -> None:
    """Insert distinct keys in a loop until killed (for SIGKILL-at-a-random-moment tests)."""
    from hpcstagger.cache import ShmCache

    cache = ShmCache(name, None, root=root)
    ready.set()
    k = 1000
    while True:
        cache.put(k, sample(k, 20_000, 200_000))
        cache.get(k)
        k += 1


def slow_put_then_hang(root: str, name: str, key: int, started: Any) -> None:
    """Write half of an entry, tell the parent, and hang: the parent SIGKILLs us mid-put."""
    from hpcstagger.cache.store import ShmCache

    class HalfWriter(ShmCache):
        def _write_entry(self, fd, header, view, off):  # a test override
            os.pwrite(fd, header, off)
            os.pwrite(fd, view[: len(view) // 2], off + len(header))
            started.set()
            time.sleep(600)

    cache = HalfWriter(name, None, root=root)
    cache.put(key, sample(key, 50_000, 50_000))


def die_inside_publish(root: str, name: str, key: int) -> None:
    """SIGKILL ourselves inside the locked publish step, after the index slot is written."""
    from hpcstagger.cache import store

    class DieInPublish(store.ShmCache):
        def _publish(self, b, hi, lo, n, off, gen):  # a test override
            led = self._led
            i, _ = self._probe(hi, lo)
            os.pwrite(led.index_fd, store.SLOT.pack(hi, lo, off, (store.LIVE << 56) | n), i << 5)
            os.kill(os.getpid(), signal.SIGKILL)

    cache = DieInPublish(name, None, root=root)
    cache.put(key, sample(key))


def count_stats_worker(root: str, name: str, keys: list[int]) -> tuple[int, int]:
    """get_or_load every key once; return (lookups made, loader calls)."""
    from hpcstagger.cache import ShmCache

    cache = ShmCache(name, None, root=root)
    loads = 0
    for k in keys:
        def loader(k=k):
            nonlocal loads
            loads += 1
            return sample(k)
        assert bytes(cache.get_or_load(k, loader)) == sample(k)
    cache.close()
    return len(keys), loads


class FileHook:
    """A picklable source_read_hook that appends 'enter'/'exit' lines to a file."""

    def __init__(self, path: str):
        self.path = path

    def _log(self, word: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{word} {os.getpid()}\n".encode())
        finally:
            os.close(fd)

    def enter(self) -> None:
        self._log("enter")

    def exit(self) -> None:
        self._log("exit")


def byte_sum(data: Any) -> int:
    """A transform for CachedDataset: the sum of the sample's bytes (checks the content exactly)."""
    import torch

    return int(torch.frombuffer(bytearray(data), dtype=torch.uint8).sum())


def read_epoch(source: Any, barrier: Any = None, order_seed: int | None = None) -> float:
    """Read every sample of ``source`` (after the barrier, if any); return the wall time."""
    order = list(range(len(source)))
    if order_seed is not None:
        random.Random(order_seed).shuffle(order)
    if barrier is not None:
        barrier.wait(timeout=60)
    t = time.monotonic()
    for i in order:
        source[i]
    return time.monotonic() - t
