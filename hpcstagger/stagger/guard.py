"""Guarding a plan the closed loop could not correct (pure).

The closed loop moves only jobs that wait, and only once the run gives evidence: the first jobs'
start-up, the watcher's warm-up and one re-fit (:func:`evidence_at`). A plan whose every delay
is shorter than that gives it nothing to act on, and an error in a calibrated term (a source slower
or faster than measured, CPU contention the model does not see) then stands. Two such plans are
guarded, where the model's own curve says holding costs at most the ``plan_guard`` knob:

- **a simultaneous start the model barely chose**: it predicts its best stagger within
  ``plan_guard`` of starting together, too near to tell apart. That stagger's waiting jobs are
  held (never past ``[plan] max_delay``) as long as their hold reaches the first evidence. Not
  where the sample-level simulator refuted a stagger the fluid model planned (``Plan.simulated``
  is set): the two models then disagree about that stagger's gain, and holding a job for it would
  only cost. A curve the simulator also finds flat (with two jobs it replays the flat points around
  a simultaneous start, and picks none) is still guarded: both models rest on the same calibrated
  terms, and the guard is for an error in those;
- **a stagger shorter than the first evidence**: the plan's delays, stretched in proportion until
  the longest hold reaches the first evidence, when the model predicts that within ``plan_guard``
  of the plan (a flat curve).

In both, the model's choice is the watcher's prior: it releases the held jobs as soon as the run's
evidence confirms that choice, or holds them while the fitted model says a later start is better.
Not for mode ``open`` nor ``[plan] steer = false``.

**Held at the first batch.** A held job that calls ``session.loader`` (its calibration saw its
loader) and shares no loader with another job is *parked* (knob ``plan_park``, on by default): it
starts with the others, sets itself up (backend, model, optimizer) during the hold, and waits at
its loop's first batch, before its loader's workers start. Its start-up then overlaps the others',
so a release lets its loop begin at once. For a parked job the hold and the prior are the times its
loop may begin (a delay plus its start-up), and the watcher plans it with no start-up left. A
hold reaches the first evidence a start-up sooner that way, so the stretch, and what it costs where
the model was right, is smaller: a stagger whose loop would begin after the first evidence needs no
stretch at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from hpcstagger import config
from hpcstagger.model import Scenario, predict
from hpcstagger.spec.jobspec import Spec
from hpcstagger.stagger.steering import WARMUP

__all__ = ["Guard", "guard_plan", "evidence_at"]


@dataclass(frozen=True)
class Guard:
    """A guarded plan: each job's hold, the model's own choice in the same terms, and why.

    ``delays`` and ``prior`` are seconds after time zero: for a job in ``park``, when its loop may
    begin (it sets itself up during the hold); for any other, when it starts. ``simultaneous`` is
    true where the model's choice was to start every job at once."""

    delays: dict[str, float]
    prior: dict[str, float]
    park: tuple[str, ...]
    why: str
    simultaneous: bool


def evidence_at(scenario: Scenario, delays: Mapping[str, float], interval: float) -> float:
    """Seconds from time zero until the run can first show the watcher whether ``delays`` were right:
    the start-up of the first jobs to start, the watcher's warm-up and one re-fit."""
    first = [j.startup for j in scenario.jobs if float(delays.get(j.name, 0.0)) <= 0]
    return min(first, default=0.0) + WARMUP + float(interval)


def _parked(spec: Spec, scenario: Scenario, held: list[str]) -> tuple[str, ...]:
    """The held jobs parked at their first batch: all of them, or none (knob off, a job whose loader
    was not seen, or a shared loader)."""
    jobs = {j.name: j for j in scenario.jobs}
    if (not held or not config.get("plan_park") or spec.loader_groups()
            or not all(n in jobs and jobs[n].loader_seen and jobs[n].startup > 0 for n in held)):
        return ()
    return tuple(held)


def _set_up_during_hold(scenario: Scenario, park: tuple[str, ...]) -> dict[str, float]:
    """Each job's start-up that its hold already covers: a parked job's whole start-up, else none."""
    return {j.name: j.startup if j.name in park else 0.0 for j in scenario.jobs}


