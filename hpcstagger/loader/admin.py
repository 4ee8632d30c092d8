"""What is in a node's shared-loader directory, and removing what dead producers left behind."""

from __future__ import annotations

import os
from typing import Any

from .. import config
from ..cache import _fs
from . import _ring as R

__all__ = ["list_pipelines", "remove_stale"]


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
            "samples": int(w[R.H_N]), "slot_bytes": int(w[R.H_SLOT_BYTES]), "consumers": consumers,
            "error": ctl.error() if state == R.P_FAILED else ""}


def list_pipelines(root: str | None = None) -> list[dict[str, Any]]:
    """One dict per pipeline under ``<root>/.loader`` (default root: the ``shm_root`` knob)."""
    fd, path, keys = _entries(root)
    out = []
    try:
        for key in keys:
            cfd = R.open_file(fd, path, key + ".ctl", create=False, size=0)
            if cfd < 0:
                continue
            try:
                ctl = R.Ctl(cfd, os.path.join(path, key + ".ctl"))
            finally:
                os.close(cfd)
            try:
                out.append(_describe(ctl, key))
            finally:
                ctl.close()
    finally:
        if fd >= 0:
            os.close(fd)
    return out


def remove_stale(root: str | None = None) -> list[str]:
    """Remove the files of pipelines whose producer and consumers are all gone; return their keys."""
    fd, path, keys = _entries(root)
    removed = []
    try:
        with R.DirLock(fd) if fd >= 0 else _Nothing():
            for key in keys:
                cfd = R.open_file(fd, path, key + ".ctl", create=False, size=0)
                if cfd < 0:
                    continue
                try:
                    ctl = R.Ctl(cfd, os.path.join(path, key + ".ctl"))
                finally:
                    os.close(cfd)
                try:
                    info = _describe(ctl, key)
                    users = any(c["alive"] for c in info["consumers"])
                    if info["state"] in ("dead", "failed", "stopped") and not users:
                        R.remove_files(fd, key, ctl.ino)
                        removed.append(key)
                finally:
                    ctl.close()
    finally:
        if fd >= 0:
            os.close(fd)
    return removed


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
