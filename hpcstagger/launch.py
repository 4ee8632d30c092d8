"""Run a job spec locally with MPMD ``mpiexec``, and read back what each job did.

:func:`mpmd_command` is pure (spec in, argv out). :func:`launch` runs it: one MPMD ``mpiexec`` for
the modes plan, simultaneous and fixed (every job in one MPI world, the coordinator in
:func:`hpcstagger.init` holding each back for its delay), or one ``mpiexec`` per job, one after
another, for mode sequential. Each rank writes status files (see :mod:`hpcstagger.coordinator`),
from which :func:`collect_results` computes each job's start and finish and the makespan, measured
from the run's time zero (when the plan reached the ranks), so process start-up is left out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ._shm import remove_stale_mpich_segments
from .coordinator import ENV_DELAYS, ENV_JOB, ENV_MODE, ENV_ONLY, ENV_RUN_DIR, ENV_SPEC
from .errors import ConfigError, LaunchError
from .spec import PLAN_MODES, JobSpec, Spec

__all__ = ["JobResult", "RunResult", "mpmd_command", "launch", "collect_results", "parse_delays"]

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


@dataclass
class RunResult:
    """A launch's outcome: the mode, the delays, every job, the makespan, and the predictions."""

    mode: str
    returncode: int
    run_dir: str
    jobs: dict[str, JobResult]
    delays: dict[str, float]
    makespan: float | None
    predicted: dict[str, float] = field(default_factory=dict)
    overhead: float | None = None
    wall: float = 0.0

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
            else:
                why = f"stopped while {j.state} (exit status {self.returncode})"
            out.append(f"job {j.name!r} ({j.ranks} rank(s)) did not finish: {why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "returncode": self.returncode, "run_dir": self.run_dir,
                "delays": self.delays, "makespan": self.makespan, "predicted": self.predicted,
                "overhead": self.overhead, "wall": self.wall,
                "jobs": {n: vars(j) for n, j in self.jobs.items()}}


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
    env = [f"{ENV_JOB}={job.name}", *(f"{k}={v}" for k, v in job.env.items())]
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


def collect_results(spec: Spec, run_dir: str | os.PathLike[str], *, jobs: Sequence[str] | None = None,
                    mode: str = "", returncode: int = 0) -> RunResult:
    """Read the status files of a run into a RunResult (jobs with no file are 'missing').

    A sequential run keeps one subdirectory per job (in spec order); their times are chained, so
    each job starts when the one before it finished and the makespan is the sum.
    """
    run_dir = Path(run_dir)
    subdirs = [j.name for j in spec.jobs if (run_dir / j.name).is_dir()]
    if subdirs and (jobs is None or len(jobs) > 1):
        return _collect_sequential(spec, run_dir, returncode)
    statuses: dict[str, list[dict[str, Any]]] = {}
    for p in sorted(run_dir.glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "job" in rec:
            statuses.setdefault(rec["job"], []).append(rec)
    results: dict[str, JobResult] = {}
    delays: dict[str, float] = {}
    predicted: dict[str, float] = {}
    overheads = []
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
        jr = JobResult(job.name, job.ranks, state)
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
            if r.get("rank") == 0:
                jr.metrics = r.get("metrics", {})
                predicted.update((r.get("plan") or {}).get("predicted") or {})
                overheads.append(sum(t.get(k, 0.0) for k in ("rendezvous", "split", "plan_exchange")))
            mode = mode or r.get("mode", "")
        results[job.name] = jr
    finishes = [j.finish for j in results.values() if j.finish is not None]
    makespan = max(finishes) if finishes and len(finishes) == len(results) else None
    return RunResult(mode=mode, returncode=returncode, run_dir=str(run_dir), jobs=results, delays=delays,
                     makespan=makespan, predicted=predicted, overhead=max(overheads) if overheads else None)


def _collect_sequential(spec: Spec, run_dir: Path, returncode: int) -> RunResult:
    results: dict[str, JobResult] = {}
    total = 0.0
    stopped = False
    for job in spec.jobs:
        if stopped or not (run_dir / job.name).is_dir():
            results[job.name] = JobResult(job.name, job.ranks, "not started")
            stopped = True
            continue
        one = collect_results(spec, run_dir / job.name, jobs=[job.name]).jobs[job.name]
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
                     delays={n: j.delay for n, j in results.items()}, makespan=total if done else None)


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: str) -> int:
    log.info("running: %s", " ".join(argv))
    started = time.time()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
        if rc != 0:  # killed ranks skip MPICH's cleanup of its /dev/shm segments
            remove_stale_mpich_segments(started)
        return rc
    except subprocess.TimeoutExpired:
        print(f"hpcstagger launch: the run exceeded its timeout of {timeout:g} s; stopping it", file=sys.stderr)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        remove_stale_mpich_segments(started)
        return 124
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        remove_stale_mpich_segments(started)
        raise


