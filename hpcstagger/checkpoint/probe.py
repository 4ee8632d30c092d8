"""Optional timing of the checkpoint writer's steps, for benchmarks/bench_ckpt_attrib.py.

Off by default, and then :func:`timed` hands back one shared do-nothing context manager (a global
test, no clock read). After :func:`enable`, each ``with timed(name, nbytes):`` block adds to its
name's totals: calls, wall seconds, CPU seconds of the calling thread (``time.thread_time``) and
bytes. The writer times ``pwrite``, ``fsync``, ``hash`` (xxh3), ``pread`` (structure bytes read
back), ``h5_structure`` (h5py, which holds the GIL), ``publish`` (rename + directory fsync),
``collectives`` (the writers' gather and broadcast), ``commit`` (the manifest) and ``prune``
(retention). Nothing here changes what is written.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

__all__ = ["enable", "disable", "enabled", "reset", "totals", "timed"]

_on = False
_lock = threading.Lock()
_totals: dict[str, list[float]] = {}  # name -> [calls, wall_s, cpu_s, bytes]
_NULL = contextlib.nullcontext()


class _Timer:
    __slots__ = ("name", "nbytes", "t", "c")

    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes = name, nbytes
        self.t = self.c = 0.0

    def __enter__(self) -> None:
        self.t, self.c = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        wall, cpu = time.perf_counter() - self.t, time.thread_time() - self.c
        with _lock:
            row = _totals.setdefault(self.name, [0, 0.0, 0.0, 0])
            row[0] += 1
            row[1] += wall
            row[2] += cpu
            row[3] += self.nbytes


def timed(name: str, nbytes: int = 0) -> Any:
    """A context manager that adds its block's wall and CPU time to ``name`` while enabled."""
    return _Timer(name, nbytes) if _on else _NULL


def enable() -> None:
    """Start counting (process-wide; totals so far are kept)."""
    global _on
    _on = True


def disable() -> None:
    """Stop counting (totals are kept)."""
    global _on
    _on = False


def enabled() -> bool:
    """True while counting."""
    return _on


def reset() -> None:
    """Drop every total."""
    with _lock:
        _totals.clear()


def totals() -> dict[str, dict[str, float]]:
    """A copy of the totals: name -> {calls, wall_s, cpu_s, bytes}."""
    with _lock:
        return {k: {"calls": v[0], "wall_s": v[1], "cpu_s": v[2], "bytes": v[3]} for k, v in _totals.items()}
