#!/usr/bin/env python3
"""Benchmark of the shared /dev/shm sample cache. All measurements come from one run.

Results: benchmarks/RESULTS.md, section Shared cache.

(a) Hit path: the throughput of ``ShmCache.get`` hits against two baselines over the same samples
    in the same random order: reading them as separate files already in the OS page cache (with
    ``open().read()`` and with the leaner ``os.open``/``os.read``), and a plain in-memory copy
    (``bytes(memoryview(blob))``, the upper bound). Two sample sets: about 2,000 samples of
    100 KB..1 MB, and 4 KB samples. Median of several repetitions (methods interleaved), plus one
    cold pass by a freshly started process that has never mapped the cache.
(b) Co-located jobs: two processes each read one epoch in their own random order through a
    ``ThrottledSource`` (one shared, bandwidth-bound budget), once through the cache (capacity >=
    dataset) and once through a pass-through cache (policy "none"); the second process starts
    together with the first, when the first has read half its epoch, or when the first is done.
    Then both started together in one order (samplers with one seed), also through the cache with
    each miss read by the process that missed it (``read_through`` off: what a cache without
    coalescing does). Wall time and hit rate of each process.
(c) Stress: 4 processes x 20,000 random get / get_or_load / put calls on overlapping keys, capacity
    40% of the dataset, occasional clear() so the cache refills under contention; every returned
    sample is compared byte for byte with the source.
(d) Small-sample hits against LMDB: the same samples (1, 4, 16, 128 KB and 1 MB) in a ShmCache and
    in an LMDB environment in /dev/shm (the ``lmdb`` package; a private directory, removed after),
    each LMDB value stored with its xxh3-64 checksum and verified on every get, as a ShmCache hit
    is. LMDB is read through one read-only transaction per process, opened once and reused for
    every get and batch (``buffers=True``: zero-copy views, like ShmCache's): what an efficient
    reader of a dataset that does not change does, since a transaction per get would add its
    begin/abort to every get. Single random gets (``get``) and batches of 64 random keys
    (``get_many``; LMDB: a loop in the one transaction), by 1 and 4 processes at once; per-process
    µs per get, the median over repetitions (methods interleaved) and then over the processes.
    Ratios are ShmCache / LMDB times: below 1, ShmCache is faster.

Usage: python benchmarks/bench_cache.py [--quick] [--parts abcd] [--json PATH] [--file-dir DIR]
       python benchmarks/bench_cache.py --lmdb-only [--sizes 1,4,16,128,1024] [--procs 1,4] [--smoke]
Prints tables with the ratios, and writes JSON (default benchmarks/out/bench_cache.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
from collections.abc import Callable
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hpcstagger.cache import CachedDataset, DirectorySource, ShmCache, ThrottledSource  # noqa: E402  (after the sys.path insert)
from hpcstagger.cache.sources import read_file  # noqa: E402  (after the sys.path insert)

FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")



def interleaved(methods: dict[str, Callable[[list[int]], object]], n: int, reps: int,
                rng: random.Random) -> dict[str, list[float]]:
    """Seconds per pass of each method over a shuffled order of the ``n`` samples: ``reps`` + 1
    rounds, the methods interleaved within each round, a new order per round; round 0 warms up
    (page tables, caches) and is not kept."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(reps + 1):
        order = list(range(n))
        rng.shuffle(order)
        for m, fn in methods.items():
            t = time.perf_counter()
            fn(order)
            if r:
                times[m].append(time.perf_counter() - t)
    return times

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sample(key: int, lo: int, hi: int) -> bytes:
    rng = random.Random(key * 7919 + 17)
    return rng.randbytes(rng.randint(lo, hi))


# ---- (a) hit path ------------------------------------------------------------------------------

def _cold_pass(root: str, name: str, order: list[int]) -> float:
    cache = ShmCache(name, None, root=root)
    t = time.perf_counter()
    for k in order:
        cache.get(k)
    return time.perf_counter() - t


