"""The scenario: one dataset, one shared source, one node-local cache, and the jobs that share them.

A scenario is read from TOML (or a dict) and validated field by field; a bad or missing field is
reported by its dotted path (``job[1].sample_time must be > 0``) and an unknown key lists the
valid keys with their defaults. Every field, with its default, is in docs/model.md ("Scenario
format"); ``hpcstagger calibrate`` writes them all. In short::

    [dataset]
    samples = 10000            # n
    sample_bytes = 131072      # mean bytes per sample
    [storage]
    bandwidth = [2.0e8, 1.2e8] # aggregate bytes/s with 1, 2, ... concurrent readers; last holds beyond
    [cache]                    # optional; no [cache] means no cache
    capacity = 6.0e8           # bytes (per node when partitioned); 0 = no cache
    policy = "minio"           # minio | lru | none
    hit_bandwidth = 5.0e9      # bytes/s per reader; optional, default unlimited
    coalesce = false           # concurrent misses of one sample are one read (page cache, ShmCache)
    shm = false                # the cache is a ShmCache (coalesce without it: the page cache)
    [node]                     # optional
    cores = 2                  # CPU cores the jobs share; 0 (the default): CPU time is not shared
    [[job]]
    name = "resnet"
    sample_time = 0.002        # seconds per sample of the training loop with data in memory (whole job)
    epochs = 3
    workers = 2                # DataLoader worker processes per rank (0: the main process loads)
    batch = 64                 # samples per batch per rank
    order = ""                 # jobs with the same order read the same permutation each epoch ("": its own)

The semantics every model of a scenario follows are stated in :mod:`hpcstagger.model`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger import _schema as S
from hpcstagger.errors import ConfigError

__all__ = ["Dataset", "Storage", "Cache", "Loader", "Node", "Job", "Scenario", "POLICIES"]

POLICIES = ("minio", "lru", "none")


@dataclass(frozen=True)
class Dataset:
    """The shared dataset: ``samples`` samples of ``sample_bytes`` bytes each (the mean)."""

    samples: int
    sample_bytes: float


@dataclass(frozen=True)
class Storage:
    """The shared source. ``bandwidth[k-1]`` is its aggregate bytes/s with k concurrent readers.

    Unused by the predictions: ``fit_baseline``, what the jobs' reads got of it while calibrated (the
    watcher's source fits are relative to it), and ``spread``, each level's (max - min) / median."""

    bandwidth: tuple[float, ...]
    fit_baseline: float = 1.0
    spread: tuple[float, ...] = ()

    def aggregate(self, readers: int) -> float:
        """Aggregate bytes/s delivered to ``readers`` (>= 1) concurrent readers."""
        bw = self.bandwidth
        return bw[min(readers, len(bw)) - 1]

    def per_reader(self, readers: int) -> float:
        """Bytes/s each of ``readers`` (>= 1) concurrent readers gets (equal shares)."""
        return self.aggregate(readers) / readers


@dataclass(frozen=True)
class Cache:
    """The node-local cache: ``capacity`` bytes, a policy, per-reader hit bandwidth, the fraction
    of the dataset it holds when the run starts (``initial``; at most what it can hold), and
    whether concurrent misses of one sample are one read (``coalesce``: the page cache, whose
    readers wait for a page being read, and a ShmCache, whose readers wait for a sample being read
    where it can insert it: calibration sets it where the cache holds the whole dataset). ``shm``:
    the cache is a ShmCache; ``coalesce`` without it is the page cache (:attr:`page_cache`).
    ``readahead`` (at least 1; more only for the page cache, ``coalesce`` with policy minio): a
    miss reads that many samples' worth of bytes, and the rest of them are other uncached samples,
    at random in the jobs' order (the file neighbours readahead brings in), inserted with it.

    ``partitioned``: the caches of ``nodes`` nodes form one cache (``capacity`` bytes on each
    node, ``nodes * capacity`` in all). Every sample has one owner node, where a miss is inserted;
    a hit on a sample another node owns (a remote hit, a share ``1 - 1/nodes`` of the hits) reads
    at ``remote_bandwidth`` bytes/s per reader, a local hit at ``hit_bandwidth``. The scenario then
    describes the jobs on all the nodes together (see docs/model.md).
    """

    capacity: float = 0.0
    policy: str = "minio"
    hit_bandwidth: float = math.inf
    initial: float = 0.0
    coalesce: bool = False
    readahead: float = 1.0
    partitioned: bool = False
    nodes: int = 1
    remote_bandwidth: float | None = None
    shm: bool = False

    @property
    def page_cache(self) -> bool:
        """Whether the cache is the node's page cache (``coalesce`` without ``shm``), which keeps the
        dataset's files for every process and is not partitioned or sized by a spec."""
        return self.coalesce and not self.shm


