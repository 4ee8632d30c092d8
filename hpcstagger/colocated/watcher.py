"""Closed-loop release: the watcher that steers, and the waiting ranks that it releases.

In mode ``"plan"`` with a calibrated scenario, :func:`~hpcstagger.stagger.delays.plan_run` adds a ``steer``
record to the plan (:func:`~hpcstagger.stagger.steering.steer_record`) when some job is planned to wait. Then:

- **The host** is the leader of the job planned to start last. It is idle until its own release,
  so the watching costs no training process any Python time, and it watches from a thread at a
  lower CPU priority (``steer_nice``). While it waits it looks at the run
  every 0.25 s (the shared cache's counters, each started job leader's progress and status file),
  re-fits the model at most every ``steer_interval`` seconds (less often when a re-fit costs more
  than ``steer_duty`` of that time in CPU: on a busy node the watcher's CPU time is the jobs'), lets
  :class:`~hpcstagger.stagger.steering.Steering` decide,
  and sends each released job's ranks a message (MPI point-to-point on the world communicator, tag
  :data:`TAG`). Its own job comes last.
- **Every other waiting rank** blocks in :meth:`Session.wait` until that message comes, running
  its idle work meanwhile. It starts on its own, with a warning, only if no message has come by its
  safety deadline (the latest release the host can choose plus ``collective_timeout``).

If the model fails while steering, the host logs it and falls back to the plan's delays. The
host writes every decision to ``<run_dir>/steer.json`` (read by ``hpcstagger launch``), and each
released rank records its release in its status file.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from hpcstagger import _io, config
from hpcstagger.cache.store import ShmCache
from hpcstagger.colocated.devreads import device_counter
from hpcstagger.errors import CacheError
from hpcstagger.model import Scenario
from hpcstagger.spec.records import read_progress, read_status, startups
from hpcstagger.stagger import history as H
from hpcstagger.stagger.delays import scenario_for
from hpcstagger.stagger.runplan import RunPlan
from hpcstagger.stagger.steering import Decision, Look, SteerLimits, Steering
from hpcstagger.stagger.latefit import LateFits

__all__ = ["TAG", "set_host", "settle", "wait_for_release"]

log = logging.getLogger(__name__)

TAG = 27181  # release messages on the world communicator
POLL = 0.05  # seconds between a waiting rank's looks for its message
WATCH_S = 2.0  # each look asks the cache to count reads in flight for this long


def set_host(steer: dict[str, Any], jobs: Mapping[str, Sequence[int]]) -> None:
    """Name the host in a ``steer`` record: the leader (lowest world rank) of the last group's first job."""
    steer["host"] = int(min(jobs[steer["groups"][-1][0]]))


class Watcher:
    """What the host sees of the run: the cache's read counters, progress and status files; with
    ``device``, also the bytes read from the block device the spec's dataset lives on (where the
    page cache is the scenario's cache: :mod:`~hpcstagger.colocated.devreads`). Without ``count`` it
    never has the cache count reads in flight (nor does the ``steer_count`` knob off)."""

    def __init__(self, spec: Any, run_dir: str, *, device: bool = False, count: bool = True):
        self.spec = spec
        self.run_dir = run_dir
        self.cache: Any = None
        self.count = count and bool(config.get("steer_count"))  # have the cache count reads in flight
        self.device: Callable[[], float | None] | None = None
        path = getattr(getattr(spec, "dataset", None), "path", "") if device else ""
        if path:
            self.device = device_counter(path)
            if self.device is None:
                log.info("%s is on no block device whose reads the kernel counts: the source is fitted to the "
                         "shared cache's reads", path)

    def _attach(self) -> Any:
        if self.cache is None and self.spec is not None and self.spec.cache.capacity > 0:
            from hpcstagger.cache.admin import list_caches

            root = os.path.abspath(self.spec.cache.root or config.get("shm_root"))
            try:
                if self.spec.cache.name in list_caches(root):
                    self.cache = ShmCache(self.spec.cache.name, None, root=root)
            except CacheError as exc:
                log.warning("the watcher cannot read the shared cache: %s", exc)
        return self.cache

    def look(self, t: float, started: Sequence[str]) -> Look:
        """The run now (``t`` seconds after time zero), for the ``started`` jobs; the cache is asked
        to count reads in flight where :attr:`count` says so (else the look reads what it counted so far)."""
        look = Look(t=t)
        cache = self._attach()
        if cache is not None:
            if self.count:
                try:
                    cache.watch(WATCH_S)  # the jobs' reads are counted in flight while somebody looks
                except CacheError as exc:
                    log.debug("the watcher cannot ask the cache to count reads in flight: %s", exc)
            nbytes, seconds = cache.read_counters()
            look.read_bytes, look.read_seconds = float(nbytes), seconds
            look.flight = cache.flight_seconds()
        if self.device is not None:
            look.device_bytes = self.device()
        for name in started:
            rec = read_progress(self.run_dir, name)
            if rec:
                look.progress[name] = rec
            status = read_status(self.run_dir, name)
            if status is not None:
                look.state[name] = str(status.get("state", ""))
        return look

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def _history_factors(plan: RunPlan) -> tuple[float, dict[str, float]]:
    """The factors on the scenario file the plan started from (its history's; 1 without one): the
    watcher fits on top of them, and records its fits multiplied by them."""
    h = plan.history or {}
    return float(h.get("source") or 1.0), {n: float(v) for n, v in (h.get("jobs") or {}).items()}


