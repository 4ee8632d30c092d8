"""The node's cores in the fluid model: CPU time shared by every job's tasks (private to :mod:`hpcstagger.model`).

With ``[node] cores = C`` every CPU task uses one core at full speed, and while k tasks are on
the node each runs at ``min(1, C / k)`` of its speed (processor sharing). A job's tasks come in
groups of identical tasks, each alternating between the CPU (its work ``s`` at full speed) and
something else (its think time ``Z``: reading from the source, a full or empty buffer, waiting
for a step):

- its ranks' steps: ``R`` tasks in lockstep (one unit), each step ``R * B * t + handoff`` of work
  (without workers also the fetches' CPU), once per step period;
- its workers: ``R * W`` tasks, each sample ``prep`` plus a hit's time, or a read's CPU work
  (``read_cpu``) for a miss, once per ``R * W`` samples of the job;
- a rank starting up (imports, backend, model, workers): ``R`` tasks always on the CPU.

The stationary law of such a network (a processor-sharing station with a state-dependent speed,
and one private delay per task) is product form and insensitive to the distributions (BCMP), the
same law :class:`._loader.Sharing` sums for the source; here each group's work differs, which
scales its think time to ``Z / s``. Each group's result is the mean speed of its tasks' work.
"""

from __future__ import annotations

from typing import NamedTuple
from collections.abc import Collection, Sequence

from hpcstagger.model._loader import Shape, Sharing


class Group(NamedTuple):
    """``F`` identical CPU tasks, each ``work`` seconds at full speed, then ``think`` seconds off
    the CPU; ``gang``: they run together (a job's ranks in lockstep)."""

    F: int
    work: float
    think: float
    gang: bool = False


class CpuShare:
    """Processor sharing of ``cores`` among up to ``most`` CPU tasks (see the module docstring)."""

    def __init__(self, cores: float, most: int):
        self.cores = float(cores)
        self.most = max(1, int(most))
        speed = [0.0] + [min(1.0, self.cores / k) for k in range(1, self.most + 1)]
        self.sharing = Sharing(speed, 1.0)

    def speeds(self, groups: Sequence[Group]) -> list[float]:
        """Each group's mean speed (0 < speed <= 1) while its tasks are on the CPU."""
        live = [i for i, g in enumerate(groups) if g.F > 0 and g.work > 0.0]
        out = [1.0] * len(groups)
        if not live or sum(groups[i].F for i in live) <= self.cores:
            return out  # never more tasks than cores
        F = [groups[i].F for i in live]
        Z = [max(0.0, groups[i].think) / groups[i].work for i in live]
        gang = [groups[i].gang for i in live]
        speed, _ = self.sharing.solve(F, Z, gang, moments=False)
        for i, v in zip(live, speed, strict=True):
            out[i] = min(1.0, max(v, 1e-9))
        return out


def groups(loaders: Sequence[Shape], speed: Sequence[Sequence[float]], hit_time: float, running: Sequence[int],
           x: Sequence[float], m: Sequence[float],
           starting: Collection[int]) -> tuple[list[Group], list[tuple[int, int]]]:
    """The CPU task groups of the running jobs (at read rates ``x``, miss fractions ``m`` and
    their current ``speed``: steps, workers, start-up) and of the ``starting`` ones, and for each
    group its (job, which speed): 0 the steps, 1 the workers, 2 the start-up."""
    out, where = [], []
    for j in running:
        L = loaders[j]
        vm, vw, _ = speed[j]
        fetch = L.prep + (1.0 - m[j]) * hit_time + m[j] * L.read_cpu  # a sample's CPU work in its fetcher
        work = L.step + (L.B * fetch if L.W == 0 else 0.0)
        out.append(Group(L.R, work, L.R * L.B / x[j] - work / vm, L.R > 1))
        where.append((j, 0))
        if L.W > 0 and fetch > 0.0:
            out.append(Group(L.R * L.W, fetch, L.R * L.W / x[j] - fetch / vw))
            where.append((j, 1))
    for j in starting:
        R = loaders[j].R
        out.append(Group(R, 1.0, 0.0, R > 1))
        where.append((j, 2))
    return out, where
