"""``hpcstagger calibrate``: measure a scenario file from short runs (source, cache hits, jobs)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate", help="measure a scenario file: source bandwidth, cache hits, each job's time per sample",
        description="Measure, within a time budget, the source's aggregate bandwidth with 1, 2, ... "
                    "concurrent reader processes, the cache's hit bandwidth, and each job's seconds "
                    "per sample on in-memory data, and write a scenario file for 'hpcstagger plan'. "
                    "Sources and jobs are named 'module:function': the function is called with no "
                    "arguments and returns the source (len, [i] -> bytes, key(i); picklable) or the "
                    "job's step(samples: list[bytes]).")
    p.add_argument("--spec", metavar="SPEC",
                   help="take the source ([dataset], with its throttle), the cache's capacity and policy, the "
                        "jobs and their epochs from a job spec; jobs without --job use the spec's sample_time")
    p.add_argument("--source", metavar="MODULE:FUNCTION",
                   help="factory of the dataset source (e.g. mypkg.data:make_source); not with --spec")
    p.add_argument("--job", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                   help="a job and the factory of its step function; repeat for every job")
    p.add_argument("--epochs", action="append", default=[], metavar="N|NAME=N",
                   help="epochs of every job (N) or of one job (NAME=N); default 1")
    p.add_argument("--capacity", default=None, metavar="BYTES|PCT",
                   help="cache capacity in bytes or as a share of the dataset ('60%%'); default: no cache")
    p.add_argument("--policy", default="minio", choices=["minio", "lru", "none"], help="cache policy (default minio)")
    p.add_argument("--cache", default=None, metavar="MODULE:FUNCTION",
                   help="factory of a cache object with put(key, data) and get(key) to time hits "
                        "against (default: files in /dev/shm)")
    p.add_argument("--readers", type=int, default=None, metavar="K",
                   help="measure the source with 1 .. K concurrent readers (default: 2, or the number "
                        "of jobs up to 4)")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="total seconds to spend (default: the calibrate_budget knob, 60)")
    p.add_argument("--batch", type=int, default=16, help="samples per step call when timing jobs (default 16)")
    p.add_argument("--prefetch", type=int, default=2, help="the jobs' loader prefetch depth (default 2)")
    p.add_argument("-o", "--out", default="scenario.toml", help="scenario file to write (default scenario.toml)")
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON object")
    p.set_defaults(func=run)


def load_factory(spec: str, what: str) -> Any:
    """Import ``module:function`` and call it with no arguments (a non-callable is returned as is)."""
    from ..errors import ConfigError

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
    from ..errors import ConfigError

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


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..model.calibrate import calibrate

    jobs = {}
    for spec in args.job:
        name, sep, factory = spec.partition("=")
        if not sep or not name:
            raise ConfigError(f"--job takes NAME=MODULE:FUNCTION, got {spec!r}")
        if name in jobs:
            raise ConfigError(f"--job {name!r} is given twice")
        step = load_factory(factory, f"job {name!r}")
        if not callable(step):
            raise ConfigError(f"job {name!r}: {factory!r} did not give a callable step(samples)")
        jobs[name] = step
    known: dict[str, float] = {}
    capacity, policy = args.capacity, args.policy
    cache = load_factory(args.cache, "cache") if args.cache else None
    private_cache = None
    if args.spec:
        from ..colocated.spec import Spec

        if args.source:
            raise ConfigError("give the source with --spec or with --source, not both")
        spec = Spec.from_toml(args.spec)
        for name in jobs:
            spec.job(name)
        missing = [j.name for j in spec.jobs if j.name not in jobs and not j.sample_time]
        if missing:
            raise ConfigError(f"job(s) {', '.join(missing)}: give --job NAME=MODULE:FUNCTION to measure, or "
                              "sample_time in the spec's [[job]] (jobs that calibrate themselves at launch "
                              "replace it with their measurement)")
        known = {j.name: float(j.sample_time) for j in spec.jobs if j.name not in jobs and j.sample_time}
        source = spec.make_source(shared_name=f"{spec.run.name}-calibrate")
        if capacity is None:
            capacity = spec.cache.capacity
        policy = spec.cache.policy if spec.cache.capacity else "none"
        if cache is None and spec.cache.capacity:
            from ..cache import ShmCache

            private_cache = cache = ShmCache(f"{spec.cache.name}-calibrate", max(64 << 20, spec.cache.capacity // 16),
                                             root=spec.cache.root or None)
        epochs: int | dict[str, int] = {j.name: j.epochs for j in spec.jobs}
        if args.epochs:
            epochs = _epochs(args.epochs, list(spec.job_names))
    else:
        if not args.source:
            raise ConfigError("give the source: --source MODULE:FUNCTION, or --spec SPEC")
        if not jobs:
            raise ConfigError("give at least one --job NAME=MODULE:FUNCTION")
        source = load_factory(args.source, "source")
        epochs = _epochs(args.epochs, list(jobs))
    try:
        cal = calibrate(source, jobs, epochs=epochs, capacity=capacity, policy=policy, readers=args.readers,
                        budget=args.budget, batch=args.batch, prefetch=args.prefetch, cache=cache, out=args.out,
                        progress=True, known=known)
    finally:
        if private_cache is not None:
            private_cache.destroy(force=True)
        if hasattr(source, "unlink"):
            source.unlink()
    if args.json:
        from .._io import json_safe

        json.dump(json_safe({"scenario": cal.scenario.to_dict(), "path": cal.path, "measurements": cal.measurements}),
                  sys.stdout, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sc = cal.scenario
        print(f"wrote {cal.path}: {sc.dataset.samples} samples of {sc.dataset.sample_bytes:.0f} B; source "
              + ", ".join(f"{b / 1e6:.1f}" for b in sc.storage.bandwidth) + " MB/s with 1, 2, ... readers; "
              + ", ".join(f"{j.name} {j.sample_time * 1e3:.3f} ms/sample" for j in sc.jobs))
    return 0
