"""``optimal_plan``: the start delays that minimise the predicted makespan.

Search. Every job may start first; delays are searched over ``[0, max_delay]`` per job and
shifted so that the earliest is 0.

- **2 jobs**: one signed stagger ``s`` (job 2 starts ``s`` after job 1; negative: job 1 starts
  ``-s`` after job 2) on a grid denser near 0, then bounded Brent between the grid
  neighbours of the best point. The grid is the makespan-versus-stagger curve.
- **N jobs**: first one family per job f: f starts at 0 and every other job at a common delay
  (a grid), and overlapped sequential orders, which picks the job to go first; then coordinate
  descent from the best point, each coordinate by a grid plus bounded Brent; last, a search
  along the plan's delays scaled together from 0 (simultaneous) to 1.6, which is also the curve.

Which job goes first is therefore decided by the model, not by a rule: it is the job whose head
start lowers the predicted makespan most. In practice that is the job with the most work when
the jobs differ in length (its delay adds to the makespan one for one, while the others finish
early anyway), and among similar jobs the most I/O-bound one (it fills the cache fastest).

Ties go to simultaneous start: a stagger is only recommended when it lowers the predicted
makespan by more than ``min_gain`` (1% by default: below that the model cannot tell, its
typical error being a fraction of a percent), and a job whose delay can return to 0
without raising the makespan starts at 0. So compute-bound jobs, and sources that lose nothing
under concurrency with a cache that cannot help a late starter, get delays of exactly 0.

Starts are not exact. A job's start-up (imports, its model, its loader's workers) varies from run
to run, so the stagger a run gets strays from the planned one; on a 2-core VM the same job's
start-up ranged over 1.2 to 2.1 s. A stagger on the edge of a cliff in the curve (a little less
and both jobs miss together) then loses much more often than it wins. With ``jitter`` J > 0, for
2 jobs the plan minimises the mean predicted makespan over the stagger moved by -J, -J/2, J/2
and J as well; for more jobs the search is the exact-start one, and its plan is kept only if its
mean over each job's start moved by -J and +J beats a simultaneous start's mean.
By default J is the ``plan_jitter`` knob (0.25) times the jobs' mean start-up, so a scenario
without start-ups plans for exact starts, and so does one whose default J is shorter than the
model's finest time step (1/64 of the shortest epoch of a job alone): the model cannot tell such a
spread from exact starts, and weighing it cost half of a 4-job plan's time (1.7 of 3.5 s).
The reported makespans are for the planned delays.

The search runs the model at a coarser integration tolerance (the scan of start points coarser
still) and, for 3 or more jobs, stops refining after a budget of CPU time (its own thread's, so
that other work on the node does not change the plan); the plan's makespans are
recomputed at full accuracy, and a stagger that does not pay then is dropped.

Last, a stagger is replayed by the sample-level simulator (:mod:`._confirm`; the ``plan_replay``
knob) with its delays and with a simultaneous start (a large dataset at a smaller scale): where the
simulator's gain falls short of the model's by more than ``min_gain`` and is no larger than that
shortfall, the two models disagree about it and the jobs start together (``Plan.simulated``). With
3 or more jobs the scan's best start is replayed before the coordinate descent, which is skipped
where the simulator finds that stagger slower than a simultaneous start. Where the curve is flat
around the plan, the simulator picks among the points the fluid model cannot tell apart first
(:func:`._confirm.refine`; ``Plan.simulated``: ``refined`` points replayed, ``moved`` to another), with 2
jobs also around a simultaneous start (``picked``: a stagger chosen over it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Callable

from hpcstagger.errors import ConfigError
from hpcstagger.model import _confirm, _engine, _quality
from hpcstagger.model._confirm import FLAT  # the fluid model's curve within this fraction of its best: a tie
from hpcstagger.model._search import CUTOFF, Evaluator, grid, line_search, minimize_bounded
from hpcstagger.model._spread import OFFSETS_MANY, OFFSETS_TWO, Spread, robust_two, start_jitter
from hpcstagger.model.scenario import Scenario
from hpcstagger import config

__all__ = ["FLAT", "Plan", "optimal_plan", "unseen_loaders", "unseen_reason"]


@dataclass(frozen=True)
class Plan:
    """A start plan and what the model predicts for it.

    ``delays`` (job name -> seconds; the first job at 0), the predicted ``makespan`` and
    ``finish`` per job with those delays, and the predicted makespans of a simultaneous start
    (``simultaneous``) and of fully sequential runs in job order (``sequential``). ``order`` is the
    start order. ``curve_stagger``/``curve_makespan`` is the predicted makespan-versus-delay curve
    described by ``curve_label``. ``jitter`` is the start-time spread planned for (seconds);
    ``spread_makespan`` and ``spread_simultaneous`` are the mean predicted makespans over it of
    the plan and of a simultaneous start (0.0 when the plan is for exact starts or starts together).
    ``staggered`` is the best stagger the search found whether or not the plan takes it (empty when
    it found none), and ``staggered_makespan`` its predicted makespan: beside a simultaneous plan,
    how near the model came to staggering. ``simulated`` holds the sample-level simulator's
    makespans of that stagger (``plan``) and of a simultaneous start, when the stagger was replayed
    (empty otherwise); a plan whose delays are 0 beside them was dropped because the simulator did
    not confirm its gain.
    """

    delays: dict[str, float]
    makespan: float
    simultaneous: float
    sequential: float
    finish: dict[str, float] = field(default_factory=dict)
    order: tuple[str, ...] = ()
    curve_stagger: tuple[float, ...] = ()
    curve_makespan: tuple[float, ...] = ()
    curve_label: str = ""
    evaluations: int = 0
    seconds: float = 0.0
    jitter: float = 0.0
    spread_makespan: float = 0.0
    spread_simultaneous: float = 0.0
    staggered: dict[str, float] = field(default_factory=dict)
    staggered_makespan: float = math.nan
    simulated: dict[str, float] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        """Predicted makespan saved against a simultaneous start, as a fraction of it."""
        return 1.0 - self.makespan / self.simultaneous if self.simultaneous > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-able types: delays, makespan, simultaneous, sequential and the rest."""
        return {"delays": dict(self.delays), "makespan": self.makespan, "simultaneous": self.simultaneous,
                "sequential": self.sequential, "gain": self.gain, "finish": dict(self.finish),
                "order": list(self.order),
                "curve": {"label": self.curve_label, "stagger": list(self.curve_stagger),
                          "makespan": list(self.curve_makespan)},
                "evaluations": self.evaluations, "seconds": self.seconds, "jitter": self.jitter,
                "spread_makespan": self.spread_makespan, "spread_simultaneous": self.spread_simultaneous,
                "staggered": dict(self.staggered),
                "staggered_makespan": self.staggered_makespan if self.staggered else None,
                "simulated": dict(self.simulated)}


