"""The model's side of closed-loop staggering: fit it to a run in progress, and pick the next start.

While jobs of a co-located run wait for their release, the run's watcher
(:mod:`hpcstagger.stagger.steering`) sees how far each running job has come and how fast the
source reads. Two pure functions serve it:

- :func:`progress_at`: each job's predicted fraction done at time ``t`` for given start times
  (a run of the fluid model stopped at ``t``);
- :func:`fit_scale`: the factor on a job's CPU costs (or any one-parameter family of scenarios)
  under which a predicted measure (the progress over a window) matches the observed one, by
  bisection in log space; 1 when the measure does not depend on it (an I/O-bound job), None when
  it does not fall as the costs grow (a job that follows another through the cache);
- :func:`best_release`: the predicted makespan as a function of when the next group of waiting
  jobs starts (later waiting jobs keep their planned gaps behind it), from ``earliest`` to
  ``latest``, and the best start;
- :func:`source_factor` and :func:`counted_factor`: the factor on the source's curve that explains
  the bytes the jobs' reads got, from the mean number of reads in flight, or from the time spent
  with each number in flight (the shared cache counts that exactly).

Nothing here reads the environment or talks to other processes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence

from hpcstagger.errors import ModelError
from hpcstagger.model import _engine, _quality
from hpcstagger.model._search import CUTOFF, Evaluator, grid
from hpcstagger.model._spread import OFFSETS_TWO
from hpcstagger.model.scenario import Scenario

__all__ = ["Release", "progress_at", "progress_series", "passage_time", "fit_scale", "best_release", "source_factor",
           "counted_factor"]


def progress_at(sc: Scenario, starts: Sequence[float], t: float, *,
                quality: _quality.Quality = _quality.SEARCH) -> list[float]:
    """Each job's predicted fraction of its samples done at time ``t`` (seconds since time zero)
    when job j starts at ``starts[j]`` (``inf``: not started by ``t``). A job's start-up (its
    ``startup``) runs from its start; give a job that has already begun its loop ``startup = 0``
    and its loop's start."""
    return progress_series(sc, starts, [t], quality=quality)[0]


def progress_series(sc: Scenario, starts: Sequence[float], times: Sequence[float], *,
                    quality: _quality.Quality = _quality.SEARCH) -> list[list[float]]:
    """:func:`progress_at` at each of ``times``, from one run of the model."""
    if len(starts) != len(sc.jobs):
        raise ModelError(f"progress_at: {len(starts)} start times for {len(sc.jobs)} jobs")
    times = [float(x) for x in times]
    J = len(sc.jobs)
    end = max(times, default=0.0)
    rows: list[tuple[float, tuple[float, ...]]] = [(0.0, (0.0,) * J)]
    if end > 0:
        eng = _engine.Engine(sc, quality, record=True)
        eng.run([float(s) for s in starts], stop=end)
        # the series has the state at the top of each step; add where the last step ended
        rows += [(r[0], r[1]) for r in eng.series]
        rows.append((eng.t, tuple(min(1.0, eng.done[j] / (eng.epochs[j] * eng.n)) for j in range(J))))
    stamps = [r[0] for r in rows]
    out = []
    for x in times:
        k = bisect.bisect_right(stamps, x)
        if x <= 0:
            out.append([0.0] * J)
        elif k >= len(rows):
            out.append([float(p) for p in rows[-1][1]])
        else:
            (t0, p0), (t1, p1) = rows[k - 1], rows[k]
            w = (x - t0) / (t1 - t0) if t1 > t0 else 1.0
            out.append([float(u + w * (v - u)) for u, v in zip(p0, p1, strict=True)])
    return out


