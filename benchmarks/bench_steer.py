"""Closed-loop staggering against a calibration that is off: steered, open loop, fixed.

Results: benchmarks/RESULTS.md, section Closed loop.

For each configuration (bench_userjobs' jobs: DataLoader workers and batches, DDP, no timing
code) it calibrates the spec once, the documented way (``hpcstagger calibrate --spec``), then
makes the calibration wrong on purpose and runs ``hpcstagger sweep`` on each case: the plan
steered (mode plan), the same plan open-loop (mode open), a simultaneous start and fixed
staggers in both orders, every run from a cold cache.

Cases: ``right`` (the calibration as measured), ``source-30``/``source+30`` (the scenario's source
bandwidth times 0.7 / 1.3), ``jobs-30``/``jobs+30`` (every job's CPU costs, ``sample_time``,
``prep_time``, ``read_cpu`` and ``handoff``, times 0.7 / 1.3).

    python benchmarks/bench_steer.py [--only NAME,...] [--cases right,source-30,...]
        [--staggers 0,1,2,3,4,6] [--repeat N] [--overhead N [--uncounted] [--steered] [--unparked] [--fixed]]
        [--keep]

``--overhead N`` instead measures what watching costs: with the calibration as measured (or made
wrong as the one case ``--cases`` names), N pairs
of launches, one in mode ``open`` (no watcher) and one in mode ``plan`` with ``[plan] steer =
false`` (the watcher looks and fits as usual but keeps the planned delays), alternating (with
``--uncounted``, another watched the same way without counting reads in flight,
``HPCSTAGGER_STEER_COUNT=0``; with ``--steered``, another in mode ``plan`` steered as usual, released
by the fitted model; with ``--unrecorded``, another steered with ``[plan] history = false``, so that
nothing is looked at or fitted after the last release; with ``--unparked``, another steered with
``HPCSTAGGER_PLAN_PARK=0``, so that a job a guarded plan holds waits in ``hpcstagger.init``, before
its set-up, not at its first batch; with ``--fixed``, another in mode ``fixed`` at the delays
the first open launch was planned (what the planning, the plan's exchange and the waiting cost, against a
launch told its delays); each launch of a round goes first in turn), every one
planned from the calibration alone (``--no-history``: the runs' history would move the plan between them). Each pair
compares the running job's batches per second while the other waits (from its leader's progress
history, from 0.5 s after its loop began to the release or its last progress record, if sooner;
none where its loop began less than 0.5 s before that), the makespans and the launches' CPU time
(every process of the launch's tree, from the benchmark's reaped children). Besides the emulated
source's configurations, ``--overhead`` takes the real file system's (``grid-w2-j3-c100-fs``: the
dataset on a kernel-throttled ext4 loop device, as in bench_userjobs; root only).

Writes benchmarks/out/bench_steer.json and prints one row per configuration and case: the steered
and the open-loop plan's gaps to the best measured fixed stagger (simultaneous included), the
planned and actual releases, the fitted factors and the watcher's CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_userjobs as U  # noqa: E402  (the configurations, spec writer and runner)

CASES = {"right": ("source", 1.0), "source-30": ("source", 0.7), "source+30": ("source", 1.3),
         "jobs-30": ("jobs", 0.7), "jobs+30": ("jobs", 1.3)}
DEFAULT_CONFIGS = ("pair-w2-b64", "rising-source")


def perturb(text: str, what: str, factor: float) -> str:
    """The scenario TOML ``text`` with its source bandwidth, or every job's CPU costs, times ``factor``."""
    if factor == 1.0:
        return text
    if what == "source":
        m = re.search(r"bandwidth = \[([^\]]*)\]", text)
        assert m, "the scenario has no [storage] bandwidth"
        vals = ", ".join(repr(float(v) * factor) for v in m.group(1).split(","))
        return text[:m.start()] + f"bandwidth = [{vals}]" + text[m.end():]

    def scale(m: re.Match[str]) -> str:
        return f"{m.group(1)} = {float(m.group(2)) * factor!r}"

    return re.sub(r"^(sample_time|prep_time|read_cpu|handoff) = ([0-9.eE+-]+)", scale, text, flags=re.M)


