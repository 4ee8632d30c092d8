"""Jobs that read the same order (private to :mod:`hpcstagger.model`; a mixin of the engine).

Jobs with the same ``order`` read the same permutation in the same epoch (PyTorch samplers with
the same seed). Within an epoch such a job's position fixes which samples it has read: the
first ones of the permutation. A job behind another of its order in the same epoch (its
*leader*: of those ahead, the nearest) therefore reads next exactly what the leader has read and
it has not, rather than a random one of its unread samples: its draws come from that class of
the class state, and its hit fraction is that class's cached fraction. Jobs level with each other
(started together) follow in job order.

Unless it is *racing*: a follower's lookups are spread over a window ahead of its position (the
batches its workers are fetching, ``ranks * batch * max(workers, 1)`` samples). A lookup further
ahead than the leader's lead comes before the leader has read that sample, and both read it from
the source: such lookups miss as often as the leader's do. With the lookups spread evenly over
the window, a share ``max(0, 1 - lead / window)`` of them races. Where concurrent misses of a
sample are one read (``[cache] coalesce``: the page cache), a racing follower waits for its
leader's reads instead: it reads nothing from the source and goes at its leader's pace, unless
reading on by itself (its own unread samples, its own misses) it would go faster than its leader
goes: then its lookups run ahead of the leader's reads and it reads those samples itself, the
leader later hitting them, so it passes (:meth:`OrderState.hold`; held to the pace, a faster job
started just after a slower one of its order would crawl behind it for a whole epoch, which the
simulator does not). A follower that has read all its leader has read overtakes it and reads on
among its own unread samples (it is the leader from then on).
"""

from __future__ import annotations

from typing import Any

# A racing follower passes its leader (coalescing reads) when by itself it would go this much faster.
PASS = 1.01