def passage_time(sc: Scenario, starts: Sequence[float], index: int, lo: float, hi: float, horizon: float, *,
                 points: int = 400, quality: _quality.Quality = _quality.SEARCH) -> float:
    """Seconds job ``index`` takes in the model to go from the fraction ``lo`` of its samples done to
    ``hi`` (starts as in :func:`progress_series`), read on ``points`` times up to ``horizon`` seconds
    after time zero (linear between them); ``inf`` when it is not at ``hi`` by then."""
    if not 0 <= lo < hi <= 1:
        raise ModelError(f"passage_time needs 0 <= lo < hi <= 1, got lo={lo}, hi={hi}")
    times = [horizon * k / (points - 1) for k in range(points)]
    done = [p[index] for p in progress_series(sc, starts, times, quality=quality)]

    def reach(f: float) -> float:
        k = bisect.bisect_left(done, f)  # progress never falls
        if k >= len(done):
            return math.inf
        if k == 0 or done[k] <= done[k - 1]:
            return times[k]
        return times[k - 1] + (times[k] - times[k - 1]) * (f - done[k - 1]) / (done[k] - done[k - 1])

    return reach(hi) - reach(lo)


def fit_scale(make: Callable[[float], Scenario], measure: Callable[[Scenario], float], observed: float, *,
              lo: float = 0.25, hi: float = 4.0, iterations: int = 8, flat: float = 0.02,
              probes: int = 0, flat_value: float | None = 1.0) -> float | None:
    """The factor ``a`` in [lo, hi] under which ``measure(make(a))`` equals ``observed``, assuming
    the measure (a job's progress, over a window or since its start) falls as ``a`` grows (``a``
    scales the job's costs).

    Bisection in log space, ``iterations`` halvings (8 give about 1% on [0.25, 4]). Returns
    ``flat_value`` (1.0) when the measure hardly depends on ``a`` (it changes by less than ``flat``
    of itself over [lo, hi]: the job is bound by something else), and ``lo`` or ``hi`` when the
    observation is beyond what the range can explain.

    With ``probes`` the measure is first evaluated at that many more factors, spread evenly in log
    space, and None is returned when it does not fall (by more than ``flat / 2`` of the fastest
    value) from one to the next. That happens when the job follows another through a shared cache:
    slowed down it falls behind and hits more, so its progress over a window can grow with its
    costs, and several factors explain one observation.
    """
    if not (0 < lo <= 1.0 <= hi):
        raise ModelError(f"fit_scale needs 0 < lo <= 1 <= hi, got lo={lo}, hi={hi}")
    fast, slow = measure(make(lo)), measure(make(hi))
    if fast - slow <= flat * max(fast, 1e-12):
        return flat_value
    a_lo, a_hi = math.log(lo), math.log(hi)
    # the measure by log factor: the probes fall on the bisection's first midpoints, run once
    seen = {round(a_lo, 12): fast, round(a_hi, 12): slow}

    def at(log_a: float) -> float:
        key = round(log_a, 12)
        if key not in seen:
            seen[key] = measure(make(math.exp(log_a)))
        return seen[key]

    if probes > 0:
        seq = [fast, *(at(a_lo + (a_hi - a_lo) * k / (probes + 1)) for k in range(1, probes + 1)), slow]
        if any(b > a + 0.5 * flat * fast for a, b in zip(seq[:-1], seq[1:], strict=True)):
            return None
    if observed >= fast:
        return lo
    if observed <= slow:
        return hi
    for _ in range(iterations):
        mid = 0.5 * (a_lo + a_hi)
        if at(mid) > observed:
            a_lo = mid  # still too fast: the job is slower than that
        else:
            a_hi = mid
    return math.exp(0.5 * (a_lo + a_hi))


def _per_read(bandwidth: Sequence[float], n: int) -> float:
    """Bytes/s each of ``n`` concurrent reads gets (the last listed level holds beyond the list)."""
    return float(bandwidth[min(n, len(bandwidth)) - 1]) / n


