"""The fluid model's time-stepping engine (private to :mod:`hpcstagger.model`; see :mod:`.fluid` for the model).

State. Samples are counted by class. A class is the set of running jobs that have yet to read the
sample this epoch, plus whether, and in which block, it is cached. ``Nu`` counts uncached samples
and ``Nb[b]`` cached ones in block b, blocks ordered from least to most recently used (minio
needs one block; lru keeps the age order, up to ``Quality.max_blocks`` blocks). A class tensor has one
axis of length 2 per job, so "samples job j has yet to read" is a view. Tracking the joint
classes, rather than one hit fraction per job, keeps the correlations between jobs exact in
expectation: a sample a job inserted is one it has already read.

Rates. :meth:`Engine.rates` solves, at a state, the fixed point between each job's prefetch
pipeline (its read rate given the bandwidth its misses get, :mod:`._pipeline`) and the shared
source (the bandwidth each reader's misses get given every job's think time between misses, by
the product-form law of processor sharing, :meth:`Engine.share_product`), with ``[node] cores``
also the CPU speeds (:mod:`._cpu`); jobs of one order draw from their leaders' classes (:mod:`._readorder`).

Steps. Between events (job starts, epoch ends, the cache filling up) the rates are constant when
the cache contents do not change, and the engine jumps to the next event. Otherwise it takes
midpoint steps of adaptive length; the predictor uses the previous midpoint rates and the exact
derivative of each job's uncached-unread count, so a step costs one rate solve.

Snapshots. :meth:`Engine.run` can record its state at every step and resume from such a record;
a run with other delays may resume from a record taken before the first start time that differs
(the planner's searches share these prefixes). A resumed run equals a fresh one exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from hpcstagger.errors import ModelError
from hpcstagger.model import _cpu, _fixed, _loader, _pipeline
from hpcstagger.model._cachestate import CacheState
from hpcstagger.model._quality import FINE, Quality
from hpcstagger.model._readorder import OrderState
from hpcstagger.model.scenario import Scenario

# Samples are tracked per subset of jobs (2**jobs classes), which bounds the number of jobs.
MAX_JOBS = 12




def pipe_fluid(P: int, h: float, a: float, b: float, t: float) -> float:
    """The plain fluid rule, one sample per max(tau, t): no prefetch-buffer loss (for ablations)."""
    tau = h * a + (1.0 - h) * b
    return tau if tau > t else t


# Seconds per sample of a job's loader/compute pipeline (pipe_fluid ignores the buffer loss).
PIPE: Callable[[int, float, float, float, float], float] = _pipeline.sample_time
# "product" (processor sharing, product form) or "independent" (readers independent; an ablation).
SHARING = "product"
# Feed the pipeline the variance of miss times that sharing causes (product form only).
MISS_VARIANCE = True

@dataclass(frozen=True)
class Snapshot:
    """The engine's state at the top of a step, at time ``t``, with the delays of the jobs started."""

    t: float
    started: tuple[tuple[int, float], ...]
    state: tuple[Any, ...]


