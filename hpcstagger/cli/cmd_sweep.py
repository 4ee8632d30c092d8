"""``hpcstagger sweep SPEC``: the plan against a simultaneous start and measured fixed staggers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hpcstagger.cli._args import add_spec


def register(sub: Any) -> None:
    p = sub.add_parser(
        "sweep", help="measure the plan against a simultaneous start and fixed staggers of a spec's jobs",
        description="Check the planner on your own jobs: launch the spec with the plan (when it has a [plan] "
                    "scenario), with a simultaneous start and with fixed staggers, each from a cold cache "
                    "(as 'hpcstagger launch --cold-cache'), and compare the measured makespans with the "
                    "coordinator's predictions. A stagger S runs in spec order (job k delayed by k*S) and in "
                    "reverse order (job k of N delayed by (N-1-k)*S); with 2 jobs: B delayed by S, and A "
                    "delayed by S. Prints a table, the plan's gap to the best measured stagger and the "
                    "prediction errors; writes JSON and a plot; one progress line per run on stderr.")
    add_spec(p, "the job spec (TOML) with at least 2 jobs")
    p.add_argument("--staggers", metavar="S,S,...",
                   help="staggers in seconds, e.g. 0,2,4,8 (default: 7 from 0 over the plan's predicted curve, "
                        "or up to --max-stagger)")
    p.add_argument("--max-stagger", type=float, metavar="S",
                   help="the largest default stagger (default: where the predicted makespan passes a "
                        "simultaneous start's by 10%%, at least twice the planned stagger; 10 s without a scenario)")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="run everything N times (default 1)")
    p.add_argument("--sequential", action="store_true", help="also run the jobs one after another")
    p.add_argument("--timeout", type=float, metavar="S", help="stop each run after S seconds (default [run] timeout)")
    p.add_argument("--launcher", choices=["mpiexec", "srun"], default="mpiexec",
                   help="mpiexec (MPMD, anywhere; the default) or srun (inside a Slurm allocation)")
    p.add_argument("--history", action="store_true",
                   help="plan each run from the spec's run history too (by default every run plans from the "
                        "calibration alone, so that the runs compare); a spec without a scenario then also "
                        "runs its learned plan, once it has observed runs")
    p.add_argument("--json", metavar="PATH", help="where the results go (default <workdir>/sweep/sweep-<time>.json)")
    p.add_argument("--plot", metavar="PNG", help="where the plot goes (default: beside the JSON, .png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcstagger.measure.sweep import parse_staggers, run_sweep
    from hpcstagger.measure.sweep_report import format_sweep, plot_sweep
    from hpcstagger.spec.jobspec import Spec

    import sys

    spec = Spec.from_toml(args.spec)
    staggers = parse_staggers(args.staggers) if args.staggers is not None else None
    result = run_sweep(spec, staggers=staggers, repeat=args.repeat, max_stagger=args.max_stagger,
                       sequential=args.sequential, timeout=args.timeout, launcher=args.launcher,
                       json_path=args.json, history=args.history)
    plot = args.plot or str(Path(result["json"]).with_suffix(".png"))
    plot_sweep(result, plot)
    sys.stdout.write(format_sweep(result) + "\n")
    print(f"\nresults: {result['json']}   plot: {plot}   ({result['seconds']:.0f} s)")
    return 0
