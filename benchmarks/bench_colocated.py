"""Co-located launch end to end: the planned stagger against a measured sweep of staggers.

A thin user of ``hpcstagger sweep`` (:mod:`hpcstagger.measure.sweep`) on the demo's jobs. It
prepares the demo's workflow once (:func:`hpcstagger.demo.run.prepare`: dataset, ThrottledSource
with bandwidth degrading under concurrency, calibration, the spec of two co-located jobs under
MPMD mpiexec with the shared cache and asynchronous checkpoints), then runs the sweep, every run
from a cold cache, and measures in each repetition:

- the makespan at the planned stagger, simultaneously and sequentially;
- the makespan at fixed staggers (default 0, 1, 2, 3, 4, 5, 6, 8 s), each in both orders (the
  second job delayed, and the first job delayed; stagger 0 is the simultaneous run);
- the coordinator's prediction for every run (with the calibration the jobs measured at start);
- the coordinator's overhead (rendezvous, split, plan exchange, on the last rank to arrive).

Targets (benchmarks/RESULTS.md, section Co-located runs): the planned stagger's measured makespan
within 5% of the best measured stagger of the sweep; prediction error at most 10%; coordinator
overhead at most 1 s.

    python benchmarks/bench_colocated.py [--repeat 2] [--sweep 0,1,2,3,4,5,6,8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _summary(result: dict) -> list[dict]:
    """The figures this benchmark has always recorded, per repetition, from the sweep's summary."""
    out = []
    for rep in result["summary"]["per_repetition"]:
        k = rep["repetition"]
        delays = rep["planned_delays"] or {}
        later = max(delays, key=lambda n: delays[n]) if delays else None
        out.append({
            "repetition": k, "planned_delay": delays.get(later, 0.0) if later else None, "later_job": later,
            "plan": rep["plan"], "simultaneous": rep["simultaneous"], "sequential": rep["sequential"],
            "best_sweep": (rep["best"] or {}).get("measured"), "best_sweep_label": (rep["best"] or {}).get("label"),
            "plan_vs_best": rep["plan_vs_best"], "prediction_error_median": rep["error_median"],
            "prediction_error_max": rep["error_max"], "coordinator_overhead_max": rep["overhead_max"],
        })
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2, help="repetitions (default 2)")
    p.add_argument("--sweep", default="0,1,2,3,4,5,6,8",
                   help="fixed staggers, seconds, each run in both orders ('auto': the sweep's default from "
                        "the plan's predicted curve)")
    p.add_argument("--samples", type=int, default=6000, help="dataset size (default 6000, as the demo)")
    p.add_argument("--quick", action="store_true", help="a smaller dataset, 5 staggers, one repetition")
    p.add_argument("--out", default=str(HERE / "out" / "bench_colocated.json"), help="JSON results")
    args = p.parse_args()
    if args.quick:
        args.repeat, args.samples, args.sweep = 1, 2000, "0,1,2,3,4"

    from hpcstagger.measure.sweep_report import format_sweep, plot_sweep
    from hpcstagger.measure.sweep import parse_staggers, run_sweep
    from hpcstagger.demo.run import DemoConfig, prepare

    staggers = None if args.sweep == "auto" else parse_staggers(args.sweep)
    if staggers is not None and len(staggers) < 5:
        print("bench_colocated: note: the target asks for a sweep of at least 5 staggers", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="bench-colocated-"))
    root = tempfile.mkdtemp(prefix="bench-colocated-", dir="/dev/shm")
    os.environ["HPCSTAGGER_SHM_ROOT"] = root
    started = time.monotonic()
    try:
        setup = prepare(DemoConfig(workdir=str(work), samples=args.samples))
        result = run_sweep(setup.spec, staggers=staggers, repeat=args.repeat, sequential=True,
                           json_path=work / "sweep.json")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    reps = sorted({r["repetition"] for r in result["runs"]})
    out = {"summary": _summary(result),
           "runs": [[r for r in result["runs"] if r["repetition"] == k] for k in reps],
           "scenario": [next((r["scenario"] for r in result["runs"] if r["repetition"] == k and r["mode"] == "plan"),
                             None) for k in reps],
           "calibrated_scenario": setup.scenario.to_dict(), "sweep": result["summary"],
           "staggers": result["staggers"], "curve": result["curve"],
           "seconds": time.monotonic() - started, "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    plot = str(Path(args.out).with_suffix(".png"))
    plot_sweep(result, plot)

    print(format_sweep(result))
    print()
    for s in out["summary"]:
        print(f"repetition {s['repetition']}: plan ({s['later_job']} +{s['planned_delay'] or 0:.2f}s) "
              f"{s['plan']:.2f} s; "
              f"best of the sweep {s['best_sweep']:.2f} s ({s['best_sweep_label']}): plan/best - 1 = "
              f"{100 * s['plan_vs_best']:+.1f}%; simultaneous {s['simultaneous']:.2f} s, sequential "
              f"{s['sequential']:.2f} s; prediction error median {100 * s['prediction_error_median']:.1f}%, "
              f"max {100 * s['prediction_error_max']:.1f}%; coordinator overhead max "
              f"{1000 * (s['coordinator_overhead_max'] or 0):.0f} ms")
    print(f"\nwrote {args.out} and {plot}; the runs are under {work} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