def _solo_times(sc: Scenario) -> list[float]:
    out = []
    for job in sc.jobs:
        eng = _engine.Engine(replace(sc, jobs=(job,)), _quality.FINE)
        out.append(eng.run([0.0])[0])
    return out


def _finest_step(sc: Scenario, solo: list[float]) -> float:
    """The model's finest time step: its full accuracy's smallest step, a fraction of the shortest
    epoch of a job running alone (``solo``: each job's solo run time)."""
    return _quality.FINE.min_step * min((t / j.epochs for t, j in zip(solo, sc.jobs, strict=True)), default=0.0)


def _sequential(sc: Scenario) -> float:
    """Makespan of the jobs run one after another in job order (the cache carries over)."""
    delays = [0.0]
    finish = _engine.Engine(replace(sc, jobs=sc.jobs[:1]), _quality.FINE).run(delays)
    for j in range(1, len(sc.jobs)):
        delays.append(finish[j - 1])
        finish = _engine.Engine(replace(sc, jobs=sc.jobs[:j + 1]), _quality.FINE).run(delays)
    return max(finish)


_SIMULTANEOUS_ONLY = "simultaneous start only"


def unseen_loaders(scenario: Scenario) -> list[str]:
    """The jobs whose loader was not measured (``loader_seen = false``: timed as step factories)."""
    return [j.name for j in scenario.jobs if not j.loader_seen]


