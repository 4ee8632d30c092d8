"""The plan of a co-located run, typed: what planning decides and the coordinator sends every rank.

:class:`PlanInputs` holds what world rank 0 knows besides the spec, the jobs and their
calibrations when it plans (the cache's state, the history of earlier runs, what was learned,
the partition). :class:`RunPlan` is the decision. Planning
(:func:`hpcstagger.stagger.delays.plan_run`) returns one; the coordinator sends
:meth:`RunPlan.to_dict` over the wire and every rank rebuilds it with :meth:`RunPlan.from_dict`;
each rank's status file holds the same dictionary, which ``hpcstagger launch`` and ``status`` read.
The dictionary form omits the parts a plan does not have (``None``), so plans written by earlier
versions read back the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any
from collections.abc import Mapping

from hpcstagger.errors import ConfigError

__all__ = ["PlanInputs", "RunPlan"]


@dataclass(frozen=True)
class PlanInputs:
    """What world rank 0 plans from, besides the spec, the jobs in spec order and their calibrations.

    - ``fixed``: mode "fixed"'s delays (default: the spec's ``[plan] delays``);
    - ``cache_state``: what the shared cache holds as the run starts (``entries``, ``bytes``), or None;
    - ``steer_interval``, ``steer_min_gain``: the watcher's period, and the least predicted gain
      (fraction of the makespan) that moves a release off the plan;
    - ``history``: the corrections earlier runs measured (:func:`hpcstagger.stagger.history.plan_history`);
    - ``learned``: what learning resolved for a spec without a scenario
      (:func:`hpcstagger.stagger.learning.resolve`);
    - ``partition``: the run's partitioned cache (``nodes``, ``remote_bandwidth``), or None.
    """

    fixed: Mapping[str, float] | None = None
    cache_state: Mapping[str, Any] | None = None
    steer_interval: float = 1.0
    steer_min_gain: float = 0.0
    history: Mapping[str, Any] | None = None
    learned: Mapping[str, Any] | None = None
    partition: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RunPlan:
    """The decision for one run: each job's delay, and what the model predicted and why.

    Always present: ``mode``, ``delays`` (job -> seconds after time zero, every job of the run) and
    ``calibrations`` (job -> what its leader measured). The rest is there when the plan has it:
    ``predicted`` (makespan per mode, with a scenario), ``scenario`` and ``curve`` (the scenario the
    plan used and its predicted makespan over staggers), ``jitter`` (the start-time spread it was
    made for), ``steer`` (the closed loop's record: release groups, host, bounds), ``cache`` (the
    shared cache at the start), ``partition``, ``history``, ``learn``, ``loader_groups`` (jobs
    planned as one because they share a loader), ``simulated`` (the sample-level simulator's
    makespans of the model's stagger and of a simultaneous start, where it replayed them:
    :attr:`hpcstagger.model.Plan.simulated`), ``simultaneous_reason`` (why every job starts at
    once), ``run_id`` (names what the run's processes share, such as the dataset's listing) and
    ``planned_ahead`` (True: the launcher's planning process made it while the ranks started).
    """

    mode: str
    delays: dict[str, float]
    calibrations: dict[str, dict[str, float]] = field(default_factory=dict)
    predicted: dict[str, float] | None = None
    scenario: dict[str, Any] | None = None
    curve: dict[str, Any] | None = None
    jitter: float | None = None
    steer: dict[str, Any] | None = None
    cache: dict[str, Any] | None = None
    partition: dict[str, Any] | None = None
    history: dict[str, Any] | None = None
    learn: dict[str, Any] | None = None
    loader_groups: dict[str, Any] | None = None
    simulated: dict[str, float] | None = None
    simultaneous_reason: str | None = None
    run_id: str | None = None
    planned_ahead: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-able values, without the parts it does not have."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunPlan:
        """The plan of :meth:`to_dict`'s output. Raises ConfigError naming a missing or unknown part."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown or "mode" not in data or "delays" not in data:
            what = f"unknown parts {unknown}" if unknown else "no 'mode' or no 'delays'"
            raise ConfigError(f"not a run plan: {what} (a plan has {sorted(names)}); was it written by another "
                              f"version of hpcstagger?")
        return cls(**data)

    def with_run_id(self, run_id: str) -> RunPlan:
        """This plan, naming its run ``run_id``."""
        return replace(self, run_id=run_id)
