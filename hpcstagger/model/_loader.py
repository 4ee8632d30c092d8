"""A job's DataLoader in the fluid model: time per sample, the epoch-start bubble, shared reads.

Private to :mod:`hpcstagger.model` (the engine uses it). The loader follows the semantics of
:class:`~hpcstagger.model.scenario.Job`: ``R`` ranks, each with ``W`` worker processes fetching
whole batches of ``B`` samples one sample at a time (a fetch is ``prep`` plus a hit or a miss),
``W * prefetch`` batches in flight per rank, and a main process that spends ``handoff`` per step
receiving the batches and ``R * B * t`` computing.

- **Steady state.** With workers, a rank's loader delivers one batch per ``B * E[X] / W`` on
  average (X a sample's fetch time) and the main process takes one step per ``R * B * t +
  handoff``. The pair is the prefetch pipeline of :mod:`._pipeline` with a step as its unit: the
  loader's per-step time has mean ``B E[X] / W`` and variance ``B Var[X] / W`` (W independent
  workers, each summing B fetch times; in order, a step waits for the slowest of the W walks, so
  their fluctuations add instead of averaging out), fed to the table as the two-point time with
  that mean and variance, and the buffer is ``W * prefetch`` steps. Without workers, nothing
  overlaps: a step takes ``B E[X] + R B t + handoff``.
- **Epoch starts.** Every epoch starts with an empty pipeline (a DataLoader iterator per epoch):
  compute waits for the first batch, one worker's ``B E[X]``; a loader-bound job instead ends
  the epoch computing the last W batches, which arrive together. The epoch takes
  ``min(B E[X], W * step)`` longer than the steady state says; the engine pauses the job for that
  long at each epoch start.
- **Shared reads.** A job has ``R * max(W, 1)`` fetchers, each alternating between reading a miss
  and thinking. :class:`Sharing` is the product-form law of processor sharing over all jobs'
  fetchers, summed over the fetchers of each job with generating functions (polynomials in the
  number of readers), so it costs O(fetchers^2), not 2^fetchers. Without workers, a job's ranks
  read in lockstep (each step's barrier lines them up): their R fetchers are one unit that reads
  R samples at once, weighted so that alone it reads at the R-reader bandwidth (an approximation:
  processor sharing with such units has no exact product form).
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple
from collections.abc import Callable, Sequence

from hpcstagger.model.scenario import Scenario

Pipe = Callable[[int, float, float, float, float], float]


class Shape(NamedTuple):
    """One job's loader and loop (see the module docstring)."""

    R: int
    W: int
    B: int
    depth: int        # steps a rank's loader may hold in flight or ready: W * prefetch
    handoff: float
    prep: float
    t: float          # seconds per sample of the main loop, whole job
    read_cpu: float = 0.0  # a read's CPU work in its fetcher, while the read lasts

    @property
    def step(self) -> float:
        """Main-process seconds per step (all ranks' batches): receiving and computing."""
        return self.R * self.B * self.t + self.handoff

    def at_speed(self, main: float, worker: float) -> Shape:
        """The shape with its main process's CPU work at speed ``main`` and its workers' at
        ``worker`` (0 < speed <= 1; the node's cores shared, :mod:`._cpu`)."""
        return Shape(self.R, self.W, self.B, self.depth, self.handoff / main, self.prep / worker, self.t / main,
                     self.read_cpu / worker)


def shapes(sc: Scenario) -> list[Shape]:
    """Every job's loader shape."""
    return [Shape(j.ranks, j.workers, j.batch, j.workers * sc.prefetch_of(j), j.handoff, j.prep_time,
                  j.sample_time, j.read_cpu) for j in sc.jobs]


def hit_spread(sc: Scenario) -> tuple[float, float] | None:
    """A partitioned cache's hits take one of two times (local, remote): the fastest hit's time and
    the second moment of a hit's time. None when every hit takes :attr:`Scenario.hit_time`."""
    M, local, remote = sc.cache.nodes, sc.local_hit_time, sc.remote_hit_time
    if M == 1 or local == remote:
        return None
    return min(local, remote), (local * local + (M - 1) * remote * remote) / M