@dataclass(frozen=True)
class Loader:
    """Each job's data loader: how many samples it may hold fetched or in flight ahead of compute."""

    prefetch: int = 2


@dataclass(frozen=True)
class Node:
    """The node the jobs share: ``cores`` CPU cores (0: unlimited, CPU time is not shared), and the bytes
    the jobs hold together (``jobs_memory``, 0: not measured; it sizes a spec's ``capacity = "auto"``).

    With cores, every CPU task (a rank's step, a worker's preparation of a sample, a rank's
    start-up) uses one core at full speed; while k tasks run on the node, each runs at
    ``min(1, cores / k)`` of its speed.
    """

    cores: float = 0.0
    jobs_memory: float = 0.0


@dataclass(frozen=True)
class Job:
    """One training job: its loop's seconds per sample with data in memory, its epochs, and its loader.

    The loader follows PyTorch's DataLoader: each of ``ranks`` ranks has ``workers`` worker
    processes (0: the main process loads each batch itself, with no overlap), each fetching whole
    batches of ``batch`` samples one sample at a time, with up to ``prefetch`` batches per worker in
    flight or ready (None: the scenario's ``[loader] prefetch``). Receiving a batch costs the main
    process ``handoff`` seconds; a worker spends ``prep_time`` seconds per sample besides reading
    it, and a read from the source costs it ``read_cpu`` seconds of CPU while the read lasts (they
    load the cores, and a read lasts at least that long at the cores' speed). The loop asks for its
    first batch ``startup`` seconds after the job starts (backend, model, loader workers); every
    later epoch's loader takes ``epoch_start`` to start (workers spawned again unless persistent).
    Jobs with the same non-empty ``order`` read the same permutation in each epoch (samplers with
    the same seed, PyTorch's default); "" gives the job an order of its own. The defaults are one
    prefetching reader fetching one sample at a time. ``loader_seen`` False: the loader's shape was
    not measured (a step factory timed in memory); a plan starts no job later than it would together.
    """

    name: str
    sample_time: float
    epochs: int = 1
    ranks: int = 1
    workers: int = 1
    batch: int = 1
    prefetch: int | None = None
    handoff: float = 0.0
    prep_time: float = 0.0
    read_cpu: float = 0.0
    startup: float = 0.0
    epoch_start: float = 0.0
    order: str = ""
    loader_seen: bool = True

    def fetchers(self) -> int:
        """How many reads the job can have in flight: one per worker (or per rank without workers)."""
        return self.ranks * max(1, self.workers)


def _job_name(where: str, value: Any) -> str:
    name = S.string()(where, value)
    if not name.strip():
        raise ConfigError(f"{where} must not be blank, got {value!r}")
    return name


_POSITIVE = S.number(minimum=0, exclusive=True)
_DELAY = S.number(minimum=0)
_DATASET = S.Table("dataset", [S.Field("samples", S.integer(minimum=1)), S.Field("sample_bytes", _POSITIVE)])
_STORAGE = S.Table("storage", [S.Field("bandwidth", S.number_list(minimum=0, exclusive=True)),
                               S.Field("fit_baseline", S.number(minimum=0, exclusive=True), 1.0),
                               S.Field("spread", S.number_list(minimum=0), (), shown="[] (not measured)")])
