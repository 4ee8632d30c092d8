"""A planned stagger, replayed by the sample-level simulator before it is recommended (private to
:mod:`hpcstagger.model`).

The fluid model plans: it is fast enough to search. The simulator (:func:`hpcstagger.model.simulate`)
replays the same scenario sample by sample: each worker's reads and decodes, a read that another job
already has in flight waited for rather than read again, the cores shared task by task. They are
two models of one node, and where they disagree about a stagger, the stagger rests on a term the
fluid model only approximates. Both replays are exact starts, and so is the comparison: the
stagger is dropped, and the jobs start together, when the simulator finds it ahead of a
simultaneous start by less than the plan's ``min_gain`` and by ``min_gain`` less than the fluid
model does. (A stagger planned for its mean over a start-time spread, which gains nothing with
exact starts, gains nothing in either model, and stands.)

The case that asked for it: four trials of one sweep reading one order through the page cache, with
two DataLoader workers each on 2 cores (12 busy processes). The fluid model counted the trials that
wait for the leader's reads as busy on the cores, saw the leader's decode starved and the first epoch
read at two thirds of the source, and predicted a stagger of 2.2 s 9% ahead of a simultaneous
start. The simulator put both at 11.4 s; the runs took 11.5 s together and 13.0 s staggered.

A replay costs about 9 µs of CPU per sample read on a 2-core VM (0.25 s for 3,343 samples, 4 jobs,
2 epochs). The check runs only while both replays together stay within :data:`READS`, about the
search's own budget (0.45 s): beyond that the stagger stands as the fluid model planned it, and
``Plan.simulated`` is empty.
"""

from __future__ import annotations

from hpcstagger.model.scenario import Scenario
from hpcstagger.model.simulate import simulate

__all__ = ["READS", "reads", "replay", "disagree"]

# sample reads (samples x epochs, summed over the jobs, for both replays) the check may take: about 0.5 s
READS = 60_000


def reads(sc: Scenario) -> int:
    """Sample reads in one replay of ``sc``: every job reads the dataset once per epoch."""
    return int(sc.dataset.samples) * sum(int(j.epochs) for j in sc.jobs)


def replay(sc: Scenario, delays: list[float]) -> dict[str, float] | None:
    """The simulator's makespans of ``delays`` (``plan``) and of a simultaneous start
    (``simultaneous``), both with seed 0, so that the two replays draw the same orders; None when
    they would read more than :data:`READS` samples together."""
    if 2 * reads(sc) > READS:
        return None
    return {"plan": float(simulate(sc, delays, seed=0).makespan),
            "simultaneous": float(simulate(sc, [0.0] * len(sc.jobs), seed=0).makespan)}


def disagree(simulated: dict[str, float], ratio: float, min_gain: float) -> bool:
    """Whether the simulator's replays (:func:`replay`) refute a stagger whose fluid-model makespan
    is ``ratio`` times a simultaneous start's: the simulator's gain is below ``min_gain`` and below
    the fluid model's by more than ``min_gain``."""
    if simulated["simultaneous"] <= 0:
        return False
    sim_gain = 1.0 - simulated["plan"] / simulated["simultaneous"]
    return sim_gain < min_gain and (1.0 - ratio) - sim_gain > min_gain