def _steering(session: Any) -> Steering:
    spec, plan = session.spec, session.plan
    steer = plan.steer or {}
    order = list(session.jobs)
    calibrations = plan.calibrations
    cache_state = plan.cache
    h_source, h_jobs = _history_factors(plan)
    # a job parked at its first batch has set itself up while it waited: its loop begins at its release
    h_startups = {**((plan.history or {}).get("startup") or {}), **{n: 0.0 for n in steer.get("park") or ()}}

    def build(beta: float, alpha: Mapping[str, float]) -> Scenario:
        # the fitted factors are on top of the history's (the plan's starting point)
        jobs = {n: float(alpha.get(n, 1.0)) * h_jobs.get(n, 1.0) for n in set(alpha) | set(h_jobs)}
        return scenario_for(spec, order, calibrations, cache_state=cache_state, source_scale=beta * h_source,
                            job_scales=jobs, partition=plan.partition,
                            startups=h_startups)

    # the source factor is fitted against the prior's curve: the file's, times the history's factor,
    # relative to what the same fit gave on the jobs' calibration runs; where the scenario's cache is
    # the page cache (readers coalesce), to the bytes read from the dataset's device instead
    prior = Scenario.from_toml(spec.plan.scenario)
    storage = prior.storage
    bandwidth = [b * h_source for b in storage.bandwidth]
    hi = steer.get("max_delay")
    limits = SteerLimits(lo=float(steer.get("min_delay") or 0.0), hi=math.inf if hi is None else float(hi),
                         interval=float(steer["interval"]), horizon=float(steer["horizon"]),
                         observe_only=bool(steer.get("observe_only")), min_gain=float(steer.get("min_gain", 0.0)),
                         duty=float(config.get("steer_duty")))
    return Steering(build, bandwidth, order, plan.delays, {n: spec.job(n).epochs for n in order}, limits,
                    baseline=storage.fit_baseline, jitter=float(plan.jitter or 0.0), priors=steer.get("prior"),
                    device=prior.cache.page_cache)


def _send(session: Any, jobs: Sequence[str], message: dict[str, Any]) -> None:
    me = session.world.rank
    for name in jobs:
        for r in session.jobs[name]:
            if r != me:
                session.world.mpi.send(message, dest=r, tag=TAG)


class _Watch(threading.Thread):
    """The host's looking and deciding, in a thread of its own at a lower CPU priority (a Linux
    thread's own nice value, ``steer_nice``), so that the model's work yields to the training
    processes on a busy node. Decisions go to :attr:`out`; the host's main thread sends them."""

    def __init__(self, session: Any, steering: Steering, watcher: Watcher):
        super().__init__(name="hpcstagger-watch", daemon=True)
        self.session, self.steering, self.watcher = session, steering, watcher
        self.out: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()
        self.failed = ""

    def run(self) -> None:
        _lower_priority()
        st, session = self.steering, self.session
        try:
            while st.waiting and not self.stop.is_set():
                now = session.elapsed()
                for d in st.decide(self.watcher.look(now, list(st.released)), session.t0):
                    self.out.put(d)
                # the next look: in a look's time, or when a release may come due, if sooner
                self.stop.wait(max(0.005, st.until_next_look(session.elapsed())))
        except Exception as exc:  # the model failed: the host falls back to the plan, and says so
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("closed-loop steering failed, releasing at the planned delays: %s", self.failed)


def _lower_priority() -> None:
    """Lower the calling (watcher) thread's CPU priority by ``steer_nice``: its model work yields to training."""
    nice = int(config.get("steer_nice"))
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError) as exc:
            log.debug("cannot lower the watcher thread's priority: %s", exc)


SETTLE_S = 5.0  # seconds the host's finish waits, at most, for the watcher's last fit and record
AFTER_LOOK = 0.5  # seconds between the looks after the releases once the run was fitted (the jobs' cores)
_AFTER: list[threading.Thread] = []  # this process's watcher thread after the releases (the host's)


