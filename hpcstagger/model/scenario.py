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
from typing import Any, Mapping, Sequence

from ..errors import ConfigError

__all__ = ["Dataset", "Storage", "Cache", "Loader", "Job", "Scenario", "POLICIES"]

POLICIES = ("minio", "lru", "none")
_UNSET: Any = object()


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


# Valid keys per table: name -> (default or _UNSET when required, description for errors).
_SCHEMA: dict[str, dict[str, tuple[Any, str]]] = {
    "dataset": {"samples": (_UNSET, "required"), "sample_bytes": (_UNSET, "required")},
    "storage": {"bandwidth": (_UNSET, "required")},
    "cache": {"capacity": (0.0, "0"), "policy": ("minio", '"minio"'),
              "hit_bandwidth": (math.inf, "unlimited")},
    "loader": {"prefetch": (2, "2")},
    "job": {"name": (_UNSET, "required"), "sample_time": (_UNSET, "required"), "epochs": (1, "1")},
}
_TOP = {"dataset": "required", "storage": "required", "cache": "optional (no cache)",
        "loader": "optional", "job": "required, one [[job]] table per job"}


def _valid_keys(table: str) -> str:
    return ", ".join(f"{k} ({d})" for k, (_, d) in _SCHEMA[table].items())


def _check_keys(path: str, table: str, data: Mapping[str, Any]) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} must be a table, got {type(data).__name__}")
    for key in data:
        if key not in _SCHEMA[table]:
            raise ConfigError(f"unknown key {path}.{key}; valid keys of [{table}]: {_valid_keys(table)}")


def _get(path: str, table: str, data: Mapping[str, Any], key: str) -> Any:
    default = _SCHEMA[table][key][0]
    if key not in data:
        if default is _UNSET:
            raise ConfigError(f"missing {path}.{key} (required); valid keys of [{table}]: {_valid_keys(table)}")
        return default
    return data[key]


def _number(where: str, value: Any, *, positive: bool = True, allow_zero: bool = False,
            allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(f"{where} must be {'>= 0' if allow_zero else '> 0'} (got {value!r})")
    return value


def _integer(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise ConfigError(f"{where} must be >= {minimum} (got {value!r})")
    return int(value)


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

    def delay_vector(self, delays: "Mapping[str, float] | Sequence[float] | None") -> list[float]:
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
                out[self.job_index(str(name))] = _number(f"delay of job {name!r}", value, allow_zero=True)
            return out
        values = list(delays)
        if len(values) != n:
            raise ConfigError(f"got {len(values)} delays for {n} jobs ({', '.join(self.job_names)}); "
                              "give one per job in job order, or a dict name -> seconds")
        return [_number(f"delay of job {self.jobs[i].name!r}", v, allow_zero=True) for i, v in enumerate(values)]

    # ---- conversion ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Scenario":
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

        ds = data["dataset"]
        _check_keys("dataset", "dataset", ds)
        dataset = Dataset(samples=_integer("dataset.samples", _get("dataset", "dataset", ds, "samples"), 1),
                          sample_bytes=_number("dataset.sample_bytes",
                                               _get("dataset", "dataset", ds, "sample_bytes")))
        st = data["storage"]
        _check_keys("storage", "storage", st)
        bw = _get("storage", "storage", st, "bandwidth")
        if isinstance(bw, (int, float)) and not isinstance(bw, bool):
            bw = [bw]
        if not isinstance(bw, (list, tuple)) or not bw:
            raise ConfigError(f"storage.bandwidth must be a non-empty list of bytes/s (1, 2, ... readers), got {bw!r}")
        storage = Storage(tuple(_number(f"storage.bandwidth[{i}]", v) for i, v in enumerate(bw)))

        ca = data.get("cache", {})
        _check_keys("cache", "cache", ca)
        policy = _get("cache", "cache", ca, "policy")
        if policy not in POLICIES:
            raise ConfigError(f"cache.policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        cache = Cache(capacity=_number("cache.capacity", _get("cache", "cache", ca, "capacity"), allow_zero=True),
                      policy=policy,
                      hit_bandwidth=_number("cache.hit_bandwidth", _get("cache", "cache", ca, "hit_bandwidth"),
                                            allow_inf=True))
        lo = data.get("loader", {})
        _check_keys("loader", "loader", lo)
        loader = Loader(prefetch=_integer("loader.prefetch", _get("loader", "loader", lo, "prefetch"), 1))

        raw_jobs = data["job"]
        if isinstance(raw_jobs, Mapping):
            raw_jobs = [raw_jobs]
        if not isinstance(raw_jobs, (list, tuple)) or not raw_jobs:
            raise ConfigError("[[job]] must be a non-empty list of job tables (name, sample_time, epochs)")
        jobs = []
        for i, jd in enumerate(raw_jobs):
            where = f"job[{i}]"
            _check_keys(where, "job", jd)
            name = _get(where, "job", jd, "name")
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(f"{where}.name must be a non-empty string, got {name!r}")
            jobs.append(Job(name=name,
                            sample_time=_number(f"{where}.sample_time", _get(where, "job", jd, "sample_time")),
                            epochs=_integer(f"{where}.epochs", _get(where, "job", jd, "epochs"), 1)))
        return cls(dataset=dataset, storage=storage, jobs=tuple(jobs), cache=cache, loader=loader)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> "Scenario":
        """Read and validate a scenario file. Raises ConfigError for an unreadable file, bad TOML or a bad field."""
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read scenario file {os.fspath(path)!r}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"scenario file {os.fspath(path)!r} is not valid TOML: {exc}") from None
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
    """Check a scenario built from its parts (from_dict has already checked types on its way)."""
    _integer("dataset.samples", s.dataset.samples, 1)
    _number("dataset.sample_bytes", s.dataset.sample_bytes)
    if not s.storage.bandwidth:
        raise ConfigError("storage.bandwidth must be a non-empty list of bytes/s (1, 2, ... readers)")
    for i, v in enumerate(s.storage.bandwidth):
        _number(f"storage.bandwidth[{i}]", v)
    _number("cache.capacity", s.cache.capacity, allow_zero=True)
    if s.cache.policy not in POLICIES:
        raise ConfigError(f"cache.policy must be one of {', '.join(POLICIES)}, got {s.cache.policy!r}")
    _number("cache.hit_bandwidth", s.cache.hit_bandwidth, allow_inf=True)
    _integer("loader.prefetch", s.loader.prefetch, 1)
    if not s.jobs:
        raise ConfigError("a scenario needs at least one [[job]]")
    seen: set[str] = set()
    for i, j in enumerate(s.jobs):
        if not isinstance(j.name, str) or not j.name.strip():
            raise ConfigError(f"job[{i}].name must be a non-empty string, got {j.name!r}")
        if j.name in seen:
            raise ConfigError(f"job[{i}].name {j.name!r} is used twice; job names must be unique")
        seen.add(j.name)
        _number(f"job[{i}].sample_time", j.sample_time)
        _integer(f"job[{i}].epochs", j.epochs, 1)
