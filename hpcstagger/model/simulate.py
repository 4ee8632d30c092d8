"""A sample-level discrete-event simulator of a scenario: the referee for :func:`~hpcstagger.model.predict`.

It follows the semantics stated in :mod:`hpcstagger.model` literally, sample by sample:

- job j starts at ``delay + startup`` (its first batch request); every job draws a fresh random
  permutation of the n samples for each epoch (seeded), the same one in its k-th epoch as every
  job with the same non-empty ``order``; step k of an epoch takes the next
  ``ranks * batch`` samples of it, split between the ranks;
- each job's loader works like PyTorch's DataLoader. At the start of every epoch each rank
  dispatches its first ``workers * prefetch`` batches, batch k to worker ``k % workers``; a
  worker fetches its batches in order, one sample at a time, each sample a lookup (a hit takes
  ``sample_bytes / hit_bandwidth``, a miss a read from the source, which also takes ``read_cpu``
  of CPU work while it lasts and ends when both are done) followed by ``prep_time``.
  Step k starts when every rank's batch k is ready and step k-1 is done; receiving the batches
  costs ``handoff``, then compute takes ``sample_time`` per sample of the step. When step k
  starts, batch ``k + workers * prefetch`` is dispatched. Without workers, each rank fetches
  batch k itself once step k-1 is done. The next epoch starts ``epoch_start`` after the last
  step is done;
- the source is processor-shared: while r misses are in flight (over all jobs and workers),
  each progresses at ``bandwidth[r-1] / r`` bytes/s, recomputed at every arrival and completion;
- with ``[node] cores = C``, the CPU is processor-shared too. Its tasks are each rank's step
  (handoff and compute), each sample's CPU work in whoever fetches it (a hit's time and
  ``prep_time``, or a miss's ``read_cpu`` and then ``prep_time``), and each rank's start-up (the job's
  ``startup`` begins at its delay). A task of a job with R ranks that all run it counts R times.
  While tasks totalling k are running, each runs at ``min(1, C / k)`` of its speed; the next
  epoch's ``epoch_start`` is a plain delay. Without cores, every task runs at full speed;
- a miss is inserted into the cache when its read completes: minio inserts until the cache is
  full and never changes after; lru inserts and evicts the least recently used sample (a hit
  refreshes it); none never caches. Two readers missing the same sample at once both read it,
  unless ``cache.coalesce``: a reader missing a sample that is being read then waits for that read.
  With ``cache.readahead = a`` a miss also reads ``a - 1`` other samples (on average: the whole
  part always, one more with the fraction's probability), the next uncached ones of a random order
  of the dataset, not being read; the read is that many times ``sample_bytes``, and they are
  inserted with it (and read for whoever misses them meanwhile);
  ``cache.initial`` of the dataset (a random subset) is cached at the start;
- a partitioned cache is ``nodes`` caches of a node's capacity each; sample x belongs to node
  ``x % nodes`` (the permutations are random, so this is a random balanced owner), is inserted
  and looked up there, and its hit takes ``sample_bytes / remote_bandwidth`` unless the fetcher
  is on that node (rank r of R on node ``r * nodes // R``). The nodes' cores are one pool.

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
from collections.abc import Callable, Hashable, Mapping, Sequence

from hpcstagger.model.scenario import Scenario

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
    """The cache's contents under its policy. A partitioned cache is one cache per node, each of a
    node's capacity, sample x owned by (inserted at, looked up in) node ``x % nodes``."""

    def __init__(self, sc: Scenario, rng: Any):
        n = sc.dataset.samples
        self.nodes = M = sc.cache.nodes
        self.cap = sc.node_cache_samples  # per node
        self.policy = sc.cache.policy if self.cap > 0 else "none"
        self.cached = bytearray(n)
        self.lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(M)]
        self.counts = [0] * M
        want = sc.initial_samples
        first = rng.permutation(n).tolist() if self.cap > 0 and want > 0 else []
        for x in first:  # the first of a random order, while their owners have room
            if want <= 0:
                break
            o = x % M
            if self.counts[o] < self.cap:
                self.cached[x] = 1
                self.lrus[o][x] = None
                self.counts[o] += 1
                want -= 1

    def lookup(self, x: int) -> bool:
        if self.policy == "minio":
            return bool(self.cached[x])
        if self.policy == "lru":
            lru = self.lrus[x % self.nodes]
            if x in lru:
                lru.move_to_end(x)
                return True
        return False

    def insert(self, x: int) -> None:
        o = x % self.nodes
        if self.policy == "minio":
            if self.counts[o] < self.cap and not self.cached[x]:
                self.cached[x] = 1
                self.counts[o] += 1
        elif self.policy == "lru":
            lru = self.lrus[o]
            if x in lru:
                lru.move_to_end(x)
            else:
                lru[x] = None
                if len(lru) > self.cap:
                    lru.popitem(last=False)


