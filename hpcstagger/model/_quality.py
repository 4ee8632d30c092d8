"""How finely the fluid model's engine steps through time: its step and fixed-point tolerances.

Kept apart from the engine (:mod:`hpcstagger.model._engine`) so that the cache state it steps
(:mod:`hpcstagger.model._cachestate`) can name it without importing the engine.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Quality", "FINE", "COARSE", "SEARCH"]


class Quality(NamedTuple):
    """Integration settings. A step covers between ``min_step`` and ``max_step`` of an epoch of the
    fastest job and shrinks when a job's time per sample moves by more than ``step_tol`` (relative
    to its time per sample if it missed everything alone) over half a step. The bandwidth fixed
    point stops when no job's bandwidth moves by more than ``fixed_point_tol`` (relative)."""

    step_tol: float
    min_step: float
    max_step: float
    fixed_point_tol: float
    max_blocks: int = 16


FINE = Quality(step_tol=0.02, min_step=1 / 64, max_step=1 / 6, fixed_point_tol=1e-5, max_blocks=16)
COARSE = Quality(step_tol=0.05, min_step=1 / 48, max_step=1 / 5, fixed_point_tol=1e-4, max_blocks=8)
SEARCH = Quality(step_tol=0.1, min_step=1 / 32, max_step=1 / 3, fixed_point_tol=1e-3, max_blocks=4)