def fetch_moments(L: Shape, m: float, a: float, miss_t: float, miss_m2: float,
                  a2: float | None = None) -> tuple[float, float]:
    """Mean and variance of one sample's fetch: prep plus a hit (mean ``a``, second moment ``a2``,
    default ``a * a``) or, with probability m, a miss (mean ``miss_t``, second moment ``miss_m2``)."""
    p = L.prep
    mean = p + (1.0 - m) * a + m * miss_t
    hit2 = (p + a) ** 2 if a2 is None else p * p + 2.0 * p * a + a2
    second = (1.0 - m) * hit2 + m * (p * p + 2.0 * p * miss_t + miss_m2)
    return mean, max(0.0, second - mean * mean)


def time_per_sample(L: Shape, m: float, a: float, miss_t: float, miss_m2: float, pipe: Pipe,
                    variance: bool = True, hit: tuple[float, float] | None = None) -> float:
    """Steady-state seconds per sample of a job whose samples miss with probability m. ``hit``
    (:func:`hit_spread`): the fastest hit's time and a hit's second moment, when hits vary. A miss
    lasts at least its read's CPU work (``L.read_cpu``, at the shape's speed)."""
    per_step = L.R * L.B
    if L.read_cpu > miss_t:
        miss_t, miss_m2 = L.read_cpu, L.read_cpu * L.read_cpu
    mean, var = fetch_moments(L, m, a, miss_t, miss_m2 if variance else miss_t * miss_t,
                              None if hit is None else hit[1])
    if L.W == 0:
        return (L.B * mean + L.step) / per_step
    W = L.W
    lo = (L.prep + (a if hit is None else hit[0])) / W  # every sample a (fast) hit
    if L.B == 1 and hit is None and (not variance or miss_m2 <= miss_t * miss_t * (1 + 1e-9) or miss_t <= a):
        # two fetch times only: the table's own case
        return pipe(L.depth, 1.0 - m, lo, (L.prep + miss_t) / W, L.step) / per_step
    mu = L.B * mean / W
    var_step = L.B * var / W
    if var_step <= 0.0 or mu <= 0.0:
        return pipe(L.depth, 1.0, mu, mu, L.step) / per_step
    if L.B > 1:  # a sum of B fetches: symmetric about its mean, unless that would go below all hits
        lo = max(mu - math.sqrt(var_step), L.B * lo)
    e1 = mu - lo
    if e1 <= 0.0:
        return pipe(L.depth, 1.0, mu, mu, L.step) / per_step
    D = (var_step + e1 * e1) / e1  # two points lo and lo + D with the same mean and variance
    return pipe(L.depth, 1.0 - e1 / D, lo, lo + D, L.step) / per_step


def bubble(L: Shape, m: float, a: float, miss_t: float) -> float:
    """Seconds an epoch takes beyond the steady state: its pipeline starts empty (0 without workers)."""
    if L.W == 0:
        return 0.0
    mean = L.prep + (1.0 - m) * a + m * miss_t
    return min(L.B * mean, L.W * L.step)


def _poly_mul(p: Sequence[float], q: Sequence[float]) -> list[float]:
    """The product of two polynomials' coefficient lists. The model's polynomials are mostly of
    degree 1 or 2 (one or two fetchers per group), so a short factor gets a loop of its own."""
    if len(q) > len(p):
        p, q = q, p
    if len(q) == 1:
        q0 = q[0]
        return [a * q0 for a in p]
    if len(q) == 2:
        q0, q1 = q
        return [p[0] * q0, *[a * q0 + b * q1 for a, b in zip(p[1:], p[:-1], strict=True)], p[-1] * q1]
    out = [0.0] * (len(p) + len(q) - 1)
    for k, qk in enumerate(q):
        if qk:
            for i, pk in enumerate(p, k):
                out[i] += pk * qk
    return out


