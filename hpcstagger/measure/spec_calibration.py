"""``hpcstagger calibrate --spec SPEC``: a scenario measured from the spec's jobs as users wrote them.

Within the budget (knob ``calibrate_budget``, 60 s, for the whole spec), with progress on stderr, after a
look at how busy the node is (:mod:`hpcstagger.nodeload`: warned about, and recorded in the summary and the scenario):

1. **Samples.** A few samples read into memory (the mean sample size); the cache's hit bandwidth,
   against the run's private calibration cache; whether the node's page cache holds the dataset
   (:func:`~hpcstagger.model.source_probe.page_cache_holds`), and if so how many samples' worth of
   bytes one read in a random order brings into it (:mod:`~hpcstagger.model.readahead`).
2. **The source with one reader**, on fresh samples with the files' pages dropped; the reader puts
   what it reads into the private calibration cache, so that the jobs see hits and misses.
3. **Each job, one at a time, alone, with its ranks**: its own command, the way ``hpcstagger launch``
   starts it (:func:`~hpcstagger.colocated.launch.mpmd_command`), in calibration mode
   (``HPCSTAGGER_CALIBRATE``; see :mod:`hpcstagger.colocated.jobmeter`): the job measures its real loop
   through ``session.loader(loader)`` and stops itself, with status 0, once it has enough batches or has
   used its share of the time. The calibration cache counts the job's source reads in flight meanwhile
   (:func:`fit_baseline`). Jobs given a step factory (``--job``) are timed on samples in memory instead
   (:func:`~hpcstagger.model.calibrate.time_steps`). Then, while the budget allows, each job's start-up
   once more, the lesser of the two kept (:mod:`~hpcstagger.measure.startup_again`).
4. **The source with 2 .. K readers**, K being the most reads the jobs can have in flight (the sum
   over jobs of ranks x max(workers, 1)), at most :data:`~hpcstagger.model.source_probe.MAX_READERS`;
   then every level 1 .. K again, and once more each level whose two measurements differ by more
   than :data:`~hpcstagger.model.source_probe.SPREAD_LIMIT`. For a small file source these levels
   read samples again with their pages dropped (see :func:`~hpcstagger.model.source_probe.measure_levels`).
5. **The scenario**: each job's loader shape and costs, the source curve (with the cost a miss adds in
   the jobs, its lookup and insert, folded in as ``scenario_for`` does), and the cache; when the page
   cache holds the dataset, the cache is the page cache: the whole dataset, hit at the slower of the
   page cache's and the ShmCache's bandwidth. A partitioned ``[cache]`` is written partitioned, with
   ``nodes = 1`` (a run plans with the nodes it spans) and the ``cache_remote_bandwidth`` knob as
   ``remote_bandwidth``, commented as not measured: every measurement here runs in this one process on
   one node, and a job's DataLoader workers cannot read another node's cache, so no remote hit is
   measured. ``[storage] fit_baseline`` is what the jobs' counted reads got of the source curve; the
   closed-loop watcher's fits are relative to it. Every value is commented with how it was measured
   (:mod:`~hpcstagger.stagger.scenario_build`), and the reports stay in ``<workdir>/calibrate/<time>/``.

Each job's measurement and each source level is kept the moment it is taken, in ``<out>.partial/``
(:mod:`~hpcstagger.measure.saved_parts`): the same call after a failure or an interrupt measures only what is
missing or changed.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

from hpcstagger import _io, config, nodeload
from hpcstagger.cache.admin import remove_empty_dirs
from hpcstagger.errors import CacheError, ConfigError, LaunchError, ModelError
from hpcstagger.model.readahead import READAHEAD_MOST, readahead_factor
from hpcstagger.model.calibrate import Calibration, check_out, reader_levels, source_length, time_steps, write_scenario
from hpcstagger.model.source_probe import (MAX_READERS, SPREAD_LIMIT, SamplePool, disagreeing, hit_bandwidth,
                                      measure_levels, mem_available, page_cache_holds, preload, reread_bandwidth,
                                      source_files)
from hpcstagger.nodeload import usable_cores
from hpcstagger.spec import runenv
from hpcstagger.stagger.scenario_build import (BASELINE_RANGE, build_scenario, describe_job, fit_baseline,
                                               scenario_cache, scenario_job)
from hpcstagger.measure.saved_parts import SavedParts, partial_dir
from hpcstagger.measure.startup_again import measure_again as startups_again
from hpcstagger.colocated.jobmeter import GRACE_S, calibration_spec
from hpcstagger.stagger.jobfields import job_fields, read_reports
from hpcstagger.colocated.launch import mpmd_command, run_group
from hpcstagger.loader.pipelines import producers_of
from hpcstagger.spec.jobspec import JobSpec, Spec
from hpcstagger.cache import ShmCache

log = logging.getLogger(__name__)

# names from scenario_build and nodeload, kept here for the callers that import them from this module
__all__ = ["BASELINE_RANGE", "calibrate_spec", "fit_baseline", "load_line", "scenario_cache", "scenario_job",
           "usable_cores", "fresh_cache"]

# Shares of the budget: samples and hits, the first source level, the jobs; the rest: the other levels.
_SHARE_SAMPLES, _SHARE_FIRST, _SHARE_JOBS = 0.05, 0.08, 0.57
_EXIT_S = 1.0       # a job's share ends this long before its deadline: leaving takes time too
_KILL_S = 60.0      # beyond its share and grace, a job's command is stopped
_LEVEL_S = 4.0      # the longest window of a source level: enough, when jobs leave budget over
_AGAIN_S = 0.5      # the least window of a level's third measurement (its readers' start-up comes on top)
_LOAD_WINDOW_S = 0.5  # how long the node's load is looked at before measuring
_TAIL_S = 1.0       # kept after the last level: the scenario's fit, its file, the cache removed, the command's exit


class _Run:
    """One calibration of a spec: the state its steps share (see the module docstring)."""

    def __init__(self, spec: Spec, steps: Mapping[str, Callable[[list[bytes]], Any]], *, budget: float,
                 readers: int | None, batch: int, mpiexec: str | None, seed: int, bar: Any, kept: Path | None,
                 fresh: bool, started: float):
        self.spec, self.steps, self.budget, self.readers = spec, dict(steps), budget, readers
        self.batch, self.mpiexec, self.seed, self.bar, self.t_start = batch, mpiexec, seed, bar, started
        self.parts = SavedParts(kept, spec, fresh=fresh, say=self.say)
        self.unmeasured: list[str] = []  # jobs that never called session.loader
        self.reports = _new_dir(Path(spec.run.workdir) / "calibrate" / time.strftime("%Y%m%d-%H%M%S"))
        self.twin = calibration_spec(spec, str(self.reports))
        self.source = self.twin.make_source()
        self.n = source_length(self.source)
        self.shm_root = os.path.abspath(self.twin.cache.root or config.get("shm_root"))
        self.root_existed = os.path.lexists(self.shm_root)  # an shm root made here goes when emptied
        self.cache = fresh_cache(self.twin)
        self.ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                               else "spawn")
        self.read: list[int] = []
        self.held: list[tuple[str, bytes]] = []
        self.pool: SamplePool | None = None

    def say(self, message: str) -> None:
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
        if not self.root_existed:
            try:
                remove_empty_dirs(self.shm_root)
            except CacheError as exc:
                log.debug("cannot tidy the shm root %s: %s", self.shm_root, exc)

    def measure(self) -> dict[str, Any]:
        """Steps 1-4 of the module docstring: the raw measurements."""
        meas: dict[str, Any] = {"budget_s": self.budget, "samples": self.n, "reports": str(self.reports),
                                "jobs": {}}
        self._samples(meas)
        # when the page cache keeps the dataset, read it in file order: readahead then counts as it does
        # over a job's whole pass (random samples alone would each pay for a readahead they waste)
        self.pool = SamplePool(self.n, self.seed, exclude=self.read if self.n - len(self.read) >= 64 else (),
                               in_order=bool(meas["page_cache"]["holds"]))
        meas["source"] = self.parts.levels()
        if not any(int(m["readers"]) == 1 for m in meas["source"]):
            # the first level takes a third of the fresh samples: the later ones share the rest; what its
            # reader reads fills the calibration cache, so that the jobs see hits and misses
            self._levels(meas, [1], _SHARE_FIRST * self.budget, later=2, cache=self.cache)
        self._jobs(meas)
        if self.unmeasured:
            names = ", ".join(self.unmeasured)
            raise ConfigError(f"job(s) {names} never called session.loader(...), so calibration cannot measure "
                              "their loop: iterate the DataLoader as 'for batch in session.loader(loader):' "
                              "(session = hpcstagger.init()) and run the same command again"
                              + (f"; the other measurements are kept in {self.parts.directory}"
                                 if self.parts.directory else ""))
        startups_again(self, meas)
        self._later_levels(meas)
        return meas

    def _levels(self, meas: dict[str, Any], levels: list[int], seconds: float, *, later: int = 0,
                cache: Any = None, overhead: float = 0.0) -> None:
        """Measure the source at each reader count of ``levels``, each kept as soon as it is measured."""
        def keep(m: dict[str, Any]) -> None:
            meas["source"].append(m)
            self.parts.save_levels(meas["source"])

        assert self.pool is not None
        measure_levels(self.source, self.pool, levels, seconds, self.ctx, self.bar, later_levels=later, cache=cache,
                       longest=_LEVEL_S, on_level=keep, overhead=overhead)

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
            # how much one random read brings in (the scenario's readahead), on samples not read yet: a
            # quarter of the dataset at most (the factor fits the kernel's readahead over that share),
            # and at most READAHEAD_MOST (a directory's files each have their pages dropped)
            rng, seen = random.Random(self.seed + 1), set(self.read)
            want = min(self.n // 4, READAHEAD_MOST)
            fresh = [i for i in rng.sample(range(self.n), min(self.n, want + len(seen))) if i not in seen]
            info["readahead"] = readahead_factor(self.source, fresh[:max(8, want)], 2 * seconds,
                                                 seed=self.seed, dataset=(self.n, total))
            self.say(f"calibrate: the dataset ({total / 1e6:.0f} MB) is below half of the node's available "
                           f"memory ({(available or 0) / 1e6:.0f} MB): the page cache keeps it once read, so the "
                           "scenario's cache is the whole dataset")
        return info

    def _jobs(self, meas: dict[str, Any]) -> None:
        """Step 3: step factories on samples in memory, then each job's command, one at a time."""
        if self.steps:
            seconds = min(0.05 * len(self.steps) * self.budget, 0.2 * self.budget)
            for name, m in time_steps(self.steps, [d for _, d in self.held], self.batch, seconds, self.bar).items():
                meas["jobs"][name] = {**m, "route": "step"}
        todo = []
        for job in self.spec.jobs:
            kept = None if job.name in self.steps else self.parts.job(job)
            if kept is not None:
                meas["jobs"][job.name] = kept
                self.bar.update(1)
            elif job.name not in self.steps:
                todo.append(job)
        deadline = time.monotonic() + _SHARE_JOBS * self.budget
        for i, job in enumerate(todo):
            share = max(1.0, (deadline - time.monotonic()) / (len(todo) - i))
            fields = self._run_job(job, share)
            if fields is not None:
                self.parts.save_job(job, fields)
                meas["jobs"][job.name] = fields

    def _run_job(self, job: JobSpec, share: float) -> dict[str, Any] | None:
        """One job's command in calibration mode, alone; its fields (None when it never called session.loader)."""
        (directory := self.reports / job.name).mkdir(parents=True, exist_ok=True)
        self.bar.set_postfix_str(f"job {job.name}: its command on {job.ranks} rank(s)")
        started = time.monotonic()
        loopless = started + share + GRACE_S  # no loop measured by then: the job never calls session.loader

        def no_loop() -> bool:
            return time.monotonic() > loopless and not (directory / "job.json").exists()

        before = self._reads(share + GRACE_S + _KILL_S)
        env = self.job_env(job, directory, time.time() + share - _EXIT_S)
        root = str(config.get("shm_root", {**env, **job.env}))  # its shared loader's detached producer: followed too
        memory = nodeload.PeakMemory(adopted=lambda pids: producers_of(pids, root))
        with open(directory / "output.log", "wb") as out:
            rc = run_group(self.command(job), env, os.path.dirname(self.spec.path) or ".", share + GRACE_S + _KILL_S,
                           output=out, stop_when=no_loop, memory=memory)
        after = self._reads(0.0)
        reports = read_reports(str(directory))
        if reports["job"] is None and rc in (0, 124):
            how = "ended" if rc == 0 else f"ran {time.monotonic() - started:.0f} s (stopped)"
            self.say(f"calibrate: job {job.name} {how} without calling session.loader(...), so calibration cannot "
                     "measure its loop: add 'for batch in session.loader(loader):' around its DataLoader "
                     f"(output: {directory / 'output.log'})")
            self.unmeasured.append(job.name)
            self.bar.update(1)
            return None
        if rc != 0:
            raise ModelError(f"job {job.name!r}: its command failed in calibration mode (exit status {rc}): "
                             f"{_tail(directory / 'output.log')} (full output: {directory / 'output.log'})")
        fields = job_fields(job.name, reports["job"], reports["loops"], reports["samples"])
        if fields["ranks"] != job.ranks:
            raise ModelError(f"job {job.name!r} measured {fields['ranks']} rank(s), the spec says {job.ranks}")
        fields.update(route="command", reports=str(directory), seconds=time.monotonic() - started,
                      memory=memory.peak, memory_workers=min(memory.workers_peak, memory.peak),
                      memory_file=memory.file_peak, memory_producer=min(memory.adopted_peak, memory.peak))
        if before is not None and after is not None:  # its source reads, counted in flight
            fields["source_reads"] = {"bytes": after[0] - before[0], "seconds": after[1] - before[1],
                                      "flight": [max(0.0, b - a) for a, b in zip(before[2], after[2], strict=True)]}
        self.say(f"calibrate: job {job.name}: {describe_job(fields)}")
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
            self.say(f"calibrate: the cache cannot count the jobs' source reads: {exc}")
            return None

    def command(self, job: JobSpec) -> list[str]:
        exe = self.mpiexec or shutil.which("mpiexec") or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
        if not exe:
            raise LaunchError("no mpiexec on PATH to run the jobs' commands; install an MPI (pip install mpich) or "
                              "load your site's MPI module")
        return mpmd_command(self.spec, mpiexec=exe, jobs=[job.name])

    def job_env(self, job: JobSpec, directory: Path, until: float) -> dict[str, str]:
        env = {**os.environ, runenv.SPEC: self.spec.path, runenv.CALIBRATE: str(directory),
               runenv.CALIBRATE_UNTIL: f"{until:.3f}", runenv.RUN_DIR: str(directory / "status"), runenv.ONLY: job.name}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        for name in (runenv.DELAYS, runenv.MODE, "MPIR_CVAR_PMI_VERSION"):
            env.pop(name, None)
        if self.spec.cache.auto:  # the jobs' calibration cache has the size this driver's has
            env[runenv.CACHE_CAPACITY] = str(self.spec.cache.capacity)
        return env

    def _later_levels(self, meas: dict[str, Any]) -> None:
        """Step 4: the source with 2 .. K readers, K from the jobs' loader shapes (or ``readers``)."""
        fetchers = sum(j.ranks * max(1, int(meas["jobs"][j.name].get("workers", 1))) for j in self.spec.jobs)
        meas["fetchers"] = fetchers
        top = self.readers or min(fetchers, MAX_READERS)
        if self.readers is None and fetchers > MAX_READERS:
            meas["reader_cap"] = MAX_READERS
            self.say(f"calibrate: the jobs can have {fetchers} reads in flight; the source is measured with up "
                           f"to {MAX_READERS} readers (the cap), and the scenario's last value holds beyond")
        tops = reader_levels(max(1, top), max(1, top))
        meas["source"] = [m for m in meas["source"] if int(m["readers"]) <= top]
        # every level twice (a second round), then once more where the two disagree: the two rounds
        # leave a third of the levels' time, so the third stays in the budget
        levels = _missing(meas["source"], tops, 1) + _missing(meas["source"], tops, 2)
        self.bar.total += len(levels)
        self.bar.refresh()
        spare = math.ceil(len(tops) / 3)
        self._levels(meas, levels, max(0.3 * len(levels), (self.left() - _TAIL_S) * len(levels)
                                       / (len(levels) + spare)), later=1)
        # a level's least time: its readers' start-up (what the rounds took beyond their windows) and a short window
        extra = sorted(max(0.0, float(m.get("elapsed_s", 0.0)) - float(m.get("window_s", 0.0)))
                       for m in meas["source"][-len(levels):]) if levels else [0.0]
        again = [k for k in disagreeing(meas["source"]) if _missing(meas["source"], [k], 3)]
        room = int(max(0.0, self.left() - _TAIL_S) // (extra[len(extra) // 2] + _AGAIN_S))
        if len(again) > room:
            skipped, again = again[room:], again[:room]
            self.say(f"calibrate: the source's two measurements with {', '.join(map(str, skipped))} reader(s) "
                     f"differ by more than {SPREAD_LIMIT * 100:.0f}%, and the budget has no time left to measure "
                     "them once more: their two measurements stand (a larger --budget gives longer windows)")
        if again:
            self.say(f"calibrate: the source's two measurements with {', '.join(map(str, again))} reader(s) "
                     f"differ by more than {SPREAD_LIMIT * 100:.0f}%: measuring them once more")
            self.bar.total += len(again)
            try:
                self._levels(meas, again, max(0.3 * len(again), self.left() - _TAIL_S), overhead=extra[len(extra) // 2])
            except ModelError as exc:  # the third round is a check: without it, the two measurements stand
                self.say(f"calibrate: the source was not measured a third time ({exc}); its two measurements "
                         "per reader count stand")
                again = [k for k in again if _missing(meas["source"], [k], 3) == []]
        meas["measured_again"] = again


def _missing(levels: list[dict[str, Any]], tops: list[int], times: int) -> list[int]:
    """The reader counts of ``tops`` measured fewer than ``times`` times in ``levels``."""
    return [k for k in tops if sum(1 for m in levels if int(m["readers"]) == k) < times]


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


def fresh_cache(twin: Spec) -> Any:
    """``twin``'s cache, emptied first (a crashed run may have left one), or None when it has none. It
    is the node's ShmCache even when ``[cache]`` is partitioned: the caller is one process on one node."""
    c = twin.cache
    if c.capacity <= 0 or c.policy == "none":
        return None

    try:
        ShmCache(c.name, None, root=c.root or None).destroy(force=True)
    except CacheError:
        pass
    return twin.make_cache(local=True)


def _say_memory(meas: dict[str, Any], spec: Spec, scenario: Any, capacity: Any, progress: bool) -> None:
    """One line on stderr about the cache's size beside the jobs' measured memory: what "auto" chose,
    or that a given size leaves the jobs too little (the kernel would kill them)."""
    sized = meas.pop("cache_sizing")
    meas["cache_sizing"] = {"capacity": sized.capacity, "why": sized.why, "room": sized.room}
    if capacity is None and spec.cache.auto:
        line = f'calibrate: [cache] capacity "auto": {sized.why}'
    elif meas["jobs_memory"] and sized.room is not None and spec.cache.capacity > max(0, sized.room) \
            and scenario.cache.capacity > 0 and not scenario.cache.page_cache:
        line = (f"calibrate: the [cache] capacity ({spec.cache.capacity / 1e6:.0f} MB) is more than the "
                f"{max(0, sized.room) / 1e6:.0f} MB the memory leaves beside the jobs' measured "
                f"{meas['jobs_memory'] / 1e6:.0f} MB: the kernel may kill jobs as the cache fills; set "
                'capacity = "auto" to size it to what is left')
    else:
        return
    if progress:
        print(line, file=sys.stderr)
    else:
        log.info("%s", line)


def _tail(log: Path, lines: int = 5) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return " | ".join(text[-lines:]) or "no output"


def _node_load(say: Callable[[str], None]) -> dict[str, Any]:
    """How busy the node is before measuring (:func:`hpcstagger.nodeload.sample`), warned about on
    stderr with the figures when other work takes a noticeable share of the cores."""
    load = nodeload.sample(_LOAD_WINDOW_S)
    warning = nodeload.busy_warning(load, "calibration")
    if warning:
        say(f"calibrate: {warning}")
    return {"cores": load.cores, "others_cores": load.others_cores, "load1": load.load1,
            "window_s": load.window_s, "busy": load.busy, "warning": warning or ""}


def load_line(load: Mapping[str, Any]) -> str:
    """One line saying how busy the node was when it was calibrated."""
    parts = []
    if load.get("others_cores") is not None:
        parts.append(f"other processes used {load['others_cores']:.2f} of {load['cores']} usable cores")
    if load.get("load1") is not None:
        parts.append(f"load average {load['load1']:.2f}")
    return (f"the node before measuring: {'; '.join(parts) or 'not readable'}"
            + (" (busy: the figures may be slow)" if load.get("busy") else " (quiet)"))


def calibrate_spec(spec: Spec, *, steps: Mapping[str, Callable[[list[bytes]], Any]] | None = None,
                   budget: float | None = None, readers: int | None = None,
                   epochs: int | Mapping[str, int] | None = None, capacity: float | str | None = None,
                   policy: str | None = None, batch: int = 16, out: str | os.PathLike[str] | None = None,
                   progress: bool = True, mpiexec: str | None = None, seed: int = 0,
                   cores: float | None = None, fresh: bool = False, started: float | None = None) -> Calibration:
    """Measure the scenario of ``spec`` from its jobs' own commands (see the module docstring).

    ``steps`` times some jobs with a step factory instead (name -> ``step(samples)``, on in-memory batches of
    ``batch``). ``budget`` defaults to the ``calibrate_budget`` knob (60 s); ``readers`` overrides the levels
    measured (1 .. K); ``epochs``, ``capacity`` and ``policy`` override the spec's. ``cores`` is the scenario's
    ``[node] cores`` (default :func:`usable_cores`; 0: CPU sharing not modelled). With ``out`` (checked before
    anything is measured) the scenario is written there atomically, and every part measured is kept in
    ``out.partial/`` as it is taken (:mod:`~hpcstagger.measure.saved_parts`): the same call after a failure or
    an interrupt measures only what is missing; ``fresh`` drops the kept parts first. Raises ConfigError for a
    bad spec or output path, or a job that never calls ``session.loader``, LaunchError without mpiexec, and
    ModelError when a job's command or a measurement fails. ``started``: the ``time.monotonic()`` the budget
    counts from (default: now; the CLI gives its process's start, so that the whole command keeps it).
    """
    t_start = time.monotonic() if started is None else started
    budget = float(config.get("calibrate_budget") if budget is None else budget)
    if not budget > 0:
        raise ConfigError(f"budget must be > 0 seconds, got {budget!r}")
    if not spec.path:
        raise ConfigError("calibrate needs a spec read from a file (Spec.from_toml): the jobs read it too")
    for name in steps or {}:
        spec.job(name)
    if cores is not None and not (math.isfinite(cores) and cores >= 0):
        raise ConfigError(f"cores must be a number >= 0 (0: do not model CPU sharing), got {cores!r}")
    if out is not None:
        check_out(out)
    from tqdm import tqdm

    bar = tqdm(total=3 + len(spec.jobs), desc="calibrate", unit="step", file=sys.stderr, disable=not progress,
               leave=True)
    run = None
    kept = partial_dir(out) if out is not None else None
    try:
        run = _Run(spec, steps or {}, budget=budget, readers=readers, batch=int(batch), mpiexec=mpiexec, seed=seed,
                   bar=bar, kept=kept, fresh=fresh, started=t_start)
        load = _node_load(run.say)
        meas = run.measure()
    except KeyboardInterrupt:
        if kept is not None and kept.exists():
            print(f"calibrate: interrupted; what was measured is kept in {kept}: the same command goes on from it",
                  file=sys.stderr)
        raise
    except (ModelError, LaunchError, CacheError) as exc:
        if kept is not None and any(kept.glob("*.json")):
            raise type(exc)(f"{exc}; what was measured is kept in {kept}: the same command goes on from it") from exc
        raise
    finally:
        bar.close()
        if run is not None:
            run.close()
    meas.update(node_load=load, reused=run.parts.reused)
    meas["cores"] = nodeload.usable_cores() if cores is None else cores
    meas["cores_how"] = ("the CPUs this calibration could run on (its affinity); the jobs share them"
                         if cores is None else "given with --cores")
    scenario, comments = build_scenario(meas, spec, epochs, capacity, policy)
    _say_memory(meas, spec, scenario, capacity, progress)
    meas["elapsed_s"], meas["budget_s"] = time.monotonic() - t_start, budget
    _io.atomic_write_json(Path(meas["reports"]) / "measurements.json", _io.json_safe(meas), durable=False)
    notes = [load_line(load)] + ([meas["source_disagree"]] if meas["source_disagree"] else [])
    path = (write_scenario(out, scenario, comments, meas["elapsed_s"], f"hpcstagger calibrate --spec {spec.path}",
                           notes=notes) if out is not None else None)
    run.parts.done()
    return Calibration(scenario=scenario, measurements=meas, path=path)
