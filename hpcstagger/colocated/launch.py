"""Run a job spec locally with MPMD ``mpiexec``, and read back what each job did.

:func:`mpmd_command` is pure (spec in, argv out). :func:`launch` runs it: one MPMD ``mpiexec`` for
the modes plan, simultaneous and fixed (every job in one MPI world, the coordinator in
:func:`hpcstagger.init` holding each back for its delay), or one ``mpiexec`` per job, one after
another, for mode sequential. Each rank writes status files (see :mod:`hpcstagger.colocated.coordinator`),
from which :func:`collect_results` computes each job's start and finish and the makespan, measured
from the run's time zero (when the plan reached the ranks), so process start-up is left out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger import _io, config
from hpcstagger.cache.throttle import remove_if_idle, throttle_dir
from hpcstagger.colocated import leftovers, preflight
from hpcstagger.colocated import planahead
from hpcstagger.colocated.procgroup import run_group
from hpcstagger.colocated.batch import job_wrapper, multiprog_conf
from hpcstagger.colocated.startcache import make_cold
from hpcstagger.errors import CacheError, ConfigError, LaunchError
from hpcstagger.slurm import het_component
from hpcstagger.spec import runenv
from hpcstagger.spec.cachesize import for_launch
from hpcstagger.spec.identity import resolve_job
from hpcstagger.spec.jobspec import PLAN_MODES, JobSpec, Spec
from hpcstagger.spec.records import misshapen_status, progress_path
from hpcstagger.stagger.steering import Decision

__all__ = ["JobResult", "RunResult", "mpmd_command", "launch", "collect_results", "parse_delays", "exec_job",
           "run_group"]

log = logging.getLogger(__name__)


@dataclass
class JobResult:
    """One job's outcome: ``start`` and ``finish`` in seconds from the run's time zero."""

    name: str
    ranks: int
    state: str
    delay: float = 0.0
    start: float | None = None
    finish: float | None = None
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    release: Decision | None = None  # closed loop: when and why it was released
    loader_seen: bool | None = None  # whether its leader's loop ran under session.loader (a progress record)

    def to_dict(self) -> dict[str, Any]:
        """As plain JSON-able types (its release as :meth:`Decision.to_dict`, or None)."""
        return {**vars(self), "release": self.release.to_dict() if self.release else None}

    def blind(self) -> str:
        """One line when the job finished without ever calling ``session.loader``, else ""."""
        if self.state != "done" or self.loader_seen is not False:
            return ""
        return (f"{self.name} never called session.loader: calibration cannot measure its loop and the closed "
                f"loop cannot see its progress; write its loop 'for batch in session.loader(loader):'")


@dataclass
class RunResult:
    """A launch's outcome: the mode, the delays, every job, the makespan, and the predictions.

    ``cache`` is what the shared cache held when the coordinator planned (``entries``, ``bytes``,
    ``fraction`` of the dataset; empty without a cache); ``cold_cache`` what ``cold_cache=True``
    did before the run (see :func:`~hpcstagger.colocated.startcache.make_cold`; empty otherwise).
    """

    mode: str
    returncode: int
    run_dir: str
    jobs: dict[str, JobResult]
    delays: dict[str, float]
    makespan: float | None
    predicted: dict[str, float] = field(default_factory=dict)
    overhead: float | None = None
    wall: float = 0.0
    scenario: dict[str, Any] = field(default_factory=dict)
    calibrations: dict[str, Any] = field(default_factory=dict)
    curve: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    cold_cache: dict[str, Any] = field(default_factory=dict)
    steer: dict[str, Any] = field(default_factory=dict)  # closed loop: the watcher's decisions (steer.json)
    learn: dict[str, Any] = field(default_factory=dict)  # a spec without a scenario: what the plan learned from

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and all(j.state == "done" for j in self.jobs.values())

    def failures(self) -> list[str]:
        """One line per job that did not finish, naming it; the failed jobs first."""
        failed = [j for j in self.jobs.values() if j.state in ("failed", "exited")]
        out = [f"job {j.name!r} ({j.ranks} rank(s)) {'failed' if j.state == 'failed' else 'ended early'}: "
               f"{j.error}" for j in failed]
        for j in self.jobs.values():
            if j.state in ("done", "failed", "exited"):
                continue
            if j.state == "missing":
                why = "never reached hpcstagger.init (see its output)"
            elif failed:
                why = f"stopped when job {failed[0].name!r} failed (it was {j.state})"
            elif self.returncode == 124:
                why = f"stopped by the run's timeout (it was {j.state})"
            elif self.returncode in (9, 137, -9):
                why = (f"killed with SIGKILL while {j.state} (exit status {self.returncode}): most often the "
                       "kernel's out-of-memory killer, at the node's or the job's memory cgroup limit (page cache "
                       "and /dev/shm count against it); see dmesg, and shrink [cache] capacity or the loaders' "
                       "workers")
            else:
                why = f"stopped while {j.state} (exit status {self.returncode})"
            out.append(f"job {j.name!r} ({j.ranks} rank(s)) did not finish: {why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "returncode": self.returncode, "run_dir": self.run_dir,
                "delays": self.delays, "makespan": self.makespan, "predicted": self.predicted,
                "overhead": self.overhead, "wall": self.wall, "scenario": self.scenario,
                "calibrations": self.calibrations, "curve": self.curve, "cache": self.cache,
                "cold_cache": self.cold_cache, "steer": self.steer, "learn": self.learn,
                "jobs": {n: j.to_dict() for n, j in self.jobs.items()}}


_COORDINATOR_PHASES = ("rendezvous", "split", "plan_exchange")
_COLD_CACHE_FILE = "cold-cache.json"  # in the run directory: what --cold-cache did


def _read_cold_cache(run_dir: Path) -> dict[str, Any]:
    return _read_json_or_empty(run_dir / _COLD_CACHE_FILE)


def parse_delays(text: str) -> dict[str, float]:
    """``"a=0,b=12.5"`` -> {"a": 0.0, "b": 12.5}; raises ConfigError on bad input."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--delays: cannot read {part!r}; write job=seconds pairs, e.g. a=0,b=12.5") from None
        if out[name.strip()] < 0:
            raise ConfigError(f"--delays: {name.strip()} has a negative delay")
    return out


