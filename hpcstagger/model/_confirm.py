"""A planned stagger, replayed by the sample-level simulator before it is recommended (private to
:mod:`hpcstagger.model`).

The fluid model plans: it is fast enough to search. The simulator (:func:`hpcstagger.model.simulate`)
replays the same scenario sample by sample: each worker's reads and decodes, a read that another job
already has in flight waited for rather than read again, the cores shared task by task. They are
two models of one node, and where they disagree about a stagger, the stagger rests on a term the
fluid model only approximates. Both replays are exact starts, and so is the comparison: where the
simulator's gain over a simultaneous start falls short of the fluid model's by more than the plan's
``min_gain``, the stagger stands only if the simulator's gain is larger than that shortfall (the
two models' disagreement, a measure of their error on this node, which a smaller gain cannot
outweigh); otherwise it is dropped and the jobs start together. (A stagger planned for its mean
over a start-time spread, which gains nothing with exact starts, gains nothing in either model,
and stands.)

The case that asked for it: four trials of one sweep reading one order through the page cache, with
two DataLoader workers each on 2 cores (12 busy processes). The fluid model counted the trials that
wait for the leader's reads as busy on the cores, saw the leader's decode starved and the first epoch
read at two thirds of the source, and predicted a stagger of 2.2 s 9% ahead of a simultaneous
start. The simulator put both at 11.4 s; the runs took 11.5 s together and 13.0 s staggered.

The same four trials over 5,015 JPEGs: the fluid model predicted a stagger of 3.8 s 6.9% ahead,
the simulator 1.4% ahead; the runs took 30 s together and 33 s staggered.

A replay costs about 9 µs of CPU per sample read on a 2-core VM (0.25 s for 3,343 samples, 4 jobs,
2 epochs). Both replays together read at most :data:`READS` samples, about the search's own budget
(0.45 s): a larger dataset is replayed at a scale of 1/k (k samples of it as one: the dataset's
samples, the cache's capacity and the delays divided by k, every per-sample time kept), down to
:data:`MIN_WINDOWS` of each job's windows per epoch (the samples its workers fetch at once: ranks
times batch times workers). Below that the stagger stands as the fluid model
planned it, and ``Plan.simulated`` is empty. A scaled replay's makespans are reported times k,
with ``scale`` = k.

Before that check, where the fluid model's curve is flat around its best stagger (points within
:data:`FLAT` of it), the simulator picks among those points (:func:`refine`): the fluid model
cannot tell them apart, and the simulator, which follows every read, often can. Two jobs on 0
DataLoader workers with half the dataset cached: the fluid model's curve lay within 1.5% from
the first job 0.3 s ahead to 2.7 s ahead and planned 0.86 s; the simulator put 2.1 s 5.7% ahead
of that, and the runs took 7.66 s at 2 s against 8.19 s at the plan. The simulator's pick
replaces the plan only where it is ahead of the plan by more than ``min_gain`` in the simulator.
With two jobs the same holds where the plan is a simultaneous start and the curve is flat around
it: two jobs of 2 DataLoader workers each over a source that loses half its bandwidth to a second
reader, the fluid model put every stagger up to 8 s either way within 2% of a simultaneous start,
while the simulator found the job with small batches 6 s ahead 20% faster. Its two workers,
paced by the steps, take turns at the source; the fluid model lets them overlap at random.
(:func:`pick`; such a stagger is kept at the final check although the fluid model finds it no
faster than a simultaneous start.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hpcstagger.model import _engine, _quality
from hpcstagger.model.scenario import Scenario
from hpcstagger.model.simulate import simulate

__all__ = ["READS", "MIN_WINDOWS", "FLAT", "reads", "replay", "disagree", "flat", "refine", "pick"]

# sample reads (samples x epochs, summed over the jobs, for both replays) the check may take: about 0.5 s
READS = 60_000
# a scaled replay keeps at least this many windows (ranks x batch x workers samples) per epoch of every job
MIN_WINDOWS = 16
# the fluid model's curve within this fraction of its best: points it cannot tell apart (its makespan
# error against the simulator: median 1.2%, beyond 2% on a fifth of random loader shapes)
FLAT = 0.02
# the refinement's first pass replays at most this many of those points, evenly spread over them
SPREAD = 5


def reads(sc: Scenario) -> int:
    """Sample reads in one replay of ``sc``: every job reads the dataset once per epoch."""
    return int(sc.dataset.samples) * sum(int(j.epochs) for j in sc.jobs)


def _scale(sc: Scenario) -> int:
    """k: the scale 1/k at which two replays of ``sc`` read at most :data:`READS` samples together."""
    return math.ceil(2 * reads(sc) / READS)


def replay(sc: Scenario, delays: list[float],
           memo: dict[tuple[float, ...], float] | None = None) -> dict[str, float] | None:
    """The simulator's makespans of ``delays`` (``plan``) and of a simultaneous start
    (``simultaneous``), both with seed 0, so that the two replays draw the same orders; at a scale
    of 1/k (and ``scale`` = k) when they would read more than :data:`READS` samples together; None
    when that scale leaves a job fewer than :data:`MIN_WINDOWS` windows per epoch. ``memo`` keeps
    the makespans of one scenario's replays by delays, for a later call (the planner replays the
    simultaneous start during its search and again at the end)."""
    k = _scale(sc)
    if k > 1:
        d = sc.to_dict()
        d["dataset"]["samples"] = int(sc.dataset.samples) // k
        window = max(j.ranks * j.batch * max(j.workers, 1) for j in sc.jobs)
        if d["dataset"]["samples"] < MIN_WINDOWS * window:
            return None
        if "capacity" in d["cache"]:
            d["cache"]["capacity"] = float(d["cache"]["capacity"]) / k
        sc, delays = Scenario.from_dict(d), [x / k for x in delays]
    memo = {} if memo is None else memo

    def makespan(d: list[float]) -> float:
        key = tuple(d)
        if key not in memo:
            memo[key] = k * float(simulate(sc, d, seed=0).makespan)
        return memo[key]

    out = {"plan": makespan(delays), "simultaneous": makespan([0.0] * len(sc.jobs))}
    if k > 1:
        out["scale"] = float(k)
    return out


def disagree(simulated: dict[str, float], ratio: float, min_gain: float) -> bool:
    """Whether the simulator's replays (:func:`replay`) refute a stagger whose fluid-model makespan
    is ``ratio`` times a simultaneous start's: the simulator's gain is below the fluid model's by
    more than ``min_gain``, and not above that shortfall."""
    if simulated["simultaneous"] <= 0:
        return False
    sim_gain = 1.0 - simulated["plan"] / simulated["simultaneous"]
    shortfall = (1.0 - ratio) - sim_gain
    return shortfall > min_gain and sim_gain <= shortfall


def refine(sc: Scenario, plan: list[float], flat: list[list[float]], memo: dict[tuple[float, ...], float],
           min_gain: float, ratio: float, penalty: Callable[[list[float]], float] | None = None
           ) -> tuple[list[float], int]:
    """Among ``flat``, delays that the fluid model finds within :data:`FLAT` of its plan ``plan``
    (ordered along its curve), the delays the simulator finds fastest, if ahead of the plan's
    replay by more than ``min_gain``; else ``plan``. Returns those delays and the number of points
    replayed. A plan whose replay refutes it (:func:`disagree`, ``ratio`` being its fluid-model
    makespan over a simultaneous start's) is returned as it is, for the check to drop: where the two
    models disagree about the plan, the simulator alone does not pick another stagger.
    ``penalty(delays)``, when given, is added to the two fastest points' replayed makespans and to
    the plan's before they are compared: what the fluid model says a start-time spread costs at
    those delays (its mean over the spread less its exact-start makespan; the replays are exact
    starts), so that a point on the edge of a cliff, which the plan waited past, does not win on
    its exact start. The first pass replays up to :data:`SPREAD` points evenly
    spread over ``flat``, the second the points halfway to the best one's neighbours there, the
    faster neighbour's side first; together at most ``2 * READS`` sample reads (a scaled replay's
    reads at its scale), as many points as that affords, none where a replay would not run
    (:func:`replay` returns None)."""
    points = [list(d) for d in flat if any(d) and list(d) != list(plan)]
    if not points:
        return list(plan), 0
    afford = int(2 * READS // max(1, math.ceil(reads(sc) / _scale(sc))))
    first = min(SPREAD, len(points), afford)
    mine = replay(sc, plan, memo) if first >= 1 else None
    if mine is None or disagree(mine, ratio, min_gain):
        return list(plan), 0
    seen: dict[int, float] = {}

    def at(i: int) -> float:
        if i not in seen:
            r = replay(sc, points[i], memo)
            seen[i] = math.inf if r is None else r["plan"]
        return seen[i]

    index = sorted({round(i * (len(points) - 1) / max(first - 1, 1)) for i in range(first)})
    best = min(index, key=at)
    # halfway to each neighbour of the best, first toward the faster neighbour (the valley's side)
    sides = [(at(n), (best + n) // 2 if n < best else (best + n + 1) // 2)
             for n in ([i for i in index if i < best][-1:] + [i for i in index if i > best][:1])]
    for _, i in sorted(sides):
        if i not in seen and len(seen) < afford and at(i) < at(best):
            best = i
    # the two fastest, each with what the spread costs it against what it costs the plan
    cost = penalty or (lambda d: 0.0)
    bar = mine["plan"] * (1.0 - min_gain)
    fastest = sorted((i for i in seen if seen[i] < bar), key=lambda i: seen[i])[:2]
    if fastest:
        bar += cost(list(plan))
    for i in fastest:
        if seen[i] + cost(points[i]) < bar:
            return points[i], len(seen)
    return list(plan), len(seen)


def flat(curve: list[tuple[float, float]], plan: list[float]) -> list[list[float]]:
    """The delays of the planner's curve points within :data:`FLAT` of its best, in the curve's
    order, a simultaneous start left out: for 2 jobs the curve's x is a signed stagger (negative:
    the first job starts later), for more the largest delay along the plan's delays scaled together."""
    if not curve:
        return []
    top, low = max(plan), min(m for _, m in curve)
    out = []
    for x, m in sorted(curve):
        if x == 0 or m > low * (1.0 + FLAT):
            continue
        if len(plan) == 2:
            out.append([0.0, x] if x > 0 else [-x, 0.0])
        elif top > 0 and x > 0:
            out.append([x / top * d for d in plan])
    return out