def hit_path(label: str, n: int, lo: int, hi: int, reps: int, shm: str, file_dir: str) -> dict:
    log(f"(a) {label}: preparing {n} samples of {lo}..{hi} bytes")
    blobs = [os.urandom(random.Random(k).randint(lo, hi)) for k in range(n)]
    total = sum(map(len, blobs))
    cache = ShmCache(f"hit-{label}", total, root=shm, max_entries=n + 16)
    for k, b in enumerate(blobs):
        assert cache.put(k, b)
    fdir = tempfile.mkdtemp(prefix=f"pagecache-{label}-", dir=file_dir)
    paths = []
    for k, b in enumerate(blobs):
        p = os.path.join(fdir, f"{k:06d}.bin")
        with open(p, "wb") as f:
            f.write(b)
        paths.append(p)
    for p in paths:  # into the page cache
        read_file(p)

    def cache_get(order):
        get = cache.get
        for k in order:
            get(k)

    def cache_get_copy(order):
        get = cache.get
        for k in order:
            bytes(get(k))

    def files_open_read(order):
        for k in order:
            with open(paths[k], "rb") as f:
                f.read()

    def files_os_read(order):
        for k in order:
            read_file(paths[k])

    def memory_copy(order):
        for k in order:
            bytes(memoryview(blobs[k]))

    methods = {"cache get (zero-copy, verified)": cache_get, "cache get + bytes() copy": cache_get_copy,
               "files open().read()": files_open_read, "files os.read": files_os_read,
               "memory copy": memory_copy}
    rng = random.Random(1)
    times = interleaved(methods, n, reps, rng)
    order = list(range(n))
    rng.shuffle(order)
    with SPAWN.Pool(1) as pool:
        cold = pool.apply(_cold_pass, (shm, cache.name, order))
    res = {m: {"median_s": statistics.median(ts), "runs_s": ts, "gb_per_s": total / statistics.median(ts) / 1e9,
               "us_per_sample": statistics.median(ts) / n * 1e6} for m, ts in times.items()}
    res["cache get, cold (new process)"] = {"median_s": cold, "runs_s": [cold], "gb_per_s": total / cold / 1e9,
                                            "us_per_sample": cold / n * 1e6}
    hit = res["cache get (zero-copy, verified)"]["median_s"]
    ratios = {"hit / files open().read()": res["files open().read()"]["median_s"] / hit,
              "hit / files os.read": res["files os.read"]["median_s"] / hit,
              "hit / memory copy": res["memory copy"]["median_s"] / hit,
              "hit+copy / files os.read": (res["files os.read"]["median_s"]
                                           / res["cache get + bytes() copy"]["median_s"]),
              "cold hit / files os.read": res["files os.read"]["median_s"] / cold}
    s = cache.stats()
    assert s["hits"] >= n * (2 * reps + 2), s  # every get was a hit
    cache.destroy()
    shutil.rmtree(fdir)
    print(f"\n(a) hit path, {label}: {n} samples, {lo}..{hi} bytes, {total / 1e6:.0f} MB, median of {reps}")
    print(f"  {'method':34s} {'GB/s':>7s} {'us/sample':>10s}")
    for m, v in res.items():
        print(f"  {m:34s} {v['gb_per_s']:7.2f} {v['us_per_sample']:10.2f}")
    for k, v in ratios.items():
        print(f"  ratio {k:28s} {v:6.2f}x")
    return {"n": n, "size_range": [lo, hi], "total_bytes": total, "reps": reps, "methods": res, "ratios": ratios}


# ---- (b) co-located jobs -----------------------------------------------------------------------

class _CountMisses:
    """source_read_hook counting this process's source reads (its misses)."""

    def __init__(self):
        self.n = 0

    def enter(self) -> None:
        self.n += 1

    def exit(self) -> None:
        pass


ONE_ORDER = "together, one order"
STARTS = ("together", "at half", "after first", ONE_ORDER)
ARMS = {False: "no cache", True: "cache", None: "cache, own reads"}  # cached: no, yes, yes without coalescing
SHORT = {False: "no", True: "yes", None: "own"}


