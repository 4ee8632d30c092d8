"""``hpcstagger calibrate``: measure a scenario file from short runs (source, cache hits, jobs)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from typing import Any

from hpcstagger.cli._args import add_spec
from hpcstagger.errors import ConfigError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate", help="measure a scenario file: source bandwidth, cache hits, each job's loop",
        description="Measure, within a time budget, the source's aggregate bandwidth with 1, 2, ... "
                    "concurrent reader processes (on samples no reader has read, with the files' pages "
                    "dropped), the cache's hit bandwidth and each job's costs, and write a scenario file "
                    "for 'hpcstagger plan'. Given a job spec (SPEC, or --spec SPEC), every job runs its own "
                    "command briefly, alone, with its ranks, in calibration mode: its loop, written 'for batch in "
                    "session.loader(loader):', measures itself and stops early; the source is measured "
                    "with up to as many readers as the jobs have fetchers (at most 16). Without a spec, "
                    "jobs are step factories timed on samples in memory: sources and jobs are named "
                    "'module:function', called with no arguments, returning the source (len, [i] -> "
                    "bytes, key(i); picklable) or the job's step(samples: list[bytes]).")
    add_spec(p, "a job spec (TOML): the source ([dataset], with its throttle), the cache's capacity and policy, "
                "and the jobs, each measured from its own command (unless given with --job); without it, "
                "--source and --job give the source and the jobs", required=False)
    p.add_argument("--source", metavar="MODULE:FUNCTION",
                   help="factory of the dataset source (e.g. mypkg.data:make_source); not with a spec")
    p.add_argument("--job", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                   help="a job and the factory of its step function, timed on samples in memory; repeat for "
                        "every job (with a spec: only for jobs not to run from their command)")
    p.add_argument("--epochs", action="append", default=[], metavar="N|NAME=N",
                   help="epochs of every job (N) or of one job (NAME=N); default 1, or the spec's")
    p.add_argument("--capacity", default=None, metavar="BYTES|PCT",
                   help="cache capacity in bytes or as a share of the dataset ('60%%'); default: no cache, or "
                        "the spec's")
    p.add_argument("--policy", default=None, choices=["minio", "lru", "none"],
                   help="cache policy (default minio, or the spec's)")
    p.add_argument("--cache", default=None, metavar="MODULE:FUNCTION",
                   help="factory of a cache object with put(key, data) and get(key) to time hits "
                        "against (default: files in /dev/shm); not with a spec")
    p.add_argument("--readers", type=int, default=None, metavar="K",
                   help="measure the source with 1 .. K concurrent readers (default: with a spec the jobs' "
                        "fetchers, ranks x max(workers, 1) summed, at most 16; else 2, or the number of jobs "
                        "up to 4)")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="total seconds to spend (default: the calibrate_budget knob, 60)")
    p.add_argument("--batch", type=int, default=16,
                   help="samples per step call when timing step factories (--job; default 16)")
    p.add_argument("--prefetch", type=int, default=2,
                   help="the loader prefetch depth written into the scenario without a spec (default 2)")
    p.add_argument("--cores", type=float, default=None, metavar="C",
                   help="with a spec: the CPU cores the co-located jobs share, written as [node] cores "
                        "(default: the CPUs this process may run on; 0: do not model CPU sharing)")
    p.add_argument("-o", "--out", default="scenario.toml", help="scenario file to write (default scenario.toml)")
    p.add_argument("--history", action="store_true",
                   help="with a spec: seed the spec's run history instead (<workdir>/history/seed.toml): a spec "
                        "without [plan] scenario then plans from it, and what its runs observe refines it")
    p.add_argument("--fresh", action="store_true",
                   help="with a spec: measure everything again, dropping the measurements a failed or "
                        "interrupted calibration kept in OUT.partial/ (by default the same command goes on from "
                        "them: only what is missing or changed is measured)")
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON object")
    p.set_defaults(func=run)


def load_factory(spec: str, what: str) -> Any:
    """Import ``module:function`` and call it with no arguments (a non-callable is returned as is)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{what} must be given as MODULE:FUNCTION, got {spec!r}")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {what} {spec!r}: {exc}; check the module is importable (PYTHONPATH)") from None
    if callable(obj) and not hasattr(obj, "__getitem__"):
        try:
            return obj()
        except Exception as exc:
            raise ConfigError(f"{what} factory {spec!r} raised {type(exc).__name__}: {exc}") from exc
    return obj


def _epochs(values: list[str], names: list[str]) -> int | dict[str, int]:
    out: dict[str, int] = {}
    default = 1
    for v in values:
        name, sep, num = v.rpartition("=")
        try:
            n = int(num)
        except ValueError:
            raise ConfigError(f"--epochs takes N or NAME=N, got {v!r}") from None
        if sep:
            if name not in names:
                raise ConfigError(f"--epochs {v!r}: no job named {name!r} (jobs: {', '.join(names)})")
            out[name] = n
        else:
            default = n
    return {name: out.get(name, default) for name in names}


def _steps(values: list[str]) -> dict[str, Any]:
    """--job NAME=MODULE:FUNCTION values: {name: step}."""
    jobs = {}
    for spec in values:
        name, sep, factory = spec.partition("=")
        if not sep or not name:
            raise ConfigError(f"--job takes NAME=MODULE:FUNCTION, got {spec!r}")
        if name in jobs:
            raise ConfigError(f"--job {name!r} is given twice")
        step = load_factory(factory, f"job {name!r}")
        if not callable(step):
            raise ConfigError(f"job {name!r}: {factory!r} did not give a callable step(samples)")
        jobs[name] = step
    return jobs