def source_factor(bandwidth: Sequence[float], fetchers: int, read_bytes: float, read_seconds: float,
                  elapsed: float) -> float | None:
    """The factor on the source's ``bandwidth`` curve (aggregate bytes/s with 1, 2, ... readers)
    that explains ``read_bytes`` read in ``read_seconds`` of read time over ``elapsed`` seconds by
    ``fetchers`` fetchers, or None when there is nothing to go on.

    The mean number of reads in flight is ``read_seconds / elapsed`` (Little's law), and each read
    got ``read_bytes / read_seconds`` bytes/s on average. What a read gets depends on how many others
    it shares the source with, so the factor compares with the mean over the law the model uses
    (processor sharing in product form, :class:`._loader.Sharing`): the fetchers' think time is
    chosen so that the law's mean number in flight is the observed one, and under that law a
    read-second carries ``sum_n p_n n b_n / sum_n p_n n`` bytes (``b_n`` each read's bandwidth
    with n in flight). Scaling the curve by a factor scales that mean by the same factor.
    """
    if read_bytes <= 0 or read_seconds <= 0 or elapsed <= 0 or not bandwidth or fetchers < 1:
        return None
    k = min(read_seconds / elapsed, fetchers * (1 - 1e-9))
    per = [0.0] + [_per_read(bandwidth, n) for n in range(1, fetchers + 1)]
    log_t = [0.0]  # log of the product of read times (1 / per[n]) for n = 1..N
    for n in range(1, fetchers + 1):
        log_t.append(log_t[-1] - math.log(per[n]))

    def law(log_z: float) -> tuple[float, float]:
        logs = [math.lgamma(fetchers + 1) - math.lgamma(n + 1) - math.lgamma(fetchers - n + 1)
                + (fetchers - n) * log_z + log_t[n] for n in range(fetchers + 1)]
        top = max(logs)
        w = [math.exp(v - top) for v in logs]
        total = sum(w)
        busy = sum(n * w[n] for n in range(fetchers + 1))
        return busy / total, sum(n * w[n] * per[n] for n in range(fetchers + 1)) / busy

    lo, hi = -60.0, 60.0  # log think time: more thinking, fewer reads in flight
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if law(mid)[0] > k:
            lo = mid
        else:
            hi = mid
    return (read_bytes / read_seconds) / law(0.5 * (lo + hi))[1]


def counted_factor(bandwidth: Sequence[float], spent: Sequence[float], read_bytes: float,
                   read_seconds: float) -> float | None:
    """The factor on the source's ``bandwidth`` curve (aggregate bytes/s with 1, 2, ... reads in
    flight) that explains ``read_bytes`` read while ``spent[k-1]`` seconds passed with k reads in
    flight: the bytes over what the curve delivers in that time. None when the count covers less
    than half of the ``read_seconds`` the reads took (reads not bracketed, or counted only part of
    the time) or there is nothing to go on."""
    if not bandwidth or read_bytes <= 0 or read_seconds <= 0:
        return None
    if sum(k * max(0.0, t) for k, t in enumerate(spent, 1)) < 0.5 * read_seconds:
        return None
    expected = sum(max(0.0, t) * float(bandwidth[min(k, len(bandwidth)) - 1]) for k, t in enumerate(spent, 1))
    return read_bytes / expected if expected > 0 else None


@dataclass(frozen=True)
class Release:
    """When the next group of waiting jobs should start: ``start`` (seconds since time zero), the
    predicted ``makespan`` then, the predicted makespan ``if_now`` when the group starts at the
    earliest allowed time, and the ``curve`` of (start, makespan) points evaluated. ``optimum`` is
    the best (start, makespan) found; ``start`` differs from it only when a prior was given and a
    start nearer the prior is predicted within ``min_gain`` of it."""

    start: float
    makespan: float
    if_now: float
    curve: tuple[tuple[float, float], ...]
    optimum: tuple[float, float] = (math.nan, math.nan)