class Sharing:
    """The product-form law of processor sharing over groups of identical fetchers.

    ``read_time[k]`` is one read's time with k reads in flight (``size / per_reader[k]``). The
    stationary weight of n_j fetchers of each job j reading is ``prod_{l <= N} read_time[l] *
    prod_j C(F_j, n_j) Z_j^(F_j - n_j)``, N the total, Z_j a fetcher's think time.
    """

    def __init__(self, per_reader: Sequence[float], size: float):
        self.per_reader = list(per_reader)
        self.size = size
        top = len(per_reader) - 1
        self.unit = size / per_reader[1]  # times are scaled by one lone read's time
        self.log_tp = [0.0]
        for k in range(1, top + 1):
            self.log_tp.append(self.log_tp[-1] + math.log(size / per_reader[k] / self.unit))

    def _poly(self, F: int, z: float) -> list[float]:
        """C(F, n) z^(F - n) for n = 0..F, scaled so that the largest is 1."""
        if z <= 0.0:
            return [0.0] * F + [1.0]
        if F == 1:
            return [1.0, 1.0 / z] if z >= 1.0 else [z, 1.0]
        if F == 2:  # z^2, 2z, 1 over the largest of them
            if z >= 2.0:
                return [1.0, 2.0 / z, 1.0 / (z * z)]
            return [z / 2.0, 1.0, 0.5 / z] if z >= 0.5 else [z * z, 2.0 * z, 1.0]
        lz = math.log(z)
        logs = [math.lgamma(F + 1) - math.lgamma(n + 1) - math.lgamma(F - n + 1) + (F - n) * lz
                for n in range(F + 1)]
        top = max(logs)
        return [math.exp(v - top) for v in logs]

    def _gang(self, F: int, z: float) -> list[float]:
        """F fetchers that read together (the ranks of a job without workers, in lockstep): one
        unit, thinking or reading F samples at once. Its reading state is weighted so that alone
        it reads at ``per_reader[F]`` (one read time, not F of them)."""
        log_read = math.log(self.size / self.per_reader[F] / self.unit) - self.log_tp[F]
        if z <= 0.0:
            return [0.0] * F + [1.0]
        lz = math.log(z)
        top = max(lz, log_read)
        return [math.exp(lz - top)] + [0.0] * (F - 1) + [math.exp(log_read - top)]

    def solve(self, F: Sequence[int], Z: Sequence[float], gang: Sequence[bool] | None = None,
              moments: bool = True) -> tuple[list[float], list[float]]:
        """Per group: the mean bytes/s a fetcher's read gets, and the second moment of a read's time
        (all 0 when ``moments`` is False: the CPU's sharing needs only the speeds).

        ``gang[i]`` says group i's fetchers read together rather than independently."""
        R = len(F)
        unit = self.unit
        polys = [self._gang(F[i], Z[i] / unit) if gang and gang[i] and F[i] > 1
                 else self._poly(F[i], Z[i] / unit) for i in range(R)]
        prefix = [[1.0]]
        for g in polys:
            prefix.append(_poly_mul(prefix[-1], g))
        suffix = [[1.0]] * (R + 1)
        for i in range(R - 1, -1, -1):
            suffix[i] = _poly_mul(suffix[i + 1], polys[i])
        top = len(prefix[-1]) - 1
        log_tp = self.log_tp
        peak = max(log_tp[:top + 1])
        tp = [math.exp(v - peak) for v in log_tp[:top + 1]]  # stationary weight of N reads in flight
        per_reader = self.per_reader
        fast = [w * per_reader[N] for N, w in enumerate(tp)]
        slow = [w / per_reader[N] if N else 0.0 for N, w in enumerate(tp)]
        bw, m2 = [], []
        size2 = self.size * self.size
        for i in range(R):
            # the weight of states by the number of group i's fetchers reading: its polynomial's
            # derivative times the others', from its lowest non-zero term (so the sums shift)
            mine = [n * c for n, c in enumerate(polys[i])]
            lo = next((n for n, c in enumerate(mine) if c), len(mine))
            coef = _poly_mul(_poly_mul(prefix[i], suffix[i + 1]), mine[lo:]) if lo < len(mine) else []
            num = sum(map(operator.mul, coef, fast[lo:]))
            den = sum(map(operator.mul, coef, tp[lo:]))
            if num <= 0.0 or den <= 0.0:
                k = sum(F)
                bw.append(per_reader[k])
                m2.append((self.size / per_reader[k]) ** 2 if moments else 0.0)
                continue
            bw.append(num / den)
            m2.append(size2 * sum(map(operator.mul, coef, slow[lo:])) / num if moments else 0.0)
        return bw, m2
