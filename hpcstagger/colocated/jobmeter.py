"""Calibration mode inside a job: how ``hpcstagger calibrate --spec`` measures a job from its own command.

The driver (:mod:`hpcstagger.measure.spec_calibration`) runs one job at a time, alone, with its
ranks, with ``HPCSTAGGER_CALIBRATE=<reports directory>`` and ``HPCSTAGGER_CALIBRATE_UNTIL=<epoch
seconds>`` set. In that mode:

- :func:`hpcstagger.init` plans nothing and holds nothing back, and the session says it is
  calibrating (``Session.calibrating`` is the reports directory). The spec it reads becomes its
  calibration twin (:func:`calibration_spec`): a private cache and throttle state (``-calibrate``
  names), and checkpoints under the reports directory, so a calibration never touches the run's;
- ``for batch in session.loader(loader):`` measures the job's real loop (:class:`LoopMeter`): per
  batch the seconds waiting in ``next()`` and the seconds until the next batch is asked for (the
  step, any all-reduce included). It reads the loader's shape from the DataLoader
  (``num_workers``, ``batch_size``, ``prefetch_factor``) and the rank count from the job's
  communicator, and gives each CachedDataset under the loader a :class:`SampleMeter` (the
  worker-side costs) and the loader's ``collate_fn`` a timer;
- after a warm-up and enough batches (:data:`TARGET_BATCHES`), or once the job's share of the time
  is used, the job's leader decides to stop and tells the other ranks (a broadcast with a
  timeout); every rank writes its files, the session is marked finished, and every rank leaves
  with status 0 after the same batch (``SystemExit(0)`` out of the loop).

Each file has one writer (never a shared stream) and is replaced atomically:

- ``job.json``: the leader's: the loader's shape, the ranks, how many batches and why it stopped;
- ``loop.<rank>.json``: each rank's per-batch records ``[wait, step, samples, warm-up, probe,
  wait CPU, step CPU]`` (the CPU seconds of the rank's process, all its threads, in each part);
- ``samples.<pid>.<n>.json``: each process's sample costs (hits, misses, transforms, collates),
  and its CPU seconds over the samples it counted.

:func:`~hpcstagger.stagger.jobfields.read_reports` and :func:`~hpcstagger.stagger.jobfields.job_fields`
(pure) turn them into the scenario's job fields.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from hpcstagger import _io
from hpcstagger.spec import runenv
from hpcstagger.stagger.runplan import RunPlan
from hpcstagger.stagger.jobfields import PROBE_EVERY, SAMPLE_FIELDS
from hpcstagger.colocated.parking import at_first_batch
from hpcstagger.colocated.progress import Counted
from hpcstagger.profile import batch_size_of

__all__ = ["calibration_dir", "calibration_spec", "no_plan", "wrap_loader", "LoopMeter", "SampleMeter",
           "TimedCollate", "loader_shape", "sampler_order"]

log = logging.getLogger(__name__)

TARGET_BATCHES = 64     # batches measured after the warm-up that are enough
MIN_BATCHES = 16        # batches measured before the job's share of time may stop it
GRACE_S = 30.0          # past its share, a job short of MIN_BATCHES goes on at most this long
CHECK_EVERY = 4         # batches between two stop decisions of a multi-rank job (a broadcast)
PROBE_MAX_S = 0.25      # longest pause before a probe batch
STOP_TIMEOUT = 60.0     # seconds the ranks wait for each other to stop together
FLUSH_EVERY_S = 0.1     # how often a process rewrites its sample-cost file
PASSIVE_RECORDS = 400   # a learning run's meter keeps this many batches per rank
PASSIVE_FLUSH = 50      # and writes its files every this many
SUFFIX = "calibrate"    # the private cache and throttle state: <name>-calibrate



def calibration_dir(environ: Mapping[str, str] | None = None) -> str:
    """The reports directory when this process runs in calibration mode, else ""."""
    value = (os.environ if environ is None else environ).get(runenv.CALIBRATE, "")
    return os.path.abspath(value) if value else ""


def calibration_spec(spec: Any, directory: str) -> Any:
    """``spec``'s calibration twin: the run, cache and throttle renamed ``<name>-calibrate`` (so a
    calibration never reads or fills the run's cache), checkpoints under ``directory``, no staging."""
    return replace(spec, run=replace(spec.run, name=f"{spec.run.name}-{SUFFIX}"),
                   cache=replace(spec.cache, name=f"{spec.cache.name}-{SUFFIX}"),
                   checkpoint=replace(spec.checkpoint, directory=os.path.join(directory, "checkpoints"),
                                      staging_dir=""))