def pick(sc: Scenario, plan: list[float], curve: list[tuple[float, float]], memo: dict[tuple[float, ...], float],
         min_gain: float, penalty: Callable[[list[float]], float] | None = None) -> tuple[list[float], int, str]:
    """:func:`refine` for the planner's ``plan``: a stagger, or with two jobs a simultaneous start
    as well. Returns the delays, the points replayed, and how the simulator changed the plan:
    ``"picked"`` a stagger in place of a simultaneous start (which the fluid model finds no faster:
    the final check keeps it on the simulator's word), ``"moved"`` another stagger, else ``""``.
    The refutation ratio of a stagger is its fluid-model makespan over a simultaneous start's at
    the final check's accuracy."""
    if not any(plan):
        if len(plan) != 2:
            return list(plan), 0, ""
        chosen, n = refine(sc, plan, flat(curve, plan), memo, min_gain, 1.0, penalty)
        return chosen, n, "picked" if any(chosen) else ""
    fine = _engine.Engine(sc, _quality.FINE)
    ratio = max(fine.run(plan)) / max(fine.run([0.0] * len(plan)))
    chosen, n = refine(sc, plan, flat(curve, plan), memo, min_gain, ratio, penalty)
    return chosen, n, "moved" if chosen != list(plan) else ""
