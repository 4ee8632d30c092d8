"""A sample-level discrete-event simulator of a scenario: the referee for :func:`~hpcstagger.model.predict`.

It follows the semantics stated in :mod:`hpcstagger.model` literally, sample by sample:

- every job draws a fresh random permutation of the n samples for each epoch (seeded);
- each job's loader looks samples up one at a time, in order. Sample ``i`` is looked up at
  ``L_i = max(F_{i-1}, S_{i-P})``: when the previous fetch has finished and compute has taken
  sample ``i-P`` off the prefetch buffer (``P`` = ``loader.prefetch``). Compute starts sample ``i``
  at ``S_i = max(F_i, C_{i-1})`` and finishes at ``C_i = S_i + sample_time``. The loader runs on
  across epoch boundaries; the job finishes when its last sample is computed;
- a hit (decided at lookup) takes ``sample_bytes / hit_bandwidth`` and is not shared;
- a miss reads ``sample_bytes`` from the source. The source is processor-shared: while k misses
  are in flight (over all jobs), each progresses at ``bandwidth[k-1] / k`` bytes/s, recomputed
  at every arrival and completion;
- a miss is inserted into the cache when its read completes: minio inserts until the cache is
  full and never changes after; lru inserts and evicts the least recently used sample (a hit
  refreshes it); none never caches. Two jobs missing the same sample at once both read it.

Everything is explicit (permutations, cache contents, in-flight reads), so it is slow next to the
fluid model but exact for the semantics; it is used to validate the model, never to plan.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence

from .scenario import Scenario

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured: finish times and per-job hit/miss counts."""

    finish: dict[str, float]
    hits: dict[str, int]
    misses: dict[str, int]
    epoch_ends: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        """The time the last job finishes (seconds from the common start)."""
        return max(self.finish.values())


def simulate(scenario: Scenario, delays: Mapping[str, float] | Sequence[float] | None = None,
             seed: int = 0, trace: list | None = None) -> SimResult:
    """Simulate ``scenario`` with job start ``delays`` (dict name -> s, or a sequence in job order).

    Deterministic for a given ``seed``. Raises ConfigError for bad delays.
    """
    import numpy as np

    sc = scenario
    d = sc.delay_vector(delays)
    J = len(sc.jobs)
    n = sc.dataset.samples
    s = float(sc.dataset.sample_bytes)
    per_reader = [0.0] + [sc.storage.per_reader(k) for k in range(1, J + 1)]
    hit_time = sc.hit_time
    cap = sc.cache_samples
    policy = sc.cache.policy if cap > 0 else "none"
    P = sc.loader.prefetch
    INF = math.inf

    rngs = [np.random.default_rng([int(seed), j]) for j in range(J)]
    sample_time = [job.sample_time for job in sc.jobs]
    total = [job.epochs * n for job in sc.jobs]
    order: list[list[int]] = [[] for _ in range(J)]
    pos = [0] * J
    c_prev = list(d)                      # compute completion of the previous sample
    ring = [[dj] * P for dj in d]         # compute start times S_{i-P} .. S_{i-1}, by i % P
    pending = [-1] * J                    # sample whose miss is in flight
    finish = [INF] * J
    hits = [0] * J
    misses = [0] * J
    epoch_ends: list[list[float]] = [[] for _ in range(J)]

    # Cache state.
    cached = bytearray(n)
    count = 0
    lru: OrderedDict[int, None] = OrderedDict()

    # Source state (processor sharing).
    active: list[int] = []
    rem = [0.0] * J
    src_t = 0.0
    rate = 0.0
    next_done = INF
    eps = 1e-9 * s

    heap: list[tuple[float, int, int]] = [(d[j], j, j) for j in range(J)]
    heapq.heapify(heap)
    seq = J

    def complete(j: int, F: float) -> float:
        """Record fetch completion F of job j's current sample; return its next lookup time (INF if done)."""
        i = pos[j]
        S = F if F > c_prev[j] else c_prev[j]
        C = S + sample_time[j]
        ring[j][i % P] = S
        c_prev[j] = C
        i += 1
        pos[j] = i
        if i % n == 0:
            epoch_ends[j].append(C)
        if i == total[j]:
            finish[j] = C
            return INF
        r = ring[j][i % P]
        return F if F > r else r

    while True:
        t_look = heap[0][0] if heap else INF
        if next_done <= t_look:
            if next_done == INF:
                break
            now = next_done
            dec = rate * (now - src_t)
            src_t = now
            done: list[int] = []
            still: list[int] = []
            for a in active:
                rem[a] -= dec
                (done if rem[a] <= eps else still).append(a)
            if not done:  # rounding: the smallest remainder is the one that finished
                a = min(active, key=rem.__getitem__)
                still.remove(a)
                done.append(a)
            active = still
            if active:
                rate = per_reader[len(active)]
                next_done = now + min(rem[a] for a in active) / rate
            else:
                rate, next_done = 0.0, INF
            for j in done:
                x = pending[j]
                pending[j] = -1
                if policy == "minio":
                    if count < cap and not cached[x]:
                        cached[x] = 1
                        count += 1
                        if trace is not None:
                            trace.append((now, count))
                elif policy == "lru":
                    if x in lru:
                        lru.move_to_end(x)
                    else:
                        lru[x] = None
                        if len(lru) > cap:
                            lru.popitem(last=False)
                nxt = complete(j, now)
                if nxt < INF:
                    heapq.heappush(heap, (nxt, seq, j))
                    seq += 1
            continue

        now, _, j = heapq.heappop(heap)
        bound = heap[0][0] if heap else INF
        if next_done < bound:
            bound = next_done
        while True:  # this job's lookups, inline while nothing else can happen first
            i = pos[j]
            k = i % n
            if k == 0:
                order[j] = rngs[j].permutation(n).tolist()
            x = order[j][k]
            if policy == "minio":
                hit = cached[x]
            elif policy == "lru":
                hit = x in lru
                if hit:
                    lru.move_to_end(x)
            else:
                hit = False
            if hit:
                hits[j] += 1
                nxt = complete(j, now + hit_time)
                if nxt == INF:
                    break
                if nxt < bound:
                    now = nxt
                    continue
                heapq.heappush(heap, (nxt, seq, j))
                seq += 1
                break
            misses[j] += 1
            pending[j] = x
            if active:
                dec = rate * (now - src_t)
                for a in active:
                    rem[a] -= dec
            src_t = now
            rem[j] = s
            active.append(j)
            rate = per_reader[len(active)]
            next_done = now + min(rem[a] for a in active) / rate
            break

    names = sc.job_names
    return SimResult(finish=dict(zip(names, finish, strict=True)), hits=dict(zip(names, hits, strict=True)),
                     misses=dict(zip(names, misses, strict=True)),
                     epoch_ends={nm: tuple(e) for nm, e in zip(names, epoch_ends, strict=True)})