def launch(spec: Spec, *, mode: str | None = None, delays: Mapping[str, float] | None = None,
           mpiexec: str | None = None, timeout: float | None = None, run_name: str | None = None,
           env: Mapping[str, str] | None = None) -> RunResult:
    """Run every job of ``spec`` locally under MPMD ``mpiexec`` and return what happened.

    ``mode`` overrides the spec's ``[plan] mode``; ``delays`` (job -> seconds) implies mode fixed.
    Mode sequential runs one ``mpiexec`` per job in spec order, and its makespan is the sum of the
    jobs' own run times. Raises LaunchError when mpiexec is missing; a failed job is reported in the
    result (``RunResult.failures()``), not raised.
    """
    mode = mode or ("fixed" if delays else spec.plan.mode)
    if mode not in PLAN_MODES:
        raise ConfigError(f"mode must be one of {', '.join(PLAN_MODES)}, not {mode!r}")
    if mode == "fixed" and not (delays or spec.plan.delays):
        raise ConfigError("mode fixed needs delays: pass --delays a=0,b=10 or set [plan] delays in the spec")
    if delays:
        for name in delays:
            spec.job(name)
    exe = mpiexec or shutil.which("mpiexec") or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if not exe:
        raise LaunchError("no mpiexec on PATH; install an MPI (pip install mpich) or load your site's MPI module")
    if not spec.path:
        raise LaunchError("launch needs a spec read from a file (Spec.from_toml), so every rank can read it too")
    stamp = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}"
    run_dir = Path(spec.run.workdir) / "runs" / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, **(env or {}), ENV_SPEC: spec.path, ENV_MODE: mode}
    base_env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), base_env.get("PATH", "")])
    base_env.pop("MPIR_CVAR_PMI_VERSION", None)
    if delays:
        base_env[ENV_DELAYS] = json.dumps(dict(delays))
    limit = float(timeout or spec.run.timeout)
    cwd = os.path.dirname(spec.path)
    start = time.monotonic()
    if mode != "sequential":
        rc = _run(mpmd_command(spec, mpiexec=exe), {**base_env, ENV_RUN_DIR: str(run_dir)}, limit, cwd)
        result = collect_results(spec, run_dir, mode=mode, returncode=rc)
    else:
        rc = 0
        for job in spec.jobs:
            sub = run_dir / job.name
            sub.mkdir(exist_ok=True)
            left = limit - (time.monotonic() - start)
            job_env = {**base_env, ENV_RUN_DIR: str(sub), ENV_ONLY: job.name, ENV_MODE: "simultaneous"}
            rc = _run(mpmd_command(spec, mpiexec=exe, jobs=[job.name]), job_env, max(left, 1.0), cwd)
            if rc != 0 or collect_results(spec, sub, jobs=[job.name]).jobs[job.name].state != "done":
                break
        result = collect_results(spec, run_dir, returncode=rc)
    result.wall = time.monotonic() - start
    from . import _io

    _io.atomic_write_json(run_dir / "result.json", result.to_dict(), durable=False)
    return result
