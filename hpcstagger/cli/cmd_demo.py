"""``hpcstagger demo``: two co-located jobs on a slow shared source, planned vs simultaneous vs sequential."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any
from hpcstagger.errors import ConfigError

# How long the demo takes with its defaults on 2 cores: 106 to 144 s measured (four runs, each on a
# node where other work used 1.3 to 2 of the cores), 161 s on a node with a load average of 3. The
# README's Quick start and docs/demo.md state the same figure (tests/test_demo.py checks it).
DURATION = "1 to 3 minutes"


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help=f"run the end-to-end demo ({DURATION} on 2 cores)",
                       description="Generate a synthetic image-like dataset, serve it through an emulated slow "
                                   "shared source, calibrate and plan, then run two co-located training jobs "
                                   "(two small models, one MPI rank each) at the planned stagger, "
                                   "simultaneously and sequentially, checkpointing asynchronously. Prints "
                                   "predicted and measured makespans and writes demo.json and demo.png. It takes "
                                   f"{DURATION} on 2 cores, longer when other work keeps the node busy "
                                   "(it says so before it measures).")
    p.add_argument("--workdir", default="hpcstagger-demo",
                   help="where data, runs and plots go (default ./hpcstagger-demo)")
    p.add_argument("--samples", type=int, default=6000, help="dataset size in samples (default 6000, 12 KB each)")
    p.add_argument("--epochs", type=int, default=3, help="epochs of each job (default 3)")
    p.add_argument("--calibrate-budget", type=float, default=20.0, metavar="S",
                   help="seconds the calibration may take (default 20)")
    p.add_argument("--sweep", metavar="S,S,...",
                   help="also run the later job at these fixed delays (seconds), for a measured sweep")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcstagger.demo.run import DemoConfig, format_table, run_demo

    if args.samples < 100:
        raise ConfigError(f"--samples must be at least 100, got {args.samples}")
    if args.epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {args.epochs}")
    if not (math.isfinite(args.calibrate_budget) and args.calibrate_budget > 0):
        raise ConfigError(f"--calibrate-budget must be a finite number of seconds > 0, got {args.calibrate_budget}")
    sweep: tuple[float, ...] = ()
    if args.sweep:
        try:
            sweep = tuple(float(v) for v in args.sweep.split(",") if v.strip())
        except ValueError:
            raise ConfigError(f"--sweep takes comma-separated seconds, e.g. 0,2,4,6,8; got {args.sweep!r}") from None
        if not all(math.isfinite(v) and v >= 0 for v in sweep):
            raise ConfigError(f"--sweep delays must be finite numbers of seconds >= 0, got {args.sweep!r}")
    cfg = DemoConfig(workdir=args.workdir, samples=args.samples, epochs={"convnet": args.epochs, "mlp": args.epochs},
                     sweep=sweep, calibrate_budget=args.calibrate_budget)
    result = run_demo(cfg)
    if args.json:
        json.dump(result, sys.stdout, default=str)
        sys.stdout.write("\n")
        return 0
    print(format_table(result))
    print(f"\nresults: {args.workdir}/demo.json   plot: {result['plot']}   ({result['seconds']:.0f} s)")
    return 0