def unseen_reason(names: list[str]) -> str:
    """Why a plan with jobs whose loader was not measured starts every job at once, in one line."""
    return (f"a simultaneous start: the loader of {', '.join(names)} was not measured (timed as a step factory, "
            "which cannot see workers, batches or prefetching), so no job is planned to wait without evidence; "
            "calibrate from the job's own command (hpcstagger calibrate SPEC), its loop written "
            "'for batch in session.loader(loader):'")


def optimal_plan(scenario: Scenario, *, max_delay: float | None = None, min_gain: float | None = None,
                 grid: int | None = None, budget: float = 0.45, jitter: float | None = None) -> Plan:
    """The start delays that minimise the predicted makespan (see the module docstring).

    ``max_delay`` bounds every job's delay (which is at most the sum of the other jobs' solo run
    times, enough to run them all first, and the jitter: a longer wait cannot help). ``min_gain``
    is the least relative gain over a simultaneous start for which a stagger is recommended
    (default: the ``plan_min_gain`` knob, 0.01). ``grid`` sets the grid points of the 1-D searches.
    A scenario with a job whose loader was not measured (``loader_seen = false``) is planned as a
    simultaneous start, its curve labelled with why. For 3 or more jobs the search (after the jobs'
    solo runs) keeps to ``budget`` seconds of its thread's CPU time: the scan of start points is as
    fine as a quarter of it affords, coordinate descent stops at 70% of it (its first sweep visits
    every job on a grid as fine as that time affords at planning accuracy, at least 2 points and
    without Brent once late), and a last search along the plan's delays scaled together uses the
    rest (4 scales instead of 8 once late); this bounds the time on slow scenarios (lru, many
    epochs, many samples). ``jitter`` is how far, in seconds, a job's real start may stray from its
    planned delay (default: the ``plan_jitter`` knob times the jobs' mean start-up; 0 plans for
    exact starts).
    Raises ConfigError for a bad argument and ModelError when the model cannot answer.
    """
    t0 = time.perf_counter()
    min_gain = _check_args(max_delay, min_gain)
    sc = scenario
    J = len(sc.jobs)
    ev = Evaluator(sc, _quality.COARSE)
    spread_s = start_jitter(sc, jitter)
    solo = _solo_times(sc) if J >= 2 else []
    if J >= 2 and jitter is None and 0 < spread_s < _finest_step(sc, solo):
        spread_s = 0.0  # the default spread, shorter than the model's finest step: it cannot tell it from exact starts
    if J == 2:
        spread = Spread(ev, spread_s, OFFSETS_TWO)
    else:  # the spread only checks the plan against a simultaneous start, at the scan's accuracy
        spread = Spread(Evaluator(sc, _quality.SEARCH) if spread_s > 0 else ev, spread_s, OFFSETS_MANY)
    simultaneous_coarse = ev([0.0] * J)
    unseen = unseen_loaders(sc)
    staggered: list[float] | None = None
    early: dict[str, float] | None = None
    replays: dict[tuple[float, ...], float] = {}  # the simulator's makespans by delays, for the search and the end
    refined, picked = 0, ""
    if J >= 2 and not unseen:
        best_d, curve, label, staggered, early = _search(sc, ev, spread, simultaneous_coarse, solo,
                                                         max_delay=max_delay, min_gain=min_gain, grid=grid,
                                                         budget=budget, replays=replays)
        if (any(best_d) or J == 2) and config.get("plan_replay"):
            cost = (lambda d: spread(d) - spread.ev(d)) if spread.jitter > 0 else None
            best_d, refined, picked = _confirm.pick(sc, best_d, curve, replays, min_gain, cost)
            staggered = list(best_d) if any(best_d) else staggered
    else:  # one job; or a loader the model cannot see, whose stagger would rest on no evidence
        label = unseen_reason(unseen) if J >= 2 else _SIMULTANEOUS_ONLY
        best_d, curve = [0.0] * J, [(0.0, simultaneous_coarse)]
    return _final_plan(sc, best_d, curve, label, min_gain, evaluations=ev.count, t0=t0,
                       jitter=spread.jitter, staggered=staggered, refuted=early, replays=replays, refined=refined,
                       picked=picked)


