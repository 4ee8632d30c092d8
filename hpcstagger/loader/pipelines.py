"""What is in a node's shared-loader directory, and removing what dead producers left behind."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection, Iterator
from typing import Any

from hpcstagger import config
from hpcstagger.cache import _fs
from hpcstagger.loader import _ring as R

__all__ = ["list_pipelines", "producers_of", "remove_stale", "stop_idle"]


def _entries(root: str | None) -> tuple[int, str, list[str]]:
    root = os.path.abspath(root or config.get("shm_root"))
    if not os.path.isdir(os.path.join(root, ".loader")):
        return -1, "", []
    fd, path = R.loader_dir(root)
    keys = sorted(n[:-4] for n in os.listdir(fd) if n.endswith(".ctl"))
    return fd, path, keys


def _describe(ctl: R.Ctl, key: str) -> dict[str, Any]:
    w = ctl.w
    state = int(w[R.H_STATE])
    running = state in (R.P_STARTING, R.P_RUNNING) and ctl.producer_alive()
    consumers = []
    for i in ctl.attached():
        c = ctl.cons(i)
        consumers.append({"pid": int(c[R.C_PID]), "state": "pending" if int(c[R.C_STATE]) == R.C_PENDING
                          else "attached", "rank": int(c[R.C_RANK]), "world": int(c[R.C_WORLD]),
                          "taken": int(c[R.C_TAKEN]), "own_prep": int(c[R.C_OWNPREP]),
                          "alive": _fs.alive(int(c[R.C_PID]), int(c[R.C_START]))})
    return {"key": key, "name": key.rsplit(".", 1)[0], "producer_pid": int(w[R.H_PPID]),
            "state": R.STATE_NAMES.get(state, "?") if running or state == R.P_FAILED else "dead",
            "published": int(w[R.H_HEAD]), "window": int(w[R.H_WINDOW]), "batch_size": int(w[R.H_BATCH]),
            "samples": int(w[R.H_N]), "slot_bytes": int(w[R.H_SLOT_BYTES]), "workers": int(w[R.H_WORKERS]),
            "consumers": consumers,
            "error": ctl.error() if state == R.P_FAILED else "", "gpu": bool(int(w[R.H_DEVICE])),
            "stager_pid": int(w[R.H_GPID]), "on_gpu": int(w[R.H_GHEAD])}


def _each_ctl(fd: int, path: str, keys: list[str]) -> Iterator[tuple[str, R.Ctl]]:
    """(key, mapped control file) of each pipeline still there; each mapping is closed after use."""
    for key in keys:
        ctl = R.open_ctl(fd, path, key)
        if ctl is None:
            continue
        try:
            yield key, ctl
        finally:
            ctl.close()


def list_pipelines(root: str | None = None) -> list[dict[str, Any]]:
    """One dict per pipeline under ``<root>/.loader`` (default root: the ``shm_root`` knob)."""
    fd, path, keys = _entries(root)
    try:
        return [_describe(ctl, key) for key, ctl in _each_ctl(fd, path, keys)]
    finally:
        if fd >= 0:
            os.close(fd)


def producers_of(pids: Collection[int], root: str | None = None) -> list[int]:
    """The producer pids of the pipelines under ``root`` that one of ``pids`` consumes from. A
    consumer starts its producer detached (in a session of its own, under init), so following a
    job's process tree misses it: calibration follows these too, for the job's memory."""
    out = []
    for info in list_pipelines(root):
        if info["producer_pid"] > 0 and any(c["pid"] in pids for c in info["consumers"]):
            out.append(int(info["producer_pid"]))
    return out


def remove_stale(root: str | None = None) -> list[str]:
    """Remove the files of pipelines whose producer and consumers are all gone; return their keys."""
    fd, path, keys = _entries(root)
    removed = []
    try:
        with R.DirLock(fd) if fd >= 0 else contextlib.nullcontext():
            for key, ctl in _each_ctl(fd, path, keys):
                info = _describe(ctl, key)
                users = any(c["alive"] for c in info["consumers"])
                if info["state"] in ("dead", "failed", "stopped") and not users:
                    R.remove_files(fd, key, ctl.ino)
                    removed.append(key)
    finally:
        if fd >= 0:
            os.close(fd)
    return removed


def stop_idle(root: str | None = None, *, wait: float = 3.0) -> list[str]:
    """Ask every producer under ``root`` that no live consumer is attached to to stop now, as if its
    linger (the ``loader_linger`` knob) had run out: it removes its files and ends its DataLoader
    workers, which then clean up after themselves (a producer left to linger past the end of a Slurm
    job is killed with the job, and leaves its files in /dev/shm and its workers' folders in /tmp).
    Waits up to ``wait`` seconds for them to end; returns the keys of the pipelines asked. A
    producer that a consumer attaches to meanwhile goes on."""
    fd, path, keys = _entries(root)
    asked: dict[str, tuple[int, int]] = {}
    try:
        with R.DirLock(fd) if fd >= 0 else contextlib.nullcontext():
            for key, ctl in _each_ctl(fd, path, keys):
                info = _describe(ctl, key)
                if info["state"] in ("starting", "running") and not any(c["alive"] for c in info["consumers"]):
                    ctl.w[R.H_QUIT] = 1  # its beat thread looks every 0.1 s
                    asked[key] = (int(ctl.w[R.H_PPID]), int(ctl.w[R.H_PSTART]))
    finally:
        if fd >= 0:
            os.close(fd)
    deadline = time.monotonic() + wait
    while any(_fs.alive(pid, start) for pid, start in asked.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return list(asked)
