"""``[cache] capacity = "auto"``: the shared /dev/shm cache sized to what the node's memory leaves
once the jobs hold theirs.

A /dev/shm page is not dropped under memory pressure as a page-cache page is: a cache sized past
what the jobs leave free gets them killed by the kernel's out-of-memory killer, in a Slurm job's
memory cgroup as on a whole node. "auto" sizes it from measurements (:func:`size_cache`):

- the memory the run may fill: the node's ``MemAvailable`` or its memory cgroup's room, the
  smaller (:func:`hpcstagger.model.source_probe.mem_available`), when the run starts;
- the jobs' own memory, ``[node] jobs_memory`` of the calibrated scenario (``hpcstagger calibrate
  --spec`` follows each job's processes alone and adds up their peaks), with a margin
  (:data:`JOB_MARGIN`) for what one run holds more than another;
- a reserve (:data:`RESERVE_SHARE` of that memory, at least :data:`RESERVE_MIN`) for the launcher,
  the coordinator, MPI and the libraries' pages.

What is left, at most the dataset, is the cache, with two exceptions where it is 0 (no cache):

- the dataset fits in what is left and is read from files, not from an emulated source: the page
  cache then keeps it once read, for every job, and a /dev/shm copy would hold it twice;
- what is left is under :data:`MIN_SHARE` of the dataset: a cache that small hits too rarely to
  pay for its inserts.

Without a measurement of the jobs (no scenario, or one calibrated before ``jobs_memory`` was
measured) the cache takes at most :data:`UNMEASURED_SHARE` of the memory.

Every process of a run must agree on the size (a ShmCache is created once, with one capacity):
``hpcstagger launch``, ``hpcstagger calibrate --spec`` and the rendered batch script (``hpcstagger
slurm prepare``) size it once and hand it to every process
in ``HPCSTAGGER_CACHE_CAPACITY`` (:data:`~hpcstagger.spec.runenv.CACHE_CAPACITY`). A process
started otherwise sizes it from the memory the node's processes may hold in all (the cgroup's
limit, or ``MemTotal``), which is the same for every process of the node.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from hpcstagger.errors import CacheError, ConfigError
from hpcstagger.model.scenario import Scenario
from hpcstagger.model.source_probe import mem_available
from hpcstagger.nodeload import RESERVE_MIN, RESERVE_SHARE, memory_reserve, memory_total
from hpcstagger.spec import runenv

__all__ = ["AUTO", "Sizing", "size_cache", "resolve_auto", "for_launch", "scenario_facts", "JOB_MARGIN",
           "RESERVE_SHARE", "RESERVE_MIN", "MIN_SHARE", "UNMEASURED_SHARE"]

log = logging.getLogger(__name__)

AUTO = "auto"
JOB_MARGIN = 0.10        # the jobs' measured memory, plus this share
MIN_SHARE = 0.10         # a cache under this share of the dataset is not worth its inserts: none
UNMEASURED_SHARE = 0.5   # the jobs' memory unknown: the cache takes at most this share of the memory


@dataclass(frozen=True)
class Sizing:
    """A cache capacity in bytes (0: no cache), one line saying why, ``room``: the bytes left beside
    the jobs (with their margin) and the reserve, and ``page_room``: the bytes the page cache keeps
    beside the jobs as measured (None: not known)."""

    capacity: int
    why: str
    room: int | None = None
    page_room: int | None = None


def _mb(x: float) -> str:
    return f"{x / 1e6:.0f} MB"


def size_cache(memory: int | None, jobs_memory: float, dataset_bytes: float | None, *,
               file_source: bool, memory_is: str = "this node leaves") -> Sizing:
    """The cache's capacity out of ``memory`` bytes (what the run may fill; None: unknown) when the
    jobs hold ``jobs_memory`` bytes (0: not measured) and the dataset is ``dataset_bytes`` (None:
    unknown). ``file_source``: the dataset is read from files (the page cache keeps what it reads),
    not from an emulated source. ``memory_is`` says what ``memory`` is, for the line. Pure."""
    if memory is None or memory <= 0:
        return Sizing(0, "the memory this node leaves could not be read (/proc/meminfo, the memory cgroup): no cache; "
                         "give [cache] capacity as a size")
    reserve = memory_reserve(memory)
    if jobs_memory <= 0:
        room = int(min(UNMEASURED_SHARE * memory, memory - reserve))
        how = (f"{UNMEASURED_SHARE:.0%} of the {_mb(memory)} {memory_is}, as the jobs' memory is not measured "
               "(hpcstagger calibrate --spec measures it)")
    else:
        held = (1.0 + JOB_MARGIN) * jobs_memory
        room, page = int(memory - held - reserve), int(memory - jobs_memory)
        how = (f"the {_mb(memory)} {memory_is}, less the jobs' measured {_mb(jobs_memory)} (+{JOB_MARGIN:.0%}) "
               f"and a reserve of {_mb(reserve)}")
        if dataset_bytes is not None and file_source and 0 < dataset_bytes <= page:
            return Sizing(0, f"no cache: the dataset ({_mb(dataset_bytes)}) fits in what the {_mb(memory)} "
                             f"{memory_is} keeps beside the jobs' measured {_mb(jobs_memory)} ({_mb(page)}), so the "
                             "page cache keeps it once read for every job; a /dev/shm copy would hold it twice",
                          room, page)
        return _left(room, how, dataset_bytes, page)
    return _left(room, how, dataset_bytes, None)


def _left(room: int, how: str, dataset_bytes: float | None, page: int | None) -> Sizing:
    """The cache of ``room`` bytes (``how`` says where they come from), at most the dataset."""
    if room <= 0:
        return Sizing(0, f"no cache: nothing is left of {how}", room, page)
    if dataset_bytes is not None and dataset_bytes > 0:
        if room < MIN_SHARE * dataset_bytes:
            return Sizing(0, f"no cache: {how} leaves {_mb(room)}, under {MIN_SHARE:.0%} of the dataset "
                             f"({_mb(dataset_bytes)}), too little to pay for the cache's inserts", room, page)
        if room >= dataset_bytes:  # the whole dataset, with room for the arena's rounding
            return Sizing(int(dataset_bytes * 1.01) + (1 << 20), f"the dataset ({_mb(dataset_bytes)}), which fits "
                                                                   f"in {how} ({_mb(room)})", room, page)
        return Sizing(room, f"{_mb(room)}: {how} ({room / dataset_bytes:.0%} of the {_mb(dataset_bytes)} dataset)",
                      room, page)
    return Sizing(room, f"{_mb(room)}: {how}", room, page)


def scenario_facts(path: str) -> tuple[float, float | None]:
    """``(jobs_memory, dataset_bytes)`` of the scenario file ``path`` (0 and None where it is
    missing or unreadable: the caller then sizes without them)."""
    if not path or not os.path.exists(path):
        return 0.0, None
    try:
        s = Scenario.from_toml(path)
    except ConfigError as exc:
        log.warning("cache capacity auto: the scenario %s cannot be read (%s); sizing without it", path, exc)
        return 0.0, None
    return float(s.node.jobs_memory), float(s.dataset.samples * s.dataset.sample_bytes)


def resolve_auto(scenario: str, file_source: bool, environ: Mapping[str, str] | None = None) -> Sizing:
    """The capacity of ``[cache] capacity = "auto"`` in this process: the launcher's
    (``HPCSTAGGER_CACHE_CAPACITY``), else sized from the memory the node's processes may hold in all
    and the scenario's ``jobs_memory`` (:func:`size_cache`), the same in every process of the node."""
    text = (os.environ if environ is None else environ).get(runenv.CACHE_CAPACITY, "")
    if text:
        try:
            value = int(text)
            if value < 0:
                raise ValueError(text)
        except ValueError:
            raise ConfigError(f"{runenv.CACHE_CAPACITY}={text!r} is not a byte count; unset it (hpcstagger launch "
                              "sets it) or give bytes") from None
        return Sizing(value, f"sized by the launcher ({runenv.CACHE_CAPACITY})")
    jobs_memory, dataset_bytes = scenario_facts(scenario)
    return size_cache(memory_total(), jobs_memory, dataset_bytes, file_source=file_source,
                      memory_is="the node's processes may hold in all")


def for_launch(spec: Any, environ: Mapping[str, str]) -> Sizing | None:
    """The size ``hpcstagger launch`` gives a spec's ``capacity = "auto"`` cache for the whole run,
    from the memory free when it starts; None when the spec gives a size, or ``environ`` has one
    already. A cache that exists (kept warm from an earlier run) keeps its size."""
    if not spec.cache.auto or environ.get(runenv.CACHE_CAPACITY):
        return None
    from hpcstagger.cache.admin import cache_contents

    try:
        found = cache_contents(spec.cache.name, spec.cache.root or None)
    except CacheError as exc:
        log.warning("cannot read the cache %r to keep its size: %s", spec.cache.name, exc)
        found = None
    if found is not None:
        return Sizing(int(found["capacity_bytes"]), f"the cache {spec.cache.name!r} exists ({found['entries']} "
                      f"entries) and keeps its {_mb(found['capacity_bytes'])}; remove it (hpcstagger cache clear "
                      f"{spec.cache.name}, or launch --cold-cache) to size it again")
    jobs_memory, dataset_bytes = scenario_facts(spec.plan.scenario)
    return size_cache(mem_available(), jobs_memory, dataset_bytes,
                      file_source=bool(spec.dataset.path) and not spec.dataset.throttle)