def no_plan(order: Sequence[str]) -> RunPlan:
    """What :func:`hpcstagger.init` decides in calibration mode: no plan, no delay."""
    return RunPlan(mode="calibrate", delays={n: 0.0 for n in order})


def _until(environ: Mapping[str, str] | None = None) -> float:
    text = (os.environ if environ is None else environ).get(runenv.CALIBRATE_UNTIL, "")
    try:
        return float(text)
    except ValueError:
        return time.time() + 60.0


# ---------------------------------------------------------------------------- worker side


class SampleMeter:
    """One process's sample costs in a CachedDataset (calibration mode), written to its own file.

    It is picklable and travels to DataLoader workers: in a new process it starts from zero and
    writes ``samples.<pid>.<serial>.json`` in ``directory`` at most every :data:`FLUSH_EVERY_S`.
    Each process's first sample (imports, first touches) is left out.
    """

    def __init__(self, directory: str, rank: int, serial: int):
        self.directory, self.rank, self.serial = directory, rank, serial
        self.origin = os.getpid()
        self.pid = 0
        self.counts: dict[str, float] = {}
        self.seen = 0
        self.cpu0 = 0.0
        self.next_flush = 0.0

    def _here(self) -> None:
        if self.pid != os.getpid():  # a fresh process (a worker): count its own samples only
            self.pid = os.getpid()
            self.counts = dict.fromkeys(SAMPLE_FIELDS, 0.0)
            self.seen = 0
            self.cpu0 = 0.0
            self.next_flush = 0.0  # the first counted sample is written at once

    def sample(self, hit: bool, nbytes: int, get_s: float, read_s: float, insert_s: float, transform_s: float,
               read_cpu_s: float = 0.0) -> None:
        """Record one sample: a hit (get, then transform) or a miss (get, source read, insert,
        transform; ``read_cpu_s`` the process's CPU time in the read)."""
        self._here()
        self.seen += 1
        if self.seen == 1:
            self.cpu0 = time.process_time()  # the CPU counted from here, with the samples after this one
            return
        c = self.counts
        if hit:
            c["hits"] += 1
            c["hit_bytes"] += nbytes
            c["hit_get_s"] += get_s
            c["hit_transform_s"] += transform_s
        else:
            c["misses"] += 1
            c["miss_bytes"] += nbytes
            c["miss_get_s"] += get_s
            c["miss_read_s"] += read_s
            c["miss_read_cpu_s"] += read_cpu_s
            c["miss_insert_s"] += insert_s
            c["miss_transform_s"] += transform_s
        self._maybe_flush()

    def collate(self, seconds: float, samples: int) -> None:
        """Record one call of the loader's collate_fn on ``samples`` samples."""
        self._here()
        self.counts["collates"] += 1
        self.counts["collate_samples"] += samples
        self.counts["collate_s"] += seconds
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if time.monotonic() >= self.next_flush:
            self.flush()

    def flush(self) -> None:
        """Write this process's counts (atomically; a no-op before its first sample)."""
        if not self.pid:
            return
        self.next_flush = time.monotonic() + FLUSH_EVERY_S
        if self.seen > 1:
            self.counts["cpu_s"] = time.process_time() - self.cpu0
        record = {"pid": self.pid, "rank": self.rank, "worker": self.pid != self.origin, **self.counts}
        _io.atomic_write_json(os.path.join(self.directory, f"samples.{self.pid}.{self.serial}.json"), record,
                              durable=False)


