"""The scenario: one dataset, one shared source, one node-local cache, and the jobs that share them.

A scenario is read from TOML (or a dict) and validated field by field; a bad or missing field is
reported by its dotted path (``job[1].sample_time must be > 0``) and an unknown key lists the
valid keys with their defaults. The format::

    [dataset]
    samples = 10000            # n
    sample_bytes = 131072      # mean bytes per sample
    [storage]
    bandwidth = [2.0e8, 1.2e8] # aggregate bytes/s with 1, 2, ... concurrent readers; last holds beyond
    [cache]                    # optional; no [cache] means no cache
    capacity = 6.0e8           # bytes; 0 = no cache
    policy = "minio"           # minio | lru | none
    hit_bandwidth = 5.0e9      # bytes/s per reader; optional, default unlimited
    [loader]                   # optional
    prefetch = 2               # samples a job's loader may hold fetched or in flight ahead of compute
    [[job]]
    name = "resnet"
    sample_time = 0.002        # seconds per sample with data in memory (whole job)
    epochs = 3

The semantics every model of a scenario follows are stated in :mod:`hpcstagger.model`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

from .. import _schema as S
from ..errors import ConfigError

__all__ = ["Dataset", "Storage", "Cache", "Loader", "Job", "Scenario", "POLICIES"]

POLICIES = ("minio", "lru", "none")


@dataclass(frozen=True)
class Dataset:
    """The shared dataset: ``samples`` samples of ``sample_bytes`` bytes each (the mean)."""

    samples: int
    sample_bytes: float


@dataclass(frozen=True)
class Storage:
    """The shared source. ``bandwidth[k-1]`` is its aggregate bytes/s with k concurrent readers."""

    bandwidth: tuple[float, ...]

    def aggregate(self, readers: int) -> float:
        """Aggregate bytes/s delivered to ``readers`` (>= 1) concurrent readers."""
        bw = self.bandwidth
        return bw[min(readers, len(bw)) - 1]

    def per_reader(self, readers: int) -> float:
        """Bytes/s each of ``readers`` (>= 1) concurrent readers gets (equal shares)."""
        return self.aggregate(readers) / readers


@dataclass(frozen=True)
class Cache:
    """The node-local cache: ``capacity`` bytes, a policy, and per-reader hit bandwidth."""

    capacity: float = 0.0
    policy: str = "minio"
    hit_bandwidth: float = math.inf


@dataclass(frozen=True)
class Loader:
    """Each job's data loader: how many samples it may hold fetched or in flight ahead of compute."""

    prefetch: int = 2


@dataclass(frozen=True)
class Job:
    """One training job: per-sample compute time with data in memory, and its number of epochs."""

    name: str
    sample_time: float
    epochs: int = 1


def _job_name(where: str, value: Any) -> str:
    name = S.string()(where, value)
    if not name.strip():
        raise ConfigError(f"{where} must not be blank, got {value!r}")
    return name


_POSITIVE = S.number(minimum=0, exclusive=True)
_DELAY = S.number(minimum=0)
_DATASET = S.Table("dataset", [S.Field("samples", S.integer(minimum=1)), S.Field("sample_bytes", _POSITIVE)])
_STORAGE = S.Table("storage", [S.Field("bandwidth", S.number_list(minimum=0, exclusive=True))])
_CACHE = S.Table("cache", [
    S.Field("capacity", S.number(minimum=0), 0.0, shown="0"),
    S.Field("policy", S.choice(*POLICIES), "minio"),
    S.Field("hit_bandwidth", S.number(minimum=0, exclusive=True, allow_inf=True), math.inf, shown="unlimited"),
])
_LOADER = S.Table("loader", [S.Field("prefetch", S.integer(minimum=1), 2)])
_JOB = S.Table("job", [S.Field("name", _job_name), S.Field("sample_time", _POSITIVE),
                       S.Field("epochs", S.integer(minimum=1), 1)])