def _arms(start: str) -> tuple[bool | None, ...]:
    """The cache arms a start is measured with: the own-reads arm only for one order together."""
    return (False, True, None) if start == ONE_ORDER else (False, True)


def _epoch(dataset_args, seed: int, wait_for, halfway, done, q, coalesce: bool = True, role: int = 1) -> None:
    source, cache_name, root = dataset_args
    hook = _CountMisses()
    cache = ShmCache(cache_name, None, root=root)
    if not coalesce:
        cache.read_through = None  # CachedDataset then reads every miss itself
    ds = CachedDataset(source, cache, source_read_hook=hook)
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    if wait_for is not None:
        wait_for.wait(600)
    t0 = time.monotonic()
    for j, i in enumerate(order):
        ds[i]
        if j + 1 == len(order) // 2 and halfway is not None:
            halfway.set()
    t1 = time.monotonic()
    if done is not None:
        done.set()
    q.put({"seed": seed, "role": role, "start": t0, "wall_s": t1 - t0, "misses": hook.n,
           "hit_rate": 1 - hook.n / len(order)})


def colocated(n: int, size: int, bw: float, reps: int, shm: str, file_dir: str) -> dict:
    ddir = tempfile.mkdtemp(prefix="colocated-", dir=file_dir)
    for i in range(n):
        with open(os.path.join(ddir, f"{i:05d}.bin"), "wb") as f:
            f.write(os.urandom(size))
    total = n * size
    log(f"(b) co-located: {n} samples x {size} B = {total / 1e6:.1f} MB at {bw / 1e6:.1f} MB/s "
        f"(one epoch alone ~{total / bw:.1f} s)")
    results: dict = {"n": n, "sample_bytes": size, "dataset_bytes": total, "bandwidth_bytes_per_s": [bw, bw],
                     "reps": reps, "scenarios": {}}
    for start in STARTS:
        for cached in _arms(start):
            runs = []
            for r in range(reps):
                tag = "".join(ch for ch in start if ch.isalnum())
                name = f"coloc-{'n' if cached is False else 'c' if cached else 'd'}-{r}-{tag}"
                cache = ShmCache(name, total if cached is not False else 0, root=shm,
                                 policy="none" if cached is False else "minio")
                source = ThrottledSource(DirectorySource(ddir), [bw, bw], shared_name=f"bench-{os.getpid()}",
                                         state_dir=os.path.join(shm, ".throttle"))
                args = (source, name, shm)
                go, half, done, q = FORK.Event(), FORK.Event(), FORK.Event(), FORK.Queue()
                second_waits = {"at half": half, "after first": done}.get(start, go)
                p1 = FORK.Process(target=_epoch, args=(args, 1, go, half, done, q, cached is not None, 1))
                p2 = FORK.Process(target=_epoch, args=(args, 1 if start == ONE_ORDER else 2, second_waits, None,
                                                       None, q, cached is not None, 2))
                p1.start()
                p2.start()
                time.sleep(0.5)  # both attached and waiting
                go.set()
                out = sorted((q.get(timeout=600) for _ in range(2)), key=lambda o: o["role"])
                for p in (p1, p2):
                    p.join(60)
                    assert p.exitcode == 0
                runs.append({"first": out[0], "second": out[1]})
                cache.destroy()
                source.unlink()
            key = f"{start}, {ARMS[cached]}"
            results["scenarios"][key] = {
                "first_wall_s": statistics.median(r["first"]["wall_s"] for r in runs),
                "second_wall_s": statistics.median(r["second"]["wall_s"] for r in runs),
                "first_hit_rate": statistics.median(r["first"]["hit_rate"] for r in runs),
                "second_hit_rate": statistics.median(r["second"]["hit_rate"] for r in runs),
                "runs": runs}
            s = results["scenarios"][key]
            log(f"    {key:26s} first {s['first_wall_s']:6.2f} s ({100 * s['first_hit_rate']:5.1f}% hits)  "
                f"second {s['second_wall_s']:6.2f} s ({100 * s['second_hit_rate']:5.1f}% hits)")
    shutil.rmtree(ddir)
    speedups = {}
    print(f"\n(b) co-located jobs: 2 processes, {n} x {size / 1e3:.0f} KB = {total / 1e6:.1f} MB, shared "
          f"{bw / 1e6:.1f} MB/s, cache capacity = dataset, median of {reps}")
    print(f"  {'second process starts':22s} {'cache':>6s} {'1st wall s':>10s} {'1st hits':>8s} "
          f"{'2nd wall s':>10s} {'2nd hits':>8s}")
    for start in STARTS:
        for cached in _arms(start):
            s = results["scenarios"][f"{start}, {ARMS[cached]}"]
            print(f"  {start:22s} {SHORT[cached]:>6s} "
                  f"{s['first_wall_s']:10.2f} {100 * s['first_hit_rate']:7.1f}% {s['second_wall_s']:10.2f} "
                  f"{100 * s['second_hit_rate']:7.1f}%")
        no, yes = (results["scenarios"][f"{start}, {c}"] for c in ("no cache", "cache"))
        speedups[start] = {"second": no["second_wall_s"] / yes["second_wall_s"],
                           "first": no["first_wall_s"] / yes["first_wall_s"]}
        if start == ONE_ORDER:
            own = results["scenarios"][f"{start}, {ARMS[None]}"]
            speedups[start + ", against own reads"] = {"second": own["second_wall_s"] / yes["second_wall_s"],
                                                       "first": own["first_wall_s"] / yes["first_wall_s"]}
    print("  (cache 'own': each miss read by the process that missed it, as without coalescing)")
    for start, v in speedups.items():
        print(f"  speed-up with the cache, second starts {start:12s}: second process {v['second']:5.2f}x, "
              f"first {v['first']:5.2f}x")
    results["speedup"] = speedups
    return results


