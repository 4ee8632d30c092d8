"""A sample-level discrete-event simulator of a scenario: the referee for :func:`~hpcstagger.model.predict`.

It follows the semantics stated in :mod:`hpcstagger.model` literally, sample by sample:

- job j starts at ``delay + startup`` (its first batch request); every job draws a fresh random
  permutation of the n samples for each epoch (seeded); step k of an epoch takes the next
  ``ranks * batch`` samples of it, split between the ranks;
- each job's loader works like PyTorch's DataLoader. At the start of every epoch each rank
  dispatches its first ``workers * prefetch`` batches, batch k to worker ``k % workers``; a
  worker fetches its batches in order, one sample at a time, each sample a lookup (a hit takes
  ``sample_bytes / hit_bandwidth``, a miss a read from the source) followed by ``prep_time``.
  Step k starts when every rank's batch k is ready and step k-1 is done; receiving the batches
  costs ``handoff``, then compute takes ``sample_time`` per sample of the step. When step k
  starts, batch ``k + workers * prefetch`` is dispatched. Without workers, each rank fetches
  batch k itself once step k-1 is done. The next epoch starts ``epoch_start`` after the last
  step is done;
- the source is processor-shared: while r misses are in flight (over all jobs and workers),
  each progresses at ``bandwidth[r-1] / r`` bytes/s, recomputed at every arrival and completion;
- a miss is inserted into the cache when its read completes: minio inserts until the cache is
  full and never changes after; lru inserts and evicts the least recently used sample (a hit
  refreshes it); none never caches. Two readers missing the same sample at once both read it.
  ``cache.initial`` of the dataset (a random subset) is cached at the start.

Everything is explicit (permutations, cache contents, in-flight reads, each worker's queue), so it
is slow next to the fluid model but exact for the semantics; it is used to validate the model,
never to plan.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

from .scenario import Scenario

__all__ = ["SimResult", "simulate"]

INF = math.inf


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


class _Cache:
    """The cache's contents under its policy."""

    def __init__(self, sc: Scenario, rng: Any):
        n = sc.dataset.samples
        self.cap = sc.cache_samples
        self.policy = sc.cache.policy if self.cap > 0 else "none"
        self.cached = bytearray(n)
        self.lru: OrderedDict[int, None] = OrderedDict()
        first = rng.permutation(n)[:sc.initial_samples].tolist() if self.cap > 0 else []
        for x in first:
            self.cached[x] = 1
            self.lru[x] = None
        self.count = len(first)

    def lookup(self, x: int) -> bool:
        if self.policy == "minio":
            return bool(self.cached[x])
        if self.policy == "lru":
            if x in self.lru:
                self.lru.move_to_end(x)
                return True
        return False

    def insert(self, x: int) -> None:
        if self.policy == "minio":
            if self.count < self.cap and not self.cached[x]:
                self.cached[x] = 1
                self.count += 1
        elif self.policy == "lru":
            if x in self.lru:
                self.lru.move_to_end(x)
            else:
                self.lru[x] = None
                if len(self.lru) > self.cap:
                    self.lru.popitem(last=False)


class _Source:
    """Processor sharing of the reads in flight: each of r gets ``per_reader[r]`` bytes/s."""

    def __init__(self, per_reader: list[float], size: float):
        self.per_reader = per_reader
        self.size = size
        self.rem: dict[int, float] = {}   # fetcher -> bytes left
        self.t = 0.0
        self.rate = 0.0
        self.next_done = INF

    def _advance(self, now: float) -> None:
        if self.rem:
            dec = self.rate * (now - self.t)
            for f in self.rem:
                self.rem[f] -= dec
        self.t = now

    def _reschedule(self, now: float) -> None:
        if self.rem:
            self.rate = self.per_reader[min(len(self.rem), len(self.per_reader) - 1)]
            self.next_done = now + min(self.rem.values()) / self.rate
        else:
            self.rate, self.next_done = 0.0, INF

    def start(self, fetcher: int, now: float) -> None:
        self._advance(now)
        self.rem[fetcher] = self.size
        self._reschedule(now)

    def complete(self) -> tuple[float, list[int]]:
        """Advance to the next completion; the time and the fetchers whose reads ended."""
        now = self.next_done
        self._advance(now)
        eps = 1e-9 * self.size
        done = [f for f, r in self.rem.items() if r <= eps]
        if not done:  # rounding: the smallest remainder is the one that finished
            done = [min(self.rem, key=self.rem.__getitem__)]
        for f in done:
            del self.rem[f]
        self._reschedule(now)
        return now, done


