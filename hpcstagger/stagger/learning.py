"""Learning a spec that was never calibrated, from its own runs.

A spec in mode ``plan`` or ``open`` without ``[plan] scenario`` (and with its history on) plans
from what its earlier runs on this kind of node measured:

- **Every such run observes.** World rank 0 names a new directory
  ``<workdir>/history/obs-<time>-<pid>/`` in the plan (``observe``). Each rank's
  ``session.loader(loader)`` is then measured passively (:class:`~hpcstagger.colocated.jobmeter.LoopMeter` with
  ``passive=True``: the same per-batch and per-sample records as ``hpcstagger calibrate --spec``,
  without its pauses and without stopping the job), into ``<dir>/<job>/``; and each job leader
  looks at the shared cache's source-read counters (bytes, and seconds from lookup to insert) at
  most every :data:`LOOK_S` seconds after a batch, into ``<dir>/source.<job>.json``. The counters
  are node-wide, so the leaders' series merge into one.
- **The first run** (nothing observed yet, and no seed) starts job ``k`` of the spec
  ``k * learn_stagger`` seconds late (knob, 3 s; within ``[plan] min_delay`` and ``max_delay``),
  and observes: a bounded cost, and it shows the source with the first job reading alone as well
  as with every job reading (a simultaneous start shows only the second).
- **Later runs** plan from ``<workdir>/history/learned.toml``, rebuilt at each plan
  (:func:`build_scenario`) from the newest :data:`MAX_RUNS` observed runs on this kind of node:
  each job's fields from the newest run that measured it (as calibration computes them,
  :func:`~.jobfields.job_fields`); the source's bandwidth at each count of reads in flight from
  every run's counter windows, recent runs weighing most (:func:`source_levels`); the cache's hit
  bandwidth and the mean sample size from the sample records. The plan then steers as usual.
- ``hpcstagger calibrate --spec SPEC --history`` writes ``<workdir>/history/seed.toml`` instead of
  a scenario file: the learned scenario starts from it, and what the runs observe replaces its
  values (source levels no run saw are the seed's, scaled to agree with the levels that were).

``hpcstagger history SPEC`` shows the observed runs; ``--clear`` removes them with the learned
scenario (not the seed). ``[plan] history = false``, ``hpcstagger launch --no-history`` and
``HPCSTAGGER_NO_HISTORY=1`` turn learning off (a spec without a scenario then needs one again).
"""

from __future__ import annotations

import glob
import logging
import math
import os
import shutil
import time
from dataclasses import replace
from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger import _io, config
from hpcstagger.errors import ConfigError, ModelError
from hpcstagger.spec import runenv
from hpcstagger.stagger.history import history_dir, node_identity, node_kind
from hpcstagger.model.calibrate import write_scenario, source_length
from hpcstagger.stagger.jobfields import read_reports, job_fields
from hpcstagger.model import Scenario
from hpcstagger.model.source_probe import MAX_READERS, mem_available, page_cache_holds, source_files
from hpcstagger.model.scenario import Dataset, Loader, Node, Storage
from hpcstagger.nodeload import usable_cores
from hpcstagger.stagger.scenario_build import scenario_cache, scenario_job, source_read_cpu

__all__ = ["LOOK_S", "MAX_RUNS", "learned_path", "seed_path", "resolve", "with_scenario", "observed_runs",
           "counter_windows", "source_levels", "build_scenario", "clear_observations"]

log = logging.getLogger(__name__)

LOOK_S = 0.1      # a job leader's looks at the source counters, at most this often
MAX_RUNS = 8      # observed runs a learned scenario is built from (the newest)
DECAY = 0.5       # weight of each older run's windows relative to the next newer run's
MIN_READ_S = 0.5  # read-seconds a reader count needs to be trusted
SERIES_MAX = 4000  # looks kept per leader (thinned by half when full)


def learned_path(workdir: str) -> str:
    """The scenario learned from the runs."""
    return os.path.join(history_dir(workdir), "learned.toml")


def seed_path(workdir: str) -> str:
    """The calibration that seeds the learning (``hpcstagger calibrate --spec SPEC --history``)."""
    return os.path.join(history_dir(workdir), "seed.toml")