# ---- (c) stress --------------------------------------------------------------------------------

def _stress(root: str, name: str, seed: int, nops: int, nkeys: int, clear_every: int) -> dict:
    cache = ShmCache(name, None, root=root)
    data = [sample(k, 500, 64_000) for k in range(nkeys)]
    rng = random.Random(seed)
    out = dict(ops=0, gets=0, puts=0, compared=0, wrong_samples=0, wrong_bytes=0, clears=0)

    def compare(v, k):
        out["compared"] += 1
        if bytes(v) != data[k]:
            out["wrong_samples"] += 1
            b = bytes(v)
            out["wrong_bytes"] += sum(x != y for x, y in zip(b, data[k], strict=False)) + abs(len(b) - len(data[k]))

    t = time.perf_counter()
    for _ in range(nops):
        k = rng.randrange(nkeys)
        op = rng.random()
        out["ops"] += 1
        if op < 0.5:
            loaded = []
            v = cache.get_or_load(k, lambda k=k, loaded=loaded: loaded.append(1) or data[k])
            out["gets"] += 1
            out["puts"] += len(loaded)
            compare(v, k)
        elif op < 0.8:
            v = cache.get(k)
            out["gets"] += 1
            if v is not None:
                compare(v, k)
        else:
            cache.put(k, data[k])
            out["puts"] += 1
        if rng.randrange(clear_every) == 0:
            cache.clear()
            out["clears"] += 1
    out["wall_s"] = time.perf_counter() - t
    cache.close()
    return out