class TimedCollate:
    """A loader's collate_fn, timed into a :class:`SampleMeter` (picklable when the collate is)."""

    def __init__(self, collate: Callable[[Any], Any], meter: SampleMeter):
        self.collate, self.meter = collate, meter

    def __call__(self, samples: Any) -> Any:
        t = time.perf_counter()
        out = self.collate(samples)
        self.meter.collate(time.perf_counter() - t, len(samples) if hasattr(samples, "__len__") else 1)
        return out


# ---------------------------------------------------------------------------- the main loop


def loader_shape(loader: Any, ranks: int) -> dict[str, Any]:
    """What the scenario needs of a loader: workers, batch size, prefetch (PyTorch's defaults when
    unset), persistence, and the job's ``ranks``. Anything but a DataLoader counts as main-process
    loading with the batch size seen."""
    workers = getattr(loader, "num_workers", None)
    is_loader = workers is not None
    workers = int(workers or 0)
    prefetch = getattr(loader, "prefetch_factor", None) if workers > 0 else None
    batch = getattr(loader, "batch_size", None)
    return {"loader": type(loader).__name__, "dataloader": is_loader, "workers": workers,
            "batch": int(batch) if isinstance(batch, int) else None,
            "prefetch": int(prefetch or 2) if workers > 0 else None,
            "persistent": bool(getattr(loader, "persistent_workers", False)), "ranks": int(ranks),
            "order": sampler_order(loader)}


def sampler_order(loader: Any) -> str:
    """Which sample order a loader reads, as the scenario's ``order``: jobs whose samplers give
    the same string read the same permutation each epoch. A DistributedSampler (or a sampler with
    a seeded generator) is named by its seed; an unseeded RandomSampler draws from the process's
    own random state ("": an order of its own); no shuffling is "sequential"."""
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if sampler is None or type(sampler).__name__ == "BatchSampler":
        sampler = inner
    if sampler is None:
        return ""
    name = type(sampler).__name__
    if name == "SequentialSampler" or (hasattr(sampler, "shuffle") and not sampler.shuffle):
        return "sequential"
    seed = getattr(sampler, "seed", None)
    if isinstance(seed, int):
        return f"{name}(seed={seed})"
    generator = getattr(sampler, "generator", None)
    if generator is not None and hasattr(generator, "initial_seed"):
        return f"{name}(seed={generator.initial_seed()})"
    return ""


def _cached_datasets(obj: Any, depth: int = 0) -> Iterator[Any]:
    """The CachedDatasets under a loader's dataset (through Subset's .dataset, ConcatDataset's .datasets)."""
    from hpcstagger.cache.dataset import CachedDataset

    if obj is None or depth > 6:
        return
    if isinstance(obj, CachedDataset):
        yield obj
        return
    yield from _cached_datasets(getattr(obj, "dataset", None), depth + 1)
    for inner in getattr(obj, "datasets", None) or ():
        yield from _cached_datasets(inner, depth + 1)