def _cpu_clock() -> float:
    """The search's budget clock: this thread's CPU time. Other processes on the node (other
    users' work, the jobs' own processes starting up) do not shorten the search, so a spec plans
    alike on a busy and a quiet node."""
    return time.thread_time()


def _check_args(max_delay: float | None, min_gain: float | None) -> float:
    """``min_gain`` (default: the ``plan_min_gain`` knob); ConfigError for a bad one or a bad ``max_delay``."""
    if min_gain is None:
        min_gain = float(config.get("plan_min_gain"))
    if max_delay is not None and (not isinstance(max_delay, (int, float)) or not max_delay >= 0
                                  or math.isinf(max_delay)):
        raise ConfigError(f"max_delay must be a finite number of seconds >= 0, got {max_delay!r}")
    if not 0 <= min_gain < 1:
        raise ConfigError(f"min_gain must be in [0, 1), got {min_gain!r}")
    return min_gain


def _search(sc: Scenario, ev: Evaluator, spread: Spread, simultaneous: float, solo: list[float], *,
            max_delay: float | None,
            min_gain: float, grid: int | None,
            budget: float, replays: dict[tuple[float, ...], float] | None = None
            ) -> tuple[list[float], list[tuple[float, float]], str, list[float] | None, dict[str, float] | None]:
    """2 or more jobs: the searched delays (all 0 unless they gain more than ``min_gain`` over a
    simultaneous start, both over the start-time spread), the makespan-versus-delay curve, its label,
    the best stagger found whether or not it gains (None when the search found none), and the
    simulator's replays where they refuted the scan's best stagger and the search stopped there."""
    J = len(sc.jobs)
    names = sc.job_names
    # a start that strays by more than every job's solo run together misses the others whichever way it
    # strays: the spread is capped there (a jitter of 1e308 s otherwise made the model crawl over empty time)
    spread.jitter = min(spread.jitter, sum(solo))
    # enough to run the others first (and the jitter beyond, so that such a wait can be padded); a longer
    # wait cannot help, and a max_delay far past it (1e9 s) only made the model crawl over empty time
    bound = [min(float(max_delay) if max_delay is not None else math.inf, sum(solo) - solo[j] + spread.jitter)
             for j in range(J)]
    if J == 2:
        best_d, best, curve = _plan_two(ev, spread, bound, grid or 24)
        label = f"stagger of {names[1]} after {names[0]} (s; negative: {names[0]} starts later)"
    else:
        c0 = _cpu_clock()  # the budget is the search's: the solo runs above are not part of it
        refuted: dict[str, float] = {}

        def check(d: list[float], val: float) -> bool:
            """Replay the scan's best stagger now: where the simulator refutes it and finds it slower than
            a simultaneous start, the search stops (a finer search costs 0.8 CPU-s for 4 trials, on cores
            the starting jobs use). One the simulator finds ahead, if by less than the model, is searched
            on: on a 3-job shape the scan's best was 1.1% ahead there, the search's 8.2% and measured best."""
            sim = _confirm.replay(sc, d, replays) if any(d) and config.get("plan_replay") else None
            if (sim is not None and sim["plan"] > sim["simultaneous"]
                    and _confirm.disagree(sim, val / simultaneous, min_gain)):
                refuted.update(sim)
                return True
            return False

        best_d, best = _plan_many(sc, ev, bound, grid or 6, solo, c0, budget, check)
        if refuted:  # the curve: a simultaneous start and the stagger the simulator refuted
            return ([0.0] * J, [(0.0, simultaneous), (max(best_d), best)],
                    "largest delay of the scan's best start (0: simultaneous; the search stopped at its replay)",
                    list(best_d), refuted)
        best_d, best = _tie_break(ev, best_d, best, min_gain)
        curve, label = [(0.0, simultaneous)], _SIMULTANEOUS_ONLY
        if max(best_d) > 0:
            best_d, best, curve, label = _plan_scaled(ev, best_d, best, c0 + budget)
            if spread.jitter > 0:  # is the plan still worth it when the starts stray?
                best = spread(best_d)
    staggered = list(best_d) if any(best_d) else None
    if staggered is None and J == 2:  # the simultaneous point won the grid: the best of the others
        x = min(((s, m) for s, m in curve if s != 0), key=lambda p: (p[1], abs(p[0])), default=None)
        staggered = None if x is None else ([0.0, x[0]] if x[0] >= 0 else [-x[0], 0.0])
    if spread.jitter > 0 and any(best_d):
        simultaneous = spread([0.0] * J)
    if best > simultaneous * (1.0 - min_gain):
        best_d = [0.0] * J
    elif J == 2:
        best_d, best = _tie_break(spread, best_d, best, min_gain)
    return best_d, curve, label, staggered, None