def stress(procs: int, nops: int, nkeys: int, shm: str) -> dict:
    log(f"(c) stress: {procs} processes x {nops} calls on {nkeys} keys")
    total = sum(len(sample(k, 500, 64_000)) for k in range(nkeys))
    cache = ShmCache("stress", int(total * 0.4), root=shm)
    t = time.perf_counter()
    with FORK.Pool(procs) as pool:
        outs = pool.starmap(_stress, [(shm, "stress", seed, nops, nkeys, 5000) for seed in range(procs)])
    wall = time.perf_counter() - t
    s = cache.stats()
    # end state: every visible entry exact, accounting equal to the entries present
    present = 0
    for k in range(nkeys):
        if k in cache:
            v = cache.get(k)
            assert bytes(v) == sample(k, 500, 64_000), k
            present += len(v)
    agg = {k: sum(o[k] for o in outs) for k in ("ops", "gets", "puts", "compared", "wrong_samples",
                                                "wrong_bytes", "clears")}
    checks = {"lookups == hits + misses == gets made": s["lookups"] == s["hits"] + s["misses"] == agg["gets"],
              "inserts + refused + duplicates == puts": s["inserts"] + s["refused"] + s["duplicates"] == agg["puts"],
              "bytes_used == bytes of entries present": s["bytes_used"] == present,
              "bytes_used <= capacity": s["bytes_used"] <= s["capacity_bytes"],
              "no reservation left": s["reserved_bytes"] == 0}
    res = {"processes": procs, "calls_per_process": nops, "keys": nkeys, "dataset_bytes": total,
           "capacity_bytes": s["capacity_bytes"], "wall_s": wall, "calls_per_s": agg["ops"] / wall, **agg,
           "stats": {k: s[k] for k in ("hits", "misses", "inserts", "refused", "duplicates", "corrupt",
                                       "generation")}, "checks": checks}
    cache.destroy()
    print(f"\n(c) stress: {procs} processes x {nops} calls, {nkeys} keys of 0.5..64 KB "
          f"({total / 1e6:.0f} MB), capacity 40%")
    print(f"  {agg['ops']} calls in {wall:.1f} s ({agg['ops'] / wall:.0f}/s), {agg['compared']} samples compared, "
          f"{agg['clears']} clears, hits {s['hits']}, inserts {s['inserts']}, refused {s['refused']}")
    print(f"  wrong samples: {agg['wrong_samples']}, wrong bytes: {agg['wrong_bytes']}")
    for k, v in checks.items():
        print(f"  check {k}: {'ok' if v else 'FAILED'}")
    return res


# ---- (d) small samples against LMDB ------------------------------------------------------------