def guard_plan(spec: Spec, p: Any, delays: Mapping[str, float], rep: Mapping[str, str], scenario: Scenario,
               interval: float) -> Guard | None:
    """The guard of a mode-plan ``p`` (an :class:`~hpcstagger.model.Plan`) whose ``delays`` the closed
    loop could not correct, else None (see the module docstring)."""
    limit = float(config.get("plan_guard"))
    if (limit <= 0 or not spec.plan.steer or p.simultaneous <= 0 or not math.isfinite(p.makespan)
            or len(scenario.jobs) < 2):
        return None
    hi = math.inf if spec.plan.max_delay is None else float(spec.plan.max_delay)
    if any(float(d) > 0 for d in delays.values()):
        return _guard_short(spec, p, delays, rep, scenario, interval, limit, hi)
    if (not p.staggered or p.simulated  # the simulator refuted the fluid model's stagger: nothing to hold for
            or not math.isfinite(p.staggered_makespan) or p.staggered_makespan > p.simultaneous * (1.0 + limit)):
        return None
    hold = {n: min(float(p.staggered.get(rep[n], 0.0)), hi) for n in delays}
    park = _parked(spec, scenario, [n for n, d in hold.items() if d > 0])
    startup = _set_up_during_hold(scenario, park)
    hold = {n: min(d + startup.get(n, 0.0), hi) if d > 0 else d for n, d in hold.items()}
    if max(hold.values()) < evidence_at(scenario, p.staggered, interval):
        return None
    held = ", ".join(f"{n}{_loop(n, park)} up to +{d:.1f} s" for n, d in hold.items() if d > 0)
    why = (f"a simultaneous start, guarded: the model predicts {p.simultaneous:.1f} s simultaneous and "
           f"{p.staggered_makespan:.1f} s for its best stagger, within plan_guard {100 * limit:g}%, too near to tell "
           f"apart; {held} is held{_at_first_batch(park)} until the run shows whether starting at once was right "
           "(the closed loop releases it then, or later if the fitted model says so)")
    prior = {n: startup.get(n, 0.0) for n in delays}
    return Guard(hold, prior, park, why, simultaneous=True)


def _at_first_batch(park: tuple[str, ...]) -> str:
    return " at its first batch (set up meanwhile)" if park else ""


def _loop(name: str, park: tuple[str, ...]) -> str:
    return "'s loop" if name in park else ""


def _guard_short(spec: Spec, p: Any, delays: Mapping[str, float], rep: Mapping[str, str], scenario: Scenario,
                 interval: float, limit: float, hi: float) -> Guard | None:
    """:func:`guard_plan`'s second case: a stagger every delay of which comes before the first evidence."""
    own = {j.name: float(delays.get(j.name, 0.0)) for j in scenario.jobs}
    longest = max(own, key=lambda n: own[n])
    evidence = evidence_at(scenario, own, interval)
    if own[longest] <= 0 or own[longest] >= evidence or evidence > hi:
        return None
    park = _parked(spec, scenario, [n for n in delays if float(delays[n]) > 0])
    startup = _set_up_during_hold(scenario, park)
    # stretched in proportion until the longest hold (its loop's start, where it is parked) is the evidence
    stretch = max(1.0, (evidence - startup[longest]) / own[longest])
    stretched = {n: d * stretch for n, d in own.items()}
    planned, held_at = float(predict(scenario, own).makespan), float(predict(scenario, stretched).makespan)
    if not (math.isfinite(held_at) and math.isfinite(planned)) or held_at > planned * (1.0 + limit):
        return None
    hold = {n: stretched[rep[n]] + startup.get(n, 0.0) if float(delays[n]) > 0 else 0.0 for n in delays}
    prior = {n: float(delays[n]) + startup.get(n, 0.0) if float(delays[n]) > 0 else 0.0 for n in delays}
    held = ", ".join(f"{n}{_loop(n, park)} up to +{d:.1f} s (planned +{float(delays[n]):.1f} s"
                     + (f" and its {startup[n]:.1f} s start-up)" if n in park else ")")
                     for n, d in hold.items() if d > 0)
    cost = (f"the model predicts {held_at:.1f} s for a stagger that long, within plan_guard {100 * limit:g}% of "
            f"the plan's {planned:.1f} s" if stretch > 1.0 else "set up during the hold, its loop begins after that")
    why = (f"a short stagger, guarded: every planned delay comes before the run can show whether it was right "
           f"(about {evidence:.1f} s), and {cost}; {held} is held{_at_first_batch(park)} until "
           "the run shows it (the closed loop releases it then, or later if the fitted model says so)")
    return Guard(hold, prior, park, why, simultaneous=False)
