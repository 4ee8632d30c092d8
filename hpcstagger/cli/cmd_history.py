"""``hpcstagger history SPEC``: what earlier runs of a spec measured, and what the next plan uses."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hpcstagger.cli._args import add_spec
from hpcstagger.measure.tables import table


def register(sub: Any) -> None:
    p = sub.add_parser("history", help="show (or clear) what earlier runs of a spec measured",
                       description="Show the run history of a job spec: one row per run whose closed-loop "
                                   "watcher fitted the model (the factors on the calibrated scenario's source "
                                   "and jobs, each job's start-up, the node, the date), and what the next plan "
                                   "starts from on this node; for a spec without a scenario, the runs observed "
                                   "to learn one and the learned scenario. Records live in <workdir>/history.")
    add_spec(p)
    p.add_argument("--clear", action="store_true",
                   help="remove every record of the spec's history, the observed runs and the learned scenario "
                        "(not the seed of 'hpcstagger calibrate --history')")
    p.add_argument("--json", action="store_true", help="print the records and the corrections as one JSON object")
    p.set_defaults(func=run)


def _f(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"x{x:.2f}"


def _s(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.2f} s"


def run(args: argparse.Namespace) -> int:
    from hpcstagger.spec.jobspec import Spec
    from hpcstagger.stagger import history as H, learning as L

    import os

    spec = Spec.from_toml(args.spec)
    workdir = spec.run.workdir
    if args.clear:
        n = H.clear_history(workdir)
        m = L.clear_observations(workdir)
        print(f"removed {n} record(s) and {m} observed run(s) from {H.history_dir(workdir)}")
        return 0
    records = H.read_history(workdir)
    observed = [{"dir": r["dir"], "time": r["time"], "mode": r["meta"].get("mode"),
                 "planned_from": r["meta"].get("planned_from")} for r in L.observed_runs(workdir)]
    learned = {"observed": observed, "learned": L.learned_path(workdir) if os.path.exists(L.learned_path(workdir))
               else None, "seed": L.seed_path(workdir) if os.path.exists(L.seed_path(workdir)) else None}
    here = H.node_kind(H.node_identity())
    now = None
    if spec.plan.scenario and os.path.exists(spec.plan.scenario):
        now = H.corrections(records, digest=H.scenario_digest(spec.plan.scenario), kind=here,
                            since=os.path.getmtime(spec.plan.scenario))
    if args.json:
        json.dump({"directory": H.history_dir(workdir), "records": records, "next_plan": now, "learning": learned},
                  sys.stdout, default=str)
        sys.stdout.write("\n")
        return 0
    if not spec.plan.scenario:
        _print_learning(learned)
    if not records:
        print(f"no runs recorded in {H.history_dir(workdir)} yet: {why_unrecorded(spec)}")
        return 0
    digest = H.scenario_digest(spec.plan.scenario) if spec.plan.scenario else ""
    names = sorted({n for r in records for n in (r.get("jobs") or {})})
    started = sorted({n for r in records for n in (r.get("startup") or {})})
    rows = [("DATE", "HOST", "SOURCE", *[n.upper() for n in names], *[f"{n.upper()} START-UP" for n in started],
             "SCENARIO")]
    for r in records:
        same = "current" if r.get("scenario", {}).get("sha256") == digest and digest else "other"
        rows.append((str(r.get("date", "")), str((r.get("node") or {}).get("host", "")), _f(r.get("source")),
                     *[_f((r.get("jobs") or {}).get(n)) for n in names],
                     *[_s((r.get("startup") or {}).get(n)) for n in started], same))
    print(table(rows))
    if now:
        print(f"\nthe next plan on this kind of node starts from {now['runs']} run(s): {H.describe(now)}")
    else:
        print("\nno record applies to the next plan on this kind of node (other nodes, another calibration, "
              "or older than it)")
    return 0


def why_unrecorded(spec: Any) -> str:
    """Why a spec's runs may have left no record: what the spec rules out, else what can stop a
    run's closed-loop watcher from fitting the model (it records only a fit)."""
    from hpcstagger.stagger.steering import WARMUP, WINDOW

    if not spec.plan.history:
        return "the spec's [plan] history = false: its runs are not recorded"
    if spec.plan.mode != "plan":
        return (f"the spec's [plan] mode is {spec.plan.mode!r}: only a run in mode plan records (what its "
                "closed-loop watcher fitted); run 'hpcstagger launch SPEC --mode plan' or set [plan] mode = \"plan\"")
    return ("a run records what its closed-loop watcher fitted, so none is recorded when the run ended before "
            f"the watcher's fit window (about {WARMUP + WINDOW:g} s of training after the last job's loop began, "
            "less once the source reads stop): a shorter run records nothing; when the plan started every job "
            "together (no job waited, so no watcher ran); or when it ran in another mode ('hpcstagger launch "
            "--mode')")


def _date(t: float) -> str:
    """Local date and time of ``t`` (seconds since the epoch); "?" for one no clock has (a damaged record)."""
    import time

    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"


def _print_learning(learned: dict[str, Any]) -> None:
    """The runs a spec without a scenario learns from."""
    runs = learned["observed"]
    if runs:
        rows = [("OBSERVED RUN", "DATE", "MODE", "PLANNED FROM")]
        rows += [(r["dir"].rsplit("/", 1)[-1], _date(r["time"]),
                  str(r.get("mode") or ""), str(r.get("planned_from") or "(first run: learn_stagger)"))
                 for r in runs]
        print(table(rows))
    print(f"the spec has no [plan] scenario: the next plan learns from {len(runs)} observed run(s) on this kind of "
          f"node{' and the seed ' + learned['seed'] if learned['seed'] else ''}" +
          (f"; last learned: {learned['learned']}" if learned["learned"] else "") + "\n")