_CACHE = S.Table("cache", [
    S.Field("capacity", S.number(minimum=0), 0.0, shown="0"),
    S.Field("policy", S.choice(*POLICIES), "minio"),
    S.Field("hit_bandwidth", S.number(minimum=0, exclusive=True, allow_inf=True), math.inf, shown="unlimited"),
    S.Field("initial", S.number(minimum=0), 0.0, shown="0 (cold)"),
    S.Field("coalesce", S.boolean(), False),
    S.Field("readahead", S.number(minimum=1), 1.0),
    S.Field("partitioned", S.boolean(), False),
    S.Field("nodes", S.integer(minimum=1, maximum=1 << 16), 1),
    S.Field("remote_bandwidth", S.optional(S.number(minimum=0, exclusive=True, allow_inf=True)), None,
            shown="unset; required when partitioned over nodes > 1"),
    S.Field("shm", S.boolean(), False),
])
_LOADER = S.Table("loader", [S.Field("prefetch", S.integer(minimum=1), 2)])
_NODE = S.Table("node", [S.Field("cores", S.number(minimum=0), 0.0, shown="0 (CPU not shared)"),
                         S.Field("jobs_memory", S.number(minimum=0), 0.0, shown="0 (not measured)")])
_JOB = S.Table("job", [S.Field("name", _job_name), S.Field("sample_time", _POSITIVE),
                       S.Field("epochs", S.integer(minimum=1), 1),
                       S.Field("ranks", S.integer(minimum=1, maximum=1024), 1),
                       S.Field("workers", S.integer(minimum=0, maximum=64), 1),
                       S.Field("batch", S.integer(minimum=1, maximum=1 << 20), 1),
                       S.Field("prefetch", S.optional(S.integer(minimum=1, maximum=1024)), None,
                               shown="[loader] prefetch"),
                       S.Field("handoff", _DELAY, 0.0), S.Field("prep_time", _DELAY, 0.0),
                       S.Field("read_cpu", _DELAY, 0.0), S.Field("startup", _DELAY, 0.0),
                       S.Field("epoch_start", _DELAY, 0.0),
                       S.Field("order", S.string(allow_empty=True), "", shown='"" (its own)'),
                       S.Field("loader_seen", S.boolean(), True)])
_TOP = {"dataset": "required", "storage": "required", "cache": "optional (no cache)",
        "loader": "optional", "node": "optional (CPU not shared)", "job": "required, one [[job]] table per job"}


