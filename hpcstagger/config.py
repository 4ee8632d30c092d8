"""Tunables in one place.

Every knob has a default, a one-line description, and an environment override named
``HPCSTAGGER_<NAME>`` (upper case). Tests override knobs with :func:`override`::

    with config.override(collective_timeout=2.0):
        ...

Read a knob with :func:`get` at the moment it is needed, never at import time, so overrides and
environment changes take effect.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping

from hpcstagger.errors import ConfigError

__all__ = ["Knob", "KNOBS", "get", "override", "describe", "register"]

ENV_PREFIX = "HPCSTAGGER_"


@dataclass(frozen=True)
class Knob:
    """One tunable: its name, type, default (a value or a zero-argument callable) and description."""

    name: str
    type: type
    default: Any
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default

    def parse(self, text: str) -> Any:
        try:
            if self.type is bool:
                low = text.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(text)
            return self.type(text)
        except ValueError:
            raise ConfigError(
                f"environment variable {self.env}={text!r} is not a valid {self.type.__name__}; "
                f"unset it or give a {self.type.__name__} ({self.help})"
            ) from None


def _default_shm_root() -> str:
    return f"/dev/shm/hpcstagger-{os.getuid()}"


def _default_state_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpcstagger")


_KNOB_LIST: list[Knob] = [
    Knob("collective_timeout", float, 300.0,
         "seconds a rank waits for the others at a guarded collective before raising CollectiveTimeout"),
    Knob("mpi", str, "auto",
         "auto: use MPI when launched by mpiexec/srun or when mpi4py is already imported; 1: always; 0: never"),
    Knob("shm_root", str, _default_shm_root, "root directory of the shared node-local sample caches"),
    Knob("state_dir", str, _default_state_dir, "where hpcstagger keeps calibrations and built wheels"),
    # --- shared sample cache (hpcstagger.cache) ---
    Knob("cache_min_sample_bytes", int, 4096,
         "smallest mean sample size a cache's index is sized for: a cache holds at most "
         "capacity_bytes / this many entries (ShmCache's max_entries overrides it)"),
    Knob("cache_memory_guard", bool, True,
         "a cache refuses inserts while the memory (MemAvailable, or the memory cgroup's room) would keep less "
         "than 5% of the node's or the cgroup's memory (at least 96 MiB) free: /dev/shm pages cannot be dropped, "
         "so a full node would kill the jobs instead"),
    Knob("throttle_dir", str, "",
         "where ThrottledSource keeps its shared reader state; empty means <shm_root>/.throttle"),
    # --- partitioned cache across nodes (hpcstagger.cache.partitioned) ---
    Knob("cache_nodes", int, 0,
         "emulate this many nodes for a partitioned cache: blocks of consecutive ranks, each with its own "
         "shm root <shm_root>/node<i> (0: the real nodes, found with MPI_Comm_split_type(SHARED))"),
    Knob("cache_remote_timeout", float, 5.0,
         "seconds a partitioned cache waits for one transfer from another node before it stops asking "
         "that node (its samples then come from the source)"),
    Knob("cache_partitioned", bool, False,
         "session.cache() partitions the spec's cache across the job's nodes even without [cache] partitioned"),
    Knob("cache_remote_bandwidth", float, 2.0e9,
         "bytes/s one reader gets for a remote hit, where the planner has no measured one and the scenario "
         "gives no [cache] remote_bandwidth (the default: about what 100 KB remote hits measured over UCX "
         "loopback on a 2-core x86 VM, benchmarks/RESULTS.md, section Partitioned cache; not a real network's)"),
    # --- shared loader (hpcstagger.loader) ---
    Knob("loader_window", int, 8,
         "batches a shared loader's producer keeps in shared memory (the most a consumer can run ahead of "
         "the slowest one, with pace='wait')"),
    Knob("loader_segments", int, 8,
         "segments a shared loader's epoch is cut into: a late consumer joins at the next segment boundary, "
         "and samples are reshuffled within segments every round (1: a full reshuffle, joins only at epochs)"),
    Knob("loader_linger", float, 5.0,
         "seconds a shared loader's producer stays up with no consumer attached before it stops and "
         "removes its shared memory"),
    Knob("loader_timeout", float, 300.0,
         "seconds a shared loader's consumer waits for one batch from a live producer before raising LoaderError"),
    Knob("loader_rank_wait", float, 120.0,
         "seconds the entries of a data-parallel job's ranks that have not attached yet hold the producer back"),
    # --- checkpoints (hpcstagger.checkpoint) and the torch.distributed rendezvous ---
    Knob("ckpt_chunk_bytes", int, 8 << 20,
         "bytes the background checkpoint writer hashes (and copies, when it writes through the page cache) "
         "between two looks at the gate"),
    Knob("ckpt_write_bytes", int, 64 << 20,
         "bytes of checkpoint data handed to the file system per write: a large direct write reaches the device "
         "as many requests at once (hashing still goes in ckpt_chunk_bytes, with a look at the gate before each)"),
    Knob("ckpt_gate_max_wait", float, 0.05,
         "seconds the checkpoint writer waits at most for a busy gate before writing the next chunk anyway"),
    Knob("ckpt_timeout", float, 1800.0,
         "seconds the ranks' background checkpoint writers wait for each other before failing the save"),
    Knob("ckpt_direct_io", bool, True,
         "write checkpoint data with O_DIRECT where the file system allows it (no copy into the page cache; "
         "0: always through the page cache)"),
    Knob("ckpt_min_split_bytes", int, 4 << 20,
         "tensors smaller than this are never split between two checkpoint shards"),
    Knob("ckpt_staging_keep", int, 1,
         "committed checkpoints kept in the fast staging level (AsyncCheckpointer staging_dir)"),
    Knob("ckpt_writer_nice", int, 0,
         "nice increment of the background checkpoint writer thread (0: same priority as training)"),
    Knob("ckpt_flush_by", str, "self",
         "who copies a staged checkpoint shard to the durable level: self (its rank's writer) or queue (an "
         "idle process on the node, through the flush queue in the staging directory)"),
    Knob("ckpt_flush_claim_wait", float, 1.0,
         "seconds a writer waits for an idle process to claim its queued flush before copying the shard itself"),
    Knob("ckpt_flush_stale", float, 10.0,
         "seconds without progress after which a writer takes its queued flush back from the process copying it"),
    Knob("ckpt_flush_nice", int, 19,
         "nice increment of the thread with which an idle process copies queued checkpoint flushes"),
    Knob("ckpt_flush_sched_idle", bool, True,
         "run that thread under Linux's SCHED_IDLE policy: it gets only CPU time no other thread wants"),
    Knob("ckpt_flush_chunk_bytes", int, 1 << 20,
         "bytes that thread copies per system call: small, so that on a kernel without preemption the "
         "training's threads get their core back within a fraction of a millisecond"),
    Knob("rendezvous_addr", str, "",
         "address rank 0 advertises for the torch.distributed store (empty: 127.0.0.1 when every rank "
         "is on one host, else rank 0's host name)"),
    # makespan model and planning (hpcstagger.model)
    Knob("calibrate_budget", float, 60.0, "seconds hpcstagger calibrate spends measuring, all steps together"),
    Knob("plan_apart", bool, True,
         "world rank 0 plans in a child interpreter, so that the planner's memory is not inherited by the "
         "DataLoader workers its job forks later (0: plan in the rank's own process)"),
    Knob("plan_ahead", bool, True,
         "hpcstagger launch starts world rank 0's planning process before the ranks, for the request rank 0 "
         "is expected to make; rank 0 takes its plan when its own request is the same (0: rank 0 plans "
         "after the ranks have met)"),
    Knob("plan_min_gain", float, 0.01,
         "least predicted gain (fraction of the makespan) for which optimal_plan recommends a stagger"),
    Knob("plan_replay", bool, True,
         "optimal_plan replays a stagger with the sample-level simulator (in about 0.5 s of CPU or less: a "
         "large dataset at a smaller scale) and starts the jobs together unless the simulator confirms its gain "
         "(0: the fluid model's plan stands alone)"),
    Knob("plan_jitter", float, 0.25,
         "how far a job's real start may stray from its planned delay, as a fraction of the jobs' mean "
         "start-up; optimal_plan minimises the mean predicted makespan over that spread (0: exact starts)"),
    Knob("plan_guard", float, 0.02,
         "mode plan, steered: when the model plans a simultaneous start but predicts its best stagger "
         "within this fraction of it, that stagger's waiting job is held until the run shows whether "
         "starting it at once was right; a stagger shorter than the run's first evidence is held that "
         "long where the model predicts that costs at most this fraction (0: never hold)"),
    Knob("plan_park", bool, True,
         "a job plan_guard holds waits at its loop's first batch (session.loader), set up meanwhile, so that "
         "its release starts its loop at once (0: it waits in hpcstagger.init, before its set-up)"),
    Knob("steer_interval", float, 1.0,
         "seconds between the closed-loop watcher's re-fits of the model while jobs wait for release"),
    Knob("steer_min_gain", float, 0.01,
         "least predicted gain (fraction of the makespan) for which the closed loop moves a release off "
         "the plan's delay; nearer the plan, the fitted model's curve is within its own noise (0: always move)"),
    Knob("steer_duty", float, 0.1,
         "most of one core the closed-loop watcher's re-fits take on average: a re-fit that cost c CPU seconds "
         "puts the next c / steer_duty seconds off at least (0: every steer_interval)"),
    Knob("steer_nice", int, 5,
         "nice value of the closed-loop watcher's thread (0: unchanged): its model work yields to training"),
    Knob("steer_count", bool, True,
         "the closed-loop watcher has the shared cache count the node's source reads in flight while it looks "
         "(the source fit's exact input; each read then takes the cache's lock twice; never where a job loads in "
         "its main process) (0: the mean number in flight stands in)"),
    Knob("progress_interval", float, 0.25,
         "seconds between a job leader's progress records (session.loader) for the watcher"),
    Knob("prefetch_idle", float, 0.1,
         "[plan] prefetch: the waiting job reads into the cache only while the running jobs had fewer "
         "reads in flight than this on average over the last 100 ms"),
    Knob("learn_stagger", float, 3.0,
         "seconds between the jobs' starts in the first run of a spec without a scenario, which learns "
         "from what it observes (0: all at once)"),
]

KNOBS: dict[str, Knob] = {k.name: k for k in _KNOB_LIST}
_overrides: dict[str, Any] = {}


def register(knob: Knob) -> Knob:
    """Add a knob (used by subpackages so their knobs live beside the others). Returns it."""
    existing = KNOBS.get(knob.name)
    if existing is not None and existing != knob:
        raise ConfigError(f"knob {knob.name!r} is registered twice with different definitions")
    KNOBS[knob.name] = knob
    return knob


def _knob(name: str) -> Knob:
    try:
        return KNOBS[name]
    except KeyError:
        valid = ", ".join(sorted(KNOBS))
        raise ConfigError(f"unknown knob {name!r}; valid knobs: {valid}") from None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Current value of knob ``name``: a test override, else the environment (``environ``, default
    this process's), else the default."""
    knob = _knob(name)
    if name in _overrides:
        return _overrides[name]
    text = (os.environ if environ is None else environ).get(knob.env)
    if text is not None and text != "":
        return knob.parse(text)
    return knob.default_value()


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily set knobs (for tests). Unknown names raise ConfigError."""
    for name in values:
        _knob(name)
    saved = {n: _overrides[n] for n in values if n in _overrides}
    _overrides.update(values)
    try:
        yield
    finally:
        for n in values:
            if n in saved:
                _overrides[n] = saved[n]
            else:
                _overrides.pop(n, None)


def describe() -> list[dict[str, Any]]:
    """Every knob with its environment variable, current value, default and description."""
    out = []
    for knob in sorted(KNOBS.values(), key=lambda k: k.name):
        try:
            value: Any = get(knob.name)
        except ConfigError as exc:
            value = f"<invalid: {exc}>"
        out.append({"name": knob.name, "env": knob.env, "value": value,
                    "default": knob.default_value(), "help": knob.help})
    return out