class OrderState:
    """Leaders, racing shares and draw masks of the jobs that share an order."""

    # The engine's attributes these methods use.
    J: int
    status: list[int]
    epoch: list[int]
    bit1: list[Any]
    maskmat: Any
    orders: list[str]
    window: list[float]
    grouped: bool
    coalesce: bool
    b: list[float]
    m2: dict[int, float]
    speed: list[list[float]]
    last_m2: list[float]
    rates: Any  # Engine.rates
    swap_state: dict[Any, tuple[Any, Any, Any, Any]]  # hold's warm start, by the swapped roles

    def leads(self, U: list[float]) -> dict[int, tuple[int, float]]:
        """Each running follower's leader and how much it races (0: reads the leader's samples,
        1: looks them up before the leader has read them), from the unread counts ``U``."""
        if not self.grouped:
            return {}
        out = {}
        for j in range(self.J):
            if self.status[j] != 1 or not self.orders[j]:
                continue
            best = -1
            tie = 1e-9 * (U[j] + 1.0)
            for k in range(self.J):
                # ahead of j, or level with it and first in job order (the two then race)
                ahead = U[k] < U[j] - tie or (abs(U[k] - U[j]) <= tie and k < j)
                if (k != j and ahead and self.orders[k] == self.orders[j] and self.status[k] == 1
                        and self.epoch[k] == self.epoch[j] and (best < 0 or U[k] > U[best])):
                    best = k
            if best >= 0:
                w = self.window[j]
                out[j] = (best, min(1.0, max(0.0, 1.0 - (U[j] - U[best]) / w)))
        return out

    def convoy(self, x: list[float], U: list[float], lead: dict[int, tuple[int, float]]) -> None:
        """With coalescing reads, hold each racing follower (``lead``: :meth:`leads` at ``U``) to
        its leader's pace (in place): it waits for the reads its leader has in flight."""
        for j in sorted(lead, key=lambda i: U[i]):  # leaders first
            k, race = lead[j]
            if race > 0.0 and x[j] > x[k]:
                x[j] = x[k]

    def hold(self, x: list[float], m: list[float], U: list[float], v: list[float], Nu: Any, Nb: Any,
             lead: dict[int, tuple[int, float]]) -> None:
        """Coalescing reads: hold each racing follower to its leader's pace (:meth:`convoy`), unless
        reading on by itself it would go faster than its leader goes: then its lookups run ahead of
        the leader's reads, it reads those samples itself and passes, or, where the leader could
        keep up with it on hits alone, the two go on together at its pace, reading each sample once
        (``x``, ``m`` in place; ``U``, ``v`` the counts before following, ``lead`` :meth:`leads`
        at ``U``)."""
        held = [j for j, (k, race) in lead.items() if race > 0.0 and x[j] > x[k]]
        if held:
            saved = (list(self.b), dict(self.m2), [list(sp) for sp in self.speed], list(self.last_m2))
            # the roles swapped: each held follower reads on, its leader racing behind it (with
            # coalescing reads it then waits for the follower's reads and reads nothing itself)
            swapped = {j: lead[j] for j in lead if j not in held}
            for j in held:
                swapped.setdefault(lead[j][0], (j, 1.0))
            # the swapped fixed point starts where the last one for the same roles ended: it moves
            # little from step to step, and far from the held one's
            key = tuple(sorted(swapped.items()))
            warm = self.swap_state.get(key)
            if warm is not None and len(warm[3]) == len(self.last_m2):
                self.b, self.m2 = list(warm[0]), dict(warm[1])
                self.speed, self.last_m2 = [list(sp) for sp in warm[2]], list(warm[3])
            xa, ma = self.rates(*self.rate_counts(U, v, Nu, Nb, swapped))
            self.swap_state = {key: (self.b, self.m2, self.speed, self.last_m2)}
            self.b, self.m2, self.speed, self.last_m2 = saved
            for j in held:
                k = lead[j][0]
                if xa[j] <= PASS * x[k]:
                    continue
                if swapped.get(k) == (j, 1.0) and xa[k] >= xa[j]:
                    # the leader, reading nothing, would keep up: the two go on as one convoy at
                    # the passer's pace, each sample read once (the leader, ahead by position,
                    # draws the reads); both reading on would read the same samples twice
                    x[k], m[k] = xa[j], ma[j]
                    x[j] = xa[j]
                else:
                    x[j], m[j] = xa[j], ma[j]
                    lead = {i: kr for i, kr in lead.items() if i != j}
        self.convoy(x, U, lead)

    def catch_up(self, x: list[float], U: list[float], lead: dict[int, tuple[int, float]]) -> float:
        """The longest step before a faster follower (``lead``: :meth:`leads` at ``U``) closes half
        its lead on its leader (at least the time to read one window): its rates depend on the
        lead, and past the leader its reads are new samples, which the rates must see (inf: no
        follower is faster)."""
        out = float("inf")
        for j, (k, _) in lead.items():
            if x[j] > x[k]:
                out = min(out, max(0.5 * (U[j] - U[k]), 0.5 * self.window[j]) / (x[j] - x[k]))
        return out

    def pairs_running(self) -> bool:
        """Whether two running jobs of one order are in the same epoch (their rates then change as
        their positions do, even when the cache does not)."""
        if not self.grouped:
            return False
        seen = set()
        for j in range(self.J):
            if self.status[j] == 1 and self.orders[j]:
                key = (self.orders[j], self.epoch[j])
                if key in seen:
                    return True
                seen.add(key)
        return False

    def follow_mask(self, j: int, k: int) -> Any:
        """The classes follower j draws from (flat 0/1): unread by it, and read by its leader k."""
        return self.bit1[j] * (1.0 - self.bit1[k])

    def masks(self, lead: dict[int, tuple[int, float]]) -> list[Any]:
        """Per job, the classes it draws from: :meth:`follow_mask` for a follower, else its unread ones."""
        return [self.follow_mask(j, lead[j][0]) if j in lead else self.bit1[j] for j in range(self.J)]

    def rate_counts(self, U: list[float], v: list[float], Nu: Any, Nb: Any,
                    lead: dict[int, tuple[int, float]] | None = None) -> tuple[list[float], list[float]]:
        """(U, v) whose ratio v/U is each job's miss fraction for the rates: a follower's (``lead``:
        :meth:`leads` at ``U``, found when not given) is its draw class's uncached share, blended
        with its leader's by how much it races."""
        if lead is None:
            lead = self.leads(U)
        if not lead:
            return U, v
        Ur, vr = list(U), list(v)
        nu = Nu.reshape(-1)
        nb = Nb.reshape(len(Nb), -1).sum(axis=0)
        for j in sorted(lead, key=lambda i: U[i]):   # leaders (fewer unread) before their followers
            k, race = lead[j]
            mask = self.follow_mask(j, k)
            vp = float(nu @ mask)
            up = vp + float(nb @ mask)
            own = vp / up if up > 1e-9 else (v[j] / U[j] if U[j] > 0 else 0.0)
            # racing, it reads what its leader reads: again, or (coalescing reads) by waiting for it
            theirs = 0.0 if self.coalesce else (vr[k] / Ur[k] if Ur[k] > 0 else 0.0)
            Ur[j], vr[j] = 1.0, race * theirs + (1.0 - race) * own
        return Ur, vr
