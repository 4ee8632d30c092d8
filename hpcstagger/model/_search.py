"""The planner's search tools (private to :mod:`hpcstagger.model`): a cached evaluator of delay
vectors that resumes runs from shared prefixes, a bounded scalar minimiser (Brent's method), and
a grid-then-Brent line search.

The minimiser is written here rather than taken from scipy: importing ``scipy.optimize`` costs
about 0.3 s of CPU, more than the planner's whole search budget, and the planner runs while the
jobs it plans for start on the same cores."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from hpcstagger.model import _engine, _quality
from hpcstagger.model.scenario import Scenario

__all__ = ["CUTOFF", "Evaluator", "grid", "line_search", "minimize_bounded"]

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


_GOLD = (3.0 - math.sqrt(5.0)) / 2.0  # the golden section's smaller part
_SQRT_EPS = math.sqrt(2.2e-16)


def minimize_bounded(f: Callable[[float], float], lo: float, hi: float, xatol: float,
                     max_evals: int) -> tuple[float, float]:
    """A local minimum of f on [lo, hi] by Brent's method (golden sections, with a parabola through
    the last three points where it falls safely inside): at most ``max_evals`` calls of f, until the
    bracket is within about ``xatol`` of the best point. Returns that point and f there."""
    if not hi > lo or max_evals < 1:
        raise ValueError(f"minimize_bounded needs lo < hi and max_evals >= 1, got [{lo}, {hi}], {max_evals}")
    a, b = lo, hi
    x = w = v = a + _GOLD * (b - a)
    fx = fw = fv = f(x)
    d = e = 0.0
    for _ in range(max_evals - 1):
        mid = 0.5 * (a + b)
        tol1 = _SQRT_EPS * abs(x) + xatol / 3.0
        tol2 = 2.0 * tol1
        if abs(x - mid) <= tol2 - 0.5 * (b - a):
            break
        step = None
        if abs(e) > tol1:  # the parabola through x, w and v
            r = (x - w) * (fx - fv)
            q = (x - v) * (fx - fw)
            p = (x - v) * q - (x - w) * r
            q = 2.0 * (q - r)
            if q > 0.0:
                p = -p
            q = abs(q)
            last, e = e, d
            if abs(p) < abs(0.5 * q * last) and q * (a - x) < p < q * (b - x):
                step = p / q
                if (x + step) - a < tol2 or b - (x + step) < tol2:
                    step = tol1 if x < mid else -tol1
        if step is None:  # a golden section of the larger part
            e = (b - x) if x < mid else (a - x)
            step = _GOLD * e
        d = step
        u = x + (step if abs(step) >= tol1 else math.copysign(tol1, step))
        fu = f(u)
        if fu <= fx:
            if u < x:
                b = x
            else:
                a = x
            v, fv, w, fw, x, fx = w, fw, x, fx, u, fu
        else:
            if u < x:
                a = u
            else:
                b = u
            if fu <= fw or w == x:
                v, fv, w, fw = w, fw, u, fu
            elif fu <= fv or v == x or v == w:
                v, fv = u, fu
    return x, fx


def line_search(f: Callable[[float], float], lo: float, hi: float, current: float, f_current: float,
                 points: int, refine_iter: int) -> tuple[float, float, list[tuple[float, float]]]:
    """Minimise f over [lo, hi]: a grid (denser near ``lo``), then bounded Brent around the best."""
    xs = sorted({lo, current, *(lo + g for g in grid(hi - lo, points))})
    vals = [f_current if x == current else f(x) for x in xs]
    k = min(range(len(xs)), key=lambda i: (vals[i], xs[i]))
    best_x, best_v = xs[k], vals[k]
    a = xs[k - 1] if k > 0 else xs[k]
    b = xs[k + 1] if k + 1 < len(xs) else xs[k]
    if b - a > 1e-9 * max(1.0, hi) and refine_iter > 0:
        x, fx = minimize_bounded(f, a, b, 1e-4 * (hi - lo) + 1e-9, refine_iter)
        if fx < best_v:
            best_x, best_v = x, fx
    return best_x, best_v, list(zip(xs, vals, strict=True))
