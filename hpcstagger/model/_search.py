"""The planner's search tools (private to :mod:`hpcstagger.model`): a cached evaluator of delay
vectors that resumes runs from shared prefixes, and a grid-then-Brent line search."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from hpcstagger.model import _engine, _quality
from hpcstagger.model.scenario import Scenario

__all__ = ["CUTOFF", "Evaluator", "grid", "line_search"]

# A search run stops once it passes the best makespan so far by this fraction (it cannot win).
CUTOFF = 0.05


class Evaluator:
    """Predicted makespan of delay vectors, cached, resuming runs from shared prefixes."""

    def __init__(self, sc: Scenario, quality: _quality.Quality, keep_runs: int = 6):
        self.engine = _engine.Engine(sc, quality)
        self.cache: dict[tuple[float, ...], tuple[float, list[float]]] = {}
        self.runs: list[tuple[list[float], list[_engine.Snapshot]]] = []
        self.keep_runs = keep_runs
        self.count = 0
        self.best = math.inf  # best makespan seen: runs that pass it (plus cutoff) stop early
        self.cutoff = CUTOFF

    def _resume_point(self, d: list[float]) -> tuple[_engine.Snapshot | None, list[_engine.Snapshot]]:
        best: _engine.Snapshot | None = None
        best_prefix: list[_engine.Snapshot] = []
        for delays, snaps in self.runs:
            diff = [min(a, b) for a, b in zip(d, delays, strict=True) if a != b]
            bound = min(diff) if diff else math.inf
            # the last snapshot strictly before the first start time that differs
            k = bisect.bisect_left([s.t for s in snaps], bound) - 1
            if k >= 0 and (best is None or snaps[k].t > best.t):
                best, best_prefix = snaps[k], snaps[:k]
        return best, best_prefix

    def finish(self, d: list[float]) -> tuple[float, list[float]]:
        """Makespan and finish times of delays ``d``. A run that passes ``self.best`` times
        ``1 + cutoff`` stops there (it cannot win) and reports that time as its makespan."""
        key = tuple(d)
        hit = self.cache.get(key)
        if hit is not None and (math.isfinite(max(hit[1])) or hit[0] >= self.best * (1.0 + self.cutoff)):
            return hit
        snap, prefix = self._resume_point(d)
        keep: list[_engine.Snapshot] = []
        stop = self.best * (1.0 + self.cutoff)
        finish = self.engine.run(d, resume=snap, keep=keep, stop=stop)
        self.count += 1
        self.runs.append((list(d), prefix + keep))
        if len(self.runs) > self.keep_runs:
            self.runs.pop(0)
        makespan = max(finish)
        if not math.isfinite(makespan):
            makespan = max(stop, self.engine.t)  # a lower bound: good enough to rank it last
        elif makespan < self.best:
            self.best = makespan
        out = (makespan, finish)
        self.cache[key] = out
        return out

    def __call__(self, d: list[float]) -> float:
        return self.finish(d)[0]


def grid(upper: float, points: int) -> list[float]:
    """``points`` values in (0, upper], denser near 0 (quadratic spacing)."""
    return [upper * (k / points) ** 2 for k in range(1, points + 1)]


def line_search(f: Callable[[float], float], lo: float, hi: float, current: float, f_current: float,
                 points: int, refine_iter: int) -> tuple[float, float, list[tuple[float, float]]]:
    """Minimise f over [lo, hi]: a grid (denser near ``lo``), then bounded Brent around the best."""
    from scipy.optimize import minimize_scalar

    xs = sorted({lo, current, *(lo + g for g in grid(hi - lo, points))})
    vals = [f_current if x == current else f(x) for x in xs]
    k = min(range(len(xs)), key=lambda i: (vals[i], xs[i]))
    best_x, best_v = xs[k], vals[k]
    a = xs[k - 1] if k > 0 else xs[k]
    b = xs[k + 1] if k + 1 < len(xs) else xs[k]
    if b - a > 1e-9 * max(1.0, hi) and refine_iter > 0:
        res = minimize_scalar(f, bounds=(a, b), method="bounded",
                              options={"xatol": 1e-4 * (hi - lo) + 1e-9, "maxiter": refine_iter})
        if float(res.fun) < best_v:
            best_x, best_v = float(res.x), float(res.fun)
    return best_x, best_v, list(zip(xs, vals, strict=True))