def _with_spec(args: argparse.Namespace, jobs: dict[str, Any]) -> Any:
    """The command route: every job of the spec from its own command (or its --job step factory)."""
    from hpcstagger.colocated.preflight import check
    from hpcstagger.nodeload import process_started
    from hpcstagger.spec.jobspec import Spec
    from hpcstagger.stagger.learning import seed_path

    from hpcstagger.measure.spec_calibration import calibrate_spec

    if args.source or args.cache:
        raise ConfigError("with a spec the source and the cache come from the spec: drop --source and --cache")
    spec = Spec.from_toml(args.spec)

    check(spec, jobs=[n for n in spec.job_names if n not in jobs], launcher=None if set(spec.job_names) <= set(jobs)
          else "mpiexec")
    epochs = _epochs(args.epochs, list(spec.job_names)) if args.epochs else None
    out = args.out
    if args.history:
        import os

        out = seed_path(spec.run.workdir)
        os.makedirs(os.path.dirname(out), exist_ok=True)
    return calibrate_spec(spec, steps=jobs, budget=args.budget, readers=args.readers, epochs=epochs,
                          capacity=args.capacity, policy=args.policy, batch=args.batch, out=out,
                          cores=args.cores, fresh=args.fresh, started=process_started())


def _with_factories(args: argparse.Namespace, jobs: dict[str, Any]) -> Any:
    """The step-factory route: a source factory and a step factory per job."""
    from hpcstagger.model.calibrate import calibrate

    if not args.source:
        raise ConfigError("give a job spec (hpcstagger calibrate SPEC), or the source: --source MODULE:FUNCTION")
    if not jobs:
        raise ConfigError("give at least one --job NAME=MODULE:FUNCTION")
    source = load_factory(args.source, "source")
    cache = load_factory(args.cache, "cache") if args.cache else None
    try:
        return calibrate(source, jobs, epochs=_epochs(args.epochs, list(jobs)), capacity=args.capacity,
                         policy=args.policy or "minio", readers=args.readers, budget=args.budget, batch=args.batch,
                         prefetch=args.prefetch, cache=cache, out=args.out, progress=True)
    finally:
        if hasattr(source, "unlink"):
            source.unlink()


def run(args: argparse.Namespace) -> int:
    from hpcstagger._io import json_safe

    if args.history and not args.spec:
        raise ConfigError("--history seeds a spec's run history: give --spec SPEC, or SPEC as the first argument")
    jobs = _steps(args.job)
    cal = _with_spec(args, jobs) if args.spec else _with_factories(args, jobs)
    if args.json:
        json.dump(json_safe({"scenario": cal.scenario.to_dict(), "path": cal.path, "measurements": cal.measurements}),
                  sys.stdout, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sc = cal.scenario
        print(f"wrote {cal.path}: {sc.dataset.samples} samples of {sc.dataset.sample_bytes:.0f} B; source "
              + ", ".join(f"{b / 1e6:.1f}" for b in sc.storage.bandwidth) + " MB/s with 1, 2, ... readers"
              + (f" (the jobs' own reads got {sc.storage.fit_baseline:.2f} of it)" if sc.storage.fit_baseline != 1.0
                 else "") + "; "
              + ", ".join(f"{j.name} {j.sample_time * 1e3:.3f} ms/sample ({j.ranks} rank(s) x {j.workers} "
                          f"worker(s), batch {j.batch})" for j in sc.jobs)
              + (f"; {sc.node.cores:g} cores shared" if sc.node.cores else ""))
        for order, names in _shared_orders(sc).items():
            together = ("a job that catches another up waits for the samples the other is reading, which the "
                        "cache reads once" if sc.cache.coalesce else
                        "started together they read every sample from the source twice")
            print(f"jobs {', '.join(names)} read the same sample order ({order}): {together}, and a follower hits "
                  "what its leader read; the model accounts for both")
        for line in _calibration_notes(cal.measurements):
            print(line)
    return 0


def _calibration_notes(meas: dict[str, Any]) -> list[str]:
    """The summary's lines on how far to trust a spec's calibration: the node's load, what was
    reused, and source measurements that disagree."""
    from hpcstagger.measure.spec_calibration import load_line

    out = []
    if meas.get("node_load"):
        out.append(load_line(meas["node_load"]))
    if meas.get("reused"):
        out.append("reused from the kept measurements: " + ", ".join(meas["reused"]))
    if meas.get("source_spread"):
        spread = ", ".join(f"{s * 100:.0f}%" for s in meas["source_spread"])
        out.append(f"the source's repeated measurements lay {spread} apart with 1, 2, ... readers"
                   + (f"; {meas['source_disagree']}" if meas.get("source_disagree") else ""))
    over = _over_budget(meas)
    if over:
        out.append(over)
    return out


def _over_budget(meas: dict[str, Any]) -> str:
    """A line when the calibration overran its budget noticeably (else ""): every step has a floor
    that a small budget cannot shrink, a job's start-up above all."""
    elapsed, budget = float(meas.get("elapsed_s") or 0.0), float(meas.get("budget_s") or 0.0)
    if budget <= 0 or elapsed <= budget * 1.05 + 1.0:
        return ""
    return (f"the calibration took {elapsed:.0f} s, more than its budget of {budget:.0f} s: each job's short run "
            "(its start-up included) and each source level (0.3 s at least) has a floor that a smaller budget "
            f"cannot shrink; give --budget {math.ceil(elapsed)} or more to keep to it")


def _shared_orders(sc: Any) -> dict[str, list[str]]:
    """Orders that more than one job of the scenario reads, and those jobs."""
    by: dict[str, list[str]] = {}
    for j in sc.jobs:
        if j.order:
            by.setdefault(j.order, []).append(j.name)
    return {o: names for o, names in by.items() if len(names) > 1}
