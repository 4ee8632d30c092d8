"""The job spec: one TOML file describing co-located jobs, their data, cache, checkpoints and plan.

``hpcstagger launch``, ``hpcstagger slurm render|submit`` and :func:`hpcstagger.init` (inside every
rank, through ``HPCSTAGGER_SPEC``) all read it. The format::

    [run]
    name = "sweep"                 # names the run, the cache and the Slurm job
    workdir = "runs/sweep"         # logs, status, checkpoints (default hpcstagger-runs/<name>)
    timeout = 3600                 # seconds before `hpcstagger launch` stops the run

    [dataset]
    path = "data/train.h5"         # an HDF5 file, or a directory of sample files
    format = "hdf5"                # hdf5 | directory (default: from the path)
    name = "images"                # the HDF5 dataset (format hdf5)
    throttle = [4.0e7, 2.4e7]      # optional: emulate a slow shared source (ThrottledSource), bytes/s
                                   # with 1, 2, ... concurrent readers

    [cache]
    capacity = "auto"              # bytes or a size; 0 = no cache; "auto": what the node's memory leaves
                                   # beside the jobs (hpcstagger.spec.cachesize)
    policy = "minio"               # minio | none
    partitioned = false            # true: one cache partitioned across the job's nodes over MPI

    [checkpoint]
    directory = "checkpoints"      # one subdirectory per job
    staging_dir = "/dev/shm/ckpt"  # optional fast level, flushed to directory in the background
    flush = "self"                 # "queue": a waiting job's processes do the flush (needs staging_dir)
    keep = 3
    every = 100                    # steps between saves (0: at the end of each epoch)

    [plan]
    mode = "plan"                  # plan | open | simultaneous | sequential | fixed
    scenario = "scenario.toml"     # optional calibrated scenario to plan from
    delays = { vit = 30.0 }        # mode = "fixed": seconds per job (missing jobs start at 0)

    [loader]
    share = true                   # jobs share one data loader (hpcstagger.loader): one producer per node
    pace = "wait"                  # wait | ahead: what a fast job does when a slow one fills the window

    [slurm]
    partition = "gpu"
    time = "02:00:00"
    launcher = "srun"              # srun (srun --multi-prog) | mpiexec (MPMD mpiexec)

    [[job]]
    name = "resnet"
    command = "python examples/train_ddp.py --model resnet"
    ranks = 2
    epochs = 3
    backend = "ddp"                # ddp | horovod | none
    env = { LR = "0.1" }
    loader = "aug1"                # optional: jobs with the same loader name share a loader (default:
                                   # one loader for all jobs when [loader] share = true)

Relative paths are taken relative to the directory of the spec file. Every field is validated, an
unknown key lists the valid keys with their defaults, and a bad value names its dotted path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger import _schema as S, config
from hpcstagger.spec.runenv import PLAN_MODES
from hpcstagger.spec.cachesize import AUTO, resolve_auto
from hpcstagger.errors import CacheError, ConfigError
from hpcstagger.cache.sources import DirectorySource, HDF5Source
from hpcstagger.cache.store import ShmCache, default_max_entries
from hpcstagger.cache.throttle import ThrottledSource

__all__ = ["Spec", "RunSpec", "DatasetSpec", "CacheSpec", "CheckpointSpec", "PlanSpec", "SlurmSpec",
           "LoaderSpec", "JobSpec", "PLAN_MODES", "BACKENDS"]

BACKENDS = ("ddp", "horovod", "none")
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME_HINT = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class RunSpec:
    """Run-wide settings: ``name``, ``workdir`` (absolute) and ``timeout`` seconds."""

    name: str = "hpcstagger"
    workdir: str = ""
    timeout: float = 3600.0


@dataclass(frozen=True)
class DatasetSpec:
    """Where the samples come from; ``path`` is absolute or empty when the jobs bring their own data."""

    path: str = ""
    format: str = ""
    name: str = ""
    pattern: str = "**/*"
    throttle: tuple[float, ...] = ()
    latency: float = 0.0


@dataclass(frozen=True)
class CacheSpec:
    """The shared node-local cache; ``capacity`` 0 means no cache. ``partitioned``: the node caches
    of a job form one cache partitioned across its nodes (:mod:`hpcstagger.cache.partitioned`).
    ``auto``: the spec said ``capacity = "auto"``, and ``capacity`` is the size found for this
    process (:func:`hpcstagger.spec.cachesize.resolve_auto`; ``sized`` says why)."""

    name: str = ""
    capacity: int = 0
    policy: str = "minio"
    root: str = ""
    max_entries: int = 0
    partitioned: bool = False
    auto: bool = False
    sized: str = ""


@dataclass(frozen=True)
class CheckpointSpec:
    """Asynchronous checkpoints: ``directory`` (absolute), optional ``staging_dir``, ``keep``, ``every``,
    and ``flush``: who copies a staged checkpoint to ``directory``: ``"self"`` (each rank's writer)
    or ``"queue"`` (a waiting job's idle process, through the run's flush queue; see
    :mod:`hpcstagger.checkpoint.flushq`)."""

    directory: str = ""
    staging_dir: str = ""
    flush: str = "self"
    keep: int = 3
    every: int = 0


@dataclass(frozen=True)
class PlanSpec:
    """How start delays are chosen: ``mode``, an optional ``scenario`` file, fixed ``delays``,
    the bounds ``min_delay`` and ``max_delay`` on every planned wait, and ``jitter``: seconds a
    job's real start may stray from its plan. Mode ``"plan"`` steers the waits while the run goes
    on (closed loop; with ``steer = false`` it only watches and keeps the planned delays);
    ``"open"`` keeps the plan's delays as fixed sleeps and does not watch. With ``history`` the plan
    starts from what earlier runs measured (:mod:`hpcstagger.stagger.history`). With ``prefetch``
    the job planned to start last fills the cache while it waits (:mod:`~hpcstagger.colocated.prefetch`)."""

    mode: str = "plan"
    scenario: str = ""
    delays: Mapping[str, float] = field(default_factory=dict)
    max_delay: float | None = None
    min_delay: float = 0.0
    steer: bool = True
    history: bool = True
    calibrate: bool = True
    jitter: float | None = None
    prefetch: bool = False


@dataclass(frozen=True)
class LoaderSpec:
    """The shared loader (:mod:`hpcstagger.loader`): with ``share`` every job without a ``loader``
    name of its own shares one; ``pace``, ``window`` and ``segments`` (0: the knobs) as in
    :class:`~hpcstagger.loader.SharedLoader`; ``workers``: the producer's DataLoader workers (0: the
    workers the sharing ranks ask for, added up, up to the node's CPUs)."""

    share: bool = False
    pace: str = "wait"
    window: int = 0
    segments: int = 0
    workers: int = 0


@dataclass(frozen=True)
class SlurmSpec:
    """What ``hpcstagger slurm render`` puts in the batch script."""

    partition: str = ""
    account: str = ""
    time: str = "01:00:00"
    cpus_per_task: int = 1
    launcher: str = "srun"
    options: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    output: str = "%x-%j.out"


@dataclass(frozen=True)
class JobSpec:
    """One co-located training job: its ``command`` runs on each of its ``ranks``."""

    name: str
    command: tuple[str, ...]
    ranks: int = 1
    epochs: int = 1
    backend: str = "none"
    env: Mapping[str, str] = field(default_factory=dict)
    sample_time: float | None = None
    loader: str = ""


_RUN = S.Table("run", [
    S.Field("name", S.string(pattern=_NAME, hint=_NAME_HINT), "hpcstagger"),
    S.Field("workdir", S.string(), "", shown='"hpcstagger-runs/<name>"'),
    S.Field("timeout", S.number(minimum=0, exclusive=True), 3600.0),
])
_DATASET = S.Table("dataset", [
    S.Field("path", S.string(allow_empty=True), "", shown="unset (the jobs read their own data)"),
    S.Field("format", S.choice("hdf5", "directory"), "", shown="from the path"),
    S.Field("name", S.string(), "", shown="required for hdf5"),
    S.Field("pattern", S.string(), "**/*"),
    S.Field("throttle", S.number_list(minimum=0, exclusive=True), (), shown="unset (no emulation)"),
    S.Field("latency", S.number(minimum=0), 0.0),
])
_CACHE = S.Table("cache", [
    S.Field("name", S.string(pattern=_NAME, hint=_NAME_HINT), "", shown="the run name"),
    S.Field("capacity", lambda where, v: AUTO if isinstance(v, str) and v.strip().lower() == AUTO else S.size(where, v),
            0, shown='0 (no cache); "auto": what the memory leaves beside the jobs'),
    S.Field("policy", S.choice("minio", "none"), "minio"),
    S.Field("root", S.string(), "", shown="HPCSTAGGER_SHM_ROOT or /dev/shm/hpcstagger-<uid>"),
    S.Field("max_entries", S.integer(minimum=0), 0,
            shown="0 (auto: capacity / cache_min_sample_bytes, and at least the dataset's samples)"),
    S.Field("partitioned", S.boolean(), False),
])
_CHECKPOINT = S.Table("checkpoint", [
    S.Field("directory", S.string(), "checkpoints", shown='"checkpoints" under the workdir'),
    S.Field("staging_dir", S.string(allow_empty=True), "", shown="unset (one level)"),
    S.Field("flush", S.choice("self", "queue"), "self"),
    S.Field("keep", S.integer(minimum=1), 3),
    S.Field("every", S.integer(minimum=0), 0, shown="0 (end of each epoch)"),
])
_PLAN = S.Table("plan", [
    S.Field("mode", S.choice(*PLAN_MODES), "plan"),
    S.Field("scenario", S.string(allow_empty=True), "", shown="unset"),
    S.Field("delays", S.table, {}, shown="{}"),
    S.Field("max_delay", S.optional(S.number(minimum=0)), None),
    S.Field("min_delay", S.number(minimum=0), 0.0, shown="0"),
    S.Field("steer", S.boolean(), True),
    S.Field("history", S.boolean(), True),
    S.Field("calibrate", S.boolean(), True),
    S.Field("jitter", S.optional(S.number(minimum=0)), None,
            shown="unset (the plan_jitter knob times the jobs' mean start-up)"),
    S.Field("prefetch", S.boolean(), False),
])
_LOADER = S.Table("loader", [
    S.Field("share", S.boolean(), False),
    S.Field("pace", S.choice("wait", "ahead"), "wait"),
    S.Field("window", S.integer(minimum=0), 0, shown="0 (the loader_window knob)"),
    S.Field("segments", S.integer(minimum=0), 0, shown="0 (the loader_segments knob)"),
    S.Field("workers", S.integer(minimum=0), 0,
            shown="0 (the workers the sharing ranks ask for, added up, up to the node's CPUs)"),
])
_SLURM = S.Table("slurm", [
    S.Field("partition", S.string(allow_empty=True), "", shown="the cluster default"),
    S.Field("account", S.string(allow_empty=True), "", shown="unset"),
    S.Field("time", S.string(pattern=r"(\d+-)?\d{1,2}(:\d{2}){0,2}", hint="use [D-]HH:MM:SS"), "01:00:00"),
    S.Field("cpus_per_task", S.integer(minimum=1), 1),
    S.Field("launcher", S.choice("srun", "mpiexec"), "srun"),
    S.Field("options", S.command, (), shown="[] (extra #SBATCH options)"),
    S.Field("setup", lambda w, v: tuple(S.string()(f"{w}[{i}]", x) for i, x in enumerate(_as_list(w, v))),
            (), shown="[] (shell lines before the launch)"),
    S.Field("output", S.string(), "%x-%j.out"),
])
_JOB = S.Table("job", [
    S.Field("name", S.string(pattern=_NAME, hint=_NAME_HINT)),
    S.Field("command", S.command),
    S.Field("ranks", S.integer(minimum=1), 1),
    S.Field("epochs", S.integer(minimum=1), 1),
    S.Field("backend", S.choice(*BACKENDS), "none"),
    S.Field("env", S.str_map, {}, shown="{}"),
    S.Field("sample_time", S.optional(S.number(minimum=0, exclusive=True)), None,
            shown="unset (measured by the job)"),
    S.Field("loader", S.string(pattern=_NAME, hint=_NAME_HINT, allow_empty=True), "",
            shown="unset (the run's shared loader when [loader] share = true, else none)"),
])
_TABLES = {"run": _RUN, "dataset": _DATASET, "cache": _CACHE, "checkpoint": _CHECKPOINT, "plan": _PLAN,
           "loader": _LOADER, "slurm": _SLURM}


def _as_list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    return list(value)


@dataclass(frozen=True)
class Spec:
    """A validated job spec. Build it with :meth:`from_toml` or :meth:`from_dict`."""

    jobs: tuple[JobSpec, ...]
    run: RunSpec = field(default_factory=RunSpec)
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    plan: PlanSpec = field(default_factory=PlanSpec)
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    loader: LoaderSpec = field(default_factory=LoaderSpec)
    path: str = ""

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Spec:
        """Read and validate a spec file. Raises ConfigError naming the file and the bad field."""
        p = Path(path)
        data = S.load_toml(p, "spec file")
        try:
            return cls.from_dict(data, base_dir=p.resolve().parent, path=str(p.resolve()))
        except ConfigError as exc:
            raise ConfigError(f"spec file {p}: {exc}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: str | os.PathLike[str] = ".",
                  path: str = "") -> Spec:
        """Validate a dict shaped like the TOML format; relative paths resolve against ``base_dir``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a spec must be a table, got {type(data).__name__}")
        S.check_tables(data, [*_TABLES, "job"], ", ".join([*(f"[{t}]" for t in _TABLES), "[[job]]"]), "job spec")
        base = Path(base_dir).resolve()

        def resolve(p: str) -> str:
            return str((base / os.path.expanduser(p)).resolve()) if p else ""

        run = _RUN.parse("run", data.get("run"))
        run["workdir"] = resolve(run["workdir"] or f"hpcstagger-runs/{run['name']}")

        ds = _DATASET.parse("dataset", data.get("dataset"))
        ds["path"] = resolve(ds["path"])
        if ds["path"] and not ds["format"]:
            # A path that is not there is an HDF5 file only by its name, so that a mistyped directory is
            # reported as missing (colocated.preflight) rather than as an HDF5 file without dataset.name.
            exists = os.path.exists(ds["path"])
            ds["format"] = ("directory" if os.path.isdir(ds["path"]) or not (
                exists or ds["path"].endswith((".h5", ".hdf5", ".hdf", ".he5"))) else "hdf5")
        if ds["format"] == "hdf5" and ds["path"] and not ds["name"]:
            raise ConfigError("missing dataset.name: the HDF5 dataset to read (format hdf5)")

        ca = _CACHE.parse("cache", data.get("cache"))
        ca["name"] = ca["name"] or run["name"]
        ca["root"] = resolve(ca["root"]) if ca["root"] else ""

        ck = _CHECKPOINT.parse("checkpoint", data.get("checkpoint"))
        ck["directory"] = str((Path(run["workdir"]) / os.path.expanduser(ck["directory"])).resolve())
        ck["staging_dir"] = resolve(ck["staging_dir"])
        if ck["flush"] == "queue" and not ck["staging_dir"]:
            raise ConfigError('checkpoint.flush = "queue" needs checkpoint.staging_dir: the queue flushes the '
                              'staging level; set staging_dir (for example "/dev/shm/ckpt") or flush = "self"')

        raw_jobs = data.get("job")
        if not raw_jobs:
            raise ConfigError("missing [[job]]: give at least one [[job]] table with name and command")
        if not isinstance(raw_jobs, list):
            raise ConfigError("job must be an array of tables: write each job as [[job]]")
        jobs = tuple(JobSpec(**_JOB.parse(f"job[{i}]", j)) for i, j in enumerate(raw_jobs))
        names = [j.name for j in jobs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"job names must be unique; repeated: {', '.join(dupes)}")

        pl = _PLAN.parse("plan", data.get("plan"))
        pl["scenario"] = resolve(pl["scenario"])
        delays = {}
        for name, value in pl["delays"].items():
            if name not in names:
                raise ConfigError(f"plan.delays.{name}: no job named {name!r}; jobs: {', '.join(names)}")
            delays[name] = S.number(minimum=0)(f"plan.delays.{name}", value)
        pl["delays"] = delays
        if pl["mode"] == "fixed" and not delays:
            raise ConfigError('plan.mode = "fixed" needs plan.delays, e.g. delays = { b = 30.0 }')
        if pl["max_delay"] is not None and pl["min_delay"] > pl["max_delay"]:
            raise ConfigError(f"plan.min_delay ({pl['min_delay']:g} s) is above plan.max_delay "
                              f"({pl['max_delay']:g} s): lower min_delay or raise max_delay")

        if ca["capacity"] == AUTO:
            sized = resolve_auto(pl["scenario"], file_source=bool(ds["path"]) and not ds["throttle"])
            ca.update(capacity=sized.capacity, auto=True, sized=sized.why)
        sl = _SLURM.parse("slurm", data.get("slurm"))
        lo = _LOADER.parse("loader", data.get("loader"))
        return cls(jobs=jobs, run=RunSpec(**run), dataset=DatasetSpec(**ds), cache=CacheSpec(**ca),
                   checkpoint=CheckpointSpec(**ck), plan=PlanSpec(**pl), slurm=SlurmSpec(**sl),
                   loader=LoaderSpec(**lo), path=path)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def job_names(self) -> tuple[str, ...]:
        return tuple(j.name for j in self.jobs)

    @property
    def total_ranks(self) -> int:
        """Ranks over all jobs: the size of the MPI world a launch of this spec creates."""
        return sum(j.ranks for j in self.jobs)

    def loader_group(self, name: str) -> str:
        """The shared loader job ``name`` uses ("" for none): its own ``loader``, else the run's name
        when ``[loader] share`` is on."""
        job = self.job(name)
        return job.loader or (self.run.name if self.loader.share else "")

    def loader_groups(self) -> dict[str, list[str]]:
        """Shared loader name -> the jobs (spec order) that share it, for loaders of two or more jobs."""
        groups: dict[str, list[str]] = {}
        for j in self.jobs:
            g = self.loader_group(j.name)
            if g:
                groups.setdefault(g, []).append(j.name)
        return {g: names for g, names in groups.items() if len(names) > 1}

    def job(self, name: str) -> JobSpec:
        """The job called ``name``; raises ConfigError listing the job names."""
        for j in self.jobs:
            if j.name == name:
                return j
        raise ConfigError(f"no job named {name!r} in the spec; jobs: {', '.join(self.job_names)}")

    def only(self, names: Sequence[str]) -> Spec:
        """This spec restricted to the jobs ``names`` (in spec order); raises ConfigError for unknown names."""
        for n in names:
            self.job(n)
        return replace(self, jobs=tuple(j for j in self.jobs if j.name in set(names)))

    def make_source(self, shared_name: str | None = None, *, listing: str | None = None) -> Any:
        """The ``[dataset]`` as a source: HDF5Source or DirectorySource, wrapped in a ThrottledSource
        (``shared_name``, default "<run name>-source", shared by every job) when ``throttle`` is set.
        ``listing``: a file through which a run's processes share a directory's listing.
        Raises ConfigError when the spec has no dataset path."""
        ds = self.dataset
        if not ds.path:
            raise ConfigError("the spec has no [dataset] path; set it, or build your own source")

        base = self._base_source(listing)
        if ds.throttle:
            return ThrottledSource(base, list(ds.throttle), shared_name=shared_name or f"{self.run.name}-source",
                                   latency=ds.latency)
        return base

    def cache_partitioned(self) -> bool:
        """True when the ``[cache]`` is partitioned across nodes: ``partitioned``, or the
        ``cache_partitioned`` knob."""
        return bool(self.cache.partitioned or config.get("cache_partitioned"))

    def make_cache(self, comm: Any = None, *, local: bool = False) -> Any:
        """The ``[cache]`` as the node's ShmCache, or None (capacity 0 or policy none). When
        :meth:`cache_partitioned` (and not ``local``) a PartitionedCache across the nodes of
        ``comm``, collective over it (``capacity`` is then per node)."""
        c = self.cache
        if c.capacity <= 0 or c.policy == "none":
            return None
        from hpcstagger.cache.partitioned import PartitionedCache  # numpy loads only for a partitioned cache

        if self.cache_partitioned() and not local:
            return PartitionedCache(c.name, c.capacity, comm, policy=c.policy, root=c.root or None,
                                    max_entries=self.cache_entries())
        return ShmCache(c.name, c.capacity, policy=c.policy, root=c.root or None, max_entries=self.cache_entries())

    def cache_entries(self) -> int:
        """How many samples the ``[cache]`` can index: its ``max_entries``, or when that is 0
        ``capacity // cache_min_sample_bytes`` (ShmCache's default) and at least the dataset's
        sample count, so that a cache sized for the dataset holds all of it however small its
        samples are; a ``capacity = "auto"`` cache, the dataset's samples where they are known (its
        index need not hold more). Every process of the run computes the same number."""
        c = self.cache
        if c.max_entries:
            return c.max_entries
        samples = self.dataset_samples() or 0
        if c.auto and samples:
            return max(64, samples)
        return max(default_max_entries(c.capacity), samples)

    def dataset_samples(self) -> int | None:
        """The ``[dataset]``'s sample count (None without a path, or when it cannot be opened)."""
        if not self.dataset.path:
            return None
        try:
            base = self._base_source()
        except (OSError, ValueError, ConfigError, CacheError):
            return None
        try:
            return len(base)
        finally:
            close = getattr(base, "close", None)
            if close is not None:
                close()

    def base_source(self) -> Any:
        """The ``[dataset]``'s files as a source, unthrottled, keyed as every job keys them (raises
        ConfigError when the dataset cannot be opened)."""
        return self._base_source()

    def _base_source(self, listing: str | None = None) -> Any:
        """The ``[dataset]``'s files as a source, unthrottled: an HDF5Source or a DirectorySource."""
        ds = self.dataset
        if ds.format == "hdf5":
            return HDF5Source(ds.path, ds.name)
        return DirectorySource(ds.path, ds.pattern, listing=listing)

    def layout(self) -> list[tuple[JobSpec, int]]:
        """Each job with its first world rank, in launch order (MPMD places jobs consecutively)."""
        out, first = [], 0
        for j in self.jobs:
            out.append((j, first))
            first += j.ranks
        return out