def best_release(sc: Scenario, starts: Sequence[float], moving: Mapping[int, float], earliest: float,
                 latest: float, *, points: int = 6, refine: int = 5, prior: float | None = None,
                 min_gain: float = 0.0, jitter: float = 0.0) -> Release:
    """The best start ``s`` in [earliest, latest] of the jobs in ``moving``.

    Job j in ``moving`` starts at ``s + moving[j]`` (0 for the group released next, the planned gap
    for jobs planned to follow it); every other job at ``starts[j]``. The search is a grid denser
    near ``earliest``, then a bounded refinement around the best point, every run resuming from a
    shared prefix of the model's run.

    With a ``prior`` start (the plan's), the start returned is the one nearest the prior (clamped to
    the range) among those predicted within ``min_gain`` (a fraction) of the best: a move away from
    the prior must be predicted to gain more than that.

    With ``jitter`` J > 0 (the plan's start-time spread, :mod:`.plan`) starts are compared by their
    mean predicted makespan over the start moved by -J, -J/2, 0, J/2 and J (the curve interpolated
    between the points evaluated, two of them before ``earliest``), as the plan compared staggers:
    a start on the edge of a cliff in the curve loses more often than it wins. The makespans
    reported are the ones at the starts themselves.
    """
    J = len(sc.jobs)
    if len(starts) != J or not moving or any(not 0 <= j < J for j in moving):
        raise ModelError("best_release: starts must give every job and moving must name some of them")
    latest = max(latest, earliest)
    ev = Evaluator(sc, _quality.SEARCH)

    def delays(s: float) -> list[float]:
        return [s + moving[j] if j in moving else float(starts[j]) for j in range(J)]

    def f(s: float) -> float:
        return ev(delays(s))

    if_now = f(earliest)
    if latest - earliest <= 1e-9:
        return Release(earliest, if_now, if_now, ((earliest, if_now),), (earliest, if_now))
    ev.cutoff = CUTOFF  # runs that pass the best so far by 5% stop there: they cannot win
    xs = [earliest] + [earliest + g for g in grid(latest - earliest, points)]
    vals = [if_now] + [f(x) for x in xs[1:]]
    k = min(range(len(xs)), key=lambda i: (vals[i], xs[i]))
    a, b = xs[max(0, k - 1)], xs[min(len(xs) - 1, k + 1)]
    best_s, best = xs[k], vals[k]
    curve = list(zip(xs, vals, strict=True))
    golden = (math.sqrt(5.0) - 1.0) / 2.0  # golden-section refinement between the best point's neighbours
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(refine):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = f(d)
    for x, v in ((c, fc), (d, fd)):
        curve.append((x, v))
        if v < best:
            best_s, best = x, v
    if best >= if_now:  # ties go to starting now
        best_s, best = earliest, if_now
    points_seen = set(curve) | {(best_s, best)}
    p = None if prior is None or min_gain < 0 else min(max(float(prior), earliest), latest)
    if p is not None and all(abs(x - p) > 1e-9 for x, _ in points_seen):
        points_seen.add((p, f(p)))  # (a run cut off past best * (1 + CUTOFF) is far out of reach)
    raw = dict(points_seen)
    score = raw
    if jitter > 0:
        ev.cutoff = math.inf  # a mean needs every point to its end
        before = {x: f(x) for x in (max(0.0, earliest - jitter), max(0.0, earliest - 0.5 * jitter)) if x < earliest}
        score = _spread_means(sorted(set(points_seen) | set(before.items())), jitter, list(score))
        best_s = min(score, key=lambda x: (score[x], x))
        best = score[best_s]
        if best >= score[earliest]:  # ties go to starting now
            best_s, best = earliest, score[earliest]
    start = best_s
    if p is not None:
        start = min((x for x in score if score[x] <= best * (1.0 + min_gain)), key=lambda x: (abs(x - p), score[x]))
    return Release(float(start), float(raw[start]), float(if_now), tuple(sorted(points_seen)),
                   (float(best_s), float(raw[best_s])))


def _spread_means(curve: Sequence[tuple[float, float]], jitter: float, at: Sequence[float]) -> dict[float, float]:
    """For each start in ``at``: the mean of the ``curve`` (sorted (start, makespan) points, linearly
    interpolated, held flat beyond its ends) at that start moved by -J, -J/2, 0, J/2 and J (the
    plan's offsets for two jobs, :data:`._spread.OFFSETS_TWO`, and 0)."""
    import numpy as np

    xs, ys = [x for x, _ in curve], [y for _, y in curve]
    offsets = (0.0, *OFFSETS_TWO)
    return {x: float(np.mean(np.interp([x + u * jitter for u in offsets], xs, ys))) for x in at}