_TOP = {"dataset": "required", "storage": "required", "cache": "optional (no cache)",
        "loader": "optional", "job": "required, one [[job]] table per job"}


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
        """How many samples the cache holds (0 when the policy is "none"), at most ``samples``."""
        if self.cache.policy == "none" or self.cache.capacity <= 0:
            return 0
        return min(self.dataset.samples, int(self.cache.capacity // self.dataset.sample_bytes))

    @property
    def miss_time(self) -> float:
        """Seconds to read one sample from the source alone (one reader)."""
        return self.dataset.sample_bytes / self.storage.bandwidth[0]

    @property
    def hit_time(self) -> float:
        """Seconds to read one sample from the cache (0 with unlimited hit bandwidth)."""
        h = self.cache.hit_bandwidth
        return 0.0 if math.isinf(h) else self.dataset.sample_bytes / h

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
        for key in data:
            if key not in _TOP:
                valid = ", ".join(f"[{k}] ({v})" for k, v in _TOP.items())
                raise ConfigError(f"unknown table [{key}]; valid tables: {valid}")
        for key in ("dataset", "storage", "job"):
            if key not in data:
                raise ConfigError(f"missing [{'[job]' if key == 'job' else key}] ({_TOP[key]})")

        dataset = Dataset(**_DATASET.parse("dataset", data["dataset"]))
        storage = Storage(_STORAGE.parse("storage", data["storage"])["bandwidth"])
        cache = Cache(**_CACHE.parse("cache", data.get("cache")))
        loader = Loader(**_LOADER.parse("loader", data.get("loader")))
        raw_jobs = data["job"]
        if isinstance(raw_jobs, Mapping):
            raw_jobs = [raw_jobs]
        if not isinstance(raw_jobs, (list, tuple)) or not raw_jobs:
            raise ConfigError("[[job]] must be a non-empty list of job tables (name, sample_time, epochs)")
        jobs = [Job(**_JOB.parse(f"job[{i}]", jd)) for i, jd in enumerate(raw_jobs)]
        return cls(dataset=dataset, storage=storage, jobs=tuple(jobs), cache=cache, loader=loader)

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
        return {
            "dataset": {"samples": self.dataset.samples, "sample_bytes": self.dataset.sample_bytes},
            "storage": {"bandwidth": list(self.storage.bandwidth)},
            "cache": cache,
            "loader": {"prefetch": self.loader.prefetch},
            "job": [{"name": j.name, "sample_time": j.sample_time, "epochs": j.epochs} for j in self.jobs],
        }

    def to_toml(self, comments: Mapping[str, str] | None = None) -> str:
        """The scenario as TOML text that :meth:`from_toml` reads back.

        ``comments`` maps a dotted key (``"storage.bandwidth"``, ``"job.resnet"``) to a comment
        written beside it, e.g. how calibration measured it.
        """
        comments = dict(comments or {})
        d = self.to_dict()
        out: list[str] = []
        for table in ("dataset", "storage", "cache", "loader"):
            out.append(f"[{table}]")
            for key, value in d[table].items():
                note = comments.get(f"{table}.{key}")
                out.append(f"{key} = {_toml_value(value)}" + (f"  # {note}" if note else ""))
            out.append("")
        for job in d["job"]:
            out.append("[[job]]")
            note = comments.get(f"job.{job['name']}")
            if note:
                out.append(f"# {note}")
            for key, value in job.items():
                out.append(f"{key} = {_toml_value(value)}")
            out.append("")
        return "\n".join(out)


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _validate(s: Scenario) -> None:
    """Check a scenario built from its parts, with the checkers that from_dict uses."""
    for table, part in ((_DATASET, s.dataset), (_CACHE, s.cache), (_LOADER, s.loader)):
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
    reads = []
    for k in range(1, max(len(s.storage.bandwidth), len(s.jobs)) + 1):
        share = s.storage.per_reader(k)  # may underflow to 0 for a tiny bandwidth
        read = s.dataset.sample_bytes / share if share > 0 else math.inf
        if not math.isfinite(read):
            i = min(k, len(s.storage.bandwidth)) - 1
            raise ConfigError(f"storage.bandwidth[{i}] = {s.storage.bandwidth[i]!r} is too small for "
                              f"dataset.sample_bytes = {s.dataset.sample_bytes!r}: reading one sample takes "
                              "forever; give the bandwidth in bytes/s")
        reads.append(read)
    slowest = max(reads)
    total = sum(float(j.epochs) * s.dataset.samples * (j.sample_time + slowest) for j in s.jobs)
    if not math.isfinite(total):
        raise ConfigError("the scenario's run time overflows (samples x epochs x seconds per sample is "
                          "infinite); check the units: seconds, bytes and bytes/s")
