"""World rank 0 plans in a process of its own, so that the planner's memory leaves with it; the
launcher may have started that process already, while the ranks were starting.

Planning a run (:func:`~hpcstagger.stagger.delays.plan_run`) builds the model's state and searches
staggers: tens of MB of Python objects and arrays, in the process of a job that then starts its
DataLoader workers. Forked workers share their parent's pages until either side writes them, and
Python's reference counts and garbage collector write them all, so every worker ends up with its
own copy, which a tight memory limit takes from the page cache (in a sweep of four trials in
1,472 MiB, planning apart lowered the run's peak from 1,384 to 1,328 MiB). :func:`plan_apart` runs the same
:func:`plan_run` in a fresh interpreter (``python -m hpcstagger.stagger.planproc``: the spec's
path and the rest as JSON on its stdin, the plan as JSON on its stdout), without MPI, and returns
its plan; where that cannot work (a spec built in memory, inputs that are not JSON, a child that
fails) it plans in this process, as before, and logs why.

Every rank waits for the plan, and a slow model takes seconds (an lru page cache over 20,000
samples: 3 s for 4 jobs). ``hpcstagger launch`` therefore starts the same planning process
before the ranks, with the request world rank 0 is expected to make
(:func:`~hpcstagger.colocated.planahead.start`), and tells the ranks where its plan will be
(``HPCSTAGGER_LAUNCHER_PLAN``: ``<pid>:<path>``, written with ``--ahead PATH``: the request and the
plan). :func:`plan_apart` takes that plan when the request it would make is the same, to the
bit; otherwise (the cache changed, a job reported a calibration, the process failed) it plans
as above, and logs why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hpcstagger import _io, config
from hpcstagger.cache._fs import alive  # a zombie has ended
from hpcstagger.spec import runenv
from hpcstagger.spec.jobspec import Spec
from hpcstagger.stagger.delays import plan_run
from hpcstagger.stagger.runplan import PlanInputs, RunPlan

__all__ = ["plan_apart", "plan_request", "CHILD_TIMEOUT"]

log = logging.getLogger(__name__)

CHILD_TIMEOUT = 120.0  # seconds the planning process may take before this one plans itself
_POLL = 0.01  # seconds between looks for the launcher's plan


def plan_request(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
                 mode: str, inputs: PlanInputs) -> dict[str, Any] | None:
    """What the planning process is given (JSON-able), or None when planning apart does not apply:
    no spec file, nothing to plan (no scenario, nothing learned), or the ``plan_apart`` knob off."""
    if (spec is None or not spec.path or not (spec.plan.scenario or inputs.learned)
            or not config.get("plan_apart")):
        return None
    request = {"spec": spec.path, "order": list(order), "mode": mode,
               "calibrations": {k: dict(v) for k, v in calibrations.items()},
               "inputs": dataclasses.asdict(inputs)}
    return json.loads(json.dumps(request))  # as it reads back: the launcher's copy compares equal


def plan_apart(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
               mode: str, inputs: PlanInputs) -> RunPlan:
    """:func:`~hpcstagger.stagger.delays.plan_run` in a child interpreter (see the module), or the
    launcher's plan made ahead for the same request, or here when there is no spec file to give
    it, nothing to plan, the ``plan_apart`` knob is off, or the child fails."""
    try:
        request = plan_request(spec, order, calibrations, mode, inputs)
    except (TypeError, ValueError) as exc:
        log.info("planning here: the plan's inputs are not JSON (%s)", exc)
        return plan_run(spec, order, calibrations, mode, inputs)
    if request is None:
        return plan_run(spec, order, calibrations, mode, inputs)
    ahead = _ahead(request, os.environ.get(runenv.PLAN_AHEAD, ""))
    if ahead is not None:
        return ahead
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "MPIR_", "HYDRA_"))}
    env["HPCSTAGGER_MPI"] = "0"
    try:
        proc = subprocess.run([sys.executable, "-m", "hpcstagger.stagger.planproc"], input=json.dumps(request),
                              capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT)
        if proc.returncode == 0:
            return RunPlan.from_dict(json.loads(proc.stdout))
        why = f"exit status {proc.returncode}: {proc.stderr.strip()[-500:]}"
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    log.warning("the planning process failed (%s); planning in this process", why)
    return plan_run(spec, order, calibrations, mode, inputs)


def _ahead(request: Mapping[str, Any], where: str) -> RunPlan | None:
    """The plan the launcher's planning process made (``where``: ``<pid>:<path>``) for ``request``,
    waiting while it plans; None without one, or when it was made for another request or failed."""
    pid_text, _, path = where.partition(":")
    if not path or not pid_text.isdigit():
        return None
    pid, until = int(pid_text), time.monotonic() + CHILD_TIMEOUT
    while not os.path.exists(path) and alive(pid, 0) and time.monotonic() < until:
        time.sleep(_POLL)
    try:
        with open(path) as f:
            made = json.load(f)
    except (OSError, ValueError) as exc:
        log.info("planning here: the launcher's plan is not there (%s)", exc)
        return None
    if made.get("request") != request:
        differ = sorted(k for k in set(request) | set(made.get("request") or {})
                        if request.get(k) != (made.get("request") or {}).get(k))
        log.info("planning here: the launcher planned for other inputs (%s differ)", ", ".join(differ))
        return None
    if "plan" not in made:
        log.info("planning here: the launcher's planning failed (%s)", made.get("error"))
        return None
    try:
        return RunPlan.from_dict({**made["plan"], "planned_ahead": True})
    except Exception as exc:  # a plan this version cannot read: plan again
        log.info("planning here: the launcher's plan cannot be read (%s)", exc)
        return None


def _plan(request: Mapping[str, Any]) -> RunPlan:
    inputs = PlanInputs(**request["inputs"])
    return plan_run(Spec.from_toml(request["spec"]), request["order"], request["calibrations"], request["mode"],
                    inputs)


def _main(argv: Sequence[str]) -> int:
    request = json.load(sys.stdin)
    if len(argv) == 2 and argv[0] == "--ahead":  # the launcher's: request and plan (or error) to a file
        try:
            made: dict[str, Any] = {"request": request, "plan": _plan(request).to_dict()}
        except Exception as exc:  # the ranks plan themselves, and see why in their log
            made = {"request": request, "error": f"{type(exc).__name__}: {exc}"}
        _io.atomic_write(argv[1], json.dumps(made).encode(), durable=False)
        return 0
    json.dump(_plan(request).to_dict(), sys.stdout)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sys.exit(_main(sys.argv[1:]))