def _steer_of(run: dict[str, Any]) -> dict[str, Any]:
    path = Path(run["run_dir"]) / "steer.json"
    try:
        s = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {"cpu_seconds": s.get("cpu_seconds"), "fit": s.get("fit"), "fits": len(s.get("fits") or []),
            "decisions": s.get("decisions")}


def summarise_case(sweep: dict[str, Any]) -> dict[str, Any]:
    """Steered and open-loop gaps to the best measured fixed stagger (medians), and the releases."""
    s = sweep["summary"]
    best = (s.get("best") or {}).get("measured")
    plans = [r for r in sweep["runs"] if r["mode"] == "plan"]
    opens = [r for r in sweep["runs"] if r["mode"] == "open"]
    return {"best": s.get("best"), "steered": s.get("plan"), "open": s.get("open"),
            "steered_gap": s.get("plan") / best - 1 if s.get("plan") and best else None,
            "open_gap": s.get("open") / best - 1 if s.get("open") and best else None,
            "planned": [r["delays"] for r in plans], "released": [r["released"] for r in plans],
            "open_released": [r["released"] for r in opens], "steer": [_steer_of(r) for r in plans],
            "error_median": s.get("error_median"), "error_max": s.get("error_max")}


def write_case(work: Path, case: str) -> Path:
    """``work/scenario-<case>.toml`` (the calibrated ``scenario.toml`` made wrong as ``case`` says) and
    ``work/spec-<case>.toml`` (``spec.toml`` planning from it); returns the spec's path."""
    what, factor = CASES[case]
    (work / f"scenario-{case}.toml").write_text(perturb((work / "scenario.toml").read_text(), what, factor))
    case_spec = work / f"spec-{case}.toml"
    case_spec.write_text((work / "spec.toml").read_text().replace('scenario = "scenario.toml"',
                                                                  f'scenario = "scenario-{case}.toml"'))
    return case_spec


def run_config(name: str, cfg: dict[str, Any], data: Path, work: Path, cases: list[str], staggers: str,
               budget: float, repeat: int) -> dict[str, Any]:
    work.mkdir(parents=True)
    log = work / "log.txt"
    spec = work / "spec.toml"
    out: dict[str, Any] = {"name": name, "config": cfg, "log": str(log), "cases": {}}
    U.write_spec(spec, name, cfg, data, data.stat().st_size)
    hs = [sys.executable, "-m", "hpcstagger"]
    t0 = time.monotonic()
    rc = U.calibrate(spec, work, log, budget)
    out["calibrate_s"] = time.monotonic() - t0
    if rc != 0:
        out["error"] = f"calibrate exited {rc}; see {log}"
        return out
    for case in cases:
        case_spec = write_case(work, case)
        print(f"[bench_steer] {name} {case} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        rc = U._run(hs + ["sweep", str(case_spec), "--staggers", staggers, "--repeat", str(repeat), "--json",
                          str(work / f"sweep-{case}.json")], log)
        res: dict[str, Any] = {"sweep_s": time.monotonic() - t0}
        if rc != 0 or not (work / f"sweep-{case}.json").exists():
            res["error"] = f"sweep exited {rc}; see {log}"
        else:
            res.update(summarise_case(json.loads((work / f"sweep-{case}.json").read_text())))
        out["cases"][case] = res
        g, o = res.get("steered_gap"), res.get("open_gap")
        print(f"[bench_steer] {name} {case}: steered {'-' if g is None else f'{100 * g:+.1f}%'}, open "
              f"{'-' if o is None else f'{100 * o:+.1f}%'}", file=sys.stderr, flush=True)
    return out


