"""``predict``: the fluid, rate-based makespan model of a scenario.

Samples are treated as a continuum. At every instant each running job j reads at a rate
``x_j`` (samples/s), the smaller of what its compute and its loader sustain, and its loader sees a
hit fraction ``h_j``. The model keeps, per job, the number ``U_j`` of samples it has yet to read
this epoch and how many of them are not cached (``v_j``); globally, how many samples are cached.

- **Hit fraction.** ``h_j = 1 - v_j / U_j``: cached samples the job has yet to read over samples it
  has yet to read. It is the cached fraction when the job starts an epoch; a job's own reads leave
  it unchanged on average (it reads its unread samples in random order); it grows when another job
  inserts a sample this job has yet to read (probability ``v_j / uncached``); under lru it shrinks
  when an eviction removes a sample this job has yet to read. For lru the cache is kept as blocks
  of samples ordered by last use, each knowing how many of its samples every job has yet to read,
  so evictions take the oldest samples first.
- **Bandwidth.** A job's loader is reading a miss a fraction ``p_j = x_j m_j s / b_j`` of the time
  (``m_j = 1 - h_j``). While it does, it gets on average ``b_j = E[bandwidth[K-1] / K]``, K being
  1 plus the number of other jobs reading at that moment, taken as independent with
  probabilities ``p_i``. This is processor sharing seen in the mean; when the aggregate bandwidth
  does not depend on the number of readers it reduces to max-min fair sharing of a
  work-conserving source. The ``p``, ``b`` and ``x`` are solved as a fixed point.
- **Pipeline.** The loader needs ``tau_j = h_j s/hit_bw + m_j s/b_j`` per sample on average, and
  compute ``sample_time``. With a prefetch buffer of P samples the pair runs at ``min(1/tau,
  1/sample_time)`` less a loss near balance, when the loader's time per sample varies (hits and
  misses): the buffer then both empties and fills. The loss is the diffusion (Brownian) limit of
  a two-stage line with a buffer of ``P + 1``.
- **Integration.** Between events (job starts, epoch ends, the cache filling up) the rates are
  constant when the cache is not changing (minio once full, no cache, lru that holds the whole
  dataset), so the model jumps from event to event exactly. While the cache fills, or lru evicts,
  the state is integrated with second-order (midpoint) steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import ModelError
from . import _pipeline
from .scenario import Scenario

__all__ = ["Prediction", "predict"]

# Integration steps per epoch of a job while the cache changes (midpoint rule).
_STEPS_PER_EPOCH = 32
# Blocks of the lru age structure kept before the two youngest-adjacent smallest are merged.
_MAX_BLOCKS = 24
# Samples are tracked per subset of jobs (2**jobs classes), which bounds the number of jobs.
_MAX_JOBS = 12


@dataclass(frozen=True)
class Prediction:
    """The fluid model's answer for one set of delays.

    ``makespan`` and ``finish`` (job name -> seconds from the common start) are the prediction.
    The time series, sampled at ``times`` (seconds), are for plots: ``progress`` (fraction of a
    job's samples read), ``hit_rate`` (the job's current hit fraction, nan when not running),
    ``bandwidth`` (bytes/s read from the source) and ``cached`` (fraction of the dataset cached).
    """

    makespan: float
    finish: dict[str, float]
    start: dict[str, float]
    times: tuple[float, ...] = ()
    progress: dict[str, tuple[float, ...]] = field(default_factory=dict)
    hit_rate: dict[str, tuple[float, ...]] = field(default_factory=dict)
    bandwidth: tuple[float, ...] = ()
    cached: tuple[float, ...] = ()


def _pipe_fluid(P: int, h: float, a: float, b: float, t: float) -> float:
    """The plain fluid rule, one sample per max(tau, t): no prefetch-buffer loss (for ablations)."""
    tau = h * a + (1.0 - h) * b
    return tau if tau > t else t


# Seconds per sample of a job's loader/compute pipeline; _pipe_fluid ignores the buffer loss.
_PIPE = _pipeline.sample_time


def _share_default(self: "_Fluid", readers: list[int], Z: list[float]) -> list[float]:
    return self.share_product(readers, Z)


# How the source is shared among readers; share_independent is the simpler ablation.
_SHARE = _share_default


class _Fluid:
    """The integrator's state and rules (one instance per predict call).

    Samples are counted by class: a class is the set of running jobs that have yet to read the
    sample this epoch (bit j of the class index), and whether and where the sample is cached.
    ``Nu[S]`` counts uncached samples of class S; ``Nb[b, S]`` cached ones in block b, blocks
    ordered from least to most recently used (minio keeps one block: order does not matter).
    """

    def __init__(self, sc: Scenario, delays: list[float], record: bool):
        import numpy as np

        self.np = np
        self.sc = sc
        self.J = J = len(sc.jobs)
        if J > _MAX_JOBS:
            raise ModelError(f"the fluid model handles at most {_MAX_JOBS} jobs, got {J}; "
                             "group identical jobs or plan them in batches")
        self.K = K = 1 << J
        self.n = float(sc.dataset.samples)
        self.s = float(sc.dataset.sample_bytes)
        self.per_reader = [0.0] + [sc.storage.per_reader(k) for k in range(1, J + 1)]
        self.hit_time = sc.hit_time
        self.cap = float(sc.cache_samples)
        self.lru = sc.cache.policy == "lru" and 0 < self.cap < self.n
        self.t_cpu = [j.sample_time for j in sc.jobs]
        self.epochs = [j.epochs for j in sc.jobs]
        self.delays = delays
        self.P = sc.loader.prefetch
        self.record = record
        idx = np.arange(K)
        self.with_j = [idx[(idx >> j) & 1 == 1] for j in range(J)]
        self.without_j = [idx[(idx >> j) & 1 == 0] for j in range(J)]
        self.maskmat = np.array([[(k >> j) & 1 for j in range(J)] for k in range(K)], dtype=float)
        # state
        self.t = 0.0
        self.status = [0] * J           # 0 waiting, 1 running, 2 done
        self.epoch = [0] * J
        self.Nu = np.zeros(K)
        self.Nu[0] = self.n
        self.Nb = np.zeros((1, K))
        self.done = [0.0] * J           # samples read in total
        self.finish = [math.inf] * J
        self.b = [0.0] * J              # warm start of the bandwidth fixed point
        self.read_time = [0.0] + [self.s / self.per_reader[k] for k in range(1, J + 1)]
        self.tau_prod = [1.0]
        for k in range(1, J + 1):
            self.tau_prod.append(self.tau_prod[-1] * self.read_time[k])
        self.series: list[tuple] = []

    # ---- rates ------------------------------------------------------------------------------
    def counts(self, Nu, Nb) -> tuple[list[float], list[float]]:
        """Per job: samples yet to read this epoch (U) and how many of those are not cached (v)."""
        v = Nu @ self.maskmat
        U = v + Nb.sum(axis=0) @ self.maskmat
        return U.tolist(), v.tolist()

    def rates(self, U: list[float], v: list[float]) -> tuple[list[float], list[float]]:
        """Per-job read rate x (samples/s) and miss fraction m at a state."""
        J, s, a = self.J, self.s, self.hit_time
        run = [j for j in range(J) if self.status[j] == 1]
        m = [0.0] * J
        for j in run:
            m[j] = min(1.0, max(0.0, v[j] / U[j])) if U[j] > 0 else 0.0
        x = [0.0] * J
        readers = [j for j in run if m[j] > 0.0]
        b = self.b  # warm start: mean bytes/s a job's miss gets
        for j in readers:
            if b[j] <= 0:
                b[j] = self.per_reader[1]
        for _ in range(100):
            for j in run:
                h = 1.0 - m[j]
                miss_t = s / b[j] if m[j] > 0 else 0.0
                tau = h * a + m[j] * miss_t
                x[j] = 1.0 / self.t_cpu[j] if tau <= 0.0 else 1.0 / _PIPE(self.P, h, a, miss_t, self.t_cpu[j])
            if not readers:
                break
            # think time between two misses of a job: its cycle per miss less the read itself
            Z = [max(0.0, 1.0 / (x[j] * m[j]) - s / b[j]) for j in readers]
            nb = _SHARE(self, readers, Z)
            change = max(abs(nb[k] - b[j]) / b[j] for k, j in enumerate(readers))
            for k, j in enumerate(readers):
                b[j] = 0.5 * b[j] + 0.5 * nb[k] if change > 1e-3 else nb[k]
            if change < 1e-9:
                break
        return x, m

    def share_independent(self, readers: list[int], Z: list[float]) -> list[float]:
        s = self.s
        p = [(s / self.b[j]) / (Z[k] + s / self.b[j]) for k, j in enumerate(readers)]
        out = []
        for k, j in enumerate(readers):
            dist = [1.0]
            for k2, i in enumerate(readers):
                if i != j:
                    pi = p[k2]
                    nd = [0.0] * (len(dist) + 1)
                    for kk, q in enumerate(dist):
                        nd[kk] += q * (1.0 - pi)
                        nd[kk + 1] += q * pi
                    dist = nd
            out.append(sum(q * self.per_reader[kk + 1] for kk, q in enumerate(dist)))
        return out

    def share_product(self, readers: list[int], Z: list[float]) -> list[float]:
        """Mean bytes/s each reader's miss gets: processor sharing as a closed product-form network."""
        R = len(readers)
        tau = self.read_time  # tau[k]: seconds to read a sample with k readers
        num = [0.0] * R
        den = [0.0] * R
        for A in range(1, 1 << R):
            k = 0
            w = 1.0
            for i in range(R):
                if (A >> i) & 1:
                    k += 1
                else:
                    w *= Z[i]
            if w == 0.0:
                continue
            w *= self.tau_prod[k]
            rate = self.per_reader[k]
            for i in range(R):
                if (A >> i) & 1:
                    num[i] += w * rate
                    den[i] += w
        return [num[i] / den[i] if den[i] > 0 else self.per_reader[R] for i in range(R)]

    # ---- state changes ------------------------------------------------------------------------
    def advance(self, Nu, Nb, x: list[float], m: list[float], dt: float):
        """New (Nu, Nb) after dt at read rates x and miss fractions m (both held constant)."""
        np = self.np
        J = self.J
        Nu = Nu.copy()
        Nb = Nb.copy()
        U, v = self.counts(Nu, Nb)
        run = [j for j in range(J) if self.status[j] == 1]
        misses = {j: min(x[j] * m[j] * dt, v[j]) for j in run}
        total_miss = sum(misses.values())
        cached = self.n - Nu.sum()
        if self.lru:
            ins_share = 1.0
        else:
            free = max(self.cap - cached, 0.0)
            ins_share = min(1.0, free / total_miss) if total_miss > 0 else 0.0
        # Misses first, so that a sample one job inserts during the step can be another's hit.
        fresh = np.zeros(self.K)
        for j in run:
            wj, bit = self.with_j[j], 1 << j
            v_j = float(Nu[wj].sum())  # what earlier jobs left uncached during this step
            if misses[j] > 0 and v_j > 0:
                moved_u = Nu[wj] * min(1.0, misses[j] / v_j)
                Nu[wj] -= moved_u
                fresh[wj ^ bit] += ins_share * moved_u
                Nu[wj ^ bit] += (1.0 - ins_share) * moved_u
        if self.lru:
            Nb = np.vstack([Nb, fresh])
        else:
            Nb[0] += fresh
        for j in run:
            wj, bit = self.with_j[j], 1 << j
            a_j = float(Nb[:, wj].sum())
            h_j = min(x[j] * (1.0 - m[j]) * dt, a_j)
            if h_j > 0:
                moved = Nb[:, wj] * (h_j / a_j)
                Nb[:, wj] -= moved
                Nb[-1, wj ^ bit] += moved.sum(axis=0)  # a hit makes the sample most recently used
        if self.lru:
            over = Nb.sum() - self.cap
            k = 0
            while over > 1e-12 and k < len(Nb):
                tot = Nb[k].sum()
                if tot > 0:
                    take = min(tot, over)
                    ev = Nb[k] * (take / tot)
                    Nb[k] -= ev
                    Nu += ev
                    over -= take
                k += 1
            keep = Nb.sum(axis=1) > 1e-9
            Nb = Nb[keep] if keep.any() else np.zeros((1, self.K))
            while len(Nb) > _MAX_BLOCKS:
                sizes = Nb.sum(axis=1)
                pair = sizes[:-1] + sizes[1:]
                i = int(np.argmin(pair))
                Nb[i] += Nb[i + 1]
                Nb = np.delete(Nb, i + 1, axis=0)
        np.maximum(Nu, 0.0, out=Nu)
        np.maximum(Nb, 0.0, out=Nb)
        return Nu, Nb

    def changing(self) -> bool:
        """Whether the cache contents change while jobs read (fill phase, or lru evicting)."""
        if self.cap <= 0:
            return False
        if self.lru:
            return True
        cached = self.n - float(self.Nu.sum())
        return cached < self.cap - 1e-9 and float(self.Nu.sum()) > 1e-9

    def _fill_time(self, x: list[float], m: list[float], dt: float) -> float:
        """Time until minio's cache is full at rates x, m (``dt`` when that is later)."""
        if self.lru:
            return dt
        ins_rate = sum(x[j] * m[j] for j in range(self.J) if self.status[j] == 1)
        free = self.cap - (self.n - float(self.Nu.sum()))
        if ins_rate <= 0 or free <= 1e-9:
            return dt
        return min(dt, free / ins_rate)

    # ---- driver -------------------------------------------------------------------------------
    def run(self) -> None:
        J, n = self.J, self.n
        while any(st != 2 for st in self.status):
            for j in range(J):
                if self.status[j] == 0 and self.delays[j] <= self.t + 1e-12:
                    self.status[j] = 1
                    self.b[j] = 0.0
                    self._set_bit(j, True)
            run = [j for j in range(J) if self.status[j] == 1]
            pending = [self.delays[j] for j in range(J) if self.status[j] == 0]
            t_next_start = min(pending) if pending else math.inf
            if not run:
                self._record(None, None)
                self.t = t_next_start
                continue
            U, v = self.counts(self.Nu, self.Nb)
            x, m = self.rates(U, v)
            self._record(x, m)
            dt = min(min(U[j] / x[j] for j in run), t_next_start - self.t)
            if self.changing():
                dt = min(dt, min(n / (_STEPS_PER_EPOCH * x[j]) for j in run))
                dt = self._fill_time(x, m, dt)
                Nu2, Nb2 = self.advance(self.Nu, self.Nb, x, m, dt / 2)
                U2, v2 = self.counts(Nu2, Nb2)
                x, m = self.rates(U2, v2)
                # re-aim at the nearest event with the midpoint rates
                dt = min([U[j] / x[j] for j in run] + [dt * 1.5, t_next_start - self.t])
                dt = self._fill_time(x, m, dt)
            self.Nu, self.Nb = self.advance(self.Nu, self.Nb, x, m, dt)
            self.t += dt
            if not self.lru and abs(self.cap - (n - float(self.Nu.sum()))) < 1e-6 * n:
                pass
            U, v = self.counts(self.Nu, self.Nb)
            for j in run:
                self.done[j] += x[j] * dt
                if U[j] <= 1e-9 * n or abs(U[j] - x[j] * 0) <= 1e-9 * n:
                    self._end_epoch(j)
        self._record(None, None)

    def _set_bit(self, j: int, on: bool) -> None:
        """Mark every sample as yet to be read (on) or as read (off) by job j."""
        wj, wo = self.with_j[j], self.without_j[j]
        for arr in (self.Nu, self.Nb):
            src = arr[..., wj] + arr[..., wo]
            if on:
                arr[..., wj] = src
                arr[..., wo] = 0.0
            else:
                arr[..., wo] = src
                arr[..., wj] = 0.0

    def _end_epoch(self, j: int) -> None:
        self.epoch[j] += 1
        if self.epoch[j] >= self.epochs[j]:
            self.status[j] = 2
            self.finish[j] = self.t
            self._set_bit(j, False)
        else:
            self._set_bit(j, True)

    def _record(self, x: list[float] | None, m: list[float] | None) -> None:
        if not self.record:
            return
        J = self.J
        total = [self.epochs[j] * self.n for j in range(J)]
        prog = tuple(min(1.0, self.done[j] / total[j]) for j in range(J))
        if x is None or m is None:
            hit = tuple(math.nan for _ in range(J))
            bw = 0.0
        else:
            hit = tuple(1.0 - m[j] if self.status[j] == 1 else math.nan for j in range(J))
            bw = sum(x[j] * m[j] for j in range(J) if self.status[j] == 1) * self.s
        self.series.append((self.t, prog, hit, bw, (self.n - float(self.Nu.sum())) / self.n))


