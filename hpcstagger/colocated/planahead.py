"""The launcher plans ahead: world rank 0's planning starts while the ranks start.

Every rank of a run waits for world rank 0's plan before its job may start, and the model can take
seconds to plan (3 s for a sweep of 4 trials over 20,000 samples with the page cache modelled as
an lru cache), while starting the ranks (Python, torch, the job's imports) takes seconds too.
:func:`start` runs the planning process (:mod:`hpcstagger.stagger.planproc`) from ``hpcstagger
launch``, with the request world rank 0 will make when no job reports a calibration of its own
(:func:`plan_inputs` is what both use), and returns the variable that tells the ranks where its
plan will be. World rank 0 takes that plan only when its own request is the same; otherwise it
plans as it would have. Not for a partitioned cache (its node count comes from the ranks), a
spec without a scenario, or the ``plan_ahead`` knob off.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcstagger import config
from hpcstagger.colocated.startcache import observe_cache
from hpcstagger.spec import runenv
from hpcstagger.spec.jobspec import Spec
from hpcstagger.stagger import learning as learn
from hpcstagger.stagger.history import plan_history
from hpcstagger.stagger.planproc import plan_request
from hpcstagger.stagger.runplan import PlanInputs

__all__ = ["plan_inputs", "start", "stop", "AHEAD_FILE"]

log = logging.getLogger(__name__)

AHEAD_FILE = "plan-ahead.json"  # in the run directory: the request and the plan made for it


def plan_inputs(spec: Spec | None, mode: str, environ: Mapping[str, str],
                partition: Mapping[str, Any] | None) -> PlanInputs:
    """What world rank 0 plans from besides the jobs and their calibrations, as a process with
    ``environ`` sees it now: the fixed delays, the shared cache's state, the history, the watcher's
    knobs, what learning resolved, and ``partition``."""
    return PlanInputs(fixed=runenv.decode_delays(environ), cache_state=observe_cache(spec),
                      history=plan_history(spec, mode, environ),
                      steer_interval=float(config.get("steer_interval", environ)),
                      steer_min_gain=float(config.get("steer_min_gain", environ)),
                      learned=learn.resolve(spec, mode, environ), partition=dict(partition) if partition else None)


def start(spec: Spec, mode: str, environ: Mapping[str, str], run_dir: Path, order: Sequence[str], *,
          detach: bool = False) -> tuple[dict[str, str], subprocess.Popen[str] | None]:
    """Start planning ``order`` (the run's jobs) in ``mode`` for ranks that will run with
    ``environ``. Returns the variables to add to the ranks' environment and the planning process
    (None, and no variables, where planning ahead does not apply or cannot start). ``detach``: the
    caller exits before the plan is made (``hpcstagger slurm prepare`` in a batch script), so the
    request is handed over now and the process is left to write its file and end by itself."""
    if (mode not in runenv.PLAN_MODES_IN_WORLD or not spec.plan.scenario or spec.cache_partitioned()
            or not config.get("plan_ahead", environ)):
        return {}, None
    try:
        inputs = plan_inputs(spec, mode, environ, None)
        request = plan_request(spec, order, {n: {} for n in order}, mode, inputs)
    except Exception as exc:  # world rank 0 plans as it would have, and meets the same error there
        log.info("not planning ahead: %s: %s", type(exc).__name__, exc)
        return {}, None
    if request is None:
        return {}, None
    path = run_dir / AHEAD_FILE
    env = {k: v for k, v in environ.items() if not k.startswith(("PMI_", "PMIX_", "MPIR_", "HYDRA_"))}
    env["HPCSTAGGER_MPI"] = "0"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "hpcstagger.stagger.planproc", "--ahead", str(path)],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL if detach else subprocess.PIPE,
                                text=True, env=env, start_new_session=detach)
    except OSError as exc:
        log.info("not planning ahead: %s", exc)
        return {}, None
    if detach:  # its failures go to its file ("error"), which world rank 0 reads and logs
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
        except OSError as exc:
            log.info("not planning ahead: the planning process: %s", exc)
            stop(proc)
            return {}, None
        return {runenv.PLAN_AHEAD: f"{proc.pid}:{path}"}, proc
    threading.Thread(target=_feed, args=(proc, json.dumps(request)), name="hpcstagger-plan-ahead",
                     daemon=True).start()
    return {runenv.PLAN_AHEAD: f"{proc.pid}:{path}"}, proc


def _feed(proc: subprocess.Popen[str], request: str) -> None:
    """Hand the request over and reap the process (a zombie would look alive to the ranks)."""
    try:
        _, err = proc.communicate(request)
    except (OSError, ValueError) as exc:
        log.info("the planning process: %s", exc)
        return
    if proc.returncode != 0:
        log.info("the planning process ended with exit status %s: %s", proc.returncode, (err or "").strip()[-500:])


def stop(proc: subprocess.Popen[str] | None) -> None:
    """End the planning process if it still runs (the run ended before it planned)."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