class _Shared:
    """A processor-shared resource: every task in progress advances at ``speed(load)`` units of its
    work per second, ``load`` the sum of the tasks' demands, recomputed at every start and end.
    The source (bytes; each read demands 1) and the node's cores (seconds at full speed; a task
    of R ranks demands R) are two."""

    def __init__(self, speed: Callable[[int], float]):
        self.speed = speed
        self.rem: dict[Hashable, float] = {}    # task -> work left
        self.work: dict[Hashable, float] = {}   # task -> its whole work
        self.demand: dict[Hashable, int] = {}
        self.load = 0
        self.t = 0.0
        self.rate = 0.0
        self.next_done = INF

    def _advance(self, now: float) -> None:
        if self.rem:
            dec = self.rate * (now - self.t)
            for key in self.rem:
                self.rem[key] -= dec
        self.t = now

    def _reschedule(self, now: float) -> None:
        if self.rem:
            self.rate = self.speed(self.load)
            self.next_done = now + min(self.rem.values()) / self.rate
        else:
            self.rate, self.next_done = 0.0, INF

    def start(self, key: Hashable, work: float, now: float, demand: int = 1) -> None:
        self._advance(now)
        self.rem[key] = self.work[key] = work
        self.demand[key] = demand
        self.load += demand
        self._reschedule(now)

    def complete(self) -> tuple[float, list[Any]]:
        """Advance to the next completion; the time and the tasks that ended."""
        now = self.next_done
        self._advance(now)
        done = [key for key, r in self.rem.items() if r <= 1e-9 * self.work[key]]
        if not done:  # rounding: the smallest remainder is the one that finished
            done = [min(self.rem, key=self.rem.__getitem__)]
        for key in done:
            del self.rem[key], self.work[key]
            self.load -= self.demand.pop(key)
        self._reschedule(now)
        return now, done


