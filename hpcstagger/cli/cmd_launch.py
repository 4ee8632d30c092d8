"""``hpcstagger launch SPEC``: run co-located jobs locally with MPMD mpiexec."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from hpcstagger.cli._args import add_spec
from hpcstagger.measure.tables import table
from hpcstagger.errors import ConfigError, LaunchError


def register(sub: Any) -> None:
    from hpcstagger.spec.runenv import PLAN_MODES

    p = sub.add_parser("launch", help="run the jobs of a spec locally with MPMD mpiexec",
                       description="Run every job of a job spec in one MPI world with MPMD mpiexec. "
                                   "hpcstagger.init() in each job plans the start delays and holds the "
                                   "jobs back; afterwards each job's start, finish and the makespan are "
                                   "printed. Mode sequential runs the jobs one after another instead.")
    add_spec(p)
    p.add_argument("--mode", choices=PLAN_MODES,
                   help="override the spec's [plan] mode")
    p.add_argument("--delays", metavar="JOB=S,...", help="fixed start delays, e.g. a=0,b=12.5 (implies --mode fixed)")
    p.add_argument("--timeout", type=float, metavar="S", help="stop the run after S seconds (default [run] timeout)")
    p.add_argument("--launcher", choices=["mpiexec", "srun"], default="mpiexec",
                   help="mpiexec (MPMD, anywhere; the default) or srun (--multi-prog, inside a Slurm allocation)")
    p.add_argument("--cold-cache", action="store_true",
                   help="start cold: empty the spec's shared cache and drop the dataset's files from the page "
                        "cache first (for comparisons); by default the run starts from the cache as it is")
    p.add_argument("--no-history", action="store_true",
                   help="plan without what earlier runs of the spec measured (see 'hpcstagger history')")
    p.add_argument("--dry-run", action="store_true", help="print the mpiexec command(s) and exit")
    p.add_argument("--check", action="store_true",
                   help="only check, starting nothing: the dataset (path, format, dataset name, files), each "
                        "job's backend (importable) and the launcher (on PATH); every launch checks these first")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)
    st = sub.add_parser("status", help="print each job's times for a run of a spec",
                        description="Print each job's delay, start, finish and state, and the makespan, from "
                                    "the status files of a run (by default the newest run of SPEC).")
    add_spec(st, then="run_dir")
    st.add_argument("run_dir", nargs="?", help="the run's status directory (default: the newest under "
                                              "<workdir>/runs)")
    st.add_argument("--json", action="store_true", help="print the result as one JSON object")
    st.set_defaults(func=run_status)
    ex = sub.add_parser("exec", help="run this rank's job command (for srun steps and heterogeneous jobs)",
                        description="Inside one launch of every rank (srun -n N, or srun --het-group=0,1 for a "
                                    "heterogeneous job), work out which job of SPEC this rank belongs to "
                                    "(HPCSTAGGER_JOB, else the heterogeneous-job component, else the rank's place "
                                    "in the spec's layout) and replace this process with that job's command.")
    add_spec(ex)
    ex.set_defaults(func=run_exec)


def run_exec(args: argparse.Namespace) -> int:
    from hpcstagger.colocated.preflight import check
    from hpcstagger.spec import runenv
    from hpcstagger.spec.jobspec import Spec

    import os

    from hpcstagger.colocated.launch import exec_job

    spec = Spec.from_toml(args.spec)
    argv, env, cwd = exec_job(spec)
    check(spec, launcher=None, jobs=[env[runenv.JOB]])  # this rank's job, before its command starts
    os.chdir(cwd)
    os.execvpe(argv[0], argv, env)
    return 1  # not reached


def run_status(args: argparse.Namespace) -> int:
    from hpcstagger.spec.jobspec import Spec

    from pathlib import Path

    from hpcstagger.colocated.launch import collect_results

    spec = Spec.from_toml(args.spec)
    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise ConfigError(f"run directory {run_dir} does not exist")
    else:
        runs = sorted((p for p in (Path(spec.run.workdir) / "runs").glob("*") if p.is_dir()),
                      key=lambda p: p.stat().st_mtime)
        if not runs:
            raise ConfigError(f"no runs of {spec.run.name!r} under {spec.run.workdir}/runs yet; "
                              f"start one with 'hpcstagger launch {args.spec}'")
        run_dir = runs[-1]
    result = collect_results(spec, run_dir)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, default=str)
        sys.stdout.write("\n")
    else:
        print(format_result(result))
    return 0 if all(j.state == "done" for j in result.jobs.values()) else 1


def format_result(result: Any) -> str:
    """The human-readable table of a RunResult."""
    from hpcstagger.colocated.startcache import describe_cold, describe_start

    lines = [f"run {result.run_dir}", f"mode {result.mode}"]
    if result.makespan is not None:
        pred = result.predicted.get("plan") if result.mode == "plan" else result.predicted.get(result.mode)
        lines[-1] += f", makespan {result.makespan:.1f} s" + (f" (predicted {pred:.1f} s)" if pred else "")
    if result.overhead is not None:
        lines[-1] += f", coordinator {result.overhead * 1000:.0f} ms"

    learned = "plan: " + str(result.learn.get("why", "")) if getattr(result, "learn", None) else ""
    for line in (describe_cold(result.cold_cache), "start: " + describe_start(result.cache) if result.cache else "",
                 learned):
        if line:
            lines.append(line)
    steered = any(j.release for j in result.jobs.values())
    rows = [("JOB", "RANKS", "PLANNED" if steered else "DELAY", *(("RELEASED",) if steered else ()), "START",
             "FINISH", "STATE")]

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    why = []
    for j in result.jobs.values():
        released = (s(j.release.at) if j.release else s(0.0),) if steered else ()
        rows.append((j.name, str(j.ranks), s(j.delay), *released, s(j.start), s(j.finish), j.state))
        if j.release:
            why.append(f"{j.name} released at +{j.release.at:.1f} s (planned "
                       f"+{j.release.planned:.1f} s): {j.release.reason}")
        if j.blind():
            why.append(j.blind())
    return "\n".join(lines) + "\n" + table(rows) + "".join("\n" + w for w in why)


def run(args: argparse.Namespace) -> int:
    from hpcstagger.colocated.preflight import check
    from hpcstagger.spec import runenv
    from hpcstagger.spec.jobspec import Spec

    from hpcstagger.colocated.launch import launch, mpmd_command, parse_delays

    spec = Spec.from_toml(args.spec)
    delays = parse_delays(args.delays) if args.delays else None
    mode = args.mode or ("fixed" if delays else None)
    if args.dry_run:
        if (mode or spec.plan.mode) == "sequential":
            for job in spec.jobs:
                print(shlex.join(mpmd_command(spec, jobs=[job.name])))
        else:
            print(shlex.join(mpmd_command(spec)))
        return 0
    if args.check:
        check(spec, launcher=args.launcher)
        print(f"{args.spec}: dataset, backends and launcher ({args.launcher}) are ready")
        return 0

    result = launch(spec, mode=mode, delays=delays, timeout=args.timeout, launcher=args.launcher,
                    cold_cache=args.cold_cache, env={runenv.NO_HISTORY: "1"} if args.no_history else None)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, default=str)
        sys.stdout.write("\n")
    else:
        print(format_result(result))
    if not result.ok:
        problems = result.failures() or [f"mpiexec exited with status {result.returncode}"]
        raise LaunchError("; ".join(problems) + f" (status files in {result.run_dir})")
    return 0
