"""Relaxation of the fluid model's fixed-point iterations (private to :mod:`hpcstagger.model`).

The rates of a state are the fixed point of a map (each job's read bandwidth, and with cores its
CPU speeds, from the others'). Iterating ``x <- x + d * (g(x) - x)`` converges at a rate set by
the map's slope: an oscillating map needs a short step ``d``, a map that creeps towards its
point in one direction (its slope near 1) needs a long one. :class:`Relax` tells the two apart
by the direction of successive steps: a turn halves ``d``; a steady creep estimates the slope
from how much the change shrank (a secant in the largest change) and takes the step that would
land on the point, within bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# the step's bounds: halving stops at LOW, a creep is stretched at most to HIGH
LOW, HIGH = 0.25, 16.0


class Relax:
    """The step factor ``d`` of one fixed-point iteration (see the module docstring)."""

    def __init__(self) -> None:
        self.damp = 1.0
        self.last = math.inf
        self.prev: Sequence[float] = ()

    def update(self, change: float, steps: Sequence[float]) -> float:
        """The factor for this iteration's ``steps`` (each ``g(x) - x``, relative to ``x``) whose
        largest size is ``change``."""
        turned = len(steps) == len(self.prev) and sum(a * b for a, b in zip(steps, self.prev, strict=True)) < 0
        if turned or change > self.last:  # oscillating, or growing: shorter steps
            self.damp = max(LOW, self.damp * 0.5)
        elif change > 0.5 * self.last:  # a steady creep: the step that lands on the point
            shrink = change / self.last  # = 1 - d (1 - slope) for a linear map
            self.damp = min(HIGH, max(self.damp, self.damp / (1.0 - shrink)))
        self.last, self.prev = change, list(steps)
        if self.damp > 1.0 and change > 0.0:  # a stretched step moves nothing by more than half
            return max(1.0, min(self.damp, 0.5 / change))
        return self.damp