class _Job:
    """One job's loader and training loop."""

    def __init__(self, sc: Scenario, j: int, delay: float, rng: Any, first_fetcher: int):
        job = sc.jobs[j]
        self.j, self.rng, self.n = j, rng, sc.dataset.samples
        self.R, self.W, self.B = job.ranks, job.workers, job.batch
        self.depth = job.workers * sc.prefetch_of(job)  # batches in flight per rank (0: no workers)
        self.t, self.handoff, self.prep, self.read_cpu = job.sample_time, job.handoff, job.prep_time, job.read_cpu
        self.epochs, self.epoch = job.epochs, -1
        self.delay, self.startup = delay, job.startup
        self.start = delay + job.startup
        self.busy = False                       # a step is running on the CPU (with cores)
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
        self.hit_time = sc.local_hit_time
        self.remote_time = sc.remote_hit_time  # a hit on a sample another node owns
        self.cache = _Cache(sc, np.random.default_rng([int(seed), 1 << 20]))
        per_reader, top = self.per_reader, len(self.per_reader) - 1
        self.size = float(sc.dataset.sample_bytes)
        self.source = _Shared(lambda reads: per_reader[min(reads, top)])  # bytes/s each of the reads gets
        cores = float(sc.total_cores)  # a partitioned cache's nodes: one pool of their cores
        self.cpu = _Shared(lambda load: min(1.0, cores / load)) if cores > 0 else None
        # with coalescing reads: sample -> the fetchers waiting for its read in flight
        self.inflight: dict[int, list[int]] | None = {} if sc.cache.coalesce else None
        # readahead: the other samples each fetcher's read brings in, taken from a random order
        self.ra = float(sc.cache.readahead)
        self.ahead_rng = np.random.default_rng([int(seed), 1 << 21])
        self.ahead_order = self.ahead_rng.permutation(sc.dataset.samples).tolist() if self.ra > 1.0 else []
        self.ahead_pos = 0
        self.extra: dict[int, list[int]] = {}
        self.parts: dict[int, int] = {}  # fetcher -> parts of its read not done yet (the source's, its CPU work)
        self.jobs: list[_Job] = []
        names = sorted({job.order for job in sc.jobs if job.order})  # shared orders: one generator each
        first = 0
        for j in range(J):
            key = j if not sc.jobs[j].order else len(sc.jobs) + names.index(sc.jobs[j].order)
            self.jobs.append(_Job(sc, j, delays[j], np.random.default_rng([int(seed), key]), first))
            first += sc.jobs[j].fetchers()
        self.owner = [job for job in self.jobs for _ in job.fetchers]
        # each fetcher's node: rank r of R on node r * nodes // R, blocks of ranks (its workers with it)
        M = sc.cache.nodes
        self.node = [(k // max(1, job.W)) * M // job.R for job in self.jobs for k in range(len(job.fetchers))]
        # per fetcher: FIFO of (available time, step, rank), the batch in progress, position in it
        self.queue: list[deque[tuple[float, int, int]]] = [deque() for _ in range(first)]
        self.current: list[tuple[int, int] | None] = [None] * first
        self.pos = [0] * first
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        for job in self.jobs:
            if self.cpu is not None and job.startup > 0:
                self._push(job.delay, 4, job.j)  # kind 4: a job's start-up begins (CPU work)
            else:
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
            cache = self.cache
            local = cache.nodes == 1 or x % cache.nodes == self.node[f]
            work = (self.hit_time if local else self.remote_time) + job.prep
            if self.cpu is not None and work > 0:
                self.cpu.start((2, f), work, now)  # kind 2: the fetcher has prepared the sample
            else:
                self.fetched(f, now + work)
        else:
            job.misses += 1
            if self.inflight is not None:
                if x in self.inflight:  # being read: wait for that read
                    self.inflight[x].append(f)
                    return
                self.inflight[x] = []
            extra = self._ahead(x) if self.ra > 1.0 else []
            if extra:
                self.extra[f] = extra
            self.source.start(f, self.size * (1 + len(extra)), now)
            if job.read_cpu > 0:
                self.parts[f] = 2
                if self.cpu is not None:
                    self.cpu.start((5, f), job.read_cpu, now)  # kind 5: a part of f's read is done
                else:
                    self._push(now + job.read_cpu, 5, f)

    def _ahead(self, x: int) -> list[int]:
        """The samples a miss of ``x`` also reads (readahead): the next uncached ones of the random
        order not being read (minio never evicts, so a cached one is passed for good)."""
        want = int(self.ra - 1.0)
        if self.ahead_rng.random() < self.ra - 1.0 - want:
            want += 1
        out: list[int] = []
        order, cached, inflight = self.ahead_order, self.cache.cached, self.inflight
        assert inflight is not None  # readahead is the page cache's: coalescing reads
        while len(out) < want and self.ahead_pos < len(order):
            y = order[self.ahead_pos]
            self.ahead_pos += 1
            if not cached[y] and y != x and y not in inflight:
                out.append(y)
                inflight[y] = []
        return out

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

    def read_part(self, f: int, now: float) -> None:
        """One part of fetcher f's read is done (its bytes from the source, or its CPU work)."""
        left = self.parts.pop(f, 1) - 1
        if left:
            self.parts[f] = left
        else:
            self.read_done(f, now)

    def read_done(self, f: int, now: float) -> None:
        job = self.owner[f]
        cur = self.current[f]
        assert cur is not None
        k, r = cur
        x = job.steps[k][r][self.pos[f]]
        self.cache.insert(x)
        if self.inflight is not None:
            for waiting in self.inflight.pop(x, []):
                self.sample_read(waiting, now)
            for y in self.extra.pop(f, ()):
                self.cache.insert(y)
                for waiting in self.inflight.pop(y, []):
                    self.sample_read(waiting, now)
        self.sample_read(f, now)

    def sample_read(self, f: int, now: float) -> None:
        """Fetcher f has its sample's bytes: it prepares it, then has it."""
        job = self.owner[f]
        if job.prep > 0 and self.cpu is not None:
            self.cpu.start((2, f), job.prep, now)
        elif job.prep > 0:
            self._push(now + job.prep, 2, f)  # kind 2: the fetcher has prepared the sample
        else:
            self.fetched(f, now)

    # ---- the training loop -----------------------------------------------------------------
    def batch_ready(self, job: _Job, k: int, when: float) -> None:
        job.ready[k] += 1
        job.ready_at[k] = max(job.ready_at[k], when)
        self.run_ready(job)

    def run_ready(self, job: _Job) -> None:
        """Start the job's next steps while their batches are ready (one at a time on the CPU)."""
        while not job.busy and job.next_step < len(job.steps) and job.ready[job.next_step] == job.R:
            self.run_step(job, job.next_step)

    def run_step(self, job: _Job, k: int) -> None:
        s = max(job.ready_at[k], job.c_prev)
        size = sum(len(part) for part in job.steps[k])
        job.next_step += 1
        if job.W and k + job.depth < len(job.steps):
            self.dispatch(job, k + job.depth, s)
        work = job.handoff + size * job.t
        if self.cpu is not None and work > 0:
            job.busy = True
            self.cpu.start((3, job.j), work, max(s, self.cpu.t), job.R)  # kind 3: the job's step is done
        else:
            self.step_done(job, k, s + work)

    def step_done(self, job: _Job, k: int, c: float) -> None:
        job.busy = False
        job.c_prev = c
        last = job.next_step == len(job.steps)
        if not job.W and not last:
            self.dispatch(job, k + 1, c)
        if last:
            job.epoch_ends.append(c)
            if job.epoch + 1 < job.epochs:
                self._push(c + job.epoch_start, 0, job.j)
            else:
                job.finish = c

    def cpu_done(self, kind: int, what: int, now: float) -> None:
        if kind == 2:
            self.fetched(what, now)
        elif kind == 5:
            self.read_part(what, now)
        elif kind == 3:
            job = self.jobs[what]
            self.step_done(job, job.next_step - 1, now)
            self.run_ready(job)
        else:
            self.start_epoch(self.jobs[what], now)

    def run(self) -> None:
        heap, source, cpu = self.heap, self.source, self.cpu
        while heap or source.next_done < INF or (cpu is not None and cpu.next_done < INF):
            top = heap[0][0] if heap else INF
            if cpu is not None and cpu.next_done < min(top, source.next_done):
                now, tasks = cpu.complete()
                for kind, what in tasks:
                    self.cpu_done(kind, what, now)
                continue
            if source.next_done <= top:
                now, done = source.complete()
                for f in done:
                    self.read_part(f, now)
                continue
            now, _, kind, what = heapq.heappop(heap)
            if kind == 0:
                self.start_epoch(self.jobs[what], now)
            elif kind == 1:
                self.lookup(what, now)
            elif kind == 2:
                self.fetched(what, now)
            elif kind == 5:
                self.read_part(what, now)
            else:  # 4: a start-up begins on the CPU
                assert cpu is not None
                job = self.jobs[what]
                cpu.start((4, what), job.startup, now, job.R)


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
