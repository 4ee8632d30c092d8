"""The closed loop's records: release groups, the plan's ``steer`` entry, the watcher's looks at a
run, its release decisions, and the bounds and pace of steering (plain data, shared by the planner,
the watcher and the waiting ranks; re-exported by :mod:`hpcstagger.stagger.steering`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

__all__ = ["Decision", "Look", "SteerLimits", "release_groups", "steer_record"]

LOOK = 0.25  # seconds between the watcher's looks at the run


def release_groups(delays: Mapping[str, float], order: Sequence[str]) -> list[list[str]]:
    """Jobs grouped by planned delay, earliest first (spec order within a group)."""
    by: dict[float, list[str]] = {}
    for name in order:
        by.setdefault(round(float(delays[name]), 9), []).append(name)
    return [by[d] for d in sorted(by)]


def steer_record(delays: Mapping[str, float], order: Sequence[str], *, lo: float, hi: float | None, horizon: float,
                 interval: float, observe_only: bool = False, min_gain: float = 0.0,
                 prior: Mapping[str, float] | None = None, guard: str | None = None,
                 park: Sequence[str] = ()) -> dict[str, Any] | None:
    """The plan's ``steer`` entry, or None when no job waits (pure).

    It holds the release ``groups``, the ``host`` (world rank of the leader of the last group's
    first job; None until every rank knows the ranks: :func:`set_host`), the bounds, and ``latest``:
    each waiting job's latest possible release (seconds after time zero), which the watcher keeps
    to: ``min(max_delay, planned + horizon)``, and at least ``min_delay``. With ``observe_only``
    the watcher fits and records but releases at the planned delays (``[plan] steer = false``).
    ``min_gain`` is the least predicted gain (fraction of the makespan) that moves a release off
    the plan's delay (the ``steer_min_gain`` knob). ``prior`` and ``guard``, for a guarded plan: the
    delays the model chose (the ``delays`` hold jobs past them until the run gives evidence) and why;
    ``park``, the held jobs that wait at their first batch, whose ``delays`` and ``prior`` are when
    their loop may begin (:mod:`~hpcstagger.stagger.guard`)."""
    groups = release_groups(delays, order)
    if len(groups) < 2:
        return None
    latest = {}
    for g in groups[1:]:
        planned = float(delays[g[0]])
        last = planned + horizon if hi is None else min(hi, planned + horizon)
        latest.update({n: max(last, lo) for n in g})
    return {"groups": groups, "host": None, "min_delay": lo, "max_delay": hi, "horizon": horizon,
            "interval": interval, "latest": latest, "observe_only": bool(observe_only),
            "min_gain": float(min_gain),
            **({"prior": {n: float(prior[n]) for n in order}, "guard": guard} if prior is not None else {}),
            **({"park": list(park)} if park else {})}


@dataclass(frozen=True)
class SteerLimits:
    """The bounds and the pace of steering: every release falls in [``lo``, ``hi``] seconds after time
    zero and no later than ``horizon`` after its planned delay (default: twice the plan's span, at
    least 10 s); the watcher re-fits every ``interval`` seconds and looks every ``look``; with
    ``observe_only`` it fits and records but releases at the planned delays; ``min_gain`` is the
    least predicted gain (fraction of the makespan) that moves a release off the plan; ``duty``,
    when > 0, is the most of one core the re-fits take on average: after a re-fit that cost ``c``
    CPU seconds the next comes ``c / duty`` seconds later at the soonest (a slow model re-fits
    less often; on a node whose cores the jobs keep busy, the watcher's CPU time is theirs)."""

    lo: float = 0.0
    hi: float = math.inf
    interval: float = 1.0
    horizon: float | None = None
    look: float = LOOK
    observe_only: bool = False
    min_gain: float = 0.0
    duty: float = 0.0


@dataclass
class Look:
    """One look at the run, ``t`` seconds after its time zero.

    ``read_bytes``/``read_seconds``: the cache's source-read counters (None without a cache);
    ``flight``: the cache's seconds with 1, 2, ... source reads in flight (None without one);
    ``device_bytes``: the bytes the kernel has read from the dataset's block device (None where it is
    not counted, :mod:`~hpcstagger.colocated.devreads`);
    ``progress``: each started job's latest progress record (:mod:`~hpcstagger.colocated.progress`); ``state``: each
    started job leader's status (``started``, ``done``, ...)."""

    t: float
    read_bytes: float | None = None
    read_seconds: float | None = None
    flight: list[float] | None = None
    device_bytes: float | None = None
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)


@dataclass
class Decision:
    """A release: the jobs, when (seconds since time zero), why, and what the model said then."""

    jobs: list[str]
    at: float
    planned: float
    reason: str
    predicted: float | None = None
    fit: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """As plain JSON-able types."""
        return {"jobs": list(self.jobs), "at": self.at, "planned": self.planned, "reason": self.reason,
                "predicted": self.predicted, "fit": dict(self.fit)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """The release of :meth:`to_dict`'s output (a status file's ``release``, a release message);
        a part it lacks takes its default (a release recorded without a fit, or by an older version)."""
        predicted = data.get("predicted")
        return cls(jobs=[str(j) for j in data.get("jobs") or []], at=float(data.get("at") or 0.0),
                   planned=float(data.get("planned") or 0.0), reason=str(data.get("reason") or ""),
                   predicted=None if predicted is None else float(predicted), fit=dict(data.get("fit") or {}))