def _enabled(spec: Any, mode: str, environ: Mapping[str, str] | None) -> bool:
    env = os.environ if environ is None else environ
    return (spec is not None and not spec.plan.scenario and spec.plan.history and mode in ("plan", "open")
            and len(spec.jobs) > 1 and env.get(runenv.NO_HISTORY) != "1")


def resolve(spec: Any, mode: str, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """What a run of ``spec`` without a scenario learns from and into (world rank 0, at plan time):
    ``{"observe": dir, "scenario": path or None, "runs": n, "why": text}``, or None when the spec
    has a scenario or learning is off (see the module docstring)."""
    if not _enabled(spec, mode, environ):
        return None
    runs = observed_runs(spec.run.workdir)
    seed = seed_path(spec.run.workdir)
    out: dict[str, Any] = {"runs": len(runs), "scenario": None, "stagger": float(config.get("learn_stagger"))}
    try:
        if runs:
            scenario, comments = build_scenario(spec, runs, seed if os.path.exists(seed) else None)

            out["scenario"] = write_scenario(learned_path(spec.run.workdir), scenario, comments, 0.0,
                                             f"hpcstagger: learned from {len(runs)} run(s) of {spec.run.name}")
            out["why"] = f"learned from {len(runs)} observed run(s)" + (" and the seed" if os.path.exists(seed) else "")
        elif os.path.exists(seed):
            out.update(scenario=seed, why="the seed calibration (no run observed yet)")
        else:
            out["why"] = (f"no run observed yet: the jobs start {out['stagger']:g} s apart (learn_stagger), and the "
                          "run is observed")
    except (ModelError, ConfigError, OSError, ValueError, KeyError) as exc:
        log.warning("cannot learn a scenario for %r from its runs: %s", spec.run.name, exc)
        out["why"] = (f"cannot learn from the runs ({exc}); the jobs start {out['stagger']:g} s apart, and the run "
                      "is observed")
    directory = os.path.join(history_dir(spec.run.workdir), f"obs-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        _io.atomic_write_json(os.path.join(directory, "meta.json"),
                              {"time": time.time(), "node": node_identity(), "jobs": list(spec.job_names),
                               "mode": mode, "planned_from": out["scenario"]}, durable=False)
        out["observe"] = directory
    except OSError as exc:
        log.warning("cannot record this run's observations for %r: %s", spec.run.name, exc)
    return out


def with_scenario(spec: Any, path: str) -> Any:
    """``spec`` planning from the scenario file ``path``."""
    return replace(spec, plan=replace(spec.plan, scenario=path))


def observed_runs(workdir: str, kind: tuple[str, int, str] | None = None) -> list[dict[str, Any]]:
    """The observed runs on a node of ``kind`` (default: this one), newest first, at most
    :data:`MAX_RUNS`: ``{"dir", "time", "meta"}`` for each with source looks and a job measured."""
    kind = node_kind(node_identity()) if kind is None else kind
    out: list[dict[str, Any]] = []
    for directory in glob.glob(os.path.join(history_dir(workdir), "obs-*")):
        try:
            meta = _io.read_json(os.path.join(directory, "meta.json"))
        except (OSError, ValueError):
            continue
        if (not isinstance(meta, dict) or not isinstance(meta.get("node") or {}, dict)
                or not isinstance(meta.get("time") or 0.0, (int, float))
                or node_kind(meta.get("node") or {}) != kind
                or not glob.glob(os.path.join(directory, "source.*.json"))
                or not glob.glob(os.path.join(directory, "*", "job.json"))):
            continue
        out.append({"dir": directory, "time": float(meta.get("time") or 0.0), "meta": meta})
    return sorted(out, key=lambda r: float(r["time"]), reverse=True)[:MAX_RUNS]


def clear_observations(workdir: str) -> int:
    """Remove the observed runs and the learned scenario (not the seed); returns how many runs."""
    dirs = glob.glob(os.path.join(history_dir(workdir), "obs-*"))
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    if os.path.exists(learned_path(workdir)):
        os.unlink(learned_path(workdir))
    return len(dirs)


# ---------------------------------------------------------------------------- the source


def _series(directory: str) -> list[list[float]]:
    """One run's looks ``[time, read_bytes, read_seconds]`` from every leader, merged by time."""
    looks: list[list[float]] = []
    for path in glob.glob(os.path.join(directory, "source.*.json")):
        try:
            looks += [list(map(float, x)) for x in (_io.read_json(path).get("series") or []) if len(x) == 3]
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return sorted(looks)


def counter_windows(looks: Sequence[Sequence[float]]) -> list[tuple[float, float, float]]:
    """``(dt, bytes, read_seconds)`` between looks at least LOOK_S apart (counters that went back:
    a cache made anew, skipped)."""
    out = []
    prev = None
    for t, b, s in looks:
        if prev is None:
            prev = (t, b, s)
            continue
        if t - prev[0] < LOOK_S:
            continue
        db, ds = b - prev[1], s - prev[2]
        if db >= 0 and ds >= 0:
            out.append((t - prev[0], db, ds))
        prev = (t, b, s)
    return out


def source_levels(runs: Sequence[Sequence[tuple[float, float, float]]], readers: int,
                  base: Sequence[float] | None = None) -> tuple[list[float], str]:
    """The source's aggregate bandwidth with 1 .. ``readers`` reads in flight (pure), from each run's
    counter windows ``(dt, bytes, read_seconds)``, newest run first, and how it was found.

    A window's reads in flight are its read-seconds over its length, rounded; a count's bandwidth
    per read is its windows' bytes over their read-seconds (each run's weighing :data:`DECAY` times
    the next newer one's), trusted with :data:`MIN_READ_S` read-seconds or more. Counts without
    enough: ``base``'s values scaled by the geometric mean of observed over ``base`` where both
    are known; without ``base``, the per-read bandwidth between two known counts is interpolated,
    below the lowest it is the lowest's, and above the highest the aggregate stays the highest's.
    Raises ModelError when no count is known and there is no ``base``."""
    nbytes = [0.0] * (readers + 1)
    secs = [0.0] * (readers + 1)
    raw = [0.0] * (readers + 1)
    for age, windows in enumerate(runs):
        w = DECAY ** age
        for dt, b, s in windows:
            k = round(s / dt) if dt > 0 else 0
            if k < 1 or b <= 0:
                continue
            k = min(k, readers)
            nbytes[k] += w * b
            secs[k] += w * s
            raw[k] += s
    per_read = {k: nbytes[k] / secs[k] for k in range(1, readers + 1) if raw[k] >= MIN_READ_S}
    seen = ", ".join(f"{k} in flight: {k * r / 1e6:.2f} MB/s over {raw[k]:.1f} read-s" for k, r in per_read.items())
    if not per_read:
        if base is None:
            raise ModelError("no source read was observed (the runs need a shared [cache], whose counters show "
                             "the source's reads)")
        return [float(b) for b in base][:readers] or list(base), "the seed's (no source read observed)"
    known = sorted(per_read)
    out = []
    if base is not None and len(base) > 0:
        def at(k: int) -> float:
            return float(base[min(k, len(base)) - 1])
        scale = math.exp(sum(math.log(k * per_read[k] / at(k)) for k in known) / len(known))
        out = [k * per_read[k] if k in per_read else scale * at(k) for k in range(1, readers + 1)]
        return out, f"observed ({seen}); the others the seed's x{scale:.2f}"
    for k in range(1, readers + 1):
        if k in per_read:
            out.append(k * per_read[k])
        elif k < known[0]:
            out.append(k * per_read[known[0]])
        elif k > known[-1]:
            out.append(known[-1] * per_read[known[-1]])
        else:
            lo = max(j for j in known if j < k)
            hi = min(j for j in known if j > k)
            r = per_read[lo] + (per_read[hi] - per_read[lo]) * (k - lo) / (hi - lo)
            out.append(k * r)
    return out, f"observed ({seen}); the others interpolated"


# ---------------------------------------------------------------------------- the scenario


def _samples_of(runs: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, float]:
    """Sums over every run's sample records: hits, hit bytes and seconds, misses and their bytes."""
    out = {"hits": 0.0, "hit_bytes": 0.0, "hit_get_s": 0.0, "misses": 0.0, "miss_bytes": 0.0}
    for run in runs:
        for name in names:
            for s in read_reports(os.path.join(run["dir"], name))["samples"]:
                for key in out:
                    out[key] += float(s.get(key) or 0.0)
    return out


def _job_measured(runs: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any] | None:
    """Job ``name``'s fields from the newest run that measured it, or None."""
    for run in runs:
        rep = read_reports(os.path.join(run["dir"], name))
        if rep["job"] is None or not rep["loops"]:
            continue
        try:
            fields = job_fields(name, rep["job"], rep["loops"], rep["samples"])
        except (ModelError, KeyError, IndexError, TypeError):
            continue
        return {**fields, "route": "command", "run": os.path.basename(run["dir"])}
    return None


def build_scenario(spec: Any, runs: Sequence[Mapping[str, Any]], seed: str | None = None) -> tuple[Any, dict[str, str]]:
    """The scenario of ``spec`` from its observed ``runs`` (newest first, :func:`observed_runs`),
    starting from the ``seed`` scenario file when given; and a comment per value saying where it
    came from. Raises ModelError when a job was never measured and the seed lacks it."""
    base = Scenario.from_toml(seed) if seed else None
    known = {j.name: j for j in base.jobs} if base else {}
    names = list(spec.job_names)
    comments: dict[str, str] = {}
    jobs, fetchers = [], 0
    measured = {js.name: _job_measured(runs, js.name) for js in spec.jobs}
    read_cpu = source_read_cpu(m for m in measured.values() if m is not None)
    for js in spec.jobs:
        m = measured[js.name]
        if m is not None:
            jobs.append(scenario_job(js.name, m, js.epochs, read_cpu))
            comments[f"job.{js.name}"] = (f"measured in run {m['run']}: {m['sample_time'] * 1e3:.3f} ms/sample, "
                                          f"{m['workers']} worker(s), batch {m['batch']}, {m['ranks']} rank(s)")
            fetchers += int(m["ranks"]) * max(1, int(m["workers"]))
        elif js.name in known:
            jobs.append(replace(known[js.name], epochs=js.epochs))
            comments[f"job.{js.name}"] = "the seed's (not measured in a run yet)"
            fetchers += known[js.name].ranks * max(1, known[js.name].workers)
        else:
            raise ModelError(f"job {js.name!r} was not measured in any run: iterate its loader as 'for batch in "
                             "session.loader(loader):' (session = hpcstagger.init()) so that runs can measure it")
    counts = _samples_of(runs, names)
    done = counts["hits"] + counts["misses"]
    size = ((counts["hit_bytes"] + counts["miss_bytes"]) / done if done else
            (base.dataset.sample_bytes if base else 0.0))
    if size <= 0:
        raise ModelError("no sample was measured in the runs (their loaders read no CachedDataset)")
    n = source_length(spec.make_source()) if spec.dataset.path else (base.dataset.samples if base else 0)
    hit = counts["hit_bytes"] / counts["hit_get_s"] if counts["hit_get_s"] > 0 else math.inf
    readers = max(1, min(fetchers, MAX_READERS))
    windows = [counter_windows(_series(r["dir"])) for r in runs]
    bandwidth, how = source_levels(windows, readers, base.storage.bandwidth if base else None)
    kind, emulated, _ = source_files(spec.make_source()) if spec.dataset.path else ("other", False, None)
    available = mem_available()
    how_hits = f"observed in the runs' loaders ({int(counts['hits'])} hits)"
    meas = {"samples": n, "sample_bytes": size, "hits": {"hit_bandwidth": hit, "how": how_hits},
            "page_cache": {"holds": page_cache_holds(n * size, available, file_source=kind != "other",
                                                     emulated=emulated),
                           "source": kind, "emulated": emulated, "dataset_bytes": n * size,
                           "mem_available": available, "hit_bandwidth": hit, "how": how_hits}}
    cache, notes = scenario_cache(meas, spec, None, None)
    comments.update(notes)
    comments["dataset.sample_bytes"] = f"mean of {int(done)} samples the runs' loaders read"
    comments["storage.bandwidth"] = f"learned from {len(runs)} run(s): {how}"
    scenario = Scenario(dataset=Dataset(samples=n, sample_bytes=size), storage=Storage(tuple(bandwidth)),
                        jobs=tuple(jobs), cache=cache, loader=Loader(prefetch=2), node=Node(cores=usable_cores()))
    return scenario, comments
