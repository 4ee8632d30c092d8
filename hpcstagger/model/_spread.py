"""The start-time spread of a plan (private to :mod:`hpcstagger.model`; see :mod:`.plan`).

A job's real start strays from its planned delay by its start-up's run-to-run variation. With a
jitter J > 0 the planner weighs the mean predicted makespan over each job's start moved by up
to J either way: for 2 jobs the stagger at -J, -J/2, 0, J/2 and J (the nonzero ones twice, one
job or the other moved), which it minimises; for more jobs each job's start at -J and +J, with
which it checks the plan against a simultaneous start.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable

from hpcstagger.errors import ConfigError
from hpcstagger.model.scenario import Scenario
from hpcstagger import config


def start_jitter(scenario: Scenario, jitter: float | None = None) -> float:
    """Seconds a job's real start may stray from its planned delay: ``jitter`` when given, else
    the ``plan_jitter`` knob times the jobs' mean start-up. ConfigError for a bad value."""
    if jitter is None:
        frac = float(config.get("plan_jitter"))
        if not (math.isfinite(frac) and frac >= 0):
            raise ConfigError(f"the plan_jitter knob must be a fraction >= 0, got {frac!r}")
        jobs = scenario.jobs
        return frac * sum(j.startup for j in jobs) / len(jobs) if jobs else 0.0
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not (math.isfinite(jitter)
                                                                              and jitter >= 0):
        raise ConfigError(f"jitter must be a finite number of seconds >= 0, got {jitter!r}")
    return float(jitter)


# The start-time spread's points, in units of the jitter (see Spread): 2 jobs get five staggers,
# more jobs each job's start at both ends (2 J + 1 runs a point).
OFFSETS_TWO = (-1.0, -0.5, 0.5, 1.0)
OFFSETS_MANY = (-1.0, 1.0)


class Spread:
    """The mean predicted makespan over a plan's start-time spread (see the module docstring):
    the delays with one job's start moved by ``jitter * u``, for each job and each u in
    ``offsets``, and the delays themselves; each set shifted so that its first start is 0."""

    def __init__(self, ev: Any, jitter: float, offsets: tuple[float, ...]):
        self.ev, self.jitter, self.offsets = ev, jitter, offsets

    def points(self, d: list[float]) -> list[list[float]]:
        out = [list(d)]
        for j in range(len(d)):
            for u in self.offsets:
                moved = list(d)
                moved[j] += u * self.jitter
                low = min(moved)
                out.append([x - low for x in moved])
        return out

    def __call__(self, d: list[float]) -> float:
        if self.jitter <= 0.0:
            return self.ev(d)
        cutoff, self.ev.cutoff = self.ev.cutoff, math.inf  # a mean needs every run to its end
        try:
            vals = [self.ev(p) for p in self.points(d)]
        finally:
            self.ev.cutoff = cutoff
        return sum(vals) / len(vals)


def robust_two(spread: Spread, delays: Callable[[float], list[float]], xs: list[float], vals: list[float],
                lo: float, hi: float) -> tuple[float, float]:
    """The stagger in [lo, hi] with the least mean makespan over the start-time spread, and that
    mean: the grid's three best by the curve interpolated, and 0, checked by the model, then a
    pattern search around the best with steps of a half, a quarter and an eighth of the jitter."""
    import numpy as np

    J = spread.jitter
    offsets = [u * J for u in spread.offsets]

    def approx(x: float) -> float:  # the spread's staggers: x once, x + each offset twice
        around = np.interp([x + o for o in offsets], xs, vals)
        return (float(np.interp(x, xs, vals)) + 2.0 * float(around.sum())) / (1 + 2 * len(offsets))

    def g(x: float) -> float:
        return spread(delays(x))

    ranked = sorted(xs, key=lambda x: (approx(x), abs(x)))[:3]
    best, _, best_s = min((g(x), abs(x), x) for x in {0.0, *ranked})
    step = J / 2
    for _ in range(3):
        for x in (best_s - step, best_s + step):
            if lo <= x <= hi:
                v = g(x)
                if v < best:
                    best_s, best = x, v
        step /= 2
    return best_s, best
