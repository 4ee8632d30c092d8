"""Prefetching in the wait: the makespan gain, and what it costs the running job.

Results: benchmarks/RESULTS.md, section Closed loop.

A compute-bound first job (``wide``: a wide CNN, batch 16, DataLoader with 2 workers, DDP, no
timing code) runs alone while the second (``mlp``: light, reading-bound, 2 epochs) waits a fixed
``--delay`` seconds; the source is bench_userjobs' emulated one (6 MB/s alone, 3 MB/s for two
readers and more) and the cache holds the whole dataset. Each pair of launches, in alternating
order, runs the same stagger with ``[plan] prefetch = false`` and ``true`` (every launch from a
cold cache); mode ``fixed``, so that only the prefetching differs (``--mode plan`` steers both).

Per launch: the makespan, the running job's batches per second while the other waits (from its
leader's progress records, from 0.5 s after its loop began to the wait's end), and what the
waiting job prefetched (its status' timings).

    python benchmarks/bench_prefetch.py [--pairs 4] [--delay 6] [--mode fixed|plan] [--keep]

Writes benchmarks/out/bench_prefetch.json and prints the medians over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_userjobs as U  # noqa: E402  (the spec writer, runner and workspace)

CONFIG: dict[str, Any] = {
    "jobs": [U._job("wide", "wide", batch=16, workers=2, epochs=1), U._job("mlp", "mlp", batch=64, workers=2)],
    "cache": 1.0, "throttle": U.FALLS}


def one_launch(spec: Path, work: Path, log: Path, tag: str, mode: str, delay: float) -> dict[str, Any]:
    from hpcstagger.spec.records import read_progress, throughput

    hs = [sys.executable, "-m", "hpcstagger", "launch", str(spec), "--mode", mode, "--cold-cache", "--no-history"]
    if mode == "fixed":
        hs += ["--delays", f"wide=0,mlp={delay}"]
    rc = U._run(hs, log)
    runs = sorted((work / "work" / "runs").glob(f"*-{mode}"), key=lambda p: p.stat().st_mtime)
    if rc != 0 or not runs:
        return {"error": f"launch exited {rc}; see {log}"}
    run_dir = runs[-1].rename(runs[-1].with_name(tag))
    result = json.loads((run_dir / "result.json").read_text())
    status = json.loads((run_dir / "mlp.0.json").read_text())
    wait_end = status["t0"] + status["timings"]["started_at"]
    rec = read_progress(str(run_dir), "wide")
    rate = throughput(rec, 0.5, wait_end - rec["loop_start"]) if rec and rec.get("loop_start") else None
    t = status["timings"]
    return {"makespan": result["makespan"], "rate": rate, "waited": t.get("waited"),
            "prefetched": t.get("prefetch_samples", 0.0), "prefetch_busy_s": t.get("prefetch_busy_s"),
            "finish": {n: j["finish"] for n, j in result["jobs"].items()}, "run_dir": str(run_dir)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4, help="pairs of launches without / with prefetching")
    p.add_argument("--delay", type=float, default=6.0, help="seconds the second job waits (mode fixed)")
    p.add_argument("--mode", default="fixed", choices=["fixed", "plan"],
                   help="fixed: the same stagger in both; plan: calibrated once, steered in both")
    p.add_argument("--samples", type=int, default=3072, help="dataset samples of 3 KiB (default 3072, ~9.4 MB)")
    p.add_argument("--out", default=str(HERE / "out" / "bench_prefetch.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    with U.workspace("bench-prefetch", args.samples, args.keep) as (root, data):
        work = root / "compute-first"
        work.mkdir()
        log = work / "log.txt"
        off = work / "spec.toml"
        U.write_spec(off, "compute-first", CONFIG, data, data.stat().st_size)
        if args.mode == "plan":
            U.calibrate(off, work, log, 60.0)
        else:
            off.write_text(off.read_text().replace('scenario = "scenario.toml"\n', ""))
        on = work / "spec-prefetch.toml"
        on.write_text(off.read_text().replace('mode = "plan"', 'mode = "plan"\nprefetch = true'))
        for k in range(args.pairs):
            order = (("off", off), ("on", on)) if k % 2 == 0 else (("on", on), ("off", off))
            for label, spec in order:
                row = {"pair": k, "label": label, **one_launch(spec, work, log, f"{label}-{k}", args.mode, args.delay)}
                rows.append(row)
                print(f"[bench_prefetch] pair {k} {label}: makespan {row.get('makespan')}, rate {row.get('rate')}, "
                      f"prefetched {row.get('prefetched')}", file=sys.stderr, flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "rows": rows}, f, indent=1)
    pairs: dict[int, dict[str, Any]] = {}
    for r in rows:
        pairs.setdefault(r["pair"], {})[r["label"]] = r
    full = [q for q in pairs.values() if q.get("on", {}).get("makespan") and q.get("off", {}).get("makespan")]
    span = [q["on"]["makespan"] / q["off"]["makespan"] for q in full]
    rate = [q["on"]["rate"] / q["off"]["rate"] for q in full if q["on"].get("rate") and q["off"].get("rate")]
    pre = [q["on"]["prefetched"] for q in full]

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f})" if xs else "-"

    print(f"\n| mode | pairs | makespan: prefetch / none | running job's batches/s in the wait: prefetch / none "
          f"| samples prefetched (median) |\n|---|---|---|---|---|\n| {args.mode} | {len(full)} | {med(span)} | "
          f"{med(rate)} | {statistics.median(pre) if pre else 0:.0f} of {args.samples} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
