"""Learning a spec that was never calibrated: three runs, then the best fixed stagger.

Results: benchmarks/RESULTS.md, section Closed loop.

For each configuration (bench_userjobs' jobs: DataLoader workers and batches, DDP, no timing
code) it writes the spec without ``[plan] scenario`` and never calibrates it. Then, for each of
``--sequences`` sequences, from an empty history: ``--runs`` launches in a row (``hpcstagger
launch SPEC --cold-cache``), each planning from what the earlier ones observed (the first one
starts the jobs ``learn_stagger`` apart). Afterwards, in the same invocation, ``hpcstagger sweep
--history`` measures a simultaneous start, fixed staggers in both orders and the plan learned from
the last sequence (steered and open), every run from a cold cache; each learned run is compared
with the best fixed stagger, and so is the learned plan inside the sweep, where it runs
interleaved with the fixed staggers (the sweep's plan runs are observed too, so it goes on
learning from them).

    python benchmarks/bench_learn.py [--only NAME,...] [--runs 3] [--sequences 2]
        [--staggers 0,1,2,3,4,6] [--repeat N] [--keep]
    python benchmarks/bench_learn.py --rounds R [--only NAME,...] [--runs 3] [--staggers ...]

With ``--rounds R`` the comparison is interleaved instead: each round is one learning sequence
from an empty history and one round of fixed staggers (``hpcstagger sweep`` without the plan),
the sequence first in odd rounds and the staggers first in even ones. The learned runs and every
fixed stagger thus see the VM in the same states equally often, and the target is judged on
medians over the rounds: run k's median makespan against the best fixed stagger's median. (The
default mode compares single learned runs with a sweep made minutes later, and the best of many
single runs is the minimum of noisy draws, biased low.)

Writes benchmarks/out/bench_learn.json and prints one row per configuration and sequence.
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
import bench_userjobs as U  # noqa: E402  (the configurations, spec writer and runner)

DEFAULT_CONFIGS = ("pair-w2-b64", "rising-source", "three-jobs")
HS = [sys.executable, "-m", "hpcstagger"]


def _launch(spec: Path, work: Path, log: Path, tag: str) -> dict[str, Any]:
    """One learning launch: its makespan, delays and releases, and how it was planned."""
    rc = U._run(HS + ["launch", str(spec), "--cold-cache"], log)
    runs = sorted((work / "work" / "runs").glob("*-plan"), key=lambda p: p.stat().st_mtime)
    if rc != 0 or not runs:
        return {"error": f"launch exited {rc}; see {log}"}
    run_dir = runs[-1].rename(runs[-1].with_name(tag))
    result = json.loads((run_dir / "result.json").read_text())
    released = {n: (j.get("release") or {}).get("at", j.get("delay")) for n, j in result["jobs"].items()}
    return {"makespan": result["makespan"], "delays": result.get("delays"), "released": released,
            "predicted": (result.get("predicted") or {}).get("plan"),
            "learned_from": (result.get("learn") or {}).get("why"), "run_dir": str(run_dir)}


def _setup(name: str, cfg: dict[str, Any], data: Path, work: Path) -> tuple[Path, Path]:
    """The configuration's work directory with its spec, never calibrated (no ``[plan] scenario``);
    returns (log, spec)."""
    work.mkdir(parents=True)
    log = work / "log.txt"
    spec = work / "spec.toml"
    U.write_spec(spec, name, cfg, data, data.stat().st_size)
    spec.write_text(spec.read_text().replace('scenario = "scenario.toml"\n', ""))
    return log, spec


def _sequence(name: str, spec: Path, work: Path, log: Path, runs: int, which: str, seq: int) -> list[dict[str, Any]]:
    """One learning sequence from an empty history: ``runs`` launches in a row (``which`` names it
    in the progress lines: "sequence" or "round")."""
    U._run(HS + ["history", str(spec), "--clear"], log)
    rows = []
    for k in range(runs):
        row = _launch(spec, work, log, f"learn-{seq}-{k + 1}")
        rows.append(row)
        print(f"[bench_learn] {name} {which} {seq + 1} run {k + 1}: {row.get('makespan', row.get('error'))} s, "
              f"released {row.get('released')}", file=sys.stderr, flush=True)
    return rows


def run_config(name: str, cfg: dict[str, Any], data: Path, work: Path, runs: int, sequences: int,
               staggers: str, repeat: int) -> dict[str, Any]:
    log, spec = _setup(name, cfg, data, work)
    out: dict[str, Any] = {"name": name, "config": cfg, "log": str(log), "sequences": []}
    for seq in range(sequences):
        out["sequences"].append(_sequence(name, spec, work, log, runs, "sequence", seq))
    t0 = time.monotonic()
    # --history: the sweep also runs the plan learned from the last sequence (steered and open),
    # interleaved with the fixed staggers, so that the learned plan and the best stagger compare in one run
    rc = U._run(HS + ["sweep", str(spec), "--history", "--staggers", staggers, "--repeat", str(repeat), "--json",
                      str(work / "sweep.json")], log)
    U._run(HS + ["history", str(spec), "--clear"], log)
    out["sweep_s"] = time.monotonic() - t0
    if rc != 0 or not (work / "sweep.json").exists():
        out["error"] = f"sweep exited {rc}; see {log}"
        return out
    sweep = json.loads((work / "sweep.json").read_text())
    out["best"] = sweep["summary"].get("best")
    best = (out["best"] or {}).get("measured")
    for rows in out["sequences"]:
        for row in rows:
            if best and row.get("makespan"):
                row["gap"] = row["makespan"] / best - 1
    out["fixed"] = {r["label"]: r["measured"] for r in sweep["runs"] if r.get("ok")}  # the last repetition's
    out["in_sweep"] = {k: sweep["summary"].get(k) for k in ("plan", "plan_vs_best", "open", "open_vs_best")}
    out["in_sweep"]["plan_delays"] = [r["released"] for r in sweep["runs"] if r["mode"] == "plan"]
    return out


def run_rounds(name: str, cfg: dict[str, Any], data: Path, work: Path, runs: int, rounds: int,
               staggers: str) -> dict[str, Any]:
    """Interleaved rounds (module docs): per round a learning sequence and one fixed-stagger sweep."""
    log, spec = _setup(name, cfg, data, work)
    out: dict[str, Any] = {"name": name, "config": cfg, "log": str(log), "mode": "rounds", "sequences": [],
                           "fixed_runs": {}}

    def sequence(r: int) -> None:
        out["sequences"].append(_sequence(name, spec, work, log, runs, "round", r))

    def fixed(r: int) -> None:
        # the sweep's own launches are not observed: without --history it plans nothing and learns nothing
        path = work / f"sweep-{r}.json"
        rc = U._run(HS + ["sweep", str(spec), "--staggers", staggers, "--json", str(path)], log)
        if rc != 0 or not path.exists():
            print(f"[bench_learn] {name} round {r + 1}: sweep exited {rc}; see {log}", file=sys.stderr, flush=True)
            return
        for x in json.loads(path.read_text())["runs"]:
            if x.get("ok") and x.get("measured") is not None:
                out["fixed_runs"].setdefault(x["label"], []).append(x["measured"])
        print(f"[bench_learn] {name} round {r + 1}: fixed staggers done", file=sys.stderr, flush=True)

    for r in range(rounds):
        for step in ((sequence, fixed) if r % 2 == 0 else (fixed, sequence)):
            step(r)
    U._run(HS + ["history", str(spec), "--clear"], log)
    medians = {k: statistics.median(v) for k, v in out["fixed_runs"].items() if v}
    if medians:
        label = min(medians, key=lambda k: medians[k])
        out["best"] = {"label": label, "measured": medians[label], "runs": out["fixed_runs"][label]}
    out["fixed"] = medians
    out["run_medians"] = []
    for k in range(runs):
        spans = [rows[k]["makespan"] for rows in out["sequences"] if len(rows) > k and rows[k].get("makespan")]
        med = statistics.median(spans) if spans else None
        best = (out.get("best") or {}).get("measured")
        out["run_medians"].append({"run": k + 1, "makespans": spans, "median": med,
                                   "gap": med / best - 1 if med and best else None})
    return out


def _print_rounds(results: list[dict[str, Any]], runs: int) -> None:
    heads = " | ".join(f"run {k + 1}, median (runs)" for k in range(runs))
    print(f"\n| configuration | {heads} | best fixed, median (runs) | run {runs}'s releases |\n"
          f"|---|{'---|' * runs}---|---|")
    for r in results:
        best = r.get("best") or {}
        cells = " | ".join(f"{_pc(m['gap'])} ({m['median'] or 0:.2f} s; "
                           + ", ".join(f"{x:.2f}" for x in m["makespans"]) + ")" for m in r["run_medians"])
        rel = "; ".join(", ".join(f"{n} {v or 0:.1f}" for n, v in (rows[-1].get("released") or {}).items())
                        for rows in r["sequences"])
        print(f"| {r['name']} | {cells} | {best.get('label')} {best.get('measured') or 0:.2f} s ("
              + ", ".join(f"{x:.2f}" for x in best.get("runs", [])) + f") | {rel} |")
    print("\nFixed staggers, medians over the rounds:\n")
    for r in results:
        print(f"- {r['name']}: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted((r.get('fixed') or {}).items(),
                                                                                  key=lambda kv: kv[1])))


def _pc(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT_CONFIGS), help="comma-separated bench_userjobs configurations")
    p.add_argument("--runs", type=int, default=3, help="learning launches per sequence (default 3)")
    p.add_argument("--sequences", type=int, default=2, help="sequences from an empty history (default 2)")
    p.add_argument("--staggers", default="0,1,2,3,4,6", help="fixed staggers, seconds, run in both orders")
    p.add_argument("--samples", type=int, default=3072, help="dataset samples of 3 KiB (default 3072, ~9.4 MB)")
    p.add_argument("--repeat", type=int, default=1, help="sweep runs per fixed stagger (medians)")
    p.add_argument("--rounds", type=int, default=0,
                   help="interleaved rounds of a learning sequence and the fixed staggers (module docs); "
                        "replaces --sequences and --repeat")
    p.add_argument("--out", default=str(HERE / "out" / "bench_learn.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory (specs, runs, logs)")
    args = p.parse_args()
    names = args.only.split(",")
    for n in names:
        if n not in U.CONFIGS or U.CONFIGS[n].get("real_fs"):
            p.error(f"unknown or unsupported configuration {n!r} (the emulated-source ones of bench_userjobs)")
    if args.runs < 1 or args.sequences < 1 or args.rounds < 0:
        p.error("--runs and --sequences must be >= 1, --rounds >= 0")
    results = []
    with U.workspace("bench-learn", args.samples, args.keep) as (root, data):
        for name in names:
            if args.rounds:
                results.append(run_rounds(name, U.CONFIGS[name], data, root / name, args.runs, args.rounds,
                                          args.staggers))
            else:
                results.append(run_config(name, U.CONFIGS[name], data, root / name, args.runs, args.sequences,
                                          args.staggers, args.repeat))
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "results": results}, f,
                          indent=1)
    if args.rounds:
        _print_rounds(results, args.runs)
        return 0
    heads = " | ".join(f"run {k + 1} vs best" for k in range(args.runs))
    print(f"\n| configuration | sequence | {heads} | run {args.runs}: delays | best fixed |\n"
          f"|---|---|{'---|' * args.runs}---|---|")
    for r in results:
        if r.get("error"):
            print(f"| {r['name']} | {r['error']} |{' |' * (args.runs + 2)}")
            continue
        best = r.get("best") or {}
        for i, rows in enumerate(r["sequences"]):
            gaps = " | ".join(f"{_pc(x.get('gap'))} ({x.get('makespan') or 0:.2f} s)" for x in rows)
            last = rows[-1]
            delays = ", ".join(f"{n} {(last.get('released') or {}).get(n, d) or 0:.1f}"
                               for n, d in (last.get("delays") or {}).items())
            print(f"| {r['name']} | {i + 1} | {gaps} | {delays} | {best.get('label')} "
                  f"{best.get('measured') or 0:.2f} s |")
        last_gaps = [rows[-1]["gap"] for rows in r["sequences"] if rows[-1].get("gap") is not None]
        if last_gaps:
            print(f"| {r['name']} | median | run {args.runs}: {_pc(statistics.median(last_gaps))} |"
                  f"{' |' * (args.runs + 1)}")
    print("\nThe learned plan inside the sweep (sweep --history: the plan learned from all the runs above, "
          "interleaved with the fixed staggers; medians over --repeat):\n\n| configuration | learned plan, "
          "steered | vs best | learned plan, open | vs best | best fixed |\n|---|---|---|---|---|---|")
    for r in results:
        q, best = r.get("in_sweep") or {}, r.get("best") or {}
        if q:
            print(f"| {r['name']} | {q.get('plan') or 0:.2f} s | {_pc(q.get('plan_vs_best'))} "
                  f"| {q.get('open') or 0:.2f} s | {_pc(q.get('open_vs_best'))} "
                  f"| {best.get('label')} {best.get('measured') or 0:.2f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
