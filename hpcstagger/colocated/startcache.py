"""The shared cache at the start of a run: what it holds, and making it cold.

- :func:`observe_cache`: what the spec's shared cache holds now (entries, bytes), looked at
  without creating anything. World rank 0 of :func:`hpcstagger.init` calls it at plan time and
  plans from that state (:func:`~hpcstagger.stagger.delays.plan_run`).
- :func:`make_cold`: ``hpcstagger launch --cold-cache`` and ``hpcstagger sweep``: empty the
  spec's cache with the cache's own clear/remove (its ownership and permission checks apply), and
  ask the kernel to drop the dataset's files from its page cache (``posix_fadvise DONTNEED``,
  which needs no root; failures are logged and reported, not raised).
- :func:`run_partition`: for a partitioned cache, the nodes the run spans (collective), which
  the plan is made for.
- :func:`describe_start`, :func:`describe_cold`: one line each for the launch output (pure).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from hpcstagger import config
from hpcstagger.errors import CacheError, ConfigError
from hpcstagger.spec.jobspec import Spec
from hpcstagger.cache.store import ShmCache
from hpcstagger.cache.nodes import discover
from hpcstagger.cache import DirectorySource
from hpcstagger._io import drop_cached_pages

__all__ = ["observe_cache", "run_partition", "make_cold", "drop_page_cache", "dataset_files", "describe_start",
           "describe_cold"]

log = logging.getLogger(__name__)


def _has_cache(spec: Spec) -> bool:
    return spec.cache.capacity > 0 and spec.cache.policy != "none"


def observe_cache(spec: Spec | None) -> dict[str, Any] | None:
    """What the spec's shared cache holds now *of the spec's dataset*: ``{"name", "exists",
    "entries", "bytes", "other_entries"}``.

    Entries are counted under the keys the jobs will look up, which carry the identity of each
    file's version (:mod:`hpcstagger.cache.sources`): a cache filled from other data, or from an
    older version of these files, is cold for this dataset, and its entries are ``other_entries``.
    The count is exact up to :data:`PROBES` samples and estimated from as many evenly spaced ones
    above that. None when there is no spec or it has no cache. A cache that does not exist yet is
    empty (and is not created). A cache that cannot be read (unsafe directory, damaged files) is
    reported with ``error`` and counted as empty, with a logged warning: planning goes on as for a
    cold start. A dataset that cannot be opened counts as cold too, with ``note``.
    """
    if spec is None or not _has_cache(spec):
        return None
    from hpcstagger.cache.admin import cache_contents

    out: dict[str, Any] = {"name": spec.cache.name, "exists": False, "entries": 0, "bytes": 0}
    try:
        found = cache_contents(spec.cache.name, _node_roots(spec)[0])  # world rank 0, which looks, is on node 0
    except CacheError as exc:
        log.warning("cannot read the shared cache %r, planning as for a cold start: %s", spec.cache.name, exc)
        out["error"] = str(exc)
        return out
    if found is not None:
        out.update(exists=True, entries=found["entries"], bytes=found["bytes"], other_entries=0)
        if found["entries"]:
            out.update(_dataset_share(spec, _node_roots(spec)[0], found))
    return out


PROBES = 4096  # sample keys looked up to count what a cache holds of a dataset


def _dataset_share(spec: Spec, root: str | None, found: Mapping[str, Any]) -> dict[str, Any]:
    """How many of the cache's ``found["entries"]`` are the spec's dataset's samples (and their
    bytes, at the cache's mean entry size), from up to :data:`PROBES` of its keys."""
    total = int(found["entries"])
    try:
        source = spec.base_source()
    except (ConfigError, CacheError, OSError) as exc:
        return {"entries": 0, "bytes": 0, "other_entries": total, "note": f"the dataset cannot be read: {exc}"}
    n = len(source)
    picks = range(n) if n <= PROBES else sorted({int(k * n / PROBES) for k in range(PROBES)})
    cache = ShmCache(spec.cache.name, None, root=root)
    try:
        hits = sum(1 for i in picks if source.key(i) in cache)
    finally:
        cache.close()
        close = getattr(source, "close", None)
        if close is not None:
            close()
    entries = min(total, round(n * hits / max(1, len(picks))))
    return {"entries": entries, "bytes": int(found["bytes"]) * entries // max(1, total),
            "other_entries": total - entries}


def _node_roots(spec: Spec) -> list[str | None]:
    """The shm roots of the spec's cache: its root (None: the knob's), or for a partitioned cache
    on emulated nodes (the ``cache_nodes`` knob) each node's ``<root>/node<i>``, node 0 first."""
    nodes = int(config.get("cache_nodes"))
    if not spec.cache_partitioned() or nodes <= 0:
        return [spec.cache.root or None]
    base = os.path.abspath(spec.cache.root or config.get("shm_root"))
    return [os.path.join(base, f"node{i}") for i in range(nodes)]


def run_partition(world: Any, spec: Spec | None, timeout: float) -> dict[str, Any] | None:
    """The run's partitioned cache, for the planner: ``{"nodes", "remote_bandwidth"}``, or None
    when the spec has no cache or does not partition it (``[cache] partitioned`` or the
    ``cache_partitioned`` knob, as :meth:`Spec.make_cache` decides).

    ``nodes`` is how many nodes ``world`` spans, found as the cache finds them
    (:func:`hpcstagger.cache.nodes.discover`: the ``cache_nodes`` knob's emulated nodes, else
    ``MPI_Comm_split_type``); ``remote_bandwidth`` is the ``cache_remote_bandwidth`` knob, the
    default for a remote hit. Collective over ``world`` when it partitions (every rank reads the
    same spec and knobs). Raises ConfigError for a bad ``cache_nodes`` and CollectiveTimeout when a
    rank never arrives."""
    if spec is None or not _has_cache(spec) or not spec.cache_partitioned():
        return None

    return {"nodes": discover(world, timeout=timeout).count,
            "remote_bandwidth": float(config.get("cache_remote_bandwidth"))}