def overhead_pairs(name: str, cfg: dict[str, Any], data: Path, work: Path, pairs: int, budget: float,
                   extra: tuple[str, ...] = (), case: str = "right") -> dict[str, Any]:
    """``pairs`` launches each of mode open and of mode plan with steer = false, alternating; with
    ``extra`` arms: ``uncounted``, watched with ``HPCSTAGGER_STEER_COUNT=0`` (no reads counted in
    flight), ``steered``, mode plan steered as usual, ``unrecorded``, steered without the run's
    history, ``unparked``, steered with ``HPCSTAGGER_PLAN_PARK=0``, and ``fixed``, mode fixed at the
    delays the first open launch was planned. Every arm plans from the calibration made wrong as
    ``case`` says (:data:`CASES`; ``right``: as measured).
    A real-file-system configuration puts the dataset on its throttled loop device first."""
    work.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        cg = None
        if cfg.get("real_fs"):  # the dataset on a throttled ext4 loop device, read through its cgroup
            data, cg = stack.enter_context(U.real_fs(data, cfg["real_fs"], work))
        return _overhead_rounds(name, cfg, data, work, pairs, budget, extra, cg, case)


def _overhead_rounds(name: str, cfg: dict[str, Any], data: Path, work: Path, pairs: int, budget: float,
                     extra: tuple[str, ...], cg: str | None, case: str = "right") -> dict[str, Any]:
    from hpcstagger.spec.records import read_progress, throughput

    log = work / "log.txt"
    spec = work / "spec.toml"
    U.write_spec(spec, name, cfg, data, data.stat().st_size)
    hs = [sys.executable, "-m", "hpcstagger"]
    if U.calibrate(spec, work, log, budget, cgroup=cg) != 0:
        return {"name": name, "error": f"calibrate failed; see {log}"}
    spec = write_case(work, case) if case != "right" else spec
    watch = work / "spec-watch.toml"
    watch.write_text(spec.read_text().replace('mode = "plan"', 'mode = "plan"\nsteer = false'))
    unrecorded = work / "spec-unrecorded.toml"
    unrecorded.write_text(spec.read_text().replace('mode = "plan"', 'mode = "plan"\nhistory = false'))
    rows: list[dict[str, Any]] = []
    arms = [("open", spec, "open"), ("watched", watch, "plan")]
    arms += [a for a in (("uncounted", watch, "plan"), ("steered", spec, "plan"), ("unrecorded", unrecorded, "plan"),
                         ("unparked", spec, "plan"), ("fixed", spec, "fixed")) if a[0] in extra]
    planned: dict[str, float] = {}  # the first open launch's delays: the fixed arm's
    for k in range(pairs):
        for label, path, mode in arms[k % len(arms):] + arms[:k % len(arms)]:  # each arm in turn goes first
            stamp = f"overhead-{k}-{label}"
            how = (["--delays", ",".join(f"{n}={d!r}" for n, d in planned.items())] if mode == "fixed"
                   else ["--mode", mode])
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            os.environ["HPCSTAGGER_STEER_COUNT"] = "0" if label == "uncounted" else "1"
            os.environ["HPCSTAGGER_PLAN_PARK"] = "0" if label == "unparked" else "1"
            try:
                U._run(hs + ["launch", str(path), *how, "--cold-cache", "--no-history", "--json"], log,
                       cgroup=cg)
            finally:
                del os.environ["HPCSTAGGER_STEER_COUNT"], os.environ["HPCSTAGGER_PLAN_PARK"]
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launch's whole tree, every process reaped
            cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            runs = sorted((work / "work" / "runs").glob(f"*-{mode}"), key=lambda p: p.stat().st_mtime)
            result = json.loads((runs[-1] / "result.json").read_text())
            runs[-1].rename(runs[-1].with_name(stamp))
            run_dir = runs[-1].with_name(stamp)
            delays = result["delays"]
            planned = planned or (dict(delays) if label == "open" else {})
            first, late = min(delays, key=lambda n: delays[n]), max(delays, key=lambda n: delays[n])
            status = json.loads((run_dir / f"{late}.0.json").read_text())
            wait_end = status["t0"] + status["timings"]["started_at"]  # wall time the late job started
            rec = read_progress(str(run_dir), first)
            rate = None
            if rec and rec.get("loop_start") and rec.get("history"):  # to the release, or the job's last record
                rate = throughput(rec, 0.5, min(wait_end - rec["loop_start"], rec["history"][-1][0]))
            loops = {n: rec_n["loop_start"] - status["t0"] for n in delays
                     if (rec_n := read_progress(str(run_dir), n)) and rec_n.get("loop_start")}
            rows.append({"pair": k, "label": label, "makespan": result["makespan"], "rate": rate,
                         "planned": delays[late], "loop_starts": loops,
                         "steer_cpu": _steer_of({"run_dir": str(run_dir)}).get("cpu_seconds"),
                         "cpu": cpu})
            print(f"[bench_steer] overhead {name} {k} {label}: makespan {result['makespan']}, rate {rate}, "
                  f"CPU {cpu:.1f} s, loops begin " + ", ".join(f"{n} +{t:.2f} s" for n, t in loops.items()),
                  file=sys.stderr, flush=True)
    return {"name": name, "case": case, "rows": rows}


