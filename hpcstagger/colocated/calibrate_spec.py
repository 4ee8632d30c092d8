"""``hpcstagger calibrate --spec SPEC``: a scenario measured from the spec's jobs as users wrote them.

Within the budget (knob ``calibrate_budget``, 60 s, for the whole spec), with progress on stderr:

1. **Samples.** A few samples read into memory (the mean sample size); the cache's hit bandwidth,
   against the run's private calibration cache; whether the node's page cache holds the dataset
   (:func:`~hpcstagger.model.calibrate_source.page_cache_holds`).
2. **The source with one reader**, on fresh samples with the files' pages dropped; the reader puts
   what it reads into the private calibration cache, so that the jobs see hits and misses.
3. **Each job, one at a time, alone, with its ranks**: its own command, the way ``hpcstagger
   launch`` starts it (:func:`~hpcstagger.colocated.launch.mpmd_command`), in calibration mode
   (``HPCSTAGGER_CALIBRATE``; see :mod:`hpcstagger.colocated.calibration`): the job measures its
   real loop through ``session.loader(loader)`` and stops itself, with status 0, once it has
   enough batches or has used its share of the time. The calibration cache counts the job's
   source reads in flight meanwhile (:func:`fit_baseline`). Jobs given a step factory (``--job``)
   are timed on samples in memory instead (:func:`~hpcstagger.model.calibrate.time_steps`).
4. **The source with 2 .. K readers**, K being the most reads the jobs can have in flight (the sum
   over jobs of ranks x max(workers, 1)), at most :data:`~hpcstagger.model.calibrate_source.MAX_READERS`.
5. **The scenario**: each job's loader shape and costs, the source curve (with the cost a miss adds
   in the jobs, its lookup and insert, folded in as ``scenario_for`` does), and the cache; when the
   page cache holds the dataset, the cache is the page cache: the whole dataset, hit at the slower
   of the page cache's and the ShmCache's bandwidth. A partitioned ``[cache]`` is written
   partitioned, with ``nodes = 1`` (a run plans with the nodes it spans) and the
   ``cache_remote_bandwidth`` knob as ``remote_bandwidth``, commented as not measured: every
   measurement here runs in this one process on one node, and a job's DataLoader workers cannot
   read another node's cache, so no remote hit is measured. ``[storage] fit_baseline`` is what the
   jobs' counted reads got of the source curve; the closed-loop watcher's fits are relative to it.
   Every value is commented with how it
   was measured, and the reports stay in ``<workdir>/calibrate/<time>/``.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

from .. import _io, config
from ..errors import CacheError, ConfigError, LaunchError, ModelError
from ..model.calibrate import (Calibration, capacity_bytes, reader_levels, source_comment, source_length,
                               time_steps, write_scenario)
from ..model.calibrate_source import (MAX_READERS, SamplePool, hit_bandwidth, measure_levels, mem_available,
                                      page_cache_holds, preload, reread_bandwidth, source_files, trusted_bandwidth)
from ..model.scenario import POLICIES, Cache, Dataset, Job, Loader, Node, Scenario, Storage
from . import env as E
from .calibration import GRACE_S, calibration_spec
from .jobfields import job_fields, read_reports
from .launch import mpmd_command, run_group
from .planning import fold_miss_overhead
from .spec import JobSpec, Spec

__all__ = ["calibrate_spec", "fit_baseline", "scenario_cache", "scenario_job", "usable_cores"]

# Shares of the budget: samples and hits, the first source level, the jobs; the rest: the other levels.
_SHARE_SAMPLES, _SHARE_FIRST, _SHARE_JOBS = 0.05, 0.08, 0.57
_EXIT_S = 1.0       # a job's share ends this long before its deadline: leaving takes time too
_KILL_S = 60.0      # beyond its share and grace, a job's command is stopped
_LEVEL_S = 4.0      # the longest window of a source level: enough, when jobs leave budget over
BASELINE_RANGE = (0.5, 2.0)  # a fit baseline outside this is not a read pattern's: it is not used


class _Run:
    """One calibration of a spec: the state its steps share (see the module docstring)."""

    def __init__(self, spec: Spec, steps: Mapping[str, Callable[[list[bytes]], Any]], *, budget: float,
                 readers: int | None, batch: int, mpiexec: str | None, seed: int, bar: Any):
        self.spec, self.steps, self.budget, self.readers = spec, dict(steps), budget, readers
        self.batch, self.mpiexec, self.seed, self.bar = batch, mpiexec, seed, bar
        self.t_start = time.monotonic()
        self.reports = _new_dir(Path(spec.run.workdir) / "calibrate" / time.strftime("%Y%m%d-%H%M%S"))
        self.twin = calibration_spec(spec, str(self.reports))
        self.source = self.twin.make_source()
        self.n = source_length(self.source)
        self.cache = _fresh_cache(self.twin)
        self.ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                               else "spawn")
        self.read: list[int] = []
        self.held: list[tuple[str, bytes]] = []
        self.pool: SamplePool | None = None

    def _say(self, message: str) -> None:
        """A progress line on stderr, above the bar."""
        if not self.bar.disable:
            self.bar.write(message, file=sys.stderr)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t_start)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.destroy(force=True)
        for name in ("unlink", "close"):
            if hasattr(self.source, name):
                getattr(self.source, name)()
                break

    def measure(self) -> dict[str, Any]:
        """Steps 1-4 of the module docstring: the raw measurements."""
        meas: dict[str, Any] = {"budget_s": self.budget, "samples": self.n, "reports": str(self.reports),
                                "jobs": {}}
        self._samples(meas)
        # when the page cache keeps the dataset, read it in file order: readahead then counts as it does
        # over a job's whole pass (random samples alone would each pay for a readahead they waste)
        self.pool = SamplePool(self.n, self.seed, exclude=self.read if self.n - len(self.read) >= 64 else (),
                               in_order=bool(meas["page_cache"]["holds"]))
        # the first level takes a third of the fresh samples: the later ones share the rest
        meas["source"] = measure_levels(self.source, self.pool, [1], _SHARE_FIRST * self.budget, self.ctx, self.bar,
                                        later_levels=2, cache=self.cache)
        self._jobs(meas)
        self._later_levels(meas)
        return meas

    def _samples(self, meas: dict[str, Any]) -> None:
        """Step 1: samples in memory, the cache's hits, and the page-cache rule."""
        share = _SHARE_SAMPLES * self.budget
        self.bar.set_postfix_str("reading samples into memory")
        self.read, self.held = preload(self.source, self.n, max(64, self.batch if self.steps else 0), share / 2,
                                       self.seed)
        size = sum(len(d) for _, d in self.held) / len(self.held)
        if size <= 0:
            raise ConfigError("the source's samples are empty (0 bytes)")
        meas.update(preloaded=len(self.held), sample_bytes=size)
        self.bar.update(1)
        self.bar.set_postfix_str("cache hit bandwidth")
        meas["hits"] = hit_bandwidth(self.held[:64], self.cache, share / 4)
        meas["page_cache"] = self._page_cache(size, share / 4)
        self.bar.update(1)

    def _page_cache(self, sample_bytes: float, seconds: float) -> dict[str, Any]:
        kind, emulated, _ = source_files(self.source)
        total = self.n * sample_bytes
        available = mem_available()
        holds = page_cache_holds(total, available, file_source=kind != "other", emulated=emulated)
        info: dict[str, Any] = {"source": kind, "emulated": emulated, "dataset_bytes": total,
                                "mem_available": available, "holds": holds}
        if holds:
            info.update(reread_bandwidth(self.source, self.read[:64], seconds))
            self._say(f"calibrate: the dataset ({total / 1e6:.0f} MB) is below half of the node's available "
                           f"memory ({(available or 0) / 1e6:.0f} MB): the page cache keeps it once read, so the "
                           "scenario's cache is the whole dataset")
        return info

    def _jobs(self, meas: dict[str, Any]) -> None:
        """Step 3: step factories on samples in memory, then each job's command, one at a time."""
        if self.steps:
            seconds = min(0.05 * len(self.steps) * self.budget, 0.2 * self.budget)
            for name, m in time_steps(self.steps, [d for _, d in self.held], self.batch, seconds, self.bar).items():
                meas["jobs"][name] = {**m, "route": "step"}
        todo = [j for j in self.spec.jobs if j.name not in self.steps]
        deadline = time.monotonic() + _SHARE_JOBS * self.budget
        for i, job in enumerate(todo):
            share = max(1.0, (deadline - time.monotonic()) / (len(todo) - i))
            meas["jobs"][job.name] = self._run_job(job, share)

    def _run_job(self, job: JobSpec, share: float) -> dict[str, Any]:
        """One job's command in calibration mode, alone; its fields from its reports."""
        directory = self.reports / job.name
        directory.mkdir(parents=True, exist_ok=True)
        self.bar.set_postfix_str(f"job {job.name}: its command on {job.ranks} rank(s)")
        started = time.monotonic()
        before = self._reads(share + GRACE_S + _KILL_S)
        rc = _run_command(self._argv(job), self._env(job, directory, time.time() + share - _EXIT_S),
                          os.path.dirname(self.spec.path) or ".", share + GRACE_S + _KILL_S, directory / "output.log")
        after = self._reads(0.0)
        reports = read_reports(str(directory))
        if rc != 0:
            raise ModelError(f"job {job.name!r}: its command failed in calibration mode (exit status {rc}): "
                             f"{_tail(directory / 'output.log')} (full output: {directory / 'output.log'})")
        if reports["job"] is None:
            raise ConfigError(f"job {job.name!r} ran without measuring its loop: iterate its loader as "
                              "'for batch in session.loader(loader):' (session = hpcstagger.init()) so that "
                              f"calibration can measure it (output: {directory / 'output.log'})")
        fields = job_fields(job.name, reports["job"], reports["loops"], reports["samples"])
        if fields["ranks"] != job.ranks:
            raise ModelError(f"job {job.name!r} measured {fields['ranks']} rank(s), the spec says {job.ranks}")
        fields.update(route="command", reports=str(directory), seconds=time.monotonic() - started)
        if before is not None and after is not None:  # its source reads, counted in flight
            fields["source_reads"] = {"bytes": after[0] - before[0], "seconds": after[1] - before[1],
                                      "flight": [max(0.0, b - a) for a, b in zip(before[2], after[2], strict=True)]}
        self._say(f"calibrate: job {job.name}: {_describe_job(fields)}")
        self.bar.update(1)
        return fields

    def _reads(self, watch: float) -> tuple[int, float, list[float]] | None:
        """The calibration cache's source-read counters (bytes, seconds, seconds with 1, 2, ...
        reads in flight), after asking it to count reads in flight for ``watch`` seconds more; None
        without a cache."""
        if self.cache is None:
            return None
        try:
            if watch > 0:
                self.cache.watch(watch)
            nbytes, seconds = self.cache.read_counters()
            return nbytes, seconds, self.cache.flight_seconds()
        except CacheError as exc:
            self._say(f"calibrate: the cache cannot count the jobs' source reads: {exc}")
            return None

    def _argv(self, job: JobSpec) -> list[str]:
        exe = self.mpiexec or shutil.which("mpiexec") or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
        if not exe:
            raise LaunchError("no mpiexec on PATH to run the jobs' commands; install an MPI (pip install mpich) or "
                              "load your site's MPI module")
        return mpmd_command(self.spec, mpiexec=exe, jobs=[job.name])

    def _env(self, job: JobSpec, directory: Path, until: float) -> dict[str, str]:
        env = {**os.environ, E.SPEC: self.spec.path, E.CALIBRATE: str(directory), E.CALIBRATE_UNTIL: f"{until:.3f}",
               E.RUN_DIR: str(directory / "status"), E.ONLY: job.name}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        for name in (E.DELAYS, E.MODE, "MPIR_CVAR_PMI_VERSION"):
            env.pop(name, None)
        return env

    def _later_levels(self, meas: dict[str, Any]) -> None:
        """Step 4: the source with 2 .. K readers, K from the jobs' loader shapes (or ``readers``)."""
        fetchers = sum(j.ranks * max(1, int(meas["jobs"][j.name].get("workers", 1))) for j in self.spec.jobs)
        meas["fetchers"] = fetchers
        top = self.readers or min(fetchers, MAX_READERS)
        if self.readers is None and fetchers > MAX_READERS:
            meas["reader_cap"] = MAX_READERS
            self._say(f"calibrate: the jobs can have {fetchers} reads in flight; the source is measured with up "
                           f"to {MAX_READERS} readers (the cap), and the scenario's last value holds beyond")
        levels = [k for k in reader_levels(max(1, top), max(1, top)) if k > 1 and k <= top]
        self.bar.total += len(levels)
        self.bar.refresh()
        assert self.pool is not None
        meas["source"] += measure_levels(self.source, self.pool, levels, max(0.3 * len(levels), self.left() - 0.5),
                                         self.ctx, self.bar, longest=_LEVEL_S)