def predict(scenario: Scenario, delays: "Mapping[str, float] | Sequence[float] | None" = None, *,
            series: bool = True) -> Prediction:
    """Predict every job's finish time and the makespan when job j starts ``delays[j]`` seconds late.

    ``delays`` is a dict job name -> seconds (missing names start at 0) or a sequence in job order.
    With ``series=False`` the time series are left empty (faster, for planning). Raises
    ConfigError for bad delays and ModelError if the model cannot be integrated.
    """
    d = scenario.delay_vector(delays)
    f = _Fluid(scenario, d, series)
    f.run()
    if any(not math.isfinite(t) for t in f.finish):
        raise ModelError("the fluid model did not finish every job; report this scenario as a bug")
    names = scenario.job_names
    out = Prediction(makespan=max(f.finish), finish=dict(zip(names, f.finish)), start=dict(zip(names, d)))
    if series and f.series:
        times = tuple(r[0] for r in f.series)
        out = Prediction(
            makespan=out.makespan, finish=out.finish, start=out.start, times=times,
            progress={nm: tuple(r[1][j] for r in f.series) for j, nm in enumerate(names)},
            hit_rate={nm: tuple(r[2][j] for r in f.series) for j, nm in enumerate(names)},
            bandwidth=tuple(r[3] for r in f.series), cached=tuple(r[4] for r in f.series))
    return out
