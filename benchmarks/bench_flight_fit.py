"""Does the counted source factor read 1.0 for a source that delivers its calibrated curve?

The closed loop's steering fits a factor on the source's bandwidth: the bytes read over what the
calibrated curve ``B(k)`` delivers in the seconds the node spent with ``k`` reads in flight
(``bytes / sum_k T_k B(k)``, the cache's exact count). This checks that estimator against
``ThrottledSource`` directly, with no model, no jobs and no DataLoader: ``P`` processes read
distinct 3 KiB samples through ``CachedDataset`` (every read a miss), each thinking for a random
time between reads, and the factor is computed from the cache's counters as the watcher does.

The emulator counts a reader for ``GRACE`` (1 ms) after its read ends, so that back-to-back reads
count as one continuous reader. With reads of about 0.5 ms and short gaps, that makes the throttle
see more readers than are in flight. Each setting runs with the emulator's grace and with none
(the module constant set in the parent before the readers fork), in the same run.

    python benchmarks/bench_flight_fit.py [--procs 2,4] [--think 0,0.0005,0.002] [--reads 1500]

Prints one row per setting and writes ``benchmarks/out/bench_flight_fit.json``.

``--cost N`` instead times what the count costs a miss: N misses of an in-memory source (no
throttle) through ``CachedDataset``, with nobody watching and with the reads counted
(``cache.watch``), alternating in 10 blocks; per-miss medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time

from hpcstagger import config
from hpcstagger.cache import CachedDataset, ShmCache, ThrottledSource
from hpcstagger.cache import throttle

SAMPLE = 3 * 1024
CURVE = (6.0e6, 8.0e6, 9.0e6, 9.0e6)  # aggregate bytes/s with 1, 2, 3, 4+ readers: a 3 KiB read alone takes 0.5 ms
FORK = mp.get_context("fork")


class Memory:
    """An in-memory source of ``n`` samples of 3 KiB."""

    def __init__(self, n: int):
        self.n = n
        self.blob = os.urandom(SAMPLE)

    def __len__(self) -> int:
        return self.n

    def key(self, i: int) -> int:
        return int(i)

    def __getitem__(self, i: int) -> bytes:
        return self.blob


def _reader(ds: CachedDataset, indices: list[int], think: float, seed: int, go) -> None:
    rng = random.Random(seed)
    go.wait(30)
    for i in indices:
        ds[i]
        if think > 0:
            time.sleep(rng.expovariate(1.0 / think))


def one(procs: int, think: float, reads: int, grace: float, root: str, tag: str) -> dict:
    """One setting: the counted factor, the mean reads in flight, and what the throttle delivered."""
    throttle.GRACE = grace  # the forked readers inherit it
    n = procs * reads
    cache = ShmCache(f"ff-{tag}", n * (SAMPLE + 256) * 2, root=root)
    src = ThrottledSource(Memory(n), list(CURVE), shared_name=f"ff-{tag}", state_dir=os.path.join(root, ".thr"))
    ds = CachedDataset(src, cache)
    go = FORK.Event()
    kids = [FORK.Process(target=_reader, args=(ds, list(range(p, n, procs)), think, p, go)) for p in range(procs)]
    for k in kids:
        k.start()
    b0, f0 = cache.read_counters()[0], cache.flight_seconds()
    t0 = time.perf_counter()
    go.set()
    for k in kids:
        k.join(300)
        if k.is_alive():
            k.kill()
            raise SystemExit(f"bench_flight_fit: a reader did not finish in 300 s ({procs} procs, think {think})")
    wall = time.perf_counter() - t0
    nbytes = cache.read_counters()[0] - b0
    spent = [b - a for a, b in zip(f0, cache.flight_seconds(), strict=True)]
    expected = sum(t * CURVE[min(k, len(CURVE)) - 1] for k, t in enumerate(spent, 1))
    busy = sum(spent)
    cache.destroy(force=True)
    src.unlink()
    return {"procs": procs, "think": think, "grace": grace, "reads": n, "wall": wall,
            "factor": nbytes / expected if expected else None,
            "mean_in_flight": sum(k * t for k, t in enumerate(spent, 1)) / busy if busy else None,
            "busy_share": busy / wall}


def cost(n: int, root: str) -> dict:
    """Per-miss time of ``CachedDataset`` on a fast source, unwatched and watched (medians of 10 blocks)."""
    cache = ShmCache("ff-cost", 20 * n * (SAMPLE + 256), root=root)
    ds = CachedDataset(Memory(20 * n), cache)
    per: dict[str, list[float]] = {"unwatched": [], "watched": []}
    base = 0
    try:
        for block in range(10):
            for mode in (("unwatched", "watched") if block % 2 == 0 else ("watched", "unwatched")):
                if mode == "watched":
                    cache.watch(3600)
                t = time.perf_counter()
                for i in range(base, base + n):
                    ds[i]
                per[mode].append((time.perf_counter() - t) / n)
                base += n
                if mode == "watched":
                    cache.destroy(force=True)  # the watch word lives in the ledger: start over unwatched
                    cache = ShmCache("ff-cost", 20 * n * (SAMPLE + 256), root=root)
                    ds = CachedDataset(Memory(20 * n), cache)
    finally:
        cache.destroy(force=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in per.items()}
    return {"misses_per_block": n, "per_miss_s": med, "blocks": per}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="2,4", help="comma-separated reader process counts")
    ap.add_argument("--think", default="0,0.0005,0.002", help="comma-separated mean think times between reads, s")
    ap.add_argument("--reads", type=int, default=1500, help="reads per process per setting")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each setting (alternating the grace)")
    ap.add_argument("--cost", type=int, metavar="N", help="time N misses per block unwatched and watched instead")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                                   "bench_flight_fit.json"))
    a = ap.parse_args(argv)
    if a.cost:
        root = tempfile.mkdtemp(prefix="hpcstagger-ff-", dir="/dev/shm")
        try:
            got = cost(a.cost, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        m = got["per_miss_s"]
        print(f"per miss: unwatched {m['unwatched'] * 1e6:.2f} us, watched (counted) {m['watched'] * 1e6:.2f} us, "
              f"difference {(m['watched'] - m['unwatched']) * 1e6:.2f} us")
        return 0
    procs = [int(x) for x in a.procs.split(",")]
    thinks = [float(x) for x in a.think.split(",")]
    root = tempfile.mkdtemp(prefix="hpcstagger-ff-", dir="/dev/shm")
    rows = []
    default = throttle.GRACE
    try:
        with config.override(shm_root=root):
            for p in procs:
                for th in thinks:
                    for r in range(a.repeat):
                        for g in ((default, 0.0) if r % 2 == 0 else (0.0, default)):
                            row = one(p, th, a.reads, g, root, f"{p}-{len(rows)}")
                            rows.append(row)
                            print(f"[bench_flight_fit] procs {p} think {th * 1e3:.1f} ms grace {g * 1e3:.1f} ms: "
                                  f"factor {row['factor']:.3f}, mean in flight {row['mean_in_flight']:.2f}, "
                                  f"busy {row['busy_share']:.2f}", file=sys.stderr, flush=True)
    finally:
        throttle.GRACE = default
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"curve": CURVE, "sample": SAMPLE, "rows": rows}, f, indent=1)
    print("| readers | mean think | factor, grace 1 ms | factor, no grace | mean in flight (1 ms / none) |")
    print("|---|---|---|---|---|")
    for p in procs:
        for th in thinks:
            sel = [r for r in rows if r["procs"] == p and r["think"] == th]
            def fmt(g: float, key: str, sel: list = sel) -> str:
                return ", ".join(f"{r[key]:.2f}" for r in sel if r["grace"] == g)
            print(f"| {p} | {th * 1e3:.1f} ms | {fmt(default, 'factor')} | {fmt(0.0, 'factor')} | "
                  f"{fmt(default, 'mean_in_flight')} / {fmt(0.0, 'mean_in_flight')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