def _new_dir(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... if it exists: a directory of this calibration alone."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise LaunchError(f"cannot make a new reports directory beside {base}")


def _fresh_cache(twin: Spec) -> Any:
    """The private calibration cache, emptied first (a crashed calibration may have left one). It is
    the node's ShmCache even when ``[cache]`` is partitioned: this driver is one process on one node."""
    c = twin.cache
    if c.capacity <= 0 or c.policy == "none":
        return None
    from ..cache import ShmCache

    try:
        ShmCache(c.name, None, root=c.root or None).destroy(force=True)
    except CacheError:
        pass
    return twin.make_cache(local=True)


def _run_command(argv: list[str], env: dict[str, str], cwd: str, limit: float, log: Path) -> int:
    """Run ``argv`` with its output in ``log``; stop it (and its process group) after ``limit`` seconds (124)."""
    with open(log, "wb") as out:
        return run_group(argv, env, cwd, limit, output=out)


def _tail(log: Path, lines: int = 5) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return " | ".join(text[-lines:]) or "no output"


def _describe_job(f: Mapping[str, Any]) -> str:
    """One line: what a job's calibration measured."""
    loader = (f"{f['workers']} worker(s), prefetch {f['prefetch']}" if f["workers"] else "main-process loading")
    return (f"{f['batches']} batches on {f['ranks']} rank(s), batch {f['batch']}, {loader}: "
            f"{f['sample_time'] * 1e3:.3f} ms/sample, handoff {f['handoff'] * 1e3:.2f} ms/batch, "
            f"start-up {f['startup']:.2f} s (epoch restart {f['epoch_start']:.2f} s), "
            f"order {f.get('order') or 'its own'}, "
            f"prep {f['prep_time'] * 1e3:.3f} ms/sample, miss overhead {f['miss_overhead'] * 1e3:.3f} ms "
            f"({f['hits']} hits, {f['misses']} misses; stopped: {f['stopped']})"
            + ("" if f["samples_seen"] else "; no CachedDataset sample costs seen (a loader that is no DataLoader "
               "over a CachedDataset, or workers started before session.loader): prep and miss overhead "
               "not measured"))


def _finite(bw: float) -> float:
    return bw if math.isfinite(bw) and bw > 0 else math.inf


def scenario_cache(meas: Mapping[str, Any], spec: Spec, capacity: float | str | None,
           policy: str | None) -> tuple[Cache, dict[str, str]]:
    """The scenario's cache, and how its capacity and hit bandwidth were found (comments)."""
    n, size, pc = meas["samples"], meas["sample_bytes"], meas["page_cache"]
    shm = meas["hits"]["hit_bandwidth"]
    if pc["holds"]:
        page = pc["hit_bandwidth"]
        has_shm = spec.cache.capacity > 0 and spec.cache.policy != "none"
        notes = {"cache.capacity": f"the page cache: the dataset ({pc['dataset_bytes'] / 1e6:.0f} MB) is below half "
                                   f"of MemAvailable ({pc['mem_available'] / 1e6:.0f} MB), so the node keeps all of it "
                                   "once read, a cache shared by every job",
                 "cache.hit_bandwidth": f"the page cache's ({page / 1e9:.2f} GB/s, {pc['how']})" +
                                        (f" or the ShmCache's ({shm / 1e9:.2f} GB/s), the slower" if has_shm else "")}
        hit = min(page, shm) if has_shm else page
        notes["cache.coalesce"] = "the page cache: a reader of a page being read waits for that read"
        return Cache(capacity=n * size, policy="minio", hit_bandwidth=_finite(hit), coalesce=True), notes
    cap = capacity_bytes(capacity, n, size) if capacity is not None else float(spec.cache.capacity)
    pol = policy or (spec.cache.policy if cap > 0 else "none")
    if pol not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {pol!r}")
    notes = {"cache.hit_bandwidth": f"measured per reader with {meas['hits']['how']}"}
    entries = spec.cache_entries()
    if entries < min(n, cap // size):  # the index fills before the arena
        notes["cache.capacity"] = (f"{entries} entries of {size:.0f} bytes: the cache's index ([cache] max_entries) "
                                   f"holds fewer samples than {cap:.0f} bytes would")
        return _partitioned(spec, Cache(capacity=entries * size, policy=pol, hit_bandwidth=_finite(shm)), notes), notes
    if not pc["holds"] and pc["source"] != "other":
        notes["cache.capacity"] = ("the spec's [cache] (the source is emulated: no page cache)" if pc["emulated"] else
                                   "the spec's [cache]: the dataset is too large for the page cache to keep")
    return _partitioned(spec, Cache(capacity=cap, policy=pol, hit_bandwidth=_finite(shm)), notes), notes


def _partitioned(spec: Spec, cache: Cache, notes: dict[str, str]) -> Cache:
    """``cache`` partitioned when the spec's cache is (``[cache] partitioned`` or the knob), with the
    default remote-hit bandwidth: calibration runs on one node and cannot measure a remote hit."""
    if not spec.cache_partitioned() or cache.capacity <= 0:
        return cache
    remote = float(config.get("cache_remote_bandwidth"))
    notes["cache.capacity"] = notes.get("cache.capacity", "the spec's [cache]") + "; per node (partitioned)"
    notes["cache.nodes"] = "calibration runs on one node; a run plans with the nodes it spans"
    notes["cache.remote_bandwidth"] = (f"NOT MEASURED (calibration runs on one node): the cache_remote_bandwidth "
                                       f"knob ({remote / 1e9:.2f} GB/s); set your network's remote-hit throughput")
    return replace(cache, partitioned=True, nodes=1, remote_bandwidth=remote)


def scenario_job(name: str, m: Mapping[str, Any], epochs: int) -> Job:
    """A job of the scenario from its measurement (a step factory's keeps the loader defaults)."""
    sample_time = max(float(m["sample_time"]), 1e-9)
    if m["route"] == "step":
        return Job(name=name, sample_time=sample_time, epochs=epochs)
    return Job(name=name, sample_time=sample_time, epochs=epochs, ranks=m["ranks"], workers=m["workers"],
               batch=m["batch"], prefetch=m["prefetch"], handoff=m["handoff"], prep_time=m["prep_time"],
               startup=m["startup"], epoch_start=m["epoch_start"], order=m.get("order", ""))


def fit_baseline(jobs: Mapping[str, Mapping[str, Any]], curve: tuple[float, ...],
                 sample_bytes: float) -> tuple[float, str]:
    """What the jobs' own source reads, counted in flight while each ran alone in calibration, got of
    ``curve`` (:func:`~hpcstagger.model.steer.counted_factor`, pooled over the jobs), and a comment.
    1 when they read too little (fewer than :data:`~.steer.MIN_READS` samples) or were not counted;
    1 as well, with the figure in the comment, outside :data:`BASELINE_RANGE`: the jobs' reads
    then differ from the measured curve by more than a read pattern explains."""
    from ..model.steer import counted_factor
    from .steer import MIN_READS

    counted = [m["source_reads"] for m in jobs.values() if m.get("source_reads")]
    nbytes = sum(float(r["bytes"]) for r in counted)
    seconds = sum(float(r["seconds"]) for r in counted)
    spent = [sum(v) for v in zip(*[r["flight"] for r in counted], strict=True)] if counted else []
    if not counted or sample_bytes <= 0 or nbytes / sample_bytes < MIN_READS:
        return 1.0, (f"not measured: the jobs read {nbytes / max(sample_bytes, 1.0):.0f} sample(s) from the source "
                     "while calibrated" if counted else "not measured: no cache counted the jobs' source reads")
    factor = counted_factor(curve, spent, nbytes, seconds)
    if factor is None:
        return 1.0, "not measured: the jobs' source reads were not counted in flight"
    lo, hi = BASELINE_RANGE
    if not lo <= factor <= hi:
        return 1.0, (f"not used: the jobs' {nbytes / sample_bytes:.0f} source reads got {factor:.2f} of the curve, "
                     f"outside {lo}-{hi}; check the source or calibrate again")
    return factor, (f"the jobs' {nbytes / sample_bytes:.0f} source reads, counted in flight while each ran alone, got "
                    f"this share of the curve; the closed-loop watcher fits the source relative to it")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity: a Slurm allocation's or a cpuset's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _scenario(meas: dict[str, Any], spec: Spec, epochs: int | Mapping[str, int] | None,
              capacity: float | str | None, policy: str | None) -> tuple[Scenario, dict[str, str]]:
    """The scenario of the measurements, and a comment per value saying how it was measured."""
    size = meas["sample_bytes"]
    trusted, held = trusted_bandwidth(meas["source"])
    measured = tuple(trusted)
    overheads = [m["miss_overhead"] for m in meas["jobs"].values()
                 if m["route"] == "command" and m["misses"] and m["miss_overhead"] > 0]
    overhead = sum(overheads) / len(overheads) if overheads else 0.0
    meas["miss_overhead"] = overhead
    cache, comments = scenario_cache(meas, spec, capacity, policy)
    comments["dataset.sample_bytes"] = f"mean of {meas['preloaded']} samples read"
    comments["storage.bandwidth"] = source_comment(meas["source"]) + held + (
        "; in file order, each reader a contiguous run (the page cache keeps what readahead brings in)"
        if meas["page_cache"]["holds"] else "") + (
        f"; a miss costs the jobs {overhead * 1e3:.3f} ms more (lookup and insert), folded in" if overhead else "") + (
        f"; the jobs can have {meas['fetchers']} reads in flight, measured up to {MAX_READERS}"
        if meas.get("reader_cap") else "")
    jobs = []
    for j in spec.jobs:
        m = meas["jobs"][j.name]
        n_epochs = (epochs.get(j.name, j.epochs) if isinstance(epochs, Mapping) else epochs) or j.epochs
        jobs.append(scenario_job(j.name, m, int(n_epochs)))
        comments[f"job.{j.name}"] = ("measured from its command: " + _describe_job(m) if m["route"] == "command" else
                                     f"its step factory: {m['sample_time'] * 1e3:.3f} ms/sample over {m['calls']} "
                                     f"in-memory batches of {m['batch']}")
    cores = float(meas["cores"])
    if cores:
        comments["node.cores"] = meas["cores_how"]
    curve = tuple(fold_miss_overhead(measured, size, overhead))
    baseline, comments["storage.fit_baseline"] = fit_baseline(meas["jobs"], curve, size)
    meas["fit_baseline"] = baseline
    scenario = Scenario(dataset=Dataset(samples=meas["samples"], sample_bytes=size),
                        storage=Storage(curve, fit_baseline=baseline), jobs=tuple(jobs),
                        cache=cache, loader=Loader(prefetch=2), node=Node(cores=cores))
    return scenario, comments


def calibrate_spec(spec: Spec, *, steps: Mapping[str, Callable[[list[bytes]], Any]] | None = None,
                   budget: float | None = None, readers: int | None = None,
                   epochs: int | Mapping[str, int] | None = None, capacity: float | str | None = None,
                   policy: str | None = None, batch: int = 16, out: str | os.PathLike[str] | None = None,
                   progress: bool = True, mpiexec: str | None = None, seed: int = 0,
                   cores: float | None = None) -> Calibration:
    """Measure the scenario of ``spec`` from its jobs' own commands (see the module docstring).

    ``steps`` times some jobs with a step factory instead (name -> ``step(samples)``, on in-memory
    batches of ``batch``). ``budget`` defaults to the ``calibrate_budget`` knob (60 s); ``readers``
    overrides the levels measured (1 .. K); ``epochs``, ``capacity`` and ``policy`` override the
    spec's. ``cores`` is the scenario's ``[node] cores`` (default :func:`usable_cores`; 0: CPU
    sharing not modelled). With ``out`` the scenario is written there atomically. Raises ConfigError for a bad
    spec or a job that never calls ``session.loader``, LaunchError without mpiexec, and ModelError
    when a job's command or a measurement fails.
    """
    t_start = time.monotonic()
    budget = float(config.get("calibrate_budget") if budget is None else budget)
    if not budget > 0:
        raise ConfigError(f"budget must be > 0 seconds, got {budget!r}")
    if not spec.path:
        raise ConfigError("calibrate needs a spec read from a file (Spec.from_toml): the jobs read it too")
    for name in steps or {}:
        spec.job(name)
    if cores is not None and not (math.isfinite(cores) and cores >= 0):
        raise ConfigError(f"cores must be a number >= 0 (0: do not model CPU sharing), got {cores!r}")
    from tqdm import tqdm

    bar = tqdm(total=3 + len(spec.jobs), desc="calibrate", unit="step", file=sys.stderr, disable=not progress,
               leave=True)
    run = None
    try:
        run = _Run(spec, steps or {}, budget=budget, readers=readers, batch=int(batch), mpiexec=mpiexec, seed=seed,
                   bar=bar)
        meas = run.measure()
    finally:
        bar.close()
        if run is not None:
            run.close()
    meas["cores"] = usable_cores() if cores is None else cores
    meas["cores_how"] = ("the CPUs this calibration could run on (its affinity); the jobs share them"
                         if cores is None else "given with --cores")
    scenario, comments = _scenario(meas, spec, epochs, capacity, policy)
    meas["elapsed_s"] = time.monotonic() - t_start
    _io.atomic_write_json(Path(meas["reports"]) / "measurements.json", _io.json_safe(meas), durable=False)
    path = (write_scenario(out, scenario, comments, meas["elapsed_s"], f"hpcstagger calibrate --spec {spec.path}")
            if out is not None else None)
    return Calibration(scenario=scenario, measurements=meas, path=path)