class Engine(CacheState, OrderState):
    """Integrates one scenario; reusable for many delay vectors (one run at a time)."""

    def __init__(self, sc: Scenario, quality: Quality = FINE, record: bool = False):
        import numpy as np

        self.np = np
        self.J = J = len(sc.jobs)
        if J > MAX_JOBS:
            raise ModelError(f"the fluid model handles at most {MAX_JOBS} jobs, got {J}; "
                             "plan the jobs in groups of at most that many")
        self.q = quality
        self.record = record
        self.n = float(sc.dataset.samples)
        self.s = float(sc.dataset.sample_bytes)
        self.loaders = _loader.shapes(sc)
        self.F = [j.fetchers() for j in sc.jobs]
        total = sum(self.F)
        self.per_reader = [0.0] + [sc.storage.per_reader(k) for k in range(1, total + 1)]
        self.read_time = [0.0] + [self.s / self.per_reader[k] for k in range(1, total + 1)]
        self.sharing = _loader.Sharing(self.per_reader, self.s)
        self.hit_time = sc.hit_time  # partitioned: the mean of a local and a remote hit
        self.hit_spread = _loader.hit_spread(sc)  # and how the two differ (None: every hit alike)
        self.cap = float(sc.cache_samples)  # partitioned: every node's cache, one cache of owners
        self.initial = float(sc.initial_samples)
        self.lru = sc.cache.policy == "lru" and 0 < self.cap < self.n
        self.epochs = [j.epochs for j in sc.jobs]
        self.startup = [j.startup for j in sc.jobs]
        self.epoch_start = [j.epoch_start for j in sc.jobs]
        # jobs that read the same order (:mod:`._readorder`), and the window their lookups are spread over
        self.orders = [j.order for j in sc.jobs]
        self.grouped = any(o and self.orders.count(o) > 1 for o in self.orders)
        self.window = [float(max(1, L.W) * L.R * L.B) for L in self.loaders]
        self.coalesce = sc.cache.coalesce
        # samples' worth of bytes a miss reads; the others are uncached samples it inserts too (readahead)
        self.ra = float(sc.cache.readahead)
        # the node's cores (None: CPU time not shared; a job then starts ``startup`` after its delay);
        # a partitioned cache's nodes pool theirs, the jobs' ranks spread evenly over them
        tasks = sum(j.fetchers() + j.ranks for j in sc.jobs)
        self.cpu = _cpu.CpuShare(sc.total_cores, tasks) if sc.node.cores else None
        self.speed = [[1.0, 1.0, 1.0] for _ in range(J)]
        # a job's time per sample if it missed everything alone: the scale of step errors
        self.t_ref = [self.job_time(j, 1.0, self.read_time[self.F[j]], self.read_time[self.F[j]] ** 2)
                      for j in range(J)]
        self.shape = (2,) * J
        # length-1 slices (not integers) so that every index is a view, even with one job
        self.sl1 = [tuple(slice(1, 2) if ax == J - 1 - j else slice(None) for ax in range(J)) for j in range(J)]
        self.sl0 = [tuple(slice(0, 1) if ax == J - 1 - j else slice(None) for ax in range(J)) for j in range(J)]
        self.bsl1 = [(slice(None),) + sl for sl in self.sl1]
        self.bsl0 = [(slice(None),) + sl for sl in self.sl0]
        # maskmat[k, j] = 1 when flat class k has job j yet to read (bit j of k)
        self.maskmat = np.array([[(k >> j) & 1 for j in range(J)] for k in range(1 << J)], dtype=float)
        self.bit1 = [np.ascontiguousarray(self.maskmat[:, j]) for j in range(J)]  # column j, flat
        self.empty_block = np.zeros((1,) + self.shape)  # lru's newest block at the start of a step
        self.reset()

    # ---- state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        np, J = self.np, self.J
        self.t = 0.0
        self.status = [0] * J           # 0 waiting, 1 running, 2 done, 3 paused (an epoch starting), 4 starting up
        self.epoch = [0] * J
        self.Nu = np.zeros(self.shape)
        self.Nu[(0,) * J] = self.n - self.initial
        self.Nb = np.zeros((1,) + self.shape)
        self.Nb[(0,) * (J + 1)] = self.initial
        self.resume: dict[int, float] = {}  # paused jobs (status 3): when they go on
        self.done = [0.0] * J           # samples read in total
        self.finish = [math.inf] * J
        self.b = [0.0] * J              # warm start of the bandwidth fixed point
        self.m2: dict[int, float] = {}  # second moment of each reader's miss time (warm start)
        self.swap_state = {}  # OrderState.hold's warm start
        self.last_m2: list[float] = []
        self.starting: dict[int, float] = {}  # jobs starting up (status 4): start-up work left
        self.speed = [[1.0, 1.0, 1.0] for _ in range(J)]  # CPU speed of each job's steps, workers, start-up
        self.step_frac = 1.0 / 32       # current step, as a fraction of an epoch
        self.fresh = True               # solve the rates afresh at the next step (after an event)
        self.hist: tuple | None = None  # (running jobs, 1/x, dt, slope) of the last step, for step control
        self.full = self.cap <= 0 or self.initial >= self.cap - 1e-9 * self.n  # full (it then stays full)
        self.x: list[float] = [0.0] * J  # last midpoint rates: the next predictor
        self.m: list[float] = [0.0] * J
        self.series: list[tuple] = []

    def snapshot(self, delays: list[float]) -> Snapshot:
        started = tuple((j, delays[j]) for j in range(self.J) if self.status[j] != 0)
        state = (self.t, list(self.status), list(self.epoch), self.Nu.copy(), self.Nb.copy(), list(self.done),
                 list(self.finish), list(self.b), self.step_frac, self.fresh, list(self.x), list(self.m),
                 self.hist, self.full, dict(self.m2), dict(self.resume), dict(self.starting),
                 [list(v) for v in self.speed])
        return Snapshot(self.t, started, state)

    def restore(self, snap: Snapshot) -> None:
        (self.t, status, epoch, Nu, Nb, done, finish, b, self.step_frac, self.fresh, x, m, self.hist, self.full,
         m2, resume, starting, speed) = snap.state
        self.m2 = dict(m2)
        self.swap_state = {}
        self.starting = dict(starting)
        self.speed = [list(v) for v in speed]
        self.resume = dict(resume)
        self.status, self.epoch, self.done, self.finish = list(status), list(epoch), list(done), list(finish)
        self.Nu, self.Nb, self.b, self.x, self.m = Nu.copy(), Nb.copy(), list(b), list(x), list(m)
        self.series = []

    # ---- rates ----------------------------------------------------------------------------------
    def rates(self, U: list[float], v: list[float]) -> tuple[list[float], list[float]]:
        """Per-job read rate x (samples/s) and miss fraction m at a state (x = 0 when not running).

        With the node's cores, also each job's CPU speeds (``self.speed``), solved jointly."""
        J, s = self.J, self.s * self.ra  # bytes a miss reads
        x = [0.0] * J
        m = [0.0] * J
        readers, running = [], []
        for j in range(J):
            if self.status[j] != 1:
                continue
            running.append(j)
            mj = v[j] / U[j] if U[j] > 0 else 0.0
            mj = 0.0 if mj < 1e-12 else (1.0 if mj > 1.0 else mj)
            m[j] = mj
            if mj > 0.0:
                readers.append(j)
            else:
                x[j] = 1.0 / self.job_time(j, 0.0, 0.0, 0.0)
        cpu = self.cpu is not None and (running or self.starting)
        if not readers and not cpu:
            return x, m
        b = self.b
        for j in readers:
            if b[j] <= 0.0:
                b[j] = self.per_reader[1]
        share = self.share_product if SHARING == "product" else self.share_independent
        variance = SHARING == "product" and MISS_VARIANCE
        tol = self.q.fixed_point_tol
        F = self.F
        relax = _fixed.Relax()
        m2 = self.m2  # second moment of each reader's miss time (sharing makes it vary)
        for _ in range(60):
            Z = []
            for j in readers:
                miss_t = s / b[j]
                xj = x[j] = 1.0 / self.job_time(j, m[j], miss_t, m2.get(j, miss_t * miss_t))
                z = F[j] / (xj * m[j]) - miss_t  # a fetcher's think time between two of its misses
                Z.append(z if z > 0.0 else 0.0)
            if cpu:
                for j in running:
                    if m[j] <= 0.0:
                        x[j] = 1.0 / self.job_time(j, 0.0, 0.0, 0.0)
            # the sharing law counts reads of sample_bytes: a read of ra times that is ra reads' time
            nb = share(readers, [z / self.ra for z in Z] if self.ra != 1.0 else Z) if readers else []
            if variance and readers:
                for j, m2j in zip(readers, self.last_m2, strict=True):
                    m2[j] = m2j * self.ra * self.ra
            speeds = self.cpu_speeds(running, x, m) if cpu else []
            steps = [(nbj - b[j]) / b[j] for j, nbj in zip(readers, nb, strict=True)]
            steps += [(new - old) / old for _, _, old, new in speeds]
            change = max(map(abs, steps), default=0.0)
            damp = relax.update(change, steps)
            for j, nbj in zip(readers, nb, strict=True):
                b[j] += damp * (nbj - b[j])
            self.set_speeds(speeds, min(damp, 1.0))
            if change < tol:
                break
        return x, m

    def job_time(self, j: int, m: float, miss_t: float, miss_m2: float) -> float:
        """Job j's steady seconds per sample at miss fraction m, a miss taking miss_t on average
        (second moment miss_m2; sharing makes it vary), its CPU work at its current speeds:
        see :mod:`._loader`."""
        L, a, hit = self.loaders[j], self.hit_time, self.hit_spread
        if self.cpu is not None:
            vm, vw, _ = self.speed[j]
            if L.W == 0:
                vw = vm  # the main process fetches
            L = L.at_speed(vm, vw)
            a /= vw
            if hit is not None:
                hit = (hit[0] / vw, hit[1] / (vw * vw))
        return _loader.time_per_sample(L, m, a, miss_t, miss_m2, PIPE, MISS_VARIANCE, hit)

    def cpu_speeds(self, running: list[int], x: list[float], m: list[float]) -> list[tuple[int, int, float, float]]:
        """(job, which, old speed, new speed) of each CPU group (:func:`._cpu.groups`) at these rates."""
        assert self.cpu is not None
        groups, where = _cpu.groups(self.loaders, self.speed, self.hit_time, running, x, m, self.starting)
        new = self.cpu.speeds(groups)
        return [(j, k, self.speed[j][k], v) for (j, k), v in zip(where, new, strict=True)]

    def set_speeds(self, speeds: list[tuple[int, int, float, float]], damp: float) -> None:
        """Move each CPU group's speed towards its new value (by ``damp``)."""
        for j, k, old, new in speeds:
            self.speed[j][k] = old + damp * (new - old)

    def share_product(self, readers: list[int], Z: list[float]) -> list[float]:
        """Mean bytes/s each reading job's misses get, by processor sharing in product form.

        Each of a job's fetchers alternates between thinking (``Z`` seconds on average: hits,
        compute, a full buffer) and reading one sample at the source, which gives each of k
        concurrent reads ``bandwidth[k-1] / k``. This is a closed network of a processor-sharing
        station with a state-dependent rate and one private delay station per fetcher, so the
        stationary law is product form (BCMP) and insensitive to the distributions (see
        :class:`._loader.Sharing`). Also sets ``last_m2``, the second moment of a miss's time.
        """
        bw, self.last_m2 = self.sharing.solve([self.F[j] for j in readers], Z,
                                              [self.loaders[j].W == 0 for j in readers])
        return bw

    def share_independent(self, readers: list[int], Z: list[float]) -> list[float]:
        """Mean bytes/s per reader if readers read independently (busy fraction read/(read+think))."""
        busy = [(self.s / self.b[j]) / (Z[k] + self.s / self.b[j]) for k, j in enumerate(readers)]
        out = []
        for k, _ in enumerate(readers):
            dist = [1.0]
            for k2, p in enumerate(busy):
                if k2 != k:
                    nd = [0.0] * (len(dist) + 1)
                    for c, q in enumerate(dist):
                        nd[c] += q * (1.0 - p)
                        nd[c + 1] += q * p
                    dist = nd
            out.append(sum(q * self.per_reader[c + 1] for c, q in enumerate(dist)))
        return out

    # ---- driver ---------------------------------------------------------------------------------
    def run(self, delays: list[float], resume: Snapshot | None = None,
            keep: list[Snapshot] | None = None, stop: float = math.inf) -> list[float]:
        """Finish time of every job when job j starts at ``delays[j]``; optionally resume/record.

        With ``stop``, the run ends as soon as the time passes it with a job unfinished, whose
        finish time is then reported as inf (the makespan is known to exceed ``stop``).
        """
        if resume is None:
            self.reset()
        else:
            self.restore(resume)
        J, n, q = self.J, self.n, self.q
        guard = 0
        counted = None  # the counts at the end of the last step, while the state stays as it left it
        while True:
            guard += 1
            if guard > 1_000_000:
                raise ModelError("the fluid model made no progress; please report this scenario")
            if keep is not None:
                keep.append(self.snapshot(delays))
            if self._starts(delays):
                counted = None
            run = [j for j in range(J) if self.status[j] == 1]
            if not run and not self.resume and not any(st in (0, 4) for st in self.status):
                break
            if self.t > stop:
                return [f if f <= stop else math.inf for f in self.finish]
            if not run:
                self._record(None, None)
                if self.starting:
                    self.set_speeds(self.cpu_speeds([], [], []), 1.0)
                t_next = self._next_start(delays)
                self._advance_starts(t_next - self.t)
                self.t = t_next
                continue
            U, v = counted if counted is not None else self.counts(self.Nu, self.Nb)
            lead = self.leads(U)
            masks = self.masks(lead) if lead else None
            changing = self.changing() or self.pairs_running()
            if self.fresh or not changing:
                self.x, self.m = self.rates(*self.rate_counts(U, v, self.Nu, self.Nb, lead))
                if lead and self.coalesce:
                    self.hold(self.x, self.m, U, v, self.Nu, self.Nb, lead)
                self.fresh = False
            x, m = self.x, self.m
            t_next_start = self._next_start(delays)
            self._record(x, m)
            dt = min(min(U[j] / x[j] for j in run), t_next_start - self.t)
            if lead:
                dt = min(dt, max(self.catch_up(x, U, lead), 1e-9))
            if changing:
                # midpoint rule; the predictor uses the last midpoint rates (still second order)
                frac = self.step_frac
                dt = min(dt, min(n * frac / x[j] for j in run))
                dt = self._fill_time(x, m, dt)
                lead2: dict[int, tuple[int, float]] = {}  # the leads at the midpoint, where it is stepped to
                if self.pairs_running() or (self.lru and sum(x[j] * m[j] for j in run) * dt > self.cap):
                    # the cache turns over within half a step (its fast dynamics only balance out
                    # over a turnover), or jobs follow others of their order: predict the midpoint
                    # with a real half step
                    Nu2, Nb2 = self.advance(U, v, x, m, dt / 2, state=(self.Nu, self.Nb), masks=masks)
                    raw2 = self.counts(Nu2, Nb2)
                    lead2 = self.leads(raw2[0])
                    U2, v2 = self.rate_counts(*raw2, Nu2, Nb2, lead2)
                else:
                    dv = self.dvdt(x, m)
                    U2 = [U[j] - x[j] * dt / 2 for j in range(J)]
                    v2 = [min(max(v[j] + dv[j] * dt / 2, 0.0), max(U2[j], 0.0)) for j in range(J)]
                x2, miss2 = self.rates(U2, v2)
                if lead and self.coalesce:
                    if lead2:
                        self.hold(x2, miss2, *raw2, Nu2, Nb2, lead2)
                    else:
                        self.convoy(x2, U, lead)
                # Step control. The midpoint rule is exact while a job's time per sample changes
                # linearly in time, so what limits the step is the change of that slope: the
                # second difference of the midpoint times per sample over the last steps. After
                # an event (no history yet) the first difference is used instead.
                inv = [1.0 / x2[j] if x2[j] > 0 else 0.0 for j in range(J)]
                hist = self.hist
                if hist is not None and hist[0] == run:
                    _, inv1, dt1, slope1 = hist
                    slope = [(inv[j] - inv1[j]) / (0.5 * (dt + dt1)) for j in range(J)]
                    if slope1 is not None:
                        err = max(abs(slope[j] - slope1[j]) * dt * dt / self.t_ref[j] for j in run)
                        grow = 2.0 if err <= 0 else min(2.0, max(0.5, 0.9 * (q.step_tol / err) ** (1 / 3)))
                    else:
                        err = max(abs(inv[j] - inv1[j]) / self.t_ref[j] for j in run)
                        grow = 2.0 if err <= 0 else min(2.0, max(0.5, 0.9 * math.sqrt(q.step_tol / err)))
                    self.hist = (run, inv, dt, slope)
                else:
                    grow = 1.0
                    self.hist = (run, inv, dt, None)
                self.step_frac = min(q.max_step, max(q.min_step, frac * grow))
                x, m = self.x, self.m = x2, miss2
                t_next_start = self._next_start(delays)
                # re-aim at the nearest event with the midpoint rates
                dt = min([dt] + [U[j] / x[j] for j in run] + [t_next_start - self.t])
                if lead:
                    dt = min(dt, max(self.catch_up(x, U, lead), 1e-9))
                dt_fill = self._fill_time(x, m, dt)
                if dt_fill < dt:
                    dt = dt_fill
                    self.fresh = True
                    self.hist = None
            # jobs whose epoch end this step was aimed at (the clamps in advance may leave a crumb)
            ending = [j for j in run if U[j] <= x[j] * dt * (1.0 + 1e-9)]
            self.advance(U, v, x, m, dt, masks=masks)
            self._advance_starts(dt)
            self.t += dt
            U, v = counted = self.counts(self.Nu, self.Nb)
            for j in run:
                self.done[j] += x[j] * dt
                if j in ending or U[j] <= 1e-9 * n:
                    self._end_epoch(j)
                    counted = None
            if self.t >= t_next_start - 1e-12:
                self.fresh = True
        self._record(None, None)
        return list(self.finish)

    def _starts(self, delays: list[float]) -> bool:
        """Start the jobs whose time has come (their start-up, then their first epoch) and resume
        the paused ones whose epoch start is over; True when a job began an epoch."""
        began = False
        for j in range(self.J):
            st = self.status[j]
            if st == 0 and self.cpu is not None and delays[j] <= self.t + 1e-12 and self.startup[j] > 0:
                self.status[j] = st = 4  # its start-up is CPU work, shared with the others
                self.starting[j] = self.startup[j]
                self.speed[j] = [1.0, 1.0, 1.0]
                self.fresh = True
                self.hist = None
            if ((st == 0 and delays[j] + (self.startup[j] if self.cpu is None else 0.0) <= self.t + 1e-12)
                    or (st == 4 and self.starting[j] <= 1e-9 * self.startup[j])):
                self.starting.pop(j, None)
                self.b[j] = 0.0
                self.m2.pop(j, None)
                self._set_bit(j, True)
                self._begin_epoch(j)
                began = True
            elif st == 3 and self.resume[j] <= self.t + 1e-12:
                del self.resume[j]
                self.status[j] = 1
                self.fresh = True
                self.hist = None
        return began

    def _next_start(self, delays: list[float]) -> float:
        """When the next job starts, ends its start-up, or ends a pause (inf: none left)."""
        out = min(self.resume.values(), default=math.inf)
        for j in range(self.J):
            if self.status[j] == 0:
                out = min(out, delays[j] + (self.startup[j] if self.cpu is None else 0.0))
            elif self.status[j] == 4:
                out = min(out, self.t + self.starting[j] / self.speed[j][2])
        return out

    def _advance_starts(self, dt: float) -> None:
        for j in self.starting:
            self.starting[j] = max(0.0, self.starting[j] - self.speed[j][2] * dt)

    def _end_epoch(self, j: int) -> None:
        self.epoch[j] += 1
        if self.epoch[j] >= self.epochs[j]:
            self.fresh = True
            self.hist = None
            self.status[j] = 2
            self.finish[j] = self.t
            self._set_bit(j, False)
        else:
            self._set_bit(j, True)
            self._begin_epoch(j)

    def _begin_epoch(self, j: int) -> None:
        """Job j starts an epoch: it pauses while its loader's pipeline fills (:func:`._loader.bubble`)."""
        self.fresh = True
        self.hist = None
        U, v = self.counts(self.Nu, self.Nb)
        m = min(1.0, v[j] / U[j]) if U[j] > 0 else 0.0
        bw = self.b[j] if self.b[j] > 0 else self.per_reader[self.F[j]]
        pause = _loader.bubble(self.loaders[j], m, self.hit_time, self.ra * self.s / bw)
        if self.epoch[j] > 0:
            pause += self.epoch_start[j]  # the loader starts again (its workers spawned again)
        if pause > 1e-12:
            self.status[j] = 3
            self.resume[j] = self.t + pause
        else:
            self.status[j] = 1

    def _record(self, x: list[float] | None, m: list[float] | None) -> None:
        if not self.record:
            return
        J = self.J
        prog = tuple(min(1.0, self.done[j] / (self.epochs[j] * self.n)) for j in range(J))
        if x is None or m is None:
            hit = tuple(math.nan for _ in range(J))
            bw = 0.0
        else:
            hit = tuple(1.0 - m[j] if self.status[j] == 1 else math.nan for j in range(J))
            bw = sum(x[j] * m[j] for j in range(J) if self.status[j] == 1) * self.s * self.ra
        self.series.append((self.t, prog, hit, bw, (self.n - float(self.Nu.sum())) / self.n))
