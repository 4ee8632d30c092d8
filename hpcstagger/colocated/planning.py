"""Planning a co-located run: the delays for a mode, and what the model predicts (pure).

World rank 0 of :func:`hpcstagger.init` calls :func:`plan_delays` with every job leader's
calibration; nothing here reads the environment or talks to other ranks, so it is tested as a
plain function.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from .spec import PLAN_MODES, PLAN_MODES_IN_WORLD, Spec

__all__ = ["plan_delays", "scenario_for"]


def _needs_scenario() -> ConfigError:
    return ConfigError("plan mode 'plan' needs a calibrated scenario: run 'hpcstagger calibrate' and set "
                       "[plan] scenario in the spec, or choose mode 'simultaneous' or 'fixed'")


def plan_delays(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
                mode: str, *, fixed: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The delays for ``mode`` (world rank 0 calls this), and what the model predicts when it can.

    ``order`` lists the jobs in spec order; ``calibrations`` maps a job to what its leader
    measured (``sample_time``, optionally ``miss_overhead``); ``fixed`` gives mode "fixed" its
    delays (default: the spec's ``[plan] delays``).

    With a calibrated scenario (``[plan] scenario``), every mode also reports the predicted
    makespan of its delays and of the plan, a simultaneous start and sequential runs
    (``predicted``), and the scenario it used, with each job's own calibration in it
    (``scenario``).
    """
    if mode not in PLAN_MODES_IN_WORLD:
        if mode == "sequential":
            raise ConfigError("plan mode 'sequential' runs the jobs one after another, each in its own launch: "
                              "use 'hpcstagger launch --mode sequential' (or the rendered Slurm script), not "
                              "one MPI world")
        raise ConfigError(f"plan mode must be one of {', '.join(PLAN_MODES)}, not {mode!r}")
    delays = {n: 0.0 for n in order}
    if mode == "fixed":
        if fixed is None:
            fixed = dict(spec.plan.delays) if spec else {}
        unknown = sorted(set(fixed) - set(order))
        if unknown:
            raise ConfigError(f"fixed delays name unknown job(s) {', '.join(unknown)}; jobs: {', '.join(order)}")
        delays = {n: float(fixed.get(n, 0.0)) for n in order}
    out: dict[str, Any] = {"mode": mode, "delays": delays,
                           "calibrations": {n: dict(c) for n, c in calibrations.items()}}
    if spec is None or not spec.plan.scenario:
        if mode == "plan" and len(order) > 1:
            raise _needs_scenario()
        return out
    from ..model import optimal_plan, predict

    scenario = scenario_for(spec, order, calibrations)
    p = optimal_plan(scenario, max_delay=spec.plan.max_delay)
    if mode == "plan":
        out["delays"] = {n: float(p.delays.get(n, 0.0)) for n in order}
    out["predicted"] = {"plan": float(p.makespan), "simultaneous": float(p.simultaneous),
                        "sequential": float(p.sequential),
                        mode: float(p.makespan) if mode == "plan" else float(predict(scenario, out["delays"]).makespan)}
    out["scenario"] = scenario.to_dict()
    out["curve"] = p.to_dict()["curve"]
    return out


def scenario_for(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]]) -> Any:
    """The scenario to plan with: the spec's calibrated scenario file, with each job's epochs from
    the spec and its sample time from the job's own calibration when it sent one.

    A job's calibration may also report ``miss_overhead``: seconds each read that goes to the source
    costs the job beyond the source's own time (its cache insert, its loader's work). The source is
    then planned with the bandwidth the jobs actually see: with ``k`` readers each read of ``S``
    bytes takes ``S * k / bandwidth[k-1] + overhead``, the mean of the reported overheads.
    """
    from ..model import Scenario

    if spec is None or not spec.plan.scenario:
        raise _needs_scenario()
    base = Scenario.from_toml(spec.plan.scenario).to_dict()
    known = {j["name"]: j for j in base.get("job", [])}
    jobs = []
    for name in order:
        entry = dict(known.get(name, {}))
        js = spec.job(name)
        entry["name"] = name
        entry["epochs"] = js.epochs
        measured = calibrations.get(name, {}).get("sample_time")
        sample_time = measured or js.sample_time or entry.get("sample_time")
        if not sample_time:
            raise ConfigError(f"no sample_time for job {name!r}: the scenario {spec.plan.scenario} lacks it, the spec "
                              "gives none, and the job sent no calibration")
        entry["sample_time"] = float(sample_time)
        jobs.append(entry)
    base["job"] = jobs
    overheads = [float(c["miss_overhead"]) for c in calibrations.values() if c.get("miss_overhead", 0) > 0]
    if overheads:
        o = sum(overheads) / len(overheads)
        size = float(base["dataset"]["sample_bytes"])
        base["storage"]["bandwidth"] = [k * size / (k * size / float(b) + o)
                                        for k, b in enumerate(base["storage"]["bandwidth"], start=1)]
    return Scenario.from_dict(base)
