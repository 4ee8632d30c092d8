"""The partitioned cache's counters, kept where ``hpcstagger cache stats`` can read them.

Each process that uses a partitioned cache maps one small file of its own,
``<node root>/.partition/<name>/<pid>``, and counts into it (one writer, no lock); the file's
last word is the process's start time, so a later process with the same pid is told apart. The
node's layout (this node's index, the node count) is in ``layout.json`` beside them.

:func:`totals` sums every process's counts, those of processes that have ended included, as the
cache's own counters are summed. It first prunes (:func:`prune`): the counts of ended processes
are added to ``folded`` and their files removed, under the directory's ``lock`` (a new process
takes it too before it makes its file), so a dead process's counts are counted exactly once and
the directory does not grow with every process that ever used the cache. Like the cache itself the
directory is node-local: a process is looked up in this host's ``/proc``.
:func:`remove` drops the directory (``hpcstagger cache clear`` when it removes the cache).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
from contextlib import contextmanager
from typing import Any
from collections.abc import Iterator

import numpy as np

from hpcstagger import _io
from hpcstagger.cache import _fs

__all__ = ["FIELDS", "Counters", "totals", "prune", "remove", "stats_dir"]

FIELDS = ("local_hits", "remote_hits", "remote_misses", "remote_failures", "source_reads", "source_bytes",
          "inserts_sent", "inserts_received", "inserts_dropped", "owner_misses")
_WORDS = 16
_BYTES = 8 * _WORDS
_START = _WORDS - 1  # the word that holds the writer's start time (0 in files made before it)
_FOLDED = "folded"   # the summed counts of pruned (ended) processes
_LOCK = "lock"


def stats_dir(root: str, name: str) -> str:
    """Where the counters of partitioned cache ``name`` under ``root`` live."""
    return os.path.join(root, ".partition", name)


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """The stats directory's lock (an exclusive flock on its ``lock`` file)."""
    fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_words(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(f.read(_BYTES).ljust(_BYTES, b"\0"), dtype="<u8").copy()


class Counters:
    """This process's counters of one partitioned cache (a mapped file; ``c[FIELD] += n``)."""

    def __init__(self, root: str, name: str, layout: dict[str, Any]):
        path = stats_dir(root, name)
        fd = _fs.open_secure_dir(path, create=True, what="partitioned cache stats directory")
        os.close(fd)
        _io.atomic_write_json(os.path.join(path, "layout.json"), layout, durable=False)
        pid, start = _fs.self_identity()
        with _locked(path):
            _fold(path, [str(pid)])  # an ended process's file under this pid: its counts kept, its file gone
            fd = os.open(os.path.join(path, str(pid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, _BYTES)
                self._map = mmap.mmap(fd, _BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.words = np.frombuffer(self._map, dtype="<u8")
            self.words[_START] = start
        self._index = {f: i for i, f in enumerate(FIELDS)}

    def add(self, field: str, n: int = 1) -> None:
        """Count ``n`` more of ``field``."""
        self.words[self._index[field]] += n

    def snapshot(self) -> dict[str, int]:
        """This process's counts."""
        return {f: int(self.words[i]) for i, f in enumerate(FIELDS)}


def _fold(path: str, entries: list[str]) -> int:
    """Add the counts of pid files ``entries`` to ``folded`` and remove them (under the lock).
    Returns how many were folded. ``folded`` is replaced before the files go: a crash in between
    counts them twice rather than losing them."""
    present = [e for e in entries if os.path.lexists(os.path.join(path, e))]
    if not present:
        return 0
    folded = os.path.join(path, _FOLDED)
    total = _read_words(folded) if os.path.exists(folded) else np.zeros(_WORDS, dtype="<u8")
    for e in present:
        total[:len(FIELDS)] += _read_words(os.path.join(path, e))[:len(FIELDS)]
    _io.atomic_write(folded, total.tobytes(), durable=False)
    for e in present:
        os.unlink(os.path.join(path, e))
    return len(present)


def prune(root: str, name: str) -> int:
    """Fold the counter files of ended processes into ``folded`` and remove them; returns how many.
    0 when there is no such stats directory."""
    path = stats_dir(root, name)
    try:
        entries = [e for e in os.listdir(path) if e.isdigit()]
    except OSError:
        return 0
    if not any(_ended(path, e) for e in entries):
        return 0
    with _locked(path):  # looked at again: a new process with one of these pids has replaced its file
        return _fold(path, [e for e in entries if _ended(path, e)])


def _ended(path: str, entry: str) -> bool:
    """True when the process that writes pid file ``entry`` has ended (its start time tells a
    later process with the same pid apart)."""
    try:
        start = int(_read_words(os.path.join(path, entry))[_START])
    except OSError:
        return False
    return not _fs.alive(int(entry), start)


def totals(root: str, name: str) -> dict[str, Any] | None:
    """Every process's counters summed (ended ones included, pruned first), with the node layout
    (``partition_node``, ``partition_nodes``); None when cache ``name`` under ``root`` was never
    partitioned."""
    path = stats_dir(root, name)
    try:
        with open(os.path.join(path, "layout.json")) as f:
            layout = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        prune(root, name)
    except OSError:  # a directory we may read but not change: the files are summed as they are
        pass
    out: dict[str, Any] = dict.fromkeys(FIELDS, 0)
    try:
        files = [e for e in os.listdir(path) if e.isdigit() or e == _FOLDED]
    except OSError:
        return None
    for e in files:
        try:
            words = _read_words(os.path.join(path, e))
        except OSError:
            continue
        for i, field in enumerate(FIELDS):
            out[field] += int(words[i])
    out["partition_node"] = layout.get("node")
    out["partition_nodes"] = layout.get("nodes")
    return out


def remove(root: str, name: str) -> bool:
    """Remove the stats directory of cache ``name`` under ``root`` (its counters restart from 0);
    False when there is none. Only for a cache no live process uses: :func:`clear_cache` calls it
    when it removes the cache itself."""
    path = stats_dir(root, name)
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    for e in os.listdir(path):
        os.unlink(os.path.join(path, e))
    os.rmdir(path)
    return True