class _Afterwards(threading.Thread):
    """After the last release: keep looking until the run gives evidence (:meth:`Steering.observe`,
    when nothing was fitted before the releases) and the costs of the jobs that waited have been
    fitted (:class:`~hpcstagger.stagger.latefit.LateFits`), or the host's job or every job has ended;
    then write the log and the run's record in the history. The record is written as soon as the
    first fit stands and rewritten when a later fit adds to it. The host's own job trains meanwhile;
    its ``finish()`` waits for this thread a little (:func:`settle`), and the thread dies with it."""

    def __init__(self, session: Any, steering: Steering, watcher: Watcher, log_path: str, failed: str):
        super().__init__(name="hpcstagger-watch-after", daemon=True)
        self.session, self.steering, self.watcher = session, steering, watcher
        self.log_path, self.failed = log_path, failed

    def run(self) -> None:
        _lower_priority()
        st, session = self.steering, self.session
        first = bool(st.source_seen or st.alpha)  # fitted before the releases
        record = _finish(session, st, self.log_path, self.failed) if first else ""
        fitted, fits = dict(st.alpha), LateFits(st)
        try:
            while True:
                look = self.watcher.look(session.elapsed(), list(st.released))
                if not first and st.observe(look, session.t0):
                    first, fitted = True, dict(st.alpha)
                    record = _finish(session, st, self.log_path, self.failed, record)
                late = fits.observe(look, session.t0)
                # the host's own job has ended: its process is about to, and the thread with it
                if (first and late) or all(look.state.get(n) in ("done", "exited") for n in st.released) \
                        or look.state.get(session.job) in ("done", "exited"):
                    break
                time.sleep(st.look if not first else AFTER_LOOK)
        except Exception as exc:  # nothing depends on it but the history: say so, record what there is
            log.warning("fitting the run after the last release failed: %s: %s", type(exc).__name__, exc)
        finally:
            self.watcher.close()
        if not record or st.alpha != fitted:
            _finish(session, st, self.log_path, self.failed, record)


def settle(timeout: float = SETTLE_S) -> None:
    """At the host's finish: give the watcher's thread after the releases (:class:`_Afterwards`) up to
    ``timeout`` seconds to fit the host's own job on its whole record and write the history."""
    while _AFTER:
        _AFTER.pop().join(timeout)


def _finish(session: Any, steering: Steering, log_path: str, failed: str, record: str = "") -> str:
    """The host's last word on the run: the log of the watcher's fits and decisions, and the history
    (the record at ``record`` replaced, if given); returns the record's path ('' for none)."""
    if log_path:
        _write_log(log_path, session, steering, failed)
    return _record_history(session, steering, record)


def _host(session: Any, idle: list[Callable[[float], bool]]) -> dict[str, Any]:
    """The host's loop: the watch thread decides, this thread sends the releases and runs the idle
    work; returns its own job's release."""
    steering = _steering(session)
    steering.prefetched = next((w.fraction for w in idle if hasattr(w, "fraction")), None)
    for n in steering.groups[0]:
        steering.released[n] = 0.0
    watcher = Watcher(session.spec, session.run_dir, device=steering.device, count=not _main_loading(session))
    log_path = os.path.join(session.run_dir, "steer.json") if session.run_dir else ""
    watch = _Watch(session, steering, watcher)
    watch.start()
    mine: dict[str, Any] | None = None
    done = False
    decisions: list[Decision] = []
    try:
        while mine is None:
            while not watch.out.empty():
                decisions.append(watch.out.get())
            if not decisions and not watch.is_alive() and watch.out.empty():
                now = session.elapsed()  # the watch ended without releasing us: the plan's delays
                failed = watch.failed or "the watcher stopped"
                for group in steering.waiting:
                    if now >= steering.planned[group[0]]:
                        decisions.append(steering.release(group, now, f"the plan's delay (steering failed: {failed})"))
                    else:
                        break
            for d in decisions:
                msg = {"release": d.to_dict()}
                _send(session, d.jobs, msg)
                if session.job in d.jobs:
                    mine = msg
            if decisions and log_path:
                _write_log(log_path, session, steering, watch.failed)
            decisions = []
            if mine is None and idle:
                _idle(idle, POLL)
            elif mine is None:  # nothing to do meanwhile: send a decision as soon as it comes
                try:
                    decisions.append(watch.out.get(timeout=POLL))
                except queue.Empty:
                    pass
        done = True
    finally:
        watch.stop.set()
        watch.join(timeout=30)
        after = done and not watch.failed and _records_history(session)
        if not after:
            watcher.close()
    if after:  # look on while the jobs train, for the history (a daemon thread)
        _AFTER.append(_Afterwards(session, steering, watcher, log_path, watch.failed))
        _AFTER[-1].start()
    else:
        _finish(session, steering, log_path, watch.failed)
    return mine


