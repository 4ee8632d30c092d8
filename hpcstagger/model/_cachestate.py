"""The class state of the fluid model's cache and how a step changes it (private; see ``_engine``).

``CacheState`` is a mixin of :class:`~hpcstagger.model._engine.Engine`: it holds no state of its
own and works on the engine's ``Nu`` (uncached samples per class) and ``Nb`` (cached samples per
block and class, least recently used block first). A class tensor has one axis of length 2 per
job; index 1 on job j's axis means "job j has yet to read these samples this epoch".
"""

from __future__ import annotations

import math
from typing import Any

from hpcstagger.model._quality import Quality


class CacheState:
    """Class-state operations: counts, one step of reads, lru eviction, derivatives, epoch bits."""

    # The engine's attributes these methods use (set by Engine.__init__ and Engine.reset).
    np: Any  # the numpy module, imported when the engine is built
    J: int
    q: Quality
    n: float
    cap: float
    ra: float
    lru: bool
    full: bool
    shape: tuple[int, ...]
    status: list[int]
    Nu: Any  # ndarray, one axis of length 2 per job
    Nb: Any  # ndarray, blocks first
    maskmat: Any
    bit1: list[Any]
    empty_block: Any
    sl1: list[tuple[slice, ...]]
    sl0: list[tuple[slice, ...]]
    bsl1: list[tuple[slice, ...]]
    bsl0: list[tuple[slice, ...]]

    def counts(self, Nu: Any, Nb: Any) -> tuple[list[float], list[float]]:
        """Per job: samples yet to read this epoch (U) and how many of those are not cached (v)."""
        v = Nu.reshape(-1) @ self.maskmat
        U = v + Nb.reshape(len(Nb), -1).sum(axis=0) @ self.maskmat
        return U.tolist(), v.tolist()

    # ---- state changes --------------------------------------------------------------------------
    # The steps work on flat views of the class tensors (bit j of a class's index set: job j has yet
    # to read it). Moving a share of the classes with bit j set to class k - 2**j, as a whole
    # contiguous array times a 0/1 mask and a shifted slice, moves the same amounts as strided
    # views would, at a fraction of numpy's per-call overhead on these tiny arrays.
    def advance(self, U: list[float], v: list[float], x: list[float], m: list[float], dt: float,
                state: tuple[Any, Any] | None = None, masks: list[Any] | None = None) -> tuple[Any, Any]:
        """Move the class state on by dt at read rates x and miss fractions m (held constant).

        ``U`` and ``v`` are the current per-job counts. A sample one job inserts during the step
        counts as cached for half the step when another job looks for hits, which keeps the step
        second order. ``masks[j]`` (flat 0/1 over the classes) is where job j draws from: its
        unread samples (``bit1[j]``, the default), or for a job following another of its order
        those its leader has read (:mod:`._readorder`); such a job draws both parts of that class in
        proportion, whatever its miss fraction for the source.
        """
        np = self.np
        total_of = np.add.reduce  # ndarray.sum without its Python wrapper
        if state is None:  # move the engine's own state
            Nu, Nb = self.Nu, self.Nb
        else:  # work on copies and return them
            Nu, Nb = state[0].copy(), state[1].copy()
        run = [j for j in range(self.J) if self.status[j] == 1]
        follow: list[int] = []  # jobs following another of their order: drawn after everyone else
        if masks is None:
            masks = self.bit1
        else:
            follow = sorted((j for j in run if masks[j] is not self.bit1[j]), key=lambda j: U[j])
            run = [j for j in run if j not in follow]
        misses = {j: min(x[j] * m[j] * dt, v[j]) for j in run}
        total_miss = sum(misses.values())
        if self.lru:
            ins_share = 1.0
        else:
            free = max(self.cap - (self.n - float(total_of(Nu, None))), 0.0)
            ins_share = min(1.0, free / (self.ra * total_miss)) if total_miss > 0 else 0.0
        # Each job reads a fraction of its pools, one job after another, so the fractions compose
        # multiplicatively (a sample two jobs read in the same step ends read by both) and nothing
        # is counted twice however long the step.
        fresh = np.zeros(self.shape)
        N = fresh.size
        uncached, fresh_flat = Nu.reshape(N), fresh.reshape(N)
        for j in run:  # misses: uncached samples the job has yet to read
            if misses[j] > 0.0:
                self._read_uncached(Nu, uncached, fresh_flat, j, misses[j], ins_share, masks[j])
        # Hits: cached samples, and samples inserted during the step, which were cached for half
        # of it on average. Other jobs' hits keep a sample cached and unread by this job, so the
        # pools taken before any hit is applied stay right.
        avail = 0.5  # fraction of the step a sample inserted during it is cached, on average
        if self.lru:
            # lru evicts as it inserts. While the step inserts no more than the cache holds, the
            # samples it evicts were cached for half of it on average: evict half of them before
            # the hits. When it inserts more (f < 1 turnovers' worth, a small cache), every old
            # sample goes within the first f of the step, and an inserted one lasts f of it.
            cached = self.n - float(total_of(Nu, None))
            inserted = float(total_of(fresh, None))
            over = cached - self.cap
            f = self.cap / inserted if inserted > 0 else math.inf
            if f < 1.0:
                avail = f * (1.0 - 0.5 * f)
                # old sample k goes after cap - cached + k inserts: cached for (cap - cached/2) / I
                # of the step on average, so keep that share of them for the hits
                early = min(max(cached * (1.0 - (self.cap - 0.5 * cached) / inserted), 0.0), cached)
            else:
                early = 0.5 * over
            if early > 0:
                Nb = self._evict(Nb, Nu, early)
            Nb = np.concatenate((Nb, self.empty_block))
        blocks = Nb.reshape(len(Nb), N)
        cached_now = total_of(blocks, 0) + avail * fresh_flat
        pools = [float(cached_now @ masks[j]) for j in range(self.J)]
        fracs = []
        short = {}
        for j in run:
            want = x[j] * (1.0 - m[j]) * dt
            if want > 0.0 and pools[j] > 0.0:
                fracs.append((j, min(1.0, want / pools[j])))
            if want > pools[j]:
                short[j] = want - max(pools[j], 0.0)
        dest = blocks[-1 if self.lru else 0]  # a hit makes the sample most recently used
        for j, frac in fracs:
            d = N - (1 << j)
            moved = blocks * (masks[j] * frac)  # cached samples job j has yet to read, every block
            blocks -= moved
            dest[:d] += total_of(moved, 0)[-d:]
            moved = fresh_flat * (masks[j] * (avail * frac))
            fresh_flat -= moved
            fresh_flat[:d] += moved[-d:]  # still inserted during the step, for later jobs' hits
        for j, extra in short.items():  # after the hits, which must not see these inserts
            # fewer cached samples left to read than the rates assumed: the job reads the rest of
            # its share of the step from the source, so that it reads x * dt samples in all
            self._read_uncached(Nu, uncached, fresh_flat, j, extra, ins_share, masks[j])
        for j in follow:  # leaders first, so a follower may read what its leader read this step
            self._follow(Nu, uncached, blocks, dest, fresh_flat, j, x[j] * dt, masks[j])
        dest += fresh_flat
        if self.lru:
            Nb = self._evict(Nb, Nu, float(total_of(Nb, None)) - self.cap)
        np.maximum(Nu, 0.0, out=Nu)
        np.maximum(Nb, 0.0, out=Nb)
        if state is None:
            self.Nb = Nb
        return Nu, Nb

    def _follow(self, Nu: Any, uncached: Any, blocks: Any, dest: Any, fresh: Any, j: int, want: float,
                mask: Any) -> None:
        """Job j, a follower (:mod:`._readorder`), reads ``want`` samples of its class ``mask``, cached
        (in any block, or inserted this step) and uncached in proportion; past the end of that
        class it overtakes its leader and reads on among all it has yet to read."""
        np = self.np
        d = len(uncached) - (1 << j)
        for pool_mask in (mask, self.bit1[j]):
            pu = float(uncached @ pool_mask)
            pc = float(np.add.reduce(blocks, 0) @ pool_mask) + float(fresh @ pool_mask)
            if want <= 0.0 or pu + pc <= 0.0:
                continue
            frac = min(1.0, want / (pu + pc))
            moved = blocks * (pool_mask * frac)
            blocks -= moved
            dest[:d] += np.add.reduce(moved, 0)[-d:]
            moved = fresh * (pool_mask * frac)
            fresh -= moved
            fresh[:d] += moved[-d:]
            if pu > 0.0:
                reads = frac * pu
                free = self.cap - (self.n - float(np.add.reduce(uncached, None)))  # what the others left
                share = 1.0 if self.lru else min(1.0, max(free, 0.0) / reads)
                self._read_uncached(Nu, uncached, fresh, j, reads, share, pool_mask)
            want -= frac * (pu + pc)

    def _read_uncached(self, Nu: Any, uncached: Any, fresh: Any, j: int, want: float,
                       ins_share: float, mask: Any) -> None:
        """Job j reads ``want`` of the uncached samples it draws from (``mask``; at most all of
        them): ``ins_share`` of what it reads goes into ``fresh`` (inserted this step), the rest
        stays uncached. ``uncached`` and ``fresh`` are flat; ``Nu`` is ``uncached`` as a class tensor."""
        if mask is self.bit1[j]:
            pool = float(self.np.add.reduce(Nu[self.sl1[j]], None))  # less what earlier jobs inserted this step
        else:
            pool = float(uncached @ mask)
        if pool <= 0.0:
            return
        d = len(uncached) - (1 << j)
        frac = min(1.0, want / pool)
        moved = uncached * (mask * frac)
        uncached -= moved
        if self.ra != 1.0 and ins_share > 0.0:
            # readahead: the other samples' worth each miss read, uncached ones at random (any class)
            left = float(self.np.add.reduce(uncached, None))
            if left > 0.0:
                ahead = uncached * min(1.0, (self.ra - 1.0) * frac * pool * ins_share / left)
                uncached -= ahead
                fresh += ahead
        moved = moved[-d:]
        if ins_share == 1.0:
            fresh[:d] += moved
        elif ins_share > 0.0:
            fresh[:d] += moved * ins_share
        if ins_share < 1.0:
            uncached[:d] += moved * (1.0 - ins_share)

    def _evict(self, Nb: Any, Nu: Any, over: float) -> Any:
        """lru: evict ``over`` samples from Nb into Nu, oldest first, then bound the blocks."""
        np = self.np
        sizes = np.add.reduce(Nb.reshape(len(Nb), -1), 1).tolist()
        k = 0
        while over > 1e-12 and k < len(Nb):
            tot = sizes[k]
            if tot > 0:
                take = min(tot, over)
                if take == tot:  # the whole block: dropped below
                    Nu += Nb[k]
                else:
                    ev = Nb[k] * (take / tot)
                    Nb[k] -= ev
                    Nu += ev
                sizes[k] -= take
                over -= take
            k += 1
        keep = [size > 1e-9 for size in sizes]
        if not all(keep):
            if not any(keep):
                return np.zeros((1,) + self.shape)
            first = keep.index(True)
            Nb = Nb[first:] if all(keep[first:]) else Nb[np.array(keep)]  # usually the oldest go
            sizes = [size for size in sizes if size > 1e-9]
        if len(Nb) > self.q.max_blocks:
            # merge the adjacent pair with the fewest samples (keeps the age order)
            i = min(range(len(sizes) - 1), key=lambda i: sizes[i] + sizes[i + 1])
            Nb[i] += Nb[i + 1]
            Nb = np.delete(Nb, i + 1, axis=0)
        return Nb

    def dvdt(self, x: list[float], m: list[float]) -> list[float]:
        """Rate of change of each job's uncached-unread count v at the current class state."""
        J = self.J
        nu = self.Nu.reshape(-1)
        V = (self.maskmat.T * nu) @ self.maskmat  # V[i, j]: uncached, unread by both i and j
        run = [j for j in range(J) if self.status[j] == 1]
        miss = {j: x[j] * m[j] for j in run}
        total = sum(miss.values())
        ins = 1.0 if (self.lru or not self.full) else 0.0
        # readahead: each miss also inserts ra - 1 uncached samples at random, of every class
        ahead = (self.ra - 1.0) * total * ins / max(float(nu.sum()), 1e-300) if self.ra != 1.0 else 0.0
        oldest = None
        if self.lru and self.full and total > 0:
            blk = self.Nb[0].reshape(-1)
            tot = float(self.np.add.reduce(blk, None))
            if tot > 0:
                oldest = ((blk @ self.maskmat) / tot).tolist()
        out = [0.0] * J
        V = V.tolist()
        # the jobs whose misses insert samples other jobs have yet to read
        inserters = [(i, miss[i] * ins, V[i], V[i][i]) for i in run if miss[i] > 0 and V[i][i] > 0]
        for j in run:
            d = -miss[j]
            for i, rate, Vi, Vii in inserters:
                if i != j:
                    d -= rate * Vi[j] / Vii
            if oldest is not None:
                d += total * oldest[j]
            out[j] = d - ahead * V[j][j]
        return out

    def changing(self) -> bool:
        """Whether the cache contents change while jobs read (minio filling, or lru evicting)."""
        if self.cap <= 0:
            return False
        if self.lru:
            return True
        if self.full:
            return False
        uncached = float(self.Nu.sum())
        if self.n - uncached >= self.cap - 1e-9 * self.n or uncached <= 1e-9 * self.n:
            self.full = True
            return False
        return True

    def _fill_time(self, x: list[float], m: list[float], dt: float) -> float:
        """Time until the cache is full at rates x, m (``dt`` when that is later): an event, since
        minio stops inserting and lru starts evicting then."""
        if self.full:
            return dt
        free = self.cap - (self.n - float(self.Nu.sum()))
        if free <= 1e-9 * self.n:
            self.full = True  # neither policy ever empties the cache again
            return dt
        ins_rate = self.ra * sum(x[j] * m[j] for j in range(self.J) if self.status[j] == 1)
        if ins_rate <= 0:
            return dt
        return min(dt, free / ins_rate)

    def _set_bit(self, j: int, on: bool) -> None:
        """Mark every sample as yet to be read (on) or as read (off) by job j."""
        for arr, s1, s0 in ((self.Nu, self.sl1[j], self.sl0[j]), (self.Nb, self.bsl1[j], self.bsl0[j])):
            total = arr[s1] + arr[s0]
            arr[s1 if on else s0] = total
            arr[s0 if on else s1] = 0.0

