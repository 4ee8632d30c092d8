"""Cache administration behind ``hpcstagger cache``: list caches, look into one without
creating it, empty or remove one, remove a damaged one. A partitioned cache's per-process stats
files (``<root>/.partition/<name>/``) go with the cache when it is removed."""

from __future__ import annotations

import os
from typing import Any

from hpcstagger import config
from hpcstagger.errors import CacheError
from hpcstagger.cache import _fs, _pstats
from hpcstagger.cache._nodelisting import LISTINGS
from hpcstagger.cache.store import ShmCache

__all__ = ["list_caches", "cache_contents", "clear_cache", "remove_broken", "remove_empty_dirs", "ROOT_SUBDIRS"]

# The root's own folders beside the caches: shared loader rings, throttle tables, partitioned stats,
# dataset listings (:mod:`._nodelisting`).
ROOT_SUBDIRS = (".loader", ".throttle", ".partition", LISTINGS)


def remove_empty_dirs(root: str | None = None, *, keep_root: bool = False) -> list[str]:
    """Remove the root's folders (:data:`ROOT_SUBDIRS`, and ``.partition``'s per-cache folders) when
    they are empty, then the root itself when nothing is left (unless ``keep_root``); return the
    paths removed. A folder with anything in it stays. Raises CacheError for an unsafe root (as
    :class:`ShmCache` would)."""
    root = os.path.abspath(root or config.get("shm_root"))
    if not os.path.lexists(root):
        return []
    removed = []
    fd = _fs.open_secure_dir(root, create=False, what="cache root")
    try:
        for sub in ROOT_SUBDIRS:
            if sub == ".partition" and os.path.isdir(os.path.join(root, sub)):
                for name in os.listdir(os.path.join(root, sub)):
                    removed += _rmdir(os.path.join(sub, name), fd, root)
            removed += _rmdir(sub, fd, root)
    finally:
        os.close(fd)
    if keep_root:
        return removed
    try:
        os.rmdir(root)  # checked above: ours, not a link; fails while anything is in it
        removed.append(root)
    except OSError:
        pass
    return removed


def _rmdir(name: str, root_fd: int, root: str) -> list[str]:
    try:
        os.rmdir(name, dir_fd=root_fd)
    except OSError:  # absent, not empty, or not a directory: leave it
        return []
    return [os.path.join(root, name)]


def list_caches(root: str | None = None) -> list[str]:
    """Names of the caches under ``root`` (default: the ``shm_root`` knob); [] if it does not exist."""
    root = os.path.abspath(root or config.get("shm_root"))
    if not os.path.lexists(root):
        return []
    fd = _fs.open_secure_dir(root, create=False, what="cache root")
    try:
        names = []
        for name in sorted(os.listdir(fd)):
            try:
                _fs.validate_name(name)
                os.stat(os.path.join(name, "ledger"), dir_fd=fd, follow_symlinks=False)
            except (CacheError, OSError):
                continue
            names.append(name)
        return names
    finally:
        os.close(fd)


def remove_broken(name: str, root: str | None = None) -> bool:
    """Remove cache directory ``name`` if it is safe to touch (ours, not a link) but not a usable cache.

    For ``hpcstagger cache clear`` on a cache whose creation died half way or whose files were
    damaged. Returns False (removing nothing) when the directory is missing, unsafe, or healthy.
    """
    root = os.path.abspath(root or config.get("shm_root"))
    try:
        _fs.validate_name(name)
    except CacheError:  # no cache has such a name; '.' or '..' would name the root or above it
        return False
    try:
        ShmCache(name, None, root=root).close()
        return False  # healthy
    except CacheError:
        pass
    try:
        root_fd = _fs.open_secure_dir(root, create=False, what="cache root")
    except CacheError:
        return False
    try:
        try:
            dir_fd = _fs.open_secure_subdir(root_fd, name, root, create=False, what="cache directory")
        except CacheError:
            return False
        try:
            for entry in os.listdir(dir_fd):
                os.unlink(entry, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        os.rmdir(name, dir_fd=root_fd)
        return True
    finally:
        os.close(root_fd)


def cache_contents(name: str, root: str | None = None) -> dict[str, Any] | None:
    """What cache ``name`` holds now: ``entries``, ``bytes`` (payload bytes used), ``capacity_bytes``
    and ``processes`` (live attached); None when there is no such cache. Creates nothing (neither
    the root nor the cache). Raises CacheError for an unsafe root or cache directory or a damaged cache.
    """
    root = os.path.abspath(root or config.get("shm_root"))
    if name not in list_caches(root):
        return None
    cache = ShmCache(name, None, root=root)
    try:
        s = cache.stats()
    finally:
        cache.close()
    return {"entries": int(s["entries"]), "bytes": int(s["bytes_used"]), "capacity_bytes": int(s["capacity_bytes"]),
            "processes": int(s["processes"])}


def clear_cache(name: str, root: str | None = None, *, missing_ok: bool = False) -> dict[str, Any]:
    """Empty cache ``name``: remove it when no live process is attached, else drop its entries.

    The cache's safety checks apply (owner, mode, no symlinks), as in :class:`ShmCache`. A damaged
    cache is removed with :func:`remove_broken`. After a removal the root's empty folders, and the
    root itself when empty, go too (:func:`remove_empty_dirs`). Returns ``{"name", "root", "action", "entries",
    "bytes", "processes"}`` with ``action`` one of ``"removed"``, ``"cleared"`` (kept: in use),
    ``"removed damaged"`` or ``"absent"`` (only with ``missing_ok``; nothing was there). A removed
    cache's partitioned-cache stats directory is removed with it; a cleared one's keeps the counts
    of live and ended processes, the ended ones folded into one file (:func:`._pstats.prune`). Raises
    CacheError for an unknown cache (unless ``missing_ok``) or one that is not safe to touch.
    """
    root = os.path.abspath(root or config.get("shm_root"))
    out: dict[str, Any] = {"name": name, "root": root, "action": "absent", "entries": 0, "bytes": 0, "processes": 0}
    try:
        cache = ShmCache(name, None, root=root)
    except CacheError:
        if missing_ok and not os.path.lexists(os.path.join(root, _fs.validate_name(name))):
            return out
        if remove_broken(name, root):  # a half-created or damaged cache: remove what is there
            out["action"] = "removed damaged"
            _pstats.remove(root, name)
            remove_empty_dirs(root)
            return out
        raise
    stats = cache.stats()
    out.update(entries=int(stats["entries"]), bytes=int(stats["bytes_used"]), processes=int(stats["processes"]))
    if out["processes"]:
        cache.clear()
        cache.close()
        out["action"] = "cleared"
        _pstats.prune(root, name)  # kept, as the cache's own counters are: only ended processes' files go
    else:
        cache.destroy()
        out["action"] = "removed"
        _pstats.remove(root, name)  # its counters restart with the cache
        remove_empty_dirs(root)  # no empty root, .loader or .throttle left behind
    return out