def _plan_scaled(ev: Evaluator, base: list[float], best: float,
                 deadline: float) -> tuple[list[float], float, list[tuple[float, float]], str]:
    """The delays ``base`` scaled together, 0 (simultaneous) to 1.6: the curve, and a last search
    along it (coordinate descent can stop short of a point on this ray), refined by bounded Brent
    if there is time before ``deadline``. Returns the delays, their makespan, the curve, its label."""
    base = list(base)
    top = max(base)
    # the curve; past the deadline only the points that say whether less or more of the stagger pays
    scales = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.6] if _cpu_clock() < deadline else [0.0, 0.5, 1.0, 1.25]
    ev.cutoff = math.inf  # the reported curve: every point runs to the end
    vals = [ev([lam * x for x in base]) for lam in scales]
    ev.cutoff = CUTOFF
    k = min(range(len(scales)), key=lambda i: (vals[i], abs(scales[i] - 1.0)))
    lam_best, val_best = scales[k], vals[k]
    if 0 < k < len(scales) - 1 and _cpu_clock() < deadline:
        lam, val = minimize_bounded(lambda lam: ev([lam * x for x in base]), scales[k - 1], scales[k + 1], 1e-3, 8)
        if val < val_best:
            lam_best, val_best = lam, val
    best_d = list(base)
    if val_best < best:
        best_d, best = [lam_best * x for x in base], val_best
    curve = sorted(set(zip((lam * top for lam in scales), vals, strict=True)) | {(lam_best * top, val_best)})
    label = (f"largest delay, with every delay scaled along the plan (0: simultaneous; "
             f"plan at {max(best_d):.3g} s)")
    return best_d, best, curve, label


