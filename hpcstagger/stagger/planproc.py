"""World rank 0 plans in a process of its own, so that the planner's memory leaves with it.

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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from hpcstagger import config
from hpcstagger.spec.jobspec import Spec
from hpcstagger.stagger.delays import plan_run
from hpcstagger.stagger.runplan import PlanInputs, RunPlan

__all__ = ["plan_apart", "CHILD_TIMEOUT"]

log = logging.getLogger(__name__)

CHILD_TIMEOUT = 120.0  # seconds the planning process may take before this one plans itself


def plan_apart(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
               mode: str, inputs: PlanInputs) -> RunPlan:
    """:func:`~hpcstagger.stagger.delays.plan_run` in a child interpreter (see the module), or here
    when there is no spec file to give it, nothing to plan, the ``plan_apart`` knob is off, or the
    child fails."""
    if (spec is None or not spec.path or not (spec.plan.scenario or inputs.learned)
            or not config.get("plan_apart")):
        return plan_run(spec, order, calibrations, mode, inputs)
    try:
        request = json.dumps({"spec": spec.path, "order": list(order), "mode": mode,
                              "calibrations": {k: dict(v) for k, v in calibrations.items()},
                              "inputs": dataclasses.asdict(inputs)})
    except (TypeError, ValueError) as exc:
        log.info("planning here: the plan's inputs are not JSON (%s)", exc)
        return plan_run(spec, order, calibrations, mode, inputs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "MPIR_", "HYDRA_"))}
    env["HPCSTAGGER_MPI"] = "0"
    try:
        proc = subprocess.run([sys.executable, "-m", "hpcstagger.stagger.planproc"], input=request,
                              capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT)
        if proc.returncode == 0:
            return RunPlan.from_dict(json.loads(proc.stdout))
        why = f"exit status {proc.returncode}: {proc.stderr.strip()[-500:]}"
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    log.warning("the planning process failed (%s); planning in this process", why)
    return plan_run(spec, order, calibrations, mode, inputs)


def _main() -> int:
    request = json.load(sys.stdin)
    inputs = PlanInputs(**request["inputs"])
    plan = plan_run(Spec.from_toml(request["spec"]), request["order"], request["calibrations"], request["mode"],
                    inputs)
    json.dump(plan.to_dict(), sys.stdout)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sys.exit(_main())