def _job_argv(job: JobSpec, python: str) -> list[str]:
    cmd = list(job.command)
    if cmd[0] in ("python", "python3"):
        cmd[0] = python  # the interpreter hpcstagger runs under, so the job sees the same packages
    env = [f"{runenv.JOB}={job.name}", *(f"{k}={v}" for k, v in job.env.items())]
    return ["env", *env, *cmd]


def mpmd_command(spec: Spec, *, mpiexec: str = "mpiexec", python: str | None = None,
                 jobs: Sequence[str] | None = None) -> list[str]:
    """The MPMD ``mpiexec`` argv that starts ``jobs`` (default all) of ``spec`` in one MPI world.

    Each part is ``-n RANKS env HPCSTAGGER_JOB=NAME [job env] COMMAND``; a ``python`` command word
    is replaced by ``python`` (default: this interpreter).
    """
    python = python or sys.executable
    argv = [mpiexec]
    chosen = [j for j in spec.jobs if jobs is None or j.name in jobs]
    for i, job in enumerate(chosen):
        if i:
            argv.append(":")
        argv += ["-n", str(job.ranks), *_job_argv(job, python)]
    return argv


def exec_job(spec: Spec, environ: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str], str]:
    """This rank's job command: (argv, environment, working directory), for ``hpcstagger exec``.

    The job is ``HPCSTAGGER_JOB``, else the heterogeneous-job component, else the job whose place in
    the spec's layout holds this rank (``SLURM_PROCID``, ``PMI_RANK`` or ``OMPI_COMM_WORLD_RANK``).
    Raises ConfigError when none of them tells.
    """
    env = dict(os.environ if environ is None else environ)
    names = list(spec.job_names)
    if not env.get(runenv.JOB) and het_component(env) is None:
        rank_text = env.get("SLURM_PROCID") or env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK")
        if rank_text is None or not rank_text.isdigit():
            raise ConfigError("hpcstagger exec cannot tell this rank's job: set HPCSTAGGER_JOB, or start it "
                              "with srun or mpiexec so that its rank is known")
        rank = int(rank_text)
        owner = next((j.name for j, first in spec.layout() if first <= rank < first + j.ranks), None)
        if owner is None:
            raise ConfigError(f"rank {rank} is beyond the spec's {spec.total_ranks} rank(s); launch exactly "
                              f"{spec.total_ranks} tasks")
        env[runenv.JOB] = owner
    index = resolve_job(names, environ=env, het_component=het_component(env))
    job = spec.jobs[index]
    env.update(job.env)
    env[runenv.JOB] = job.name
    env.setdefault(runenv.SPEC, spec.path)
    return list(job.command), env, os.path.dirname(spec.path) or "."