def _final_plan(sc: Scenario, best_d: list[float], curve: list[tuple[float, float]], label: str,
                min_gain: float, *, evaluations: int, t0: float, jitter: float = 0.0,
                staggered: list[float] | None = None, refuted: dict[str, float] | None = None,
                replays: dict[tuple[float, ...], float] | None = None, refined: int = 0, picked: str = "") -> Plan:
    """The plan of delays ``best_d`` with its makespans recomputed at full accuracy, back to a
    simultaneous start if the stagger then gains less than ``min_gain``: with exact starts in its
    makespan, over a start-time spread of ``jitter`` seconds in its mean over the spread (the search
    weighed the spread at its own, coarser accuracy, which can favour a stagger that loses).
    ``refuted``: the simulator's replays of ``staggered``, which refuted it during the search;
    ``replays``: the makespans the search's replays found (:func:`._confirm.replay`'s memo);
    ``refined``: the points :func:`._confirm.refine` replayed before ``best_d`` was chosen; ``picked``: how the
    simulator changed the fluid model's choice (:func:`._confirm.pick`; a ``"picked"`` stagger is kept here)."""
    J = len(sc.jobs)
    names = sc.job_names
    zero = [0.0] * J
    final_eng = _engine.Engine(sc, _quality.FINE)
    finish = final_eng.run(best_d)
    searched_d, searched_m = list(best_d), max(finish)  # before any step back to a simultaneous start
    together_finish = final_eng.run(zero) if any(best_d) else finish
    simultaneous = max(together_finish)
    means = (0.0, 0.0)
    if any(best_d) and jitter:
        spread = Spread(Evaluator(sc, _quality.FINE), jitter, OFFSETS_TWO if J == 2 else OFFSETS_MANY)
        means = (spread(best_d), spread(zero))
    mine, together = means if jitter else (max(finish), simultaneous)
    if any(best_d) and mine > together * (1.0 - min_gain) and picked != "picked":
        # the stagger does not pay at full accuracy: start together
        best_d, means, finish = list(zero), (0.0, 0.0), together_finish
    simulated = _confirm.replay(sc, best_d, replays) if any(best_d) and config.get("plan_replay") else refuted
    if simulated is not None and _confirm.disagree(simulated, max(finish) / simultaneous, min_gain):
        best_d, means, finish = list(zero), (0.0, 0.0), together_finish  # the simulator does not confirm it
    if simulated is not None and refined:
        simulated = {**simulated, "refined": float(refined), **({picked: 1.0} if picked and any(best_d) else {})}
    sequential = _sequential(sc) if J > 1 else max(finish)
    order = tuple(names[j] for j in sorted(range(J), key=lambda j: (best_d[j], j)))
    stag_d = list(staggered) if staggered and any(staggered) else []
    stag_m = (searched_m if stag_d == searched_d else max(final_eng.run(stag_d))) if stag_d else math.nan
    return Plan(delays=dict(zip(names, best_d, strict=True)), makespan=max(finish), simultaneous=simultaneous,
                sequential=sequential, finish=dict(zip(names, finish, strict=True)), order=order,
                curve_stagger=tuple(c[0] for c in curve), curve_makespan=tuple(c[1] for c in curve),
                curve_label=label, evaluations=evaluations, seconds=time.perf_counter() - t0, jitter=jitter,
                spread_makespan=means[0], spread_simultaneous=means[1],
                staggered=dict(zip(names, stag_d, strict=True)) if stag_d else {}, staggered_makespan=stag_m,
                simulated=simulated or {})


def _plan_two(ev: Evaluator, spread: Spread, bound: list[float], points: int):
    """2 jobs: signed stagger s in [-bound[0], bound[1]] (job 1 delayed when s < 0); with a
    start-time spread, the stagger whose mean makespan over the spread is least, and that mean."""
    def delays(s: float) -> list[float]:
        return [0.0, s] if s >= 0 else [-s, 0.0]

    def f(s: float) -> float:
        return ev(delays(s))

    xs = sorted({0.0, *grid(bound[1], points), *(-g for g in grid(bound[0], points))})
    ev.cutoff = math.inf  # the grid is the reported curve: every point runs to the end
    vals = [f(x) for x in xs]
    ev.cutoff = CUTOFF
    if spread.jitter > 0:
        best_s, best = robust_two(spread, delays, xs, vals, -bound[0], bound[1])
        return delays(best_s), best, sorted(set(zip(xs, vals, strict=True)) | {(best_s, f(best_s))})
    k = min(range(len(xs)), key=lambda i: (vals[i], abs(xs[i])))
    best_s, best = xs[k], vals[k]
    a = xs[k - 1] if k > 0 else xs[k]
    b = xs[k + 1] if k + 1 < len(xs) else xs[k]
    if b > a:
        s, val = minimize_bounded(f, a, b, 1e-5 * (bound[0] + bound[1]) + 1e-9, 30)
        if val < best:
            best_s, best = s, val
    curve = sorted(set(zip(xs, vals, strict=True)) | {(best_s, best)})
    return delays(best_s), best, curve


