"""What hpcstagger keeps in /dev/shm for this user, who still uses it, and removing it.

Everything lives in two places: the shm root (the ``shm_root`` knob, ``/dev/shm/hpcstagger-<uid>``
by default: one folder per cache, shared loader rings in ``.loader``, throttle tables in
``.throttle``, partitioned-cache counters in ``.partition``, dataset listings in ``.listings``;
the ``throttle_dir`` knob may move the tables) and this user's checkpoint gate files,
``/dev/shm/hpcstagger-gate-<uid>-<pid>-*``. A live process uses an item when it has one of its
files open or mapped (``/proc/<pid>/fd`` and ``/proc/<pid>/maps``): every attached cache, ring,
table and gate maps its file, and every process that read a dataset listing keeps it open.
``hpcstagger clean`` is :func:`clean`; a launch calls :func:`remove_unused` when its ranks are
gone, so that what killed ranks could not remove goes with them.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from collections.abc import Iterable, Mapping

from hpcstagger import config
from hpcstagger.cache import _fs
from hpcstagger.cache.admin import ROOT_SUBDIRS, remove_empty_dirs
from hpcstagger.checkpoint.gates import gate_owner
from hpcstagger.errors import CacheError, LoaderError
from hpcstagger.cache.throttle import remove_if_idle

__all__ = ["Leftover", "find", "users_of", "clean", "remove_unused"]

log = logging.getLogger(__name__)

GATE_DIR = "/dev/shm"
_KINDS = {".loader": "loader ring", ".throttle": "throttle table", ".partition": "partition counters",
          ".listings": "dataset listing"}


@dataclass(frozen=True)
class Leftover:
    """One item in /dev/shm: ``kind`` (cache, loader ring, throttle table, partition counters, gate
    file, other), its ``path``, and ``users``: (pid, command) of the live processes that hold it."""

    kind: str
    path: str
    users: tuple[tuple[int, str], ...] = ()

    def describe(self) -> str:
        """One line: what and where, and who uses it."""
        who = ", ".join(f"pid {p} ({c})" for p, c in self.users)
        return f"{self.kind} {self.path}" + (f" (in use by {who})" if who else "")


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def users_of(prefixes: Iterable[str]) -> dict[str, set[int]]:
    """Path -> pids of the live processes (not this one) that have it open or mapped, for every
    path under one of ``prefixes``."""
    prefixes = tuple(prefixes)
    me = os.getpid()
    out: dict[str, set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        paths = set()
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        paths.add(parts[5].strip())
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:  # gone, or another user's
            continue
        for p in paths:
            p = p.removesuffix(" (deleted)")
            if p.startswith(prefixes):
                out.setdefault(p, set()).add(pid)
    return out


def _entries(root: str, throttle: str) -> list[tuple[str, str]]:
    """(kind, path) of each item under the root (and the throttle folder when it is elsewhere)."""
    items: list[tuple[str, str]] = []
    if os.path.lexists(root):
        os.close(_fs.open_secure_dir(root, create=False, what="cache root"))  # ours, not a link
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name in ROOT_SUBDIRS and os.path.isdir(path) and not os.path.islink(path):
                items += [(_KINDS[name], os.path.join(path, n)) for n in sorted(os.listdir(path))]
            else:
                kind = "cache" if os.path.lexists(os.path.join(path, "ledger")) else "other"
                items.append((kind, path))
    if throttle != os.path.join(root, ".throttle") and os.path.isdir(throttle) and not os.path.islink(throttle):
        items += [("throttle table", os.path.join(throttle, n)) for n in sorted(os.listdir(throttle))]
    return items


def find(root: str | None = None, *, gate_dir: str = GATE_DIR,
         environ: Mapping[str, str] | None = None) -> list[Leftover]:
    """Every item hpcstagger keeps for this user under ``root`` (default: the ``shm_root`` knob, as a
    process with ``environ`` sees it) and its gate files in ``gate_dir``, with their live users.
    Raises CacheError for an unsafe root (another user's, a link, writable by others)."""
    root = os.path.abspath(root or config.get("shm_root", environ))
    throttle = os.path.abspath(config.get("throttle_dir", environ) or os.path.join(root, ".throttle"))
    items = _entries(root, throttle)
    try:
        gates = sorted(n for n in os.listdir(gate_dir) if gate_owner(n) is not None)
    except OSError:
        gates = []
    items += [("gate file", os.path.join(gate_dir, n)) for n in gates]
    held = users_of(sorted({root + os.sep, throttle + os.sep,
                            *(os.path.join(gate_dir, n) for n in gates)}))
    out = []
    for kind, path in items:
        pids: set[int] = set()
        for p, who in held.items():
            if p == path or p.startswith(path + os.sep):
                pids |= who
        owner = gate_owner(os.path.basename(path)) if kind == "gate file" else None
        if owner and owner != os.getpid() and _fs.alive(owner, 0):
            pids.add(owner)
        out.append(Leftover(kind, path, tuple((p, _command(p)) for p in sorted(pids))))
    return out


def _remove(item: Leftover) -> bool:
    try:
        if os.path.isdir(item.path) and not os.path.islink(item.path):
            shutil.rmtree(item.path)
        else:
            os.unlink(item.path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CacheError(f"cannot remove {item.kind} {item.path}: {exc.strerror}; remove it by hand") from None
    return True


def clean(root: str | None = None, *, force: bool = False, dry_run: bool = False, unused_only: bool = False,
          gate_dir: str = GATE_DIR) -> list[Leftover]:
    """Remove everything :func:`find` lists, then the empty root folders; return the items (with
    ``dry_run``: what would go, removing nothing). Raises CacheError naming the first item a live
    process uses, and its pid, unless ``force`` (remove it anyway: its users keep their mappings
    but lose it for new processes) or ``unused_only`` (leave the used items, remove the rest)."""
    root = os.path.abspath(root or config.get("shm_root"))
    items = find(root, gate_dir=gate_dir)
    busy = [i for i in items if i.users]
    if busy and not (force or unused_only or dry_run):
        more = f" and {len(busy) - 1} more item(s)" if len(busy) > 1 else ""
        raise CacheError(f"{busy[0].describe()}{more}: stop those processes first, or pass --force "
                         f"(or --unused to remove only what no live process uses)")
    todo = [i for i in items if not (unused_only and i.users)]
    if dry_run:
        return todo
    for item in todo:
        _remove(item)
    remove_empty_dirs(root)
    return todo


def remove_unused(environ: Mapping[str, str] | None = None, *, gate_dir: str = GATE_DIR,
                  keep_root: bool = True, stop_wait: float = 3.0) -> list[str]:
    """After a run: stop the shared loaders' producers that no consumer is attached to any more
    (they would linger for ``loader_linger`` seconds, for a consumer that no longer comes; waiting
    up to ``stop_wait`` seconds for them to end), then remove the gate files, loader rings, throttle
    tables and dataset listings (a listing is of one run) that no live process uses (caches stay:
    they are for the next run), each by its own liveness record where it has one (a ring's producer
    and consumers, a table's readers), and the root's empty folders (the root itself too when empty,
    unless ``keep_root``: it was there before the run); return the paths removed. Never raises: a
    problem is logged."""
    from hpcstagger.loader.pipelines import remove_stale, stop_idle

    root = os.path.abspath(config.get("shm_root", environ))
    removed = []
    try:
        stopped = stop_idle(root, wait=stop_wait)  # nothing to do without a .loader folder
        if stopped:
            log.info("stopped the idle shared-loader producer(s) of %s", ", ".join(stopped))
        for item in find(root, gate_dir=gate_dir, environ=environ):
            if item.users:
                continue
            if item.kind == "gate file" and _remove(item):
                removed.append(item.path)
            elif item.kind == "throttle table" and remove_if_idle(os.path.basename(item.path),
                                                                  os.path.dirname(item.path)):
                removed.append(item.path)
            elif item.kind == "dataset listing" and _remove(item):
                removed.append(item.path)
        removed += [os.path.join(root, ".loader", key) for key in remove_stale(root)]
        if os.path.isdir(root):
            removed += remove_empty_dirs(root, keep_root=keep_root)
    except (CacheError, LoaderError, OSError) as exc:
        log.warning("could not remove what the run left in /dev/shm: %s", exc)
    return removed