class _Job:
    """One job's loader and training loop."""

    def __init__(self, sc: Scenario, j: int, delay: float, rng: Any, first_fetcher: int):
        job = sc.jobs[j]
        self.j, self.rng, self.n = j, rng, sc.dataset.samples
        self.R, self.W, self.B = job.ranks, job.workers, job.batch
        self.depth = job.workers * sc.prefetch_of(job)  # batches in flight per rank (0: no workers)
        self.t, self.handoff, self.prep = job.sample_time, job.handoff, job.prep_time
        self.epochs, self.epoch = job.epochs, -1
        self.start = delay + job.startup
        self.epoch_start = job.epoch_start
        # fetcher id -> (rank, worker): one per worker of each rank, or one per rank without workers
        per_rank = max(1, self.W)
        self.fetchers = [(first_fetcher + r * per_rank + w) for r in range(self.R) for w in range(per_rank)]
        self.steps: list[list[list[int]]] = []  # step k -> per rank, the samples of its batch
        self.ready: list[int] = []              # step k -> ranks whose batch k is ready
        self.ready_at: list[float] = []
        self.next_step = 0
        self.c_prev = self.start                # when the previous step's compute ended
        self.finish = INF
        self.hits = self.misses = 0
        self.epoch_ends: list[float] = []

    def fetcher_of(self, r: int, k: int) -> int:
        per_rank = max(1, self.W)
        return self.fetchers[r * per_rank + (k % per_rank if self.W else 0)]

    def new_epoch(self) -> None:
        self.epoch += 1
        order = self.rng.permutation(self.n).tolist()
        size = self.R * self.B
        self.steps = []
        for lo in range(0, self.n, size):
            chunk = order[lo:lo + size]
            share = -(-len(chunk) // self.R)
            self.steps.append([chunk[r * share:(r + 1) * share] for r in range(self.R)])
        self.ready = [0] * len(self.steps)
        self.ready_at = [0.0] * len(self.steps)
        self.next_step = 0


class _Sim:
    """The event loop: worker lookups and starts on a heap, reads on the shared source."""

    def __init__(self, sc: Scenario, delays: list[float], seed: int):
        import numpy as np

        self.sc = sc
        J = len(sc.jobs)
        total = sum(j.fetchers() for j in sc.jobs)
        self.per_reader = [0.0] + [sc.storage.per_reader(k) for k in range(1, total + 1)]
        self.hit_time = sc.hit_time
        self.cache = _Cache(sc, np.random.default_rng([int(seed), 1 << 20]))
        self.source = _Source(self.per_reader, float(sc.dataset.sample_bytes))
        self.jobs: list[_Job] = []
        first = 0
        for j in range(J):
            self.jobs.append(_Job(sc, j, delays[j], np.random.default_rng([int(seed), j]), first))
            first += sc.jobs[j].fetchers()
        self.owner = [job for job in self.jobs for _ in job.fetchers]
        # per fetcher: FIFO of (available time, step, rank), the batch in progress, position in it
        self.queue: list[deque[tuple[float, int, int]]] = [deque() for _ in range(first)]
        self.current: list[tuple[int, int] | None] = [None] * first
        self.pos = [0] * first
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        for job in self.jobs:
            self._push(job.start, 0, job.j)  # kind 0: a job starts an epoch

    def _push(self, t: float, kind: int, what: int) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, what))
        self.seq += 1

    # ---- the loader ------------------------------------------------------------------------
    def start_epoch(self, job: _Job, now: float) -> None:
        job.new_epoch()
        first = job.depth if job.W else 1
        for k in range(min(first, len(job.steps))):
            self.dispatch(job, k, now)

    def dispatch(self, job: _Job, k: int, at: float) -> None:
        """Give each rank's batch k to its fetcher, available from time ``at``."""
        for r in range(job.R):
            f = job.fetcher_of(r, k)
            self.queue[f].append((at, k, r))
            if self.current[f] is None:
                self.next_batch(f, at)

    def next_batch(self, f: int, now: float) -> None:
        """Fetcher f takes its next queued batch (no earlier than it becomes available)."""
        if not self.queue[f]:
            self.current[f] = None
            return
        at, k, r = self.queue[f].popleft()
        self.current[f] = (k, r)
        self.pos[f] = 0
        self._push(max(now, at), 1, f)  # kind 1: a fetcher looks up its next sample

    def lookup(self, f: int, now: float) -> None:
        job = self.owner[f]
        cur = self.current[f]
        assert cur is not None
        k, r = cur
        batch = job.steps[k][r]
        if self.pos[f] >= len(batch):  # an empty share of a short last step
            self.batch_ready(job, k, now)
            self.next_batch(f, now)
            return
        x = batch[self.pos[f]]
        if self.cache.lookup(x):
            job.hits += 1
            self.fetched(f, now + self.hit_time + job.prep)
        else:
            job.misses += 1
            self.source.start(f, now)

    def fetched(self, f: int, done: float) -> None:
        """Fetcher f has its current sample (and prepared it) at time ``done``."""
        job = self.owner[f]
        cur = self.current[f]
        assert cur is not None
        k, r = cur
        self.pos[f] += 1
        if self.pos[f] < len(job.steps[k][r]):
            self._push(done, 1, f)
            return
        self.batch_ready(job, k, done)
        self.next_batch(f, done)

    def read_done(self, f: int, now: float) -> None:
        job = self.owner[f]
        cur = self.current[f]
        assert cur is not None
        k, r = cur
        self.cache.insert(job.steps[k][r][self.pos[f]])
        if job.prep > 0:
            self._push(now + job.prep, 2, f)  # kind 2: the fetcher has prepared the sample
        else:
            self.fetched(f, now)

    # ---- the training loop -----------------------------------------------------------------
    def batch_ready(self, job: _Job, k: int, when: float) -> None:
        job.ready[k] += 1
        job.ready_at[k] = max(job.ready_at[k], when)
        while job.next_step < len(job.steps) and job.ready[job.next_step] == job.R:
            self.run_step(job, job.next_step)

    def run_step(self, job: _Job, k: int) -> None:
        s = max(job.ready_at[k], job.c_prev)
        size = sum(len(part) for part in job.steps[k])
        job.c_prev = c = s + job.handoff + size * job.t
        job.next_step += 1
        last = job.next_step == len(job.steps)
        if job.W:
            if k + job.depth < len(job.steps):
                self.dispatch(job, k + job.depth, s)
        elif not last:
            self.dispatch(job, k + 1, c)
        if last:
            job.epoch_ends.append(c)
            if job.epoch + 1 < job.epochs:
                self._push(c + job.epoch_start, 0, job.j)
            else:
                job.finish = c

    def run(self) -> None:
        heap, source = self.heap, self.source
        while heap or source.next_done < INF:
            if source.next_done <= (heap[0][0] if heap else INF):
                now, done = source.complete()
                for f in done:
                    self.read_done(f, now)
                continue
            now, _, kind, what = heapq.heappop(heap)
            if kind == 0:
                self.start_epoch(self.jobs[what], now)
            elif kind == 1:
                self.lookup(what, now)
            else:
                self.fetched(what, now)


def simulate(scenario: Scenario, delays: Mapping[str, float] | Sequence[float] | None = None,
             seed: int = 0) -> SimResult:
    """Simulate ``scenario`` with job start ``delays`` (dict name -> s, or a sequence in job order).

    Deterministic for a given ``seed``. Raises ConfigError for bad delays.
    """
    sim = _Sim(scenario, scenario.delay_vector(delays), seed)
    sim.run()
    names = scenario.job_names
    jobs: list[Any] = sim.jobs
    return SimResult(finish={nm: jb.finish for nm, jb in zip(names, jobs, strict=True)},
                     hits={nm: jb.hits for nm, jb in zip(names, jobs, strict=True)},
                     misses={nm: jb.misses for nm, jb in zip(names, jobs, strict=True)},
                     epoch_ends={nm: tuple(jb.epoch_ends) for nm, jb in zip(names, jobs, strict=True)})
