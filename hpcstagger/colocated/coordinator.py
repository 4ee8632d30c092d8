"""Co-located jobs in one MPI world: who is which job, the stagger plan, the wait, the backend.

A training script calls :func:`init` first (``session = hpcstagger.init()``). In one MPI world that
holds every job's ranks (MPMD ``mpiexec -n 2 python a.py : -n 2 python b.py``, ``srun
--multi-prog``, or a Slurm heterogeneous job step) it:

1. works out which job this rank belongs to: the ``job`` argument, else ``HPCSTAGGER_JOB`` (a
   name or an index), else the MPMD application number, else the heterogeneous-job component,
   else the only job;
2. meets every rank at world rank 0 (the coordinator) with a deadline, so a job that crashed or
   never started is reported by name instead of hanging the others, and splits the world into one
   communicator per job;
3. gathers each job's calibration (its leader's per-sample time) at world rank 0, which plans the
   start delays with the performance model (or takes them from the spec's mode) and sends them back;
4. waits out this job's delay, running the given idle work meanwhile (a job held at its first
   batch waits there instead: :mod:`.parking`), then starts its data-parallel backend on its own
   communicator: Horovod or torch.distributed with gloo, the rendezvous address sent over MPI.

Every step records its time (:attr:`Session.overhead`: the coordinator's own cost); each rank writes a
status file (``<workdir>/status``) at every stage, for ``hpcstagger launch`` and ``status``."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from hpcstagger import _io, config, slurm
from hpcstagger.colocated import source_watch
from hpcstagger.colocated._rendezvous import rendezvous
from hpcstagger.colocated.dataloader import data_loader
from hpcstagger.colocated.idle import flush_root, flusher_for
from hpcstagger.colocated.planahead import plan_inputs
from hpcstagger.colocated.jobmeter import calibration_dir, calibration_spec, no_plan, wrap_loader
from hpcstagger.colocated.parking import wait_or_park
from hpcstagger.colocated.prefetch import prefetcher_for
from hpcstagger.colocated.progress import ProgressMeter, plain_metrics
from hpcstagger.colocated.startcache import describe_start, run_partition
from hpcstagger.colocated.watcher import set_host, settle, wait_for_release
from hpcstagger.comm import Comm, as_comm
from hpcstagger.errors import CollectiveError, CollectiveTimeout, ConfigError
from hpcstagger.integrations.horovod import init as init_horovod
from hpcstagger.integrations.torch_ddp import init_process_group
from hpcstagger.spec import runenv
from hpcstagger.spec.identity import resolve_job
from hpcstagger.spec.jobspec import Spec
from hpcstagger.spec.records import status_path
from hpcstagger.stagger import learning as learn
from hpcstagger.stagger.planproc import plan_apart
from hpcstagger.stagger.history import describe as describe_history
from hpcstagger.stagger.runplan import RunPlan
from hpcstagger.stagger.steering import Decision

__all__ = ["Session", "init", "resolve_job"]

log = logging.getLogger(__name__)


IdleWork = Callable[[float], bool]
"""Work done while a job waits: called with the seconds left, does a bounded step, returns whether
more is left."""


@dataclass
class Session:
    """What :func:`init` returns: this rank's job, its communicator, its delay, and the run's timing."""

    world: Comm
    comm: Comm
    job: str
    job_index: int
    jobs: dict[str, list[int]]
    delays: dict[str, float]
    mode: str
    plan: RunPlan
    spec: Spec | None
    t0: float
    timings: dict[str, float] = field(default_factory=dict)
    run_dir: str = ""
    backend: str = "none"
    verbose: bool = True
    calibrating: str = ""  # the reports directory when `hpcstagger calibrate --spec` runs this job
    release: Decision | None = None  # closed loop: when and why this job was released
    progress_meter: ProgressMeter | None = None  # a job leader's, for the watcher (session.loader)
    observer: Any = None  # a passive LoopMeter when the run is observed for learning (.learn)
    parked: list[Any] | None = None  # the idle work of a job held at its first batch (.parking)
    _closed: bool = False

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank within its job."""
        return self.comm.rank

    @property
    def delay(self) -> float:
        """Seconds this job waits after the plan before it starts."""
        return self.delays[self.job]

    @property
    def is_leader(self) -> bool:
        """True on rank 0 of this job."""
        return self.comm.rank == 0

    @property
    def overhead(self) -> float:
        """Seconds this rank spent in the coordinator (rendezvous, split, plan exchange), waits for slower
        ranks included; ``hpcstagger launch`` reports as the run's own cost the last rank's time there."""
        return sum(self.timings.get(k, 0.0) for k in ("rendezvous", "split", "plan_exchange"))

    def elapsed(self) -> float:
        """Seconds since the run's time zero (when the plan reached this rank)."""
        return time.time() - self.t0

    def say(self, message: str) -> None:
        """Print a progress line on this job's leader (when verbose)."""
        if self.verbose and self.is_leader:
            _io.say_line(f"[hpcstagger {self.job} +{self.elapsed():.1f}s] {message}")

    # ---- what the spec describes ---------------------------------------------------------------
    def _need_spec(self, what: str) -> Spec:
        if self.spec is None:
            raise ConfigError(f"session.{what}() reads the job spec, but this run has none: launch with "
                              f"'hpcstagger launch SPEC' or pass init(spec=...)")
        return self.spec

    def source(self) -> Any:
        """The spec's ``[dataset]`` as a source (:meth:`Spec.make_source`); a directory listed once per run."""
        rid = self.plan.run_id
        listing = os.path.join(self.run_dir, f"dataset-{rid}.listing") if self.run_dir and rid else None
        return self._need_spec("source").make_source(listing=listing)

    def cache(self) -> Any:
        """The spec's ``[cache]`` as the node's ShmCache (partitioned across this job's nodes, collectively,
        with ``[cache] partitioned``), or None (capacity 0)."""
        return self._need_spec("cache").make_cache(self.comm)

    def checkpoint_dir(self) -> tuple[str, str | None]:
        """This job's checkpoint directory and staging directory (None without a fast level)."""
        spec = self._need_spec("checkpoint_dir")
        ck = spec.checkpoint
        return (os.path.join(ck.directory, self.job),
                os.path.join(ck.staging_dir, spec.run.name, self.job) if ck.staging_dir else None)

    def checkpoint_options(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~hpcstagger.AsyncCheckpointer` from the spec's ``[checkpoint]``:
        ``directory``, ``staging_dir``, ``keep`` and, with a staging level, ``flush_by`` and
        ``flush_queue`` (the run's shared queue, :mod:`.idle`)."""
        spec = self._need_spec("checkpoint_options")
        directory, staging = self.checkpoint_dir()
        opts: dict[str, Any] = {"directory": directory, "staging_dir": staging, "keep": spec.checkpoint.keep}
        if staging:
            opts.update(flush_by=spec.checkpoint.flush, flush_queue=flush_root(spec))
        return opts

    def data_loader(self, dataset: Any, batch_size: int = 1, **kwargs: Any) -> Any:
        """This job's loader: a :class:`~hpcstagger.loader.SharedLoader` when the spec's ``[loader]``
        (or ``share=True``) says so, else a plain DataLoader
        (:func:`hpcstagger.colocated.dataloader.data_loader`)."""
        return data_loader(self, dataset, batch_size, **kwargs)

    # ---- stages --------------------------------------------------------------------------------
    def wait(self, idle_work: Sequence[IdleWork] = ()) -> float:
        """Wait out this job's delay, running ``idle_work`` meanwhile; return the seconds waited.

        In mode ``"plan"`` a waiting job is released by the run's watcher, from what the run shows,
        instead (:mod:`hpcstagger.colocated.watcher`); the plan's delay is its prior."""
        start = time.time()
        until = self.t0 + self.delay
        prefetcher = prefetcher_for(self)  # [plan] prefetch: fill the cache in the source's idle time
        flusher = flusher_for(self)  # [checkpoint] flush = "queue": flush the running jobs' checkpoints
        work = list(idle_work) + [w for w in (prefetcher, flusher) if w is not None]  # the flusher lingers: last
        if self.delay > 0 and self.plan.steer:
            self.say(f"waiting for release (planned +{self.delay:.1f} s; steered by the run)")
            self.release = wait_for_release(self, work)
            self.say(f"released at +{self.elapsed():.1f} s: {self.release.reason}")
            until = 0.0
        elif self.delay > 0:
            self.say(f"waiting {self.delay:.1f} s (planned start)")
        while True:
            left = until - time.time()
            if left <= 0:
                break
            if work:
                if not work[0](left):
                    work.pop(0)
            else:
                time.sleep(min(left, 0.5))
        waited = time.time() - start
        if prefetcher is not None:
            prefetcher.close()
            self.timings.update(prefetcher.stats())
        if flusher is not None:
            flusher.close()
            self.timings.update(flushed_for_others=float(flusher.flushed), flush_failed=float(flusher.failed))
        self.timings["waited"] = waited
        self.timings["started_at"] = self.elapsed()
        self.write_status("started")
        return waited

    def start_backend(self, backend: str | None = None) -> None:
        """Start this job's data-parallel backend on its own communicator.

        ``"horovod"`` runs ``hvd.init(comm=...)``; ``"ddp"`` starts torch.distributed (gloo) with the
        rendezvous address sent over MPI; ``"none"`` does nothing. Raises DependencyError when the
        backend's package is missing.
        """
        backend = backend or self.backend
        t = time.perf_counter()
        if backend == "horovod":
            init_horovod(self.comm)
        elif backend == "ddp":
            init_process_group(self.comm)
        elif backend != "none":
            raise ConfigError(f"backend must be 'horovod', 'ddp' or 'none', not {backend!r}")
        self.backend = backend
        self.timings["backend_start"] = time.perf_counter() - t

    def write_status(self, state: str, **extra: Any) -> None:
        """Record this rank's stage and timings in ``<run_dir>/<job>.<rank>.json`` (no-op without a run dir)."""
        if not self.run_dir:
            return
        record = {"job": self.job, "rank": self.rank, "world_rank": self.world.rank, "state": state,
                  "host": socket.gethostname(), "pid": os.getpid(), "t0": self.t0, "time": time.time(),
                  "elapsed": self.elapsed(), "delay": self.delay, "mode": self.mode,
                  "timings": self.timings, "plan": self.plan.to_dict() if self.rank == 0 else {},
                  "release": self.release.to_dict() if self.release else None, **extra}
        _io.atomic_write_json(status_path(self.run_dir, self.job, self.rank), record, durable=False)

    def loader(self, iterable: Any, *, profiler: Any = None) -> Any:
        """The training loop's one wrapper: ``for batch in session.loader(loader):``.

        It gives ``iterable`` back as it is, or ``profiler.wrap(iterable)`` with a
        :class:`~hpcstagger.profile.StallProfiler`. When ``hpcstagger calibrate --spec`` runs the job
        (:attr:`calibrating`) it measures the loop instead and ends the job early, with status 0 on
        every rank: see :mod:`hpcstagger.colocated.jobmeter`.
        """
        return wrap_loader(self, iterable, profiler)

    def finish(self, **metrics: Any) -> None:
        """Mark this rank done (its status file records ``metrics``, tensors as numbers, and its finish time)."""
        if self._closed:
            return
        self._closed = True
        self.timings["finished_at"] = self.elapsed()
        self.write_status("done", metrics=plain_metrics(metrics))
        self.say(f"finished after {self.elapsed():.1f} s")
        settle()  # the host: the watcher's last fit, of this job's whole record (the history's)


# ---------------------------------------------------------------------------- init


def _appnum(world: Comm) -> int | None:
    if not world.is_mpi:
        return None
    from mpi4py import MPI

    value = world.mpi.Get_attr(MPI.APPNUM)
    return None if value is None or value < 0 else int(value)


def _load_spec(spec: Spec | str | os.PathLike[str] | None) -> Spec | None:
    if not isinstance(spec, Spec):
        path = spec if spec is not None else os.environ.get(runenv.SPEC)
        spec = Spec.from_toml(path) if path else None
    only = os.environ.get(runenv.ONLY)
    if spec is not None and only:
        spec = spec.only([n for n in only.split(",") if n])
    return spec


def _calibration_of(calibration: Mapping[str, float] | Callable[[], Mapping[str, float]] | None) -> dict[str, float]:
    if calibration is None:
        return {}
    value = calibration() if callable(calibration) else calibration
    return {str(k): float(v) for k, v in dict(value).items()}


def _install_fail_fast(session: Session) -> None:
    """On an uncaught exception: record it, say which job failed, and leave without MPI_Finalize.

    mpi4py finalizes MPI at exit, and MPICH's MPI_Finalize waits for every rank, so a rank that
    died of a Python exception would otherwise sit there while its job's other ranks wait for it in
    a collective. Leaving with os._exit makes the launcher (mpiexec, srun --kill-on-bad-exit) stop
    the run at once, and the status file names the job for ``hpcstagger launch``.
    """
    previous = sys.excepthook

    def hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
        try:
            previous(exc_type, exc, tb)
            message = f"{exc_type.__name__}: {exc}"
            _io.say_line(f"[hpcstagger] job {session.job!r} rank {session.rank} (world rank {session.world.rank}) "
                         f"failed: {message}; stopping the run")
            session.write_status("failed", error=message)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    if session.world.is_mpi and session.world.size > 1:
        sys.excepthook = hook


def _record_exit(session: Session) -> None:
    """At interpreter exit: a rank that never called finish() (sys.exit, or the script just ended)
    is recorded as 'exited', so the launcher does not report it as still running."""
    if not session._closed:
        session.write_status("exited", error="the process exited without calling Session.finish() "
                                             "(sys.exit, or the script ended early)")
        settle()


def init(spec: Spec | str | os.PathLike[str] | None = None, *, job: str | None = None,
         calibration: Mapping[str, float] | Callable[[], Mapping[str, float]] | None = None,
         backend: str | None = None, wait: bool = True, idle_work: Sequence[IdleWork] = (),
         world: Comm | Any | None = None, timeout: float | None = None, verbose: bool = True,
         fail_fast: bool = True) -> Session:
    """Join the co-located run: identify the job, plan, wait out the delay, start the backend.

    ``spec`` is a :class:`~hpcstagger.spec.jobspec.Spec` or the path of one (default ``HPCSTAGGER_SPEC``);
    without a spec every MPMD part (or ``HPCSTAGGER_JOB`` value) is its own job and all start at
    once. ``calibration`` (a dict, or a function called on the job's leader only) reports the job's
    measured ``sample_time`` to the planner. ``backend`` overrides the spec's (``"none"`` skips it).
    ``wait=False`` returns before the delay: call :meth:`Session.wait` and
    :meth:`Session.start_backend` yourself. ``timeout`` bounds each coordination step (default: the
    ``collective_timeout`` knob). With ``fail_fast`` (the default) an uncaught exception on any rank
    is recorded in its status file and ends the whole run at once instead of leaving the other
    ranks waiting for it.

    Raises ConfigError for a bad spec or identity, CollectiveTimeout naming the jobs that never
    arrived, and CollectiveError on every rank when planning fails.
    """
    t_world = time.perf_counter()  # MPI starts in Comm.world() (mpi4py's MPI_Init): timed until _init begins
    world_comm = as_comm(world) if world is not None else Comm.world()
    multi = fail_fast and world_comm.is_mpi and world_comm.size > 1
    try:
        return _init(spec, job=job, calibration=calibration, backend=backend, wait=wait, idle_work=idle_work,
                     world=world_comm, timeout=timeout, verbose=verbose, fail_fast=fail_fast, t_world=t_world)
    except CollectiveError as exc:
        if multi and isinstance(exc, CollectiveTimeout):
            # Some rank never arrived or never answered: it cannot take part in a clean exit.
            _io.say_line(f"[hpcstagger] {exc}; aborting the run")
            world_comm.abort(1)
        raise  # raised identically on every rank: they all leave together
    except Exception as exc:
        if multi:  # raised on this rank alone: the others would wait for it
            _io.say_line(f"[hpcstagger] hpcstagger.init failed on world rank {world_comm.rank}: "
                         f"{type(exc).__name__}: {exc}; aborting the run")
            world_comm.abort(1)
        raise


def _init(spec: Spec | str | os.PathLike[str] | None, *, job: str | None,
          calibration: Mapping[str, float] | Callable[[], Mapping[str, float]] | None,
          backend: str | None, wait: bool, idle_work: Sequence[IdleWork], world: Comm,
          timeout: float | None, verbose: bool, fail_fast: bool, t_world: float) -> Session:
    t_begin = time.perf_counter()
    timings: dict[str, float] = {"world": t_begin - t_world}  # MPI's start-up (Comm.world() in init)
    calibrating = calibration_dir()  # hpcstagger calibrate --spec: no plan, no delay, private cache
    spec_obj = _load_spec(spec)
    if calibrating and spec_obj is not None:
        spec_obj = calibration_spec(spec_obj, calibrating)
    timings["spec"] = time.perf_counter() - t_begin
    limit = float(timeout if timeout is not None else config.get("collective_timeout"))
    name = _identify(spec_obj, job, world)
    jobs, index, comm = _meet_and_split(world, spec_obj, name, limit, timings)
    decided = (no_plan(list(jobs)) if calibrating else
               _exchange_plan(world, comm, spec_obj, name, list(jobs), calibration, limit, timings))
    if decided.steer:
        set_host(decided.steer, jobs)  # every rank names the same one
    learned = (decided.learn or {}).get("scenario")
    if spec_obj is not None and learned:
        spec_obj = learn.with_scenario(spec_obj, learned)  # what the plan was made from
    t0 = time.time()
    timings["init"] = time.perf_counter() - t_begin
    session = _open_session(world, comm, spec_obj, name, index, jobs, decided, t0, timings, backend, verbose)
    session.calibrating = calibrating
    source_watch.attach(session)  # a run of a spec without a scenario measures itself for the next plan
    if session.run_dir and comm.rank == 0 and not calibrating:
        session.progress_meter = ProgressMeter(session.run_dir, name)
    if fail_fast:
        _install_fail_fast(session)
    atexit.register(_record_exit, session)
    session.write_status("planned")
    if calibrating:
        session.say(f"calibrating for 'hpcstagger calibrate': no plan, no delay; reports in {calibrating}")
    else:
        _announce(session, decided)
    if wait:
        wait_or_park(session, idle_work)
        session.start_backend()
    return session


def _identify(spec: Spec | None, job: str | None, world: Comm) -> str:
    """Step 1: this rank's job name (see :func:`resolve_job`)."""
    appnum = _appnum(world)
    if spec:
        names = list(spec.job_names)
        return names[resolve_job(names, explicit=job, appnum=appnum, het_component=slurm.het_component())]
    return job or os.environ.get(runenv.JOB) or (f"job{appnum}" if appnum is not None else "job0")


def _meet_and_split(world: Comm, spec: Spec | None, name: str, limit: float,
                    timings: dict[str, float]) -> tuple[dict[str, list[int]], int, Comm]:
    """Step 2: every rank says who it is; world rank 0 checks the layout against the spec; the world
    splits into one communicator per job. Returns ``({job: world ranks}, job index, job comm)``."""
    t = time.perf_counter()

    def describe_missing(ranks: list[int]) -> str:
        if not spec:
            return f"world rank(s) {ranks}"
        owners = sorted({j.name for j, first in spec.layout() for r in ranks if first <= r < first + j.ranks})
        return f"world rank(s) {ranks} (job(s) {', '.join(repr(o) for o in owners)} by the spec's layout)"

    def assign(hellos: list[Any]) -> dict[int, Any]:
        by_job: dict[str, list[int]] = {}
        for r, h in enumerate(hellos):
            by_job.setdefault(h["job"], []).append(r)
        if spec:
            problems = [f"job {j.name!r} has {len(by_job.get(j.name, []))} rank(s), the spec says {j.ranks}"
                        for j in spec.jobs if len(by_job.get(j.name, [])) != j.ranks]
            if problems:
                raise ConfigError("; ".join(problems) + "; launch each job with its spec's number of ranks")
            order = list(spec.job_names)
        else:
            order = sorted(by_job, key=lambda n: by_job[n][0])
        return {r: {"jobs": {n: by_job[n] for n in order}, "color": order.index(hellos[r]["job"])}
                for r in range(len(hellos))}

    hello = {"job": name, "host": socket.gethostname(), "pid": os.getpid()}
    layout = rendezvous(world, hello, assign, timeout=limit, describe_missing=describe_missing,
                        what="hpcstagger.init")
    timings["rendezvous"] = time.perf_counter() - t
    index, t = layout["color"], time.perf_counter()
    comm = world.split(index, key=world.rank, timeout=limit) if world.is_mpi else Comm.single()
    assert comm is not None
    timings["split"] = time.perf_counter() - t
    return layout["jobs"], index, comm


def _exchange_plan(world: Comm, comm: Comm, spec: Spec | None, name: str, order: list[str],
                   calibration: Mapping[str, float] | Callable[[], Mapping[str, float]] | None,
                   limit: float, timings: dict[str, float]) -> RunPlan:
    """Step 3: each job's leader calibrates; world rank 0 plans with every calibration
    (:func:`~hpcstagger.stagger.planproc.plan_apart`, in a child); every rank gets it (as a dictionary on the wire)."""
    t = time.perf_counter()
    calib = _calibration_of(calibration) if comm.rank == 0 else {}
    timings["calibration"] = time.perf_counter() - t
    mode = os.environ.get(runenv.MODE) or (spec.plan.mode if spec else "simultaneous")
    partition = run_partition(world, spec, limit)  # a partitioned cache: the nodes the run spans (collective)

    def plan(hellos: list[Any]) -> dict[int, Any]:
        leaders = {h["job"]: h["calibration"] for h in hellos if h["leader"]}
        # plan from the cache as it is now: a warm cache (an earlier run's) changes the plan
        inputs = plan_inputs(spec, mode, os.environ, partition)
        # the run id names what the run's processes share (the dataset's listing)
        decided = plan_apart(spec, order, leaders, mode, inputs).with_run_id(os.urandom(8).hex()).to_dict()
        return {r: decided for r in range(len(hellos))}

    t = time.perf_counter()
    decided = rendezvous(world, {"job": name, "leader": comm.rank == 0, "calibration": calib}, plan,
                         timeout=limit, what="hpcstagger.init planning")
    timings["plan_exchange"] = time.perf_counter() - t
    return RunPlan.from_dict(decided)


def _open_session(world: Comm, comm: Comm, spec: Spec | None, name: str, index: int,
                  jobs: dict[str, list[int]], decided: RunPlan, t0: float, timings: dict[str, float],
                  backend: str | None, verbose: bool) -> Session:
    """Step 4: the Session, with its status directory (``HPCSTAGGER_RUN_DIR``, else <workdir>/status)."""
    if run_dir := os.environ.get(runenv.RUN_DIR) or (os.path.join(spec.run.workdir, "status") if spec else ""):
        os.makedirs(run_dir, exist_ok=True)
    job_backend = backend or (spec.job(name).backend if spec else "none")
    return Session(world=world, comm=comm, job=name, job_index=index, jobs=jobs, delays=decided.delays,
                   mode=decided.mode, plan=decided, spec=spec, t0=t0, timings=timings,
                   run_dir=run_dir, backend=job_backend, verbose=verbose)


def _announce(session: Session, decided: RunPlan) -> None:
    summary = ", ".join(f"{n} +{d:.1f}s" for n, d in decided.delays.items())
    p = decided.predicted
    extra = ("; predicted makespan " + ", ".join(f"{k} {v:.1f}s" for k, v in p.items())) if p else ""
    start = describe_start(decided.cache)
    extra += f"; {start}" if start else ""
    extra += f"; {why}" if (why := decided.simultaneous_reason or (decided.steer or {}).get("guard")) else ""
    if decided.learn:
        extra += f"; {decided.learn.get('why', '')}"
    if h := decided.history:
        extra += f"; from the history of {h['runs']} run(s): {describe_history(h)}"
    ahead = "; planned ahead while the ranks started" if decided.planned_ahead else ""
    session.say(f"mode {decided.mode}: delays {summary}{extra} (coordinator {session.overhead * 1000:.0f} ms{ahead})")