def _plan_many(sc: Scenario, ev: Evaluator, bound: list[float], points: int,
               solo: list[float], t0: float, budget: float,
               check: Callable[[list[float], float], bool] | None = None) -> tuple[list[float], float]:
    """N jobs: scan one-parameter families (cheaply) for a start point, then coordinate descent.
    The scan takes a quarter of ``budget`` (CPU seconds from ``t0``); the descent stops at 70% of
    it, except that its first sweep visits every job on the full grid (past that, without Brent).
    ``check(delays, makespan)`` sees the scan's best start at planning accuracy; True stops there."""
    J = len(bound)
    scan_until, deadline = t0 + 0.25 * budget, t0 + 0.7 * budget
    scan = Evaluator(sc, _quality.SEARCH)
    t_eval = _cpu_clock()
    scan([0.0] * J)
    t_eval = _cpu_clock() - t_eval
    # as many family points as the scan's share of the budget affords (a slow model: coarse scan)
    remaining = max(scan_until - _cpu_clock(), 0.0)
    fam = int(min(max(remaining / max(J * t_eval, 1e-9), 3), 2 * points))
    candidates: list[list[float]] = [[0.0] * J]
    for first in range(J):  # this job first, every other one a common delay later
        upper = max(bound[j] for j in range(J) if j != first)
        for delta in grid(upper, fam):
            d = [min(delta, bound[j]) for j in range(J)]
            d[first] = 0.0
            candidates.append(d)
    for order in (list(range(J)), sorted(range(J), key=lambda j: -solo[j])):
        for lam in (0.5, 1.0):  # one after another (longest first, or in job order), or overlapped by half
            d, t = [0.0] * J, 0.0
            for j in order:
                d[j] = min(lam * t, bound[j])
                t += solo[j]
            candidates.append(d)
    scored = sorted(((scan(d), i) for i, d in enumerate(candidates)))
    best_d, best = list(candidates[scored[0][1]]), math.inf
    t_ev = _cpu_clock()
    for _, i in scored[:2]:  # the two best starts, at planning accuracy
        val = ev(candidates[i])
        if val < best:
            best_d, best = list(candidates[i]), val
    t_ev = (_cpu_clock() - t_ev) / 2
    if check is not None:
        t_check = _cpu_clock()
        if check(best_d, best):
            return best_d, best
        deadline += _cpu_clock() - t_check  # the check's replays are not the search's budget
    # the first sweep's grid: as many points per job as the rest of the budget affords at this
    # accuracy, at least 2 (a slow model: an lru cache over many samples took 0.27 s a run, and 6
    # points per job took 8 s for 4 jobs against a budget of 0.45 s)
    points = int(min(max((deadline - _cpu_clock()) / max(J * t_ev, 1e-9), 2), points))
    width = [bound[j] / points for j in range(J)]
    for sweep in range(2):
        before = best
        for j in sorted(range(J), key=lambda i: -best_d[i]):
            late = _cpu_clock() > deadline
            if late and sweep:
                break

            def f(x: float, j: int = j, base: list[float] = best_d) -> float:
                d = list(base)
                d[j] = x
                return ev(d)

            if sweep == 0:  # a grid over the whole range, then Brent around the best point. The grid's
                # count is set once, before the sweep (the scan alone is too coarse to stop at, and a plan
                # must not depend on how busy the node was); past the deadline Brent is skipped
                x, val, _ = line_search(f, 0.0, bound[j], best_d[j], best, points, 0 if late else 5)
            else:  # Brent in a bracket around the current point
                lo, hi = max(0.0, best_d[j] - width[j]), min(bound[j], best_d[j] + width[j])
                x, val = best_d[j], best
                if hi > lo:
                    xb, vb = minimize_bounded(f, lo, hi, 1e-4 * bound[j] + 1e-9, 5)
                    if vb < val:
                        x, val = xb, vb
            if val < best:
                best_d[j], best = x, val
                shift = min(best_d)
                if shift > 0:
                    best_d = [v - shift for v in best_d]
                    best = ev(best_d)
        if best > before * (1.0 - 1e-4):
            break
    return best_d, best


def _tie_break(ev: Callable[[list[float]], float], d: list[float], best: float,
               min_gain: float) -> tuple[list[float], float]:
    """Start at 0 every job whose delay does not matter (within min_gain / 10 of the makespan)."""
    d = list(d)
    for j in sorted(range(len(d)), key=lambda i: -d[i]):
        if d[j] <= 0:
            continue
        trial = list(d)
        trial[j] = 0.0
        val = ev(trial)
        if val <= best * (1.0 + min_gain / 10):
            d, best = trial, min(best, val)
    return d, best
