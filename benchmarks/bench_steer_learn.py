"""What a spec learns from its own runs after a wrong calibration, and where the model's optimum sits.

Two uses, both on a work directory that ``bench_steer.py --keep`` left (its configuration directory,
e.g. ``/tmp/bench-steer-XXXX/rising-source``, with ``spec.toml`` and ``scenario.toml``):

    python benchmarks/bench_steer_learn.py learn DIR [--case source-30] [--rounds 5] [--fixed cnn=0.75,mlp=0]
    python benchmarks/bench_steer_learn.py explain DIR [--sweep DIR/sweep-right.json]

``learn`` makes the case's wrong scenario (as bench_steer does), clears the spec's history, then
runs ``--rounds`` rounds of three launches from a cold cache, each planned from the history so far:
mode ``plan`` (steered; it records the run), mode ``open``, and the fixed delays ``--fixed`` (the
baseline: the best fixed stagger measured in that setting). It prints each launch and the medians,
and the history table at the end. The launches keep their caches under a private shm root, removed
at the end.

``explain`` compares a sweep's measured makespans (medians per stagger) with the model's
predictions for the same staggers, once with the scenario's jobs as calibrated and once with each
job's start-up replaced by the median start-up measured in the sweep's runs (release to the loop's
first batch request, :func:`hpcstagger.spec.records.startups`).

Writes benchmarks/out/bench_steer_learn.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_steer as B  # noqa: E402  (the cases and write_case)

HS = [sys.executable, "-m", "hpcstagger"]


def _env(shm: str | None = None) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(HERE.parent), **({"HPCSTAGGER_SHM_ROOT": shm} if shm else {}))


def learn(root: Path, case: str, rounds: int, fixed: str) -> dict[str, Any]:
    """The launches run with a private shm root (their caches and the emulated source's state),
    removed at the end."""
    shm = tempfile.mkdtemp(prefix="bench-steer-learn-", dir="/dev/shm")
    try:
        return _learn(root, case, rounds, fixed, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _learn(root: Path, case: str, rounds: int, fixed: str, shm: str) -> dict[str, Any]:
    spec = B.write_case(root, case)
    subprocess.run(HS + ["history", str(spec), "--clear"], check=True, capture_output=True, env=_env())
    variants = (("plan", ["--mode", "plan"]), ("open", ["--mode", "open"]), (f"fixed {fixed}", ["--delays", fixed]))
    runs: list[dict[str, Any]] = []
    for k in range(rounds):
        for label, extra in variants:
            out = subprocess.run(HS + ["launch", str(spec), "--cold-cache", "--json", *extra], capture_output=True,
                                 text=True, env=_env(shm), timeout=600)
            if out.returncode != 0:
                print(f"[bench_steer_learn] round {k} {label}: exit {out.returncode}: {out.stderr[-400:]}",
                      file=sys.stderr)
                continue
            r = json.loads(out.stdout)
            hist = next((line.split("from the history of", 1)[1].split(" (coordinator")[0].strip()
                         for line in out.stderr.splitlines() if "from the history of" in line), "")
            row = {"round": k, "variant": label, "makespan": r["makespan"], "delays": r["delays"],
                   "started": {n: j.get("start") for n, j in r["jobs"].items()}, "history": hist}
            runs.append(row)
            print(f"round {k} {label:>14}: {r['makespan']:.2f} s, delays "
                  + ", ".join(f"{n} +{d:.2f}" for n, d in r["delays"].items()) + (f"; history {hist}" if hist else ""),
                  flush=True)
    medians = {label: statistics.median([r["makespan"] for r in runs if r["variant"] == label])
               for label, _ in variants if any(r["variant"] == label for r in runs)}
    base = medians.get(f"fixed {fixed}")
    for label, m in medians.items():
        gap = "" if not base or label.startswith("fixed") else f" ({100 * (m / base - 1):+.1f}% against fixed)"
        print(f"{label:>14}: median {m:.2f} s{gap}")
    table = subprocess.run(HS + ["history", str(spec)], capture_output=True, text=True, env=_env()).stdout
    print(table)
    return {"case": case, "fixed": fixed, "runs": runs, "medians": medians, "history": table}


def explain(root: Path, sweep_path: Path) -> dict[str, Any]:
    from hpcstagger.spec.records import startups
    from hpcstagger.model import Scenario, predict

    sweep = json.loads(sweep_path.read_text())
    runs = [r for r in sweep["runs"] if r.get("ok", True) and r.get("run_dir")]
    sc = Scenario.from_dict(runs[0]["scenario"])
    names = list(sc.job_names)
    seen: dict[str, list[float]] = {n: [] for n in names}
    for r in runs:
        for n, v in startups(r["run_dir"], names).items():
            seen[n].append(v)
    measured_startup = {n: statistics.median(v) for n, v in seen.items() if v}
    learned = replace(sc, jobs=tuple(replace(j, startup=measured_startup.get(j.name, j.startup)) for j in sc.jobs))
    points = []
    for p in sweep["summary"]["points"]:
        run = next(r for r in runs if r["label"] == p["label"])
        delays = run["released"] if p["label"] in ("plan", "open") else run["delays"]
        points.append({"label": p["label"], "delays": delays, "measured": p["measured_median"],
                       "calibrated": predict(sc, delays, series=False).makespan,
                       "measured_startups": predict(learned, delays, series=False).makespan})
    pairs = [f"{j.name} {j.startup:.2f} -> {measured_startup.get(j.name, float('nan')):.2f} s" for j in sc.jobs]
    print("start-up, calibrated -> measured in the runs: " + ", ".join(pairs))
    print(f"{'point':>14} {'measured':>9} {'model (calibrated)':>19} {'model (runs start-ups)':>23}")
    for p in sorted(points, key=lambda p: (p["label"][:3], p["measured"])):
        print(f"{p['label']:>14} {p['measured']:8.2f}s {p['calibrated']:18.2f}s {p['measured_startups']:22.2f}s")
    for key in ("measured", "calibrated", "measured_startups"):
        best = min(points, key=lambda p: p[key])
        print(f"best by {key}: {best['label']} ({best[key]:.2f} s)")
    return {"startups": measured_startup, "points": points}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("learn", "explain"))
    p.add_argument("dir", type=Path, help="a configuration directory that bench_steer.py --keep left")
    p.add_argument("--case", default="source-30", choices=sorted(B.CASES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fixed", default="cnn=0.75,mlp=0", help="the baseline's fixed delays, JOB=S,...")
    p.add_argument("--sweep", type=Path, help="the sweep JSON to explain (default DIR/sweep-right.json)")
    args = p.parse_args()
    if not (args.dir / "spec.toml").exists() or not (args.dir / "scenario.toml").exists():
        p.error(f"{args.dir} has no spec.toml and scenario.toml: give a configuration directory that "
                "'bench_steer.py --keep' left")
    if args.what == "learn":
        res = learn(args.dir, args.case, args.rounds, args.fixed)
    else:
        res = explain(args.dir, args.sweep or args.dir / "sweep-right.json")
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "bench_steer_learn.json").write_text(json.dumps({args.what: res}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