def _main_loading(session: Any) -> bool:
    """Whether a job of the plan's scenario loads in its main process (0 DataLoader workers). Then
    the watcher has no reads counted in flight, before the releases or after (the source is fitted to
    the mean number in flight): such a job's reads are on its training loop's path, and counting one
    takes the cache's ``flock`` twice. With 2 jobs of 0 workers running and a third waiting 3 s (ext4,
    2 cores, 6 rounds of open and watched launches of about 8 s), counting cost 0.7 CPU-s a launch;
    counted after the last release only, a job's loop took 2.5 to 4% longer. Jobs with 0 workers keep
    one read in flight each, so the mean stands in well (a source factor of 0.94 counted and 0.94 by
    the mean, in one launch)."""
    sc = session.plan.scenario
    return bool(sc) and any(j.workers == 0 for j in Scenario.from_dict(sc).jobs)


def _records_history(session: Any) -> bool:
    """Whether the run is to be recorded in a history (``[plan] history``): then the watcher looks on
    after the last release, for evidence and for the costs of the jobs it released last."""
    spec = session.spec
    return spec is not None and bool(spec.plan.history)


def _record_history(session: Any, steering: Steering, path: str = "") -> str:
    """Add what this run's watcher fitted to the spec's history (nothing without evidence), or
    replace the record at ``path`` with it; returns the record's path ('' for none)."""
    spec, plan = session.spec, session.plan
    if spec is None or not spec.plan.history or not (steering.source_seen or steering.alpha):
        return path

    h_source, h_jobs = _history_factors(plan)
    record = {"time": time.time(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "spec": spec.run.name,
              "run_dir": session.run_dir, "node": H.node_identity(),
              "scenario": {"path": spec.plan.scenario, "sha256": H.scenario_digest(spec.plan.scenario)},
              "source": steering.beta * h_source if steering.source_seen else None,
              "jobs": {n: a * h_jobs.get(n, 1.0) for n, a in steering.alpha.items()},
              "seen": steering.source_seen or None, "releases": [d.to_dict() for d in steering.decisions],
              "run_jobs": list(steering.order),
              "startup": startups(session.run_dir, steering.order) if session.run_dir else {}}
    try:
        return H.write_record(spec.run.workdir, record, path=path or None)
    except OSError as exc:
        log.warning("cannot record this run in the history of %r: %s", spec.run.name, exc)
        return path


def _write_log(path: str, session: Any, steering: Steering, failed: str) -> None:
    record = {"host": {"job": session.job, "world_rank": session.world.rank}, "t0": session.t0,
              "planned": steering.planned, "released": steering.released,
              "decisions": [d.to_dict() for d in steering.decisions],
              "fit": {"source": steering.beta, "jobs": steering.alpha}, "fits": steering.fits,
              "cpu_seconds": steering.cpu_seconds, "failed": failed or None}
    try:
        _io.atomic_write_json(path, record, durable=False)
    except OSError as exc:
        log.warning("cannot write %s: %s", path, exc)


def _idle(idle: list[Callable[[float], bool]], interval: float) -> None:
    """Spend about ``interval`` seconds: idle work first, else sleep."""
    until = time.time() + max(interval, POLL)
    while time.time() < until:
        if idle:
            if not idle[0](until - time.time()):
                idle.pop(0)
        else:
            time.sleep(max(0.0, min(until - time.time(), interval)))


def _follower(session: Any, idle: list[Callable[[float], bool]]) -> dict[str, Any]:
    """A waiting rank that is not the host: wait for the host's message (or the safety deadline)."""
    steer = session.plan.steer
    host = int(steer["host"])
    cap = session.t0 + float(steer["latest"][session.job]) + float(config.get("collective_timeout"))
    mpi = session.world.mpi
    while True:
        if mpi.Iprobe(source=host, tag=TAG):
            return dict(mpi.recv(source=host, tag=TAG))
        if time.time() >= cap:
            reason = (f"no release from the watcher (world rank {host}) by +{cap - session.t0:.1f} s; "
                      "starting anyway")
            log.warning(reason)
            return {"release": {"jobs": [session.job], "at": session.elapsed(), "reason": reason,
                                "planned": session.delay}}
        if idle:
            if not idle[0](POLL):
                idle.pop(0)
        else:
            time.sleep(POLL)


def wait_for_release(session: Any, idle_work: Sequence[Callable[[float], bool]] = ()) -> Decision:
    """Block until this rank's job is released (see the module docstring); returns the release."""
    idle = list(idle_work)
    if session.world.rank == int(session.plan.steer["host"]):
        msg = _host(session, idle)
    else:
        msg = _follower(session, idle)
    return Decision.from_dict(msg.get("release") or {"jobs": [session.job], "planned": session.delay})
