"""The partitioned cache's counters, kept where ``hpcstagger cache stats`` can read them.

Each process that uses a partitioned cache maps one small file of its own,
``<node root>/.partition/<name>/<pid>``, and counts into it (one writer, no lock). The node's
layout (this node's index, the node count) is in ``layout.json`` beside them. :func:`totals` sums
every file, those of processes that have ended included, as the cache's own counters are summed.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any

import numpy as np

from .. import _io
from . import _fs

__all__ = ["FIELDS", "Counters", "totals", "stats_dir"]

FIELDS = ("local_hits", "remote_hits", "remote_misses", "remote_failures", "source_reads", "source_bytes",
          "inserts_sent", "inserts_received", "inserts_dropped", "owner_misses")
_BYTES = 8 * 16


def stats_dir(root: str, name: str) -> str:
    """Where the counters of partitioned cache ``name`` under ``root`` live."""
    return os.path.join(root, ".partition", name)


class Counters:
    """This process's counters of one partitioned cache (a mapped file; ``c[FIELD] += n``)."""

    def __init__(self, root: str, name: str, layout: dict[str, Any]):
        path = stats_dir(root, name)
        fd = _fs.open_secure_dir(path, create=True, what="partitioned cache stats directory")
        os.close(fd)
        _io.atomic_write_json(os.path.join(path, "layout.json"), layout, durable=False)
        fd = os.open(os.path.join(path, str(os.getpid())), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.ftruncate(fd, _BYTES)
            self._map = mmap.mmap(fd, _BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.words = np.frombuffer(self._map, dtype="<u8")
        self._index = {f: i for i, f in enumerate(FIELDS)}

    def add(self, field: str, n: int = 1) -> None:
        """Count ``n`` more of ``field``."""
        self.words[self._index[field]] += n

    def snapshot(self) -> dict[str, int]:
        """This process's counts."""
        return {f: int(self.words[i]) for i, f in enumerate(FIELDS)}


def totals(root: str, name: str) -> dict[str, Any] | None:
    """Every process's counters summed, with the node layout (``partition_node``,
    ``partition_nodes``); None when cache ``name`` under ``root`` was never partitioned."""
    path = stats_dir(root, name)
    try:
        with open(os.path.join(path, "layout.json")) as f:
            layout = json.load(f)
        files = [e for e in os.listdir(path) if e.isdigit()]
    except (OSError, ValueError):
        return None
    out: dict[str, Any] = dict.fromkeys(FIELDS, 0)
    for e in files:
        try:
            with open(os.path.join(path, e), "rb") as f:
                words = np.frombuffer(f.read(_BYTES).ljust(_BYTES, b"\0"), dtype="<u8")
        except OSError:
            continue
        for i, field in enumerate(FIELDS):
            out[field] += int(words[i])
    out["partition_node"] = layout.get("node")
    out["partition_nodes"] = layout.get("nodes")
    return out