def dataset_files(spec: Spec) -> list[str]:
    """The files behind the spec's ``[dataset]``: the HDF5 file, or every file of a directory that
    matches its pattern (sorted); [] without a dataset path."""
    ds = spec.dataset
    if not ds.path:
        return []
    base = Path(ds.path)
    if base.is_dir():
        try:
            source = DirectorySource(base, ds.pattern)
        except ConfigError:  # nothing matches
            return []
        return [source.path(i) for i in range(len(source))]
    return [ds.path] if base.exists() else []


def drop_page_cache(paths: list[str]) -> dict[str, Any]:
    """Ask the kernel to drop ``paths`` from its page cache (``posix_fadvise(..., DONTNEED)``).

    Needs no privileges; pages that are dirty or mapped by a process stay. Returns ``{"files",
    "bytes", "failed", "note"}``: the files advised, their bytes, the files that failed (each
    logged as a warning). Never raises for a file that cannot be advised.
    """
    out: dict[str, Any] = {"files": 0, "bytes": 0, "failed": 0, "note": ""}
    if not hasattr(os, "posix_fadvise"):
        out["note"] = "posix_fadvise is not available on this platform"
        log.warning("cannot drop the dataset from the page cache: %s", out["note"])
        return out

    for path in paths:
        try:
            size = drop_cached_pages(path)
        except OSError as exc:
            out["failed"] += 1
            log.warning("cannot drop %s from the page cache: %s", path, exc)
            continue
        out["files"] += 1
        out["bytes"] += size
    return out


def make_cold(spec: Spec) -> dict[str, Any]:
    """Empty the spec's shared cache and drop its dataset from the page cache, before a run.

    Returns ``{"cache": <clear_cache's report, or None without a cache>, "page_cache":
    <drop_page_cache's report>}``. Raises CacheError when the cache exists but is not safe to
    touch (another user's, a symlink, a bad mode): a run that was asked to start cold must not
    start warm silently.
    """
    out: dict[str, Any] = {"cache": None, "page_cache": None}
    if _has_cache(spec):
        from hpcstagger.cache.admin import clear_cache

        try:
            reports = [clear_cache(spec.cache.name, root, missing_ok=True) for root in _node_roots(spec)]
            out["cache"] = reports[0]
            if len(reports) > 1:  # emulated nodes: one report for all of them
                out["cache"].update(entries=sum(r["entries"] for r in reports), bytes=sum(r["bytes"] for r in reports),
                                    nodes=len(reports))
        except CacheError as exc:
            raise CacheError(f"--cold-cache: cannot clear the shared cache {spec.cache.name!r}: {exc}") from None
    files = dataset_files(spec)
    out["page_cache"] = drop_page_cache(files) if files else {
        "files": 0, "bytes": 0, "failed": 0, "note": "the spec names no dataset files"}
    return out


def _mb(n: Any) -> str:
    x = float(n or 0)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{int(x)} B"


def describe_start(cache: Mapping[str, Any] | None) -> str:
    """``"cold cache"`` or ``"warm cache: 1200 samples (14.7 MB, 40% of the dataset)"``, then how many
    entries are of other data when there are any; "" with no cache."""
    if not cache:
        return ""
    if cache.get("error"):
        return "cache unreadable, planned as cold"
    entries = int(cache.get("entries") or 0)
    other = int(cache.get("other_entries") or 0)
    tail = ""
    if other:
        tail = (f"; {other} entries of other data or of an older version of these files "
                f"(`hpcstagger cache clear {cache.get('name')}` frees their space)")
    if entries == 0:
        return "cold cache" + tail
    extra = f", {cache['fraction']:.0%} of the dataset" if cache.get("fraction") is not None else ""
    return f"warm cache: {entries} samples ({_mb(cache.get('bytes'))}{extra})" + tail


def describe_cold(cold: Mapping[str, Any] | None) -> str:
    """What ``--cold-cache`` did, in one line; "" when it was not asked for."""
    if not cold:
        return ""
    try:
        return _describe_cold(cold)
    except (AttributeError, KeyError, TypeError, ValueError):  # a record damaged on disk, or another version's
        return "cold cache: (its record in the run directory is damaged)"


def _describe_cold(cold: Mapping[str, Any]) -> str:
    parts = []
    cache = cold.get("cache")
    if cache:
        action = cache.get("action")
        if action == "absent":
            parts.append(f"cache {cache['name']!r} was already empty (none yet)")
        elif action == "cleared":
            parts.append(f"cleared cache {cache['name']!r} ({cache['entries']} entries, {_mb(cache['bytes'])}; "
                         f"kept, {cache['processes']} live process(es) use it)")
        else:
            parts.append(f"{action} cache {cache['name']!r} ({cache['entries']} entries, {_mb(cache['bytes'])})")
    page = cold.get("page_cache") or {}
    if page.get("files"):
        parts.append(f"dropped {page['files']} dataset file(s) ({_mb(page['bytes'])}) from the page cache")
    if page.get("failed"):
        parts.append(f"could not drop {page['failed']} file(s) from the page cache (see the log)")
    if page.get("note"):
        parts.append(f"page cache: {page['note']}")
    return "cold cache: " + "; ".join(parts) if parts else "cold cache"