class LoopMeter:
    """Measures one job's training loop in calibration mode (see the module docstring).

    ``passive``: a learning run's meter (:mod:`~hpcstagger.stagger.learning`) instead: it never pauses or stops the job,
    keeps at most :data:`PASSIVE_RECORDS` batches, writes its files every :data:`PASSIVE_FLUSH`
    batches, and calls ``on_batch()`` after each batch (the job leader's look at the source)."""

    def __init__(self, session: Any, directory: str, until: float, *, passive: bool = False,
                 on_batch: Callable[[], None] | None = None):
        self.session, self.directory = session, directory
        self.passive, self.on_batch = passive, on_batch
        self.passive_failed = False
        self.until, self.hard = until, until + GRACE_S
        self.records: list[list[float]] = []
        self.shape: dict[str, Any] = {}
        self.meters: list[SampleMeter] = []
        self.segments = 0
        self.stopped = ""
        self.setup_s: float | None = None  # from the job's start to its loop's first pass
        self.iter_s: list[float] = []      # each pass's iter(loader): starting the loader (its workers)
        # the DataLoader workers' CPU seconds over the measured batches, and those batches' samples:
        # the workers' cost per sample where no CachedDataset under the loader counts it (ImageFolder)
        self.worker_cpu = {"cpu_s": 0.0, "samples": 0}
        self._workers: list[int] = []
        self._worker_cpu0: float | None = None
        os.makedirs(directory, exist_ok=True)

    @property
    def measured(self) -> int:
        """Batches recorded after the warm-up."""
        return sum(1 for r in self.records if not r[3])

    def wrap(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable``'s batches, each timed; may end the process (see the module docstring)."""
        self.segments += 1
        if self.setup_s is None:
            session = self.session
            self.setup_s = max(0.0, session.elapsed() - float(session.timings.get("started_at", 0.0)))
        if not self.shape:
            self.shape = loader_shape(iterable, self.session.comm.size)
            if self.session.is_leader:
                self._write_job()
        self._instrument(iterable)
        return self._loop(iterable)

    def _instrument(self, loader: Any) -> None:
        """A SampleMeter for each CachedDataset under ``loader``, and a timer on its collate_fn
        (before its workers start: they take copies of both)."""
        for ds in _cached_datasets(getattr(loader, "dataset", None)):
            if ds.meter is None:
                ds.meter = SampleMeter(self.directory, self.session.rank, len(self.meters))
                self.meters.append(ds.meter)
        collate = getattr(loader, "collate_fn", None)
        if self.meters and collate is not None and not isinstance(collate, TimedCollate):
            loader.collate_fn = TimedCollate(collate, self.meters[0])

    def _warmup(self) -> int:
        """Batches left out at the start of every pass: the loader filling its prefetch buffers."""
        return max(2, self.shape["workers"] * (self.shape["prefetch"] or 0))

    def _loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        t_iter = time.perf_counter()
        it = iter(iterable)
        self.iter_s.append(time.perf_counter() - t_iter)
        self._worker_pass(it)
        warm, seen, body, body_cpu = self._warmup(), 0, 0.0, 0.0
        wait, wait_cpu, samples, probe = 0.0, 0.0, 0, False
        cpu = time.process_time
        try:
            while True:
                t0, c0 = time.perf_counter(), cpu()
                if seen and (not self.passive or len(self.records) < PASSIVE_RECORDS):
                    self.records.append([wait, t0 - body, samples, int(seen <= warm), int(probe), wait_cpu,
                                         c0 - body_cpu])
                if seen:
                    self._check()
                probe = self._probe(seen - warm)
                t1, c1 = time.perf_counter(), cpu()
                try:
                    item = next(it)
                except StopIteration:
                    return
                wait, wait_cpu = time.perf_counter() - t1, cpu() - c1
                samples = batch_size_of(item)
                seen += 1
                if seen == warm + 1:
                    self._worker_cpu0 = _cpu_of(self._workers)
                elif seen > warm + 1 and self._worker_cpu0 is not None:
                    self.worker_cpu["samples"] += samples
                body, body_cpu = time.perf_counter(), cpu()
                yield item
        finally:
            self._flush()

    def _worker_pass(self, it: Any) -> None:
        """A new pass over the loader: count its workers' CPU from the end of its warm-up (what the
        last pass's workers used is kept)."""
        self._worker_count()
        self._workers = [int(w.pid) for w in getattr(it, "_workers", ()) if getattr(w, "pid", None)]
        self._worker_cpu0 = None

    def _worker_count(self) -> None:
        """Add what the workers used since the warm-up of this pass, and restart the count there."""
        if self._worker_cpu0 is not None:
            now = _cpu_of(self._workers)
            self.worker_cpu["cpu_s"] += max(0.0, now - self._worker_cpu0)
            self._worker_cpu0 = now

    def _probe(self, measured: int) -> bool:
        """Before every PROBE_EVERY-th measured batch, give the workers time to have it ready, so
        that its wait is a pure handoff (the same batches on every rank)."""
        if self.passive or self.shape["workers"] == 0 or measured <= 0 or measured % PROBE_EVERY:
            return False
        recent = [r[0] for r in self.records[-PROBE_EVERY:]]
        time.sleep(min(PROBE_MAX_S, 1.5 * max(recent, default=0.0) + 0.001))
        return True

    def _decide(self) -> str:
        """The leader's decision: why to stop now, or "" to go on."""
        now = time.time()
        if self.measured >= TARGET_BATCHES:
            return f"{self.measured} batches measured"
        if now >= self.until and self.measured >= MIN_BATCHES:
            return f"its share of the calibration time was used ({self.measured} batches measured)"
        if now >= self.hard:
            return f"out of time with {self.measured} batches measured"
        return ""

    def _check(self) -> None:
        if self.passive:
            if self.passive_failed:
                return
            if self.on_batch is not None:
                self.on_batch()
            if len(self.records) % PASSIVE_FLUSH == 0 and len(self.records) < PASSIVE_RECORDS:
                self._flush()
            return
        comm = self.session.comm
        if comm.size > 1 and len(self.records) % CHECK_EVERY:
            return
        reason = self._decide() if comm.rank == 0 else ""
        if comm.size > 1:
            reason = comm.bcast(reason, root=0, timeout=STOP_TIMEOUT)
        if reason:
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        """Every rank: write the files, wait for the others, finish the session, leave with status 0."""
        self.stopped = reason
        self._flush()
        comm = self.session.comm
        if comm.size > 1:
            comm.barrier(timeout=STOP_TIMEOUT)
        self.session.say(f"calibration: stopping after {len(self.records)} batches ({reason}); "
                         f"every rank leaves with status 0")
        self.session.finish(calibration=reason, batches=len(self.records), measured=self.measured)
        raise SystemExit(0)

    def _flush(self) -> None:
        if not self.passive:
            self._write_all()
            return
        try:  # a learning run's measurement never fails the job
            self._write_all()
        except (OSError, ValueError) as exc:
            log.warning("cannot write this run's measurements to %s (%s); the next plan learns without them",
                        self.directory, exc)
            self.passive_failed = True

    def _write_all(self) -> None:
        rank = self.session.rank
        _io.atomic_write_json(os.path.join(self.directory, f"loop.{rank}.json"),
                              {"rank": rank, "size": self.session.comm.size, "records": self.records}, durable=False)
        for m in self.meters:
            m.flush()
        if self.session.is_leader:
            self._write_job()

    def _write_job(self) -> None:
        self._worker_count()
        _io.atomic_write_json(os.path.join(self.directory, "job.json"),
                              {"job": self.session.job, "shape": self.shape, "segments": self.segments,
                               "batches": len(self.records), "measured": self.measured, "stopped": self.stopped,
                               "setup_s": self.setup_s, "iter_s": self.iter_s, "until": self.until,
                               "worker_cpu": dict(self.worker_cpu), "time": time.time()}, durable=False)


def _cpu_of(pids: Sequence[int]) -> float:
    """The CPU seconds (user + system) the processes ``pids`` have used so far; a process that is
    gone counts 0 (what it used is lost with it)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / hz


_METERS: dict[int, LoopMeter] = {}


def wrap_loader(session: Any, iterable: Iterable[Any], profiler: Any = None) -> Iterable[Any]:
    """``session.loader(iterable)``: in calibration mode the measured loop (a :class:`LoopMeter` per
    session), else ``iterable`` (``profiler.wrap``-ed when given), counted on a job leader by its
    :class:`~hpcstagger.colocated.progress.ProgressMeter` for the run's watcher, and measured by the
    session's passive ``observer`` in a run that learns (:mod:`~hpcstagger.stagger.learning`). A job
    held at its first batch waits there for its release (:mod:`~hpcstagger.colocated.parking`)."""
    if session.calibrating:
        meter = _METERS.get(id(session))
        if meter is None or meter.session is not session:
            meter = _METERS[id(session)] = LoopMeter(session, session.calibrating, _until())
        return Counted(iterable, meter)  # each pass measured, also when one wrapper serves every epoch
    passive = getattr(session, "observer", None)  # a learning run's passive LoopMeter (.learn)
    if passive is not None:
        iterable = Counted(iterable, passive)
    inner = profiler.wrap(iterable) if profiler is not None else iterable
    meter = getattr(session, "progress_meter", None)  # a ProgressMeter on a job leader
    # a job held at its first batch waits for its release before its loop (and its count) begins
    return at_first_batch(session, inner if meter is None else meter.counted(inner))