def _lmdb_worker(shm: str, name: str, lmdb_dir: str, n: int, reps: int, seed: int, go, q) -> None:
    import struct

    import lmdb
    import xxhash

    cache = ShmCache(name, None, root=shm)
    env = lmdb.open(lmdb_dir, readonly=True, lock=True, readahead=False, max_readers=64)
    txn = env.begin(buffers=True)  # one read-only transaction for all of this process's gets
    tget, checksum, stored = txn.get, xxhash.xxh3_64_intdigest, struct.Struct("<Q").unpack_from

    def lmdb_get(k):
        v = tget(b"%d" % k)
        if v is None:
            return None
        if checksum(v[8:]) != stored(v)[0]:
            raise ValueError(f"LMDB value {k} failed its checksum")
        return v[8:]

    for k in range(0, n, max(1, n // 16)):  # both hold the same bytes
        assert bytes(cache.get(k)) == bytes(lmdb_get(k)), k

    def shm_get(order):
        get = cache.get
        for k in order:
            get(k)

    def lmdb_single(order):
        for k in order:
            v = tget(b"%d" % k)
            if checksum(v[8:]) != stored(v)[0]:
                raise ValueError(f"LMDB value {k} failed its checksum")

    def shm_many(order):
        get_many = cache.get_many
        for j in range(0, len(order), 64):
            get_many(order[j:j + 64])

    def lmdb_many(order):
        for j in range(0, len(order), 64):
            out = []
            for k in order[j:j + 64]:
                v = tget(b"%d" % k)
                if checksum(v[8:]) != stored(v)[0]:
                    raise ValueError(f"LMDB value {k} failed its checksum")
                out.append(v[8:])

    methods = {"shm get": shm_get, "lmdb get": lmdb_single, "shm get_many 64": shm_many, "lmdb batch 64": lmdb_many}
    rng = random.Random(seed)
    go.wait(120)
    times = {m: [t / n * 1e6 for t in ts] for m, ts in interleaved(methods, n, reps, rng).items()}
    txn.abort()
    env.close()
    cache.close()
    q.put({m: statistics.median(ts) for m, ts in times.items()})


def lmdb_compare(sizes_kb: list[int], procs_list: list[int], budget: int, max_n: int, reps: int, shm: str) -> dict:
    try:
        import lmdb
        import xxhash
    except ImportError as exc:
        raise SystemExit(f"part (d) needs the lmdb package ({exc}); install it with 'pip install lmdb'") from None
    res: dict = {"transaction": "one read-only transaction per process, reused for every get and batch",
                 "lmdb_version": lmdb.__version__, "reps": reps, "sizes": {}}
    for kb in sizes_kb:
        size = kb * 1024
        n = max(64, min(max_n, budget // size))
        log(f"(d) {kb} KB: {n} samples")
        name = f"lmdb-vs-{kb}k"
        cache = ShmCache(name, n * size, root=shm, max_entries=n + 16)
        lmdb_dir = tempfile.mkdtemp(prefix=f"lmdb-{kb}k-", dir=shm)
        env = lmdb.open(lmdb_dir, map_size=n * (size + 4096) * 2 + (16 << 20), sync=False, metasync=False,
                        readahead=False)
        with env.begin(write=True) as txn:
            for k in range(n):
                blob = os.urandom(size)
                assert cache.put(k, blob)
                txn.put(b"%d" % k, xxhash.xxh3_64_intdigest(blob).to_bytes(8, "little") + blob)
        env.close()  # the workers open their own (an environment must not cross a fork)
        per_size: dict = {"n": n, "sample_bytes": size, "procs": {}}
        for procs in procs_list:
            go, q = FORK.Event(), FORK.Queue()
            ps = [FORK.Process(target=_lmdb_worker, args=(shm, name, lmdb_dir, n, reps, 1000 * procs + i, go, q))
                  for i in range(procs)]
            for p in ps:
                p.start()
            time.sleep(0.2)
            go.set()
            outs = [q.get(timeout=600) for _ in ps]
            for p in ps:
                p.join(60)
                assert p.exitcode == 0, p.exitcode
            us = {m: statistics.median(o[m] for o in outs) for m in outs[0]}
            per_size["procs"][procs] = {
                "us_per_get": us, "per_process": outs,
                "ratios": {"get": us["shm get"] / us["lmdb get"],
                           "batch 64": us["shm get_many 64"] / us["lmdb batch 64"]}}
        s = cache.stats()
        assert s["misses"] == 0 and s["corrupt"] == 0, s
        cache.destroy()
        shutil.rmtree(lmdb_dir)
        res["sizes"][kb] = per_size
    print(f"\n(d) ShmCache against LMDB + xxh3-64 in /dev/shm: µs per get, per process (median of {reps}); "
          "ratio = ShmCache / LMDB, below 1 ShmCache is faster")
    print(f"  {'size':>7s} {'procs':>5s} {'shm get':>8s} {'lmdb get':>8s} {'ratio':>6s}   "
          f"{'shm get_many':>12s} {'lmdb batch':>10s} {'ratio':>6s}  (batches of 64, µs per key)")
    for kb, v in res["sizes"].items():
        for procs, r in v["procs"].items():
            u = r["us_per_get"]
            print(f"  {kb:>5d}KB {procs:>5d} {u['shm get']:8.2f} {u['lmdb get']:8.2f} {r['ratios']['get']:6.2f}   "
                  f"{u['shm get_many 64']:12.2f} {u['lmdb batch 64']:10.2f} {r['ratios']['batch 64']:6.2f}")
    return res


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and one repetition (about 30 s)")
    ap.add_argument("--parts", default="abcd", help="which parts to run (default: abcd)")
    ap.add_argument("--lmdb-only", action="store_true", help="run only part (d), the comparison with LMDB")
    ap.add_argument("--sizes", default="1,4,16,128,1024", help="part (d): sample sizes in KB (default 1,4,16,128,1024)")
    ap.add_argument("--procs", default="1,4", help="part (d): numbers of processes reading at once (default 1,4)")
    ap.add_argument("--smoke", action="store_true",
                    help="part (d) in a few seconds: few samples, one repetition (the figures mean nothing)")
    ap.add_argument("--json", default=str(HERE / "out" / "bench_cache.json"), help="where to write the JSON")
    ap.add_argument("--file-dir", default=str(HERE / "out"),
                    help="a directory on a regular file system for the page-cache files (default benchmarks/out)")
    args = ap.parse_args()
    if args.lmdb_only:
        args.parts = "d"
    os.makedirs(args.file_dir, exist_ok=True)
    q = args.quick
    shm = tempfile.mkdtemp(prefix="hpcs-bench-", dir="/dev/shm")
    load0 = os.getloadavg()
    out: dict = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                 "date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "python": platform.python_version(), "loadavg_start": load0}}
    t0 = time.time()
    try:
        if "a" in args.parts:
            out["hit_path_large"] = hit_path("100KB-1MB", 300 if q else 2000, 100_000, 1_000_000, 2 if q else 5,
                                             shm, args.file_dir)
            out["hit_path_4KB"] = hit_path("4KB", 5000 if q else 20_000, 4096, 4096, 2 if q else 5,
                                           shm, args.file_dir)
        if "b" in args.parts:
            out["colocated"] = (colocated(100, 50_000, 5e6, 1, shm, args.file_dir) if q
                                else colocated(200, 100_000, 10e6, 2, shm, args.file_dir))
        if "c" in args.parts:
            out["stress"] = stress(4, 3000 if q else 20_000, 2000, shm)
        if "d" in args.parts:
            sizes = [int(x) for x in args.sizes.split(",") if x]
            procs = [int(x) for x in args.procs.split(",") if x]
            if args.smoke:
                out["lmdb"] = lmdb_compare(sizes, procs, 2 << 20, 512, 1, shm)
            else:
                out["lmdb"] = lmdb_compare(sizes, procs, (16 if q else 64) << 20, 20_000, 2 if q else 7, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    out["machine"]["loadavg_end"] = os.getloadavg()
    out["wall_s"] = time.time() - t0
    targets = {}
    if "hit_path_large" in out:
        for label in ("hit_path_large", "hit_path_4KB"):
            r = out[label]["ratios"]
            targets[f"{label}: hit >= 1.0x page-cache files (os.read, the faster)"] = r["hit / files os.read"] >= 1.0
            targets[f"{label}: hit >= 1.0x page-cache files (open().read())"] = r["hit / files open().read()"] >= 1.0
        targets["hit_path_large: hit >= 0.5x memory copy"] = out["hit_path_large"]["ratios"]["hit / memory copy"] >= 0.5
    if "colocated" in out:
        for start, v in out["colocated"]["speedup"].items():
            if start in ("together", "at half", "after first"):
                targets[f"co-located, second starts {start}: second process >= 3x faster with cache"] = v["second"] >= 3
    if "lmdb" in out and not args.smoke:
        for kb, v in out["lmdb"]["sizes"].items():
            one = v["procs"].get(1)
            if one is None:
                continue
            if kb == 4:
                targets["lmdb: 4 KB get within 1.1x of LMDB + xxh3 (1 process)"] = one["ratios"]["get"] <= 1.1
            batch = one["ratios"]["batch 64"]
            targets[f"lmdb: {kb} KB batch of 64 at least as fast as LMDB's (1 process)"] = batch <= 1.0
    if "stress" in out:
        targets["stress: zero wrong bytes"] = out["stress"]["wrong_bytes"] == 0 and out["stress"]["wrong_samples"] == 0
    out["targets"] = targets
    print(f"\ntargets (load average {load0[0]:.1f} -> {out['machine']['loadavg_end'][0]:.1f}, {out['wall_s']:.0f} s):")
    for k, v in targets.items():
        print(f"  {'MET    ' if v else 'NOT MET'} {k}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {args.json}")
    return 0 if out.get("stress", {}).get("wrong_bytes", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