def _ratios(pairs: dict[int, dict[str, Any]], arm: str, key: str) -> list[float]:
    """Per round, ``arm``'s ``key`` over the open launch's, where both have it."""
    return [p[arm][key] / p["open"][key] for p in pairs.values()
            if p.get(arm, {}).get(key) and p.get("open", {}).get(key)]


def _print_overhead(results: list[dict[str, Any]]) -> None:
    import statistics

    print("\n| configuration | arm | pairs | running job's batches/s while the other waits: arm / open (median) "
          "| makespan: arm / open (median) | watcher CPU per wait | the launch's CPU, arm - open (median) "
          "|\n|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("error"):
            print(f"| {r['name']} | {r['error']} | | | | | |")
            continue
        pairs: dict[int, dict[str, Any]] = {}
        for row in r["rows"]:
            pairs.setdefault(row["pair"], {})[row["label"]] = row
        for arm in sorted({row["label"] for row in r["rows"]} - {"open"}):
            rate, span = _ratios(pairs, arm, "rate"), _ratios(pairs, arm, "makespan")
            cpu = [row["steer_cpu"] for row in r["rows"] if row["label"] == arm and row.get("steer_cpu") is not None]
            total = [p[arm]["cpu"] - p["open"]["cpu"] for p in pairs.values()
                     if p.get(arm, {}).get("cpu") is not None and p.get("open", {}).get("cpu") is not None]
            label = r["name"] + ("" if r.get("case", "right") == "right" else f" {r['case']}")
            print(f"| {label} | {arm} | {len(span)} | {statistics.median(rate) if rate else float('nan'):.3f} "
                  f"(range {min(rate, default=float('nan')):.3f}-{max(rate, default=float('nan')):.3f}) | "
                  f"{statistics.median(span) if span else float('nan'):.3f} "
                  f"(range {min(span, default=float('nan')):.3f}-{max(span, default=float('nan')):.3f}) | "
                  f"{statistics.median(cpu) if cpu else float('nan'):.2f} s | "
                  f"{statistics.median(total) if total else float('nan'):+.2f} s |")


def _pc(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated bench_userjobs configurations, named or of its grid (emulated source)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated cases of {', '.join(CASES)}")
    p.add_argument("--staggers", default="0,1,2,3,4,6", help="fixed staggers, seconds, run in both orders")
    p.add_argument("--samples", type=int, default=3072, help="dataset samples of 3 KiB (default 3072, ~9.4 MB)")
    p.add_argument("--budget", type=float, default=60.0, help="calibration budget per spec, seconds")
    p.add_argument("--repeat", type=int, default=1, help="runs per point (sweep --repeat); points are medians")
    p.add_argument("--overhead", type=int, default=0, metavar="N",
                   help="measure the watching's cost instead: N pairs of open / watched launches")
    p.add_argument("--uncounted", action="store_true",
                   help="with --overhead: another launch each round, watched without counting reads in flight "
                        "(HPCSTAGGER_STEER_COUNT=0)")
    p.add_argument("--steered", action="store_true",
                   help="with --overhead: a launch each round in mode plan steered as usual (released by the fitted "
                        "model), beside the open-loop and watched ones")
    p.add_argument("--unrecorded", action="store_true",
                   help="with --overhead: a launch each round steered as usual but with [plan] history = false "
                        "(the run is not recorded, so nothing is fitted after the last release)")
    p.add_argument("--unparked", action="store_true",
                   help="with --overhead: a launch each round steered with HPCSTAGGER_PLAN_PARK=0 (a job a guarded "
                        "plan holds waits before its set-up, not at its first batch)")
    p.add_argument("--fixed", action="store_true",
                   help="with --overhead: a launch each round in mode fixed at the delays the first open launch was "
                        "planned (launched with --delays: no search for a plan)")
    p.add_argument("--out", default=str(HERE / "out" / "bench_steer.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory (specs, scenarios, logs)")
    args = p.parse_args()
    names, cases = args.only.split(","), args.cases.split(",")
    for c in cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}; cases: {', '.join(CASES)}")
    if args.overhead and args.cases != ",".join(CASES) and len(cases) > 1:
        p.error(f"--overhead measures one calibration: name one case with --cases, not {len(cases)} "
                f"({args.cases}); run it once per case")
    configs = {**U.CONFIGS, **U.grid_configs()}
    for n in names:
        if n not in configs or (configs[n].get("real_fs") and not args.overhead):
            p.error(f"unknown or unsupported configuration {n!r} (the emulated-source ones of bench_userjobs, "
                    "named or of its grid: grid-w<workers>-j<jobs>-c<cache %>-emu; with --overhead also the "
                    "real file system's, grid-w<workers>-j<jobs>-c<cache %>-fs)")
        if configs[n].get("real_fs") and os.geteuid() != 0:
            p.error(f"{n}: the real file system (a loop device, a blkio cgroup) needs root")
    results = []
    with U.workspace("bench-steer", args.samples, args.keep) as (root, data):
        for name in names:
            if args.overhead:
                arms = tuple(a for a in ("uncounted", "steered", "unrecorded", "unparked", "fixed")
                             if getattr(args, a))
                case = cases[0] if args.cases != ",".join(CASES) else "right"
                results.append(overhead_pairs(name, configs[name], data, root / name, args.overhead, args.budget,
                                              arms, case))
            else:
                results.append(run_config(name, configs[name], data, root / name, cases, args.staggers,
                                          args.budget, args.repeat))
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "results": results}, f,
                          indent=1)
    if args.overhead:
        _print_overhead(results)
        return 0
    print("\n| configuration | case | steered vs best | open vs best | best fixed | planned -> released "
          "| fitted | watcher CPU |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        for case, c in r["cases"].items():
            if c.get("error"):
                print(f"| {r['name']} | {case} | {c['error']} | | | | | |")
                continue
            moves = "; ".join(", ".join(f"{n} {p[n]:.1f}->{q[n]:.1f}" for n in p if p[n] > 0)
                              for p, q in zip(c["planned"], c["released"], strict=True))
            fits = "; ".join(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                         for k, v in ((st.get("fit") or {}).items())}) for st in c["steer"])
            cpu = ", ".join(f"{st['cpu_seconds']:.2f} s" for st in c["steer"] if st.get("cpu_seconds") is not None)
            best = c["best"] or {}
            print(f"| {r['name']} | {case} | {_pc(c['steered_gap'])} | {_pc(c['open_gap'])} | "
                  f"{best.get('label')} {best.get('measured') or 0:.2f} s | {moves} | {fits} | {cpu} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
