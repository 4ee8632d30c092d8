"""Running a command in a process session of its own: its exit status, a timeout that stops the
whole session (SIGTERM, then SIGKILL), and what killed MPI ranks leave in /dev/shm removed.
``hpcstagger launch`` runs each launcher command this way, and ``hpcstagger calibrate --spec``
each job's command (following its memory with :class:`~hpcstagger.nodeload.PeakMemory`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any
from collections.abc import Callable

from hpcstagger.colocated._shm import remove_stale_mpich_segments

__all__ = ["run_group"]


def run_group(argv: list[str], env: dict[str, str], cwd: str, timeout: float, *, output: Any = None,
              on_timeout: Callable[[], None] | None = None, stop_when: Callable[[], bool] | None = None,
              memory: Any = None) -> int:
    """Run ``argv`` in a session of its own (its output to the file ``output``, else inherited) and
    return its exit status, or 124 after ``timeout`` seconds or once ``stop_when()`` (asked every
    half second) is true. On a timeout (after ``on_timeout``) or an exception here (Ctrl-C) the
    whole process group gets SIGTERM, then SIGKILL 15 s later. Killed MPICH ranks skip the cleanup
    of their /dev/shm segments, so a failed run removes them. ``memory`` (a
    :class:`~hpcstagger.nodeload.PeakMemory`) follows the memory of the command's processes while it runs.
    """
    started = time.time()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True, stdout=output,
                            stderr=subprocess.STDOUT if output is not None else None)
    if memory is not None:
        memory.start(proc.pid)

    def stop() -> None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    try:
        rc = _wait(proc, timeout, stop_when)
    except subprocess.TimeoutExpired:
        if on_timeout is not None:
            on_timeout()
        stop()
        rc = 124
    except BaseException:
        stop()
        remove_stale_mpich_segments(started, settle=3.0)
        raise
    finally:
        if memory is not None:
            memory.stop()
    if rc != 0:
        remove_stale_mpich_segments(started, settle=3.0)
    return rc


def _wait(proc: subprocess.Popen[Any], timeout: float, stop_when: Callable[[], bool] | None) -> int:
    """``proc.wait(timeout)``, ending early (TimeoutExpired) once ``stop_when()`` is true."""
    if stop_when is None:
        return proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline or stop_when():
                raise