@dataclass(frozen=True)
class Scenario:
    """A dataset, its shared source and cache, each job's loader, and the jobs.

    Build one with :meth:`from_dict` or :meth:`from_toml` (both validate every field and raise
    :class:`~hpcstagger.errors.ConfigError` naming the bad one), or directly from the parts.
    """

    dataset: Dataset
    storage: Storage
    jobs: tuple[Job, ...]
    cache: Cache = field(default_factory=Cache)
    loader: Loader = field(default_factory=Loader)
    node: Node = field(default_factory=Node)

    def __post_init__(self) -> None:
        # Validate the parts too when the scenario is built directly rather than from a dict.
        if not isinstance(self.jobs, tuple):
            object.__setattr__(self, "jobs", tuple(self.jobs))
        if not isinstance(self.storage.bandwidth, tuple):
            object.__setattr__(self.storage, "bandwidth", tuple(self.storage.bandwidth))
        _validate(self)

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def job_names(self) -> tuple[str, ...]:
        return tuple(j.name for j in self.jobs)

    @property
    def cache_samples(self) -> int:
        """How many samples the cache holds (0 when the policy is "none"), at most ``samples``;
        a partitioned cache, all its nodes together."""
        if self.cache.policy == "none" or self.cache.capacity <= 0:
            return 0
        return min(self.dataset.samples, self.node_cache_samples * self.cache.nodes)

    @property
    def node_cache_samples(self) -> int:
        """How many samples one node's cache holds (the whole cache unless partitioned), at most ``samples``."""
        if self.cache.policy == "none" or self.cache.capacity <= 0:
            return 0
        return min(self.dataset.samples, int(self.cache.capacity // self.dataset.sample_bytes))

    @property
    def miss_time(self) -> float:
        """Seconds to read one sample from the source alone (one reader)."""
        return self.dataset.sample_bytes / self.storage.bandwidth[0]

    @property
    def local_hit_time(self) -> float:
        """Seconds to read one sample from this node's cache (0 with unlimited hit bandwidth)."""
        h = self.cache.hit_bandwidth
        return 0.0 if math.isinf(h) else self.dataset.sample_bytes / h

    @property
    def remote_hit_time(self) -> float:
        """Seconds to read one sample that another node's cache holds (partitioned over nodes > 1;
        otherwise every hit is local and this is :attr:`local_hit_time`)."""
        r = self.cache.remote_bandwidth
        if self.cache.nodes == 1 or r is None:
            return self.local_hit_time
        return 0.0 if math.isinf(r) else self.dataset.sample_bytes / r

    @property
    def hit_time(self) -> float:
        """Mean seconds to read one sample from the cache (0 with unlimited hit bandwidth): a
        partitioned cache's hit is local with probability ``1 / nodes``, remote otherwise."""
        M = self.cache.nodes
        if M == 1:
            return self.local_hit_time
        return (self.local_hit_time + (M - 1) * self.remote_hit_time) / M

    @property
    def total_cores(self) -> float:
        """CPU cores of all the nodes the jobs run on: ``[node] cores`` times ``cache.nodes`` (0: not shared)."""
        return self.node.cores * self.cache.nodes

    @property
    def initial_samples(self) -> int:
        """How many samples the cache holds when the run starts (``cache.initial``, at most ``cache_samples``)."""
        return min(self.cache_samples, int(round(self.cache.initial * self.dataset.samples)))

    def prefetch_of(self, job: Job) -> int:
        """Batches per worker ``job``'s loader keeps in flight (its own ``prefetch``, else ``[loader]``'s)."""
        return job.prefetch if job.prefetch is not None else self.loader.prefetch

    def job_index(self, name: str) -> int:
        """Position of job ``name``; raises ConfigError listing the names when it is unknown."""
        for i, j in enumerate(self.jobs):
            if j.name == name:
                return i
        raise ConfigError(f"unknown job {name!r}; jobs in this scenario: {', '.join(self.job_names)}")

    def delay_vector(self, delays: Mapping[str, float] | Sequence[float] | None) -> list[float]:
        """Delays as a list in job order, from a dict name -> seconds or a sequence in job order.

        Missing names in a dict mean 0. Raises ConfigError for unknown names, a wrong length or a
        negative or non-finite delay.
        """
        n = len(self.jobs)
        if delays is None:
            return [0.0] * n
        if isinstance(delays, Mapping):
            out = [0.0] * n
            for name, value in delays.items():
                out[self.job_index(str(name))] = _DELAY(f"delay of job {name!r}", value)
            return out
        values = list(delays)
        if len(values) != n:
            raise ConfigError(f"got {len(values)} delays for {n} jobs ({', '.join(self.job_names)}); "
                              "give one per job in job order, or a dict name -> seconds")
        return [_DELAY(f"delay of job {self.jobs[i].name!r}", v) for i, v in enumerate(values)]

    # ---- conversion ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scenario:
        """Build and validate a scenario from a dict shaped like the TOML format.

        Raises ConfigError naming the first bad, missing or unknown field.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a scenario must be a table/dict, got {type(data).__name__}")
        S.check_tables(data, list(_TOP), ", ".join(f"[{k}] ({v})" for k, v in _TOP.items()), "scenario")
        for key in ("dataset", "storage", "job"):
            if key not in data:
                raise ConfigError(f"missing [{'[job]' if key == 'job' else key}] ({_TOP[key]})")

        dataset = Dataset(**_DATASET.parse("dataset", data["dataset"]))
        storage = Storage(**_STORAGE.parse("storage", data["storage"]))
        cache = Cache(**_CACHE.parse("cache", data.get("cache")))
        loader = Loader(**_LOADER.parse("loader", data.get("loader")))
        node = Node(**_NODE.parse("node", data.get("node")))
        raw_jobs = data["job"]
        if isinstance(raw_jobs, Mapping):
            raw_jobs = [raw_jobs]
        if not isinstance(raw_jobs, (list, tuple)) or not raw_jobs:
            raise ConfigError("[[job]] must be a non-empty list of job tables (name, sample_time, epochs)")
        jobs = [Job(**_JOB.parse(f"job[{i}]", jd)) for i, jd in enumerate(raw_jobs)]
        return cls(dataset=dataset, storage=storage, jobs=tuple(jobs), cache=cache, loader=loader, node=node)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Scenario:
        """Read and validate a scenario file. Raises ConfigError for an unreadable file, bad TOML or a bad field."""
        data = S.load_toml(path, "scenario file")
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{os.fspath(path)}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The scenario as a dict that :meth:`from_dict` reads back (unlimited hit bandwidth is left out)."""
        cache: dict[str, Any] = {"capacity": self.cache.capacity, "policy": self.cache.policy}
        if not math.isinf(self.cache.hit_bandwidth):
            cache["hit_bandwidth"] = self.cache.hit_bandwidth
        if self.cache.initial:
            cache["initial"] = self.cache.initial
        if self.cache.coalesce:
            cache["coalesce"] = True
        if self.cache.shm:
            cache["shm"] = True
        if self.cache.readahead != 1.0:
            cache["readahead"] = self.cache.readahead
        if self.cache.partitioned:
            cache["partitioned"] = True
            cache["nodes"] = self.cache.nodes
            if self.cache.remote_bandwidth is not None:
                cache["remote_bandwidth"] = self.cache.remote_bandwidth
        out: dict[str, Any] = {
            "dataset": {"samples": self.dataset.samples, "sample_bytes": self.dataset.sample_bytes},
            "storage": {"bandwidth": list(self.storage.bandwidth),
                        **({"spread": list(self.storage.spread)} if self.storage.spread else {})},
            "cache": cache,
            "loader": {"prefetch": self.loader.prefetch},
        }
        if self.storage.fit_baseline != 1.0:
            out["storage"]["fit_baseline"] = self.storage.fit_baseline
        if self.node.cores or self.node.jobs_memory:
            cores, mem = self.node.cores, self.node.jobs_memory
            out["node"] = {"cores": int(cores) if float(cores).is_integer() else cores}  # "2", not "2.0"
            out["node"].update({"jobs_memory": mem} if mem else {})
        out["job"] = [_job_dict(j) for j in self.jobs]
        return out

    def to_toml(self, comments: Mapping[str, str] | None = None) -> str:
        """The scenario as TOML text that :meth:`from_toml` reads back; ``comments`` maps a dotted key
        (``"storage.bandwidth"``, ``"job.resnet"``) to a comment written beside it (how it was measured)."""
        comments = dict(comments or {})
        d = self.to_dict()
        out: list[str] = []
        for table in ("dataset", "storage", "cache", "loader", "node"):
            if table not in d:
                continue
            out.append(f"[{table}]")
            for key, value in d[table].items():
                note = comments.get(f"{table}.{key}")
                out.append(f"{key} = {S.toml_value(value)}" + (f"  # {note}" if note else ""))
            out.append("")
        for job in d["job"]:
            out.append("[[job]]")
            note = comments.get(f"job.{job['name']}")
            if note:
                out.append(f"# {note}")
            for key, value in job.items():
                out.append(f"{key} = {S.toml_value(value)}")
            out.append("")
        return "\n".join(out)


def _job_dict(j: Job) -> dict[str, Any]:
    """A job as a dict, its loader fields only where they differ from the defaults."""
    out: dict[str, Any] = {"name": j.name, "sample_time": j.sample_time, "epochs": j.epochs}
    rest = (k for k in _JOB.fields if k not in out)
    out.update({k: getattr(j, k) for k in rest if getattr(j, k) != _JOB.fields[k].default})
    return out


def _validate_partition(s: Scenario) -> None:
    """The partitioned cache's fields, checked together."""
    c = s.cache
    if c.nodes > 1 and not c.partitioned:
        raise ConfigError(f"cache.nodes = {c.nodes} needs cache.partitioned = true: only a partitioned cache is "
                          "modelled across nodes (node-local caches on several nodes are not); set "
                          "partitioned = true, or nodes = 1 to model one node")
    if c.remote_bandwidth is not None and not c.partitioned:
        raise ConfigError("cache.remote_bandwidth is only for a partitioned cache; set cache.partitioned = true "
                          "and cache.nodes, or leave remote_bandwidth out")
    if c.readahead != 1.0 and not (c.coalesce and c.policy == "minio" and 1.0 < c.readahead < math.inf):
        raise ConfigError(f"cache.readahead = {c.readahead!r}: a finite number of samples, at least 1, and above 1 "
                          "only for the page cache (cache.coalesce = true, cache.policy = \"minio\")")
    if not c.partitioned:
        return
    if c.coalesce:
        raise ConfigError("cache.coalesce (the page cache, which is node-local) cannot be partitioned; set "
                          "cache.coalesce = false or cache.partitioned = false")
    if c.nodes > 1 and c.remote_bandwidth is None:
        raise ConfigError(f"cache.remote_bandwidth is required with cache.partitioned = true and cache.nodes = "
                          f"{c.nodes}: give the bytes/s one reader gets for a hit another node holds (the "
                          "partitioned cache's measured remote-hit throughput; inf for free remote hits)")
    if c.nodes > 1 and not math.isfinite(s.remote_hit_time):
        raise ConfigError(f"cache.remote_bandwidth = {c.remote_bandwidth!r} is too small for dataset.sample_bytes "
                          f"= {s.dataset.sample_bytes!r}: a remote hit takes forever; give it in bytes/s")


def _validate(s: Scenario) -> None:
    """Check a scenario built from its parts, with the checkers that from_dict uses."""
    for table, part in ((_DATASET, s.dataset), (_CACHE, s.cache), (_LOADER, s.loader), (_NODE, s.node)):
        for name, f in table.fields.items():
            f.check(f"{table.name}.{name}", getattr(part, name))
    _STORAGE.fields["bandwidth"].check("storage.bandwidth", s.storage.bandwidth)
    if not s.jobs:
        raise ConfigError("a scenario needs at least one [[job]]")
    seen: set[str] = set()
    for i, j in enumerate(s.jobs):
        for name, f in _JOB.fields.items():
            f.check(f"job[{i}].{name}", getattr(j, name))
        if j.name in seen:
            raise ConfigError(f"job[{i}].name {j.name!r} is used twice; job names must be unique")
        seen.add(j.name)
    # Each value may be fine alone and their products still overflow (bytes / a tiny bandwidth).
    if s.cache.initial > 1:
        raise ConfigError(f"cache.initial is the fraction of the dataset cached at the start, between 0 and 1; "
                          f"got {s.cache.initial!r}")
    _validate_partition(s)
    reads = []
    most = sum(j.fetchers() for j in s.jobs)
    for k in sorted(set(range(1, len(s.storage.bandwidth) + 1)) | {most}):
        share = s.storage.per_reader(k)  # may underflow to 0 for a tiny bandwidth
        read = s.dataset.sample_bytes / share if share > 0 else math.inf
        if not math.isfinite(read):
            i = min(k, len(s.storage.bandwidth)) - 1
            raise ConfigError(f"storage.bandwidth[{i}] = {s.storage.bandwidth[i]!r} is too small for "
                              f"dataset.sample_bytes = {s.dataset.sample_bytes!r}: reading one sample takes "
                              "forever; give the bandwidth in bytes/s")
        reads.append(read)
    slowest = max(max(reads), s.hit_time)  # a hit slower than a miss (a remote one) bounds it too
    total = sum(float(j.epochs) * (s.dataset.samples * (j.sample_time + j.prep_time + j.handoff + slowest)
                                   + j.epoch_start) + j.startup for j in s.jobs)
    if not total < 1e15:  # 30 million years: past it the model's squares of times overflow (OverflowError)
        raise ConfigError(f"the scenario's run time overflows: {total:.3g} s (samples x epochs x seconds per sample) "
                          "is beyond any run; check the units: seconds, bytes and bytes/s")