def collect_results(spec: Spec, run_dir: str | os.PathLike[str], *, jobs: Sequence[str] | None = None,
                    mode: str = "", returncode: int = 0) -> RunResult:
    """Read the status files of a run into a RunResult (jobs with no file are 'missing').

    A sequential run keeps one subdirectory per job (in spec order); their times are chained, so
    each job starts when the one before it finished and the makespan is the sum.
    """
    run_dir = Path(run_dir)
    subdirs = [j.name for j in spec.jobs if (run_dir / j.name).is_dir()]
    if subdirs and (jobs is None or len(jobs) > 1):
        seq = _collect_sequential(spec, run_dir, returncode)
        seq.cold_cache = _read_cold_cache(run_dir)
        return seq
    statuses: dict[str, list[dict[str, Any]]] = {}
    for p in sorted(run_dir.glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "job" in rec and "state" in rec:  # a rank's status file
            bad = misshapen_status(rec)
            if bad:
                log.warning("status file %s is damaged (%s); its rank counts as missing", p, bad)
            else:
                statuses.setdefault(rec["job"], []).append(rec)
    results: dict[str, JobResult] = {}
    delays: dict[str, float] = {}
    predicted: dict[str, float] = {}
    plan_info: dict[str, Any] = {}
    phases: dict[str, list[float]] = {}
    for job in spec.jobs:
        if jobs is not None and job.name not in jobs:
            continue
        recs = statuses.get(job.name, [])
        if len(recs) < job.ranks:
            state = "missing" if not recs else next((r["state"] for r in recs if r["state"] != "done"), "missing")
        else:
            states = [r["state"] for r in recs]
            state = ("done" if all(s == "done" for s in states) else "failed" if "failed" in states else
                     "exited" if "exited" in states else next(s for s in states if s != "done"))
        jr = JobResult(job.name, job.ranks, state, loader_seen=os.path.exists(progress_path(str(run_dir), job.name)))
        for r in recs:
            jr.delay = float(r.get("delay", 0.0))
            delays[job.name] = jr.delay
            t = r.get("timings", {})
            if "started_at" in t:
                jr.start = t["started_at"] if jr.start is None else min(jr.start, t["started_at"])
            if "finished_at" in t:
                jr.finish = t["finished_at"] if jr.finish is None else max(jr.finish, t["finished_at"])
            if r.get("error"):
                jr.error = f"rank {r['rank']}: {r['error']}"
            for phase in _COORDINATOR_PHASES:
                if phase in t:
                    phases.setdefault(phase, []).append(float(t[phase]))
            if r.get("rank") == 0:
                jr.metrics = r.get("metrics", {})
                jr.release = Decision.from_dict(r["release"]) if r.get("release") else None
                predicted.update((r.get("plan") or {}).get("predicted") or {})
                plan_info = plan_info or (r.get("plan") or {})
            mode = mode or r.get("mode", "")
        results[job.name] = jr
    finishes = [j.finish for j in results.values() if j.finish is not None]
    makespan = max(finishes) if finishes and len(finishes) == len(results) else None
    # Each phase's cost is what the last rank to reach it spent there: it waited for nobody, so its
    # time is the coordinator's own (the other ranks' include waiting for slower starters).
    overhead = sum(min(v) for v in phases.values()) if phases else None
    return RunResult(mode=mode, returncode=returncode, run_dir=str(run_dir), jobs=results, delays=delays,
                     makespan=makespan, predicted=predicted, overhead=overhead,
                     scenario=plan_info.get("scenario") or {}, calibrations=plan_info.get("calibrations") or {},
                     curve=plan_info.get("curve") or {}, cache=plan_info.get("cache") or {},
                     cold_cache=_read_cold_cache(run_dir), steer=_read_json_or_empty(run_dir / "steer.json"),
                     learn=plan_info.get("learn") or {})


def _read_json_or_empty(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _collect_sequential(spec: Spec, run_dir: Path, returncode: int) -> RunResult:
    results: dict[str, JobResult] = {}
    total = 0.0
    stopped = False
    cache: dict[str, Any] = {}
    for job in spec.jobs:
        if stopped or not (run_dir / job.name).is_dir():
            results[job.name] = JobResult(job.name, job.ranks, "not started")
            stopped = True
            continue
        part = collect_results(spec, run_dir / job.name, jobs=[job.name])
        cache = cache or part.cache  # the cache as the first job found it
        one = part.jobs[job.name]
        one.delay = total  # it waits for every job before it
        if one.start is not None:
            one.start += total
        if one.finish is not None:
            one.finish += total
            total = one.finish
        results[job.name] = one
        stopped = one.state != "done"
    done = all(j.state == "done" for j in results.values())
    return RunResult(mode="sequential", returncode=returncode, run_dir=str(run_dir), jobs=results,
                     delays={n: j.delay for n, j in results.items()}, makespan=total if done else None,
                     cache=cache)


def _release_throttle(spec: Spec, env: Mapping[str, str]) -> None:
    """Remove the emulated source's shared reader table once the run is over and nobody reads it
    (the jobs' DataLoader workers exit without detaching, so it would stay in /dev/shm). ``env``
    is the jobs' environment, which may move the table (the throttle_dir and shm_root knobs)."""
    if not spec.dataset.throttle:
        return

    try:
        remove_if_idle(f"{spec.run.name}-source", throttle_dir(env))
    except CacheError as exc:
        log.warning("could not remove the throttle state of run %s: %s", spec.run.name, exc)


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: str) -> int:
    log.info("running: %s", " ".join(argv))

    def say() -> None:
        print(f"hpcstagger launch: the run exceeded its timeout of {timeout:g} s; stopping it", file=sys.stderr)

    return run_group(argv, env, cwd, timeout, on_timeout=say)


def _srun_commands(spec: Spec, run_dir: Path, jobs: Sequence[str] | None) -> list[str]:
    """Write the per-job wrappers (and the multi-prog file) into ``run_dir``; return the srun argv."""
    exe = shutil.which("srun")
    if not exe or not os.environ.get("SLURM_JOB_ID"):
        raise LaunchError("the srun launcher runs inside a Slurm allocation (sbatch or salloc); "
                          "use the default mpiexec launcher elsewhere")
    workdir = os.path.dirname(spec.path)
    chosen = [j for j in spec.jobs if jobs is None or j.name in jobs]
    for job in chosen:
        (run_dir / f"job-{job.name}.sh").write_text(job_wrapper(job, workdir))
    base = [exe, "--mpi=pmi2", "--kill-on-bad-exit=1", f"--ntasks={sum(j.ranks for j in chosen)}"]
    if len(chosen) == 1:
        return base + ["bash", str(run_dir / f"job-{chosen[0].name}.sh")]
    sub = spec.only([j.name for j in chosen])
    (run_dir / "multiprog.conf").write_text(multiprog_conf(sub, lambda n: str(run_dir / f"job-{n}.sh")))
    return base + ["--multi-prog", str(run_dir / "multiprog.conf")]


def _check_launch(spec: Spec, mode: str, delays: Mapping[str, float] | None, launcher: str, mpiexec: str | None,
                  check: bool) -> str | None:
    """Validate a launch's arguments, then (``check``) the spec's dataset, backends and launcher;
    return the mpiexec to use (None for srun)."""
    if mode not in PLAN_MODES:
        raise ConfigError(f"mode must be one of {', '.join(PLAN_MODES)}, not {mode!r}")
    if mode == "fixed" and not (delays or spec.plan.delays):
        raise ConfigError("mode fixed needs delays: pass --delays a=0,b=10 or set [plan] delays in the spec")
    if delays:
        for name in delays:
            spec.job(name)
    if launcher not in ("mpiexec", "srun"):
        raise ConfigError(f"launcher must be 'mpiexec' or 'srun', not {launcher!r}")
    if check:
        preflight.check(spec, launcher=launcher, mpiexec=mpiexec)
    exe = mpiexec or shutil.which("mpiexec") or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if launcher == "mpiexec" and not exe:
        raise LaunchError("no mpiexec on PATH; install an MPI (pip install mpich) or load your site's MPI module")
    if not spec.path:
        raise LaunchError("launch needs a spec read from a file (Spec.from_toml), so every rank can read it too")
    return exe


def launch(spec: Spec, *, mode: str | None = None, delays: Mapping[str, float] | None = None,
           mpiexec: str | None = None, timeout: float | None = None, run_name: str | None = None,
           env: Mapping[str, str] | None = None, launcher: str = "mpiexec", cold_cache: bool = False,
           check: bool = True) -> RunResult:
    """Run every job of ``spec`` in one MPI world and return what happened.

    ``launcher`` is ``"mpiexec"`` (MPMD mpiexec, anywhere) or ``"srun"`` (``srun --multi-prog``,
    inside a Slurm allocation). ``mode`` overrides the spec's ``[plan] mode``; ``delays`` (job ->
    seconds) implies mode fixed. Mode sequential runs one launch per job in spec order, and its
    makespan is the sum of the jobs' own run times. ``cold_cache`` first empties the spec's shared
    cache and drops the dataset from the page cache (:func:`~hpcstagger.colocated.startcache.make_cold`;
    reported in ``RunResult.cold_cache``); otherwise the run starts from the cache as it is, and the
    coordinator plans from it. With ``check`` (the default), before anything starts, the dataset,
    each job's backend and the launcher are checked (:func:`~hpcstagger.colocated.preflight.check`:
    ConfigError, DependencyError or LaunchError, one line naming the job, the field and the fix).
    Raises LaunchError when the launcher is missing, CacheError when the cache cannot be cleared; a
    failed job is reported in the result (``RunResult.failures()``), not raised. When the ranks are
    gone, what they left in /dev/shm that no live process uses (gate files, loader rings, throttle
    tables: :func:`~hpcstagger.colocated.leftovers.remove_unused`) is removed; caches stay.
    """
    mode = mode or ("fixed" if delays else spec.plan.mode)
    exe = _check_launch(spec, mode, delays, launcher, mpiexec, check)
    stamp = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}"
    run_dir = Path(spec.run.workdir) / "runs" / stamp
    run_dir.mkdir(parents=True, exist_ok=True)

    cold: dict[str, Any] = {}
    if cold_cache:
        cold = make_cold(spec)
        log.info("cold cache before the run: %s", cold)
        _io.atomic_write_json(run_dir / _COLD_CACHE_FILE, cold, durable=False)
    base_env = {**os.environ, **(env or {}), runenv.SPEC: spec.path, runenv.MODE: mode}
    sized = for_launch(spec, base_env)  # [cache] capacity "auto": one size for every process of the run
    if sized is not None:
        base_env[runenv.CACHE_CAPACITY] = str(sized.capacity)
        spec = replace(spec, cache=replace(spec.cache, capacity=sized.capacity, sized=sized.why))
        print(f"hpcstagger launch: [cache] capacity auto: {sized.why}", file=sys.stderr)
    root_existed = os.path.lexists(config.get("shm_root", base_env))
    base_env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), base_env.get("PATH", "")])
    base_env.pop("MPIR_CVAR_PMI_VERSION", None)
    if delays:
        base_env[runenv.DELAYS] = runenv.encode_delays(delays)
    limit = float(timeout or spec.run.timeout)
    cwd = os.path.dirname(spec.path)
    start = time.monotonic()
    def command(jobs: Sequence[str] | None, where: Path) -> list[str]:
        if launcher == "srun":
            return _srun_commands(spec, where, jobs)
        assert exe, "launch() raised LaunchError above when there is no mpiexec"
        return mpmd_command(spec, mpiexec=exe, jobs=jobs)

    if mode != "sequential":
        run_env = {**base_env, runenv.RUN_DIR: str(run_dir)}
        # world rank 0's planning, started now: it plans while the ranks start
        ahead, planner = planahead.start(spec, mode, run_env, run_dir, [j.name for j in spec.jobs])
        try:
            rc = _run(command(None, run_dir), {**run_env, **ahead}, limit, cwd)
        finally:
            planahead.stop(planner)
        result = collect_results(spec, run_dir, mode=mode, returncode=rc)
    else:
        rc = 0
        for job in spec.jobs:
            sub = run_dir / job.name
            sub.mkdir(exist_ok=True)
            left = limit - (time.monotonic() - start)
            job_env = {**base_env, runenv.RUN_DIR: str(sub), runenv.ONLY: job.name, runenv.MODE: "sequential"}
            rc = _run(command([job.name], sub), job_env, max(left, 1.0), cwd)
            if rc != 0 or collect_results(spec, sub, jobs=[job.name]).jobs[job.name].state != "done":
                break
        result = collect_results(spec, run_dir, returncode=rc)
    result.wall = time.monotonic() - start
    result.cold_cache = cold
    _release_throttle(spec, base_env)
    # what killed ranks could not remove (their gate files, rings, tables); a root made by the run goes too
    leftovers.remove_unused(base_env, keep_root=root_existed)
    _io.atomic_write_json(run_dir / "result.json", result.to_dict(), durable=False)
    return result
