"""Finding and removing what killed MPI processes leave in /dev/shm.

MPI_Abort, SIGKILL and os._exit skip MPICH's cleanup of its shared-memory segments
(``/dev/shm/mpich_shm_*``, about 2 MB per rank). :func:`remove_stale_mpich_segments` removes those
created after a given time that no live process has open or mapped, so it never touches a segment
of an MPI job that is still running.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["in_use", "unheld_entries", "remove_stale_mpich_segments"]

SHM = Path("/dev/shm")


def in_use() -> set[str]:
    """Paths under /dev/shm that some live process has open or mapped."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and "/dev/shm/" in parts[5]:
                        used.add(parts[5].strip())
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    used.add(target)
        except OSError:
            continue
    return {u.replace(" (deleted)", "") for u in used}


def unheld_entries(since: float, root: Path = SHM) -> list[Path]:
    """Entries of ``root`` modified at or after ``since`` (epoch seconds) that no live process holds."""
    used = in_use()
    out = []
    for entry in root.iterdir():
        try:
            if entry.lstat().st_mtime >= since - 1 and str(entry) not in used:
                out.append(entry)
        except FileNotFoundError:
            continue
    return out


def remove_stale_mpich_segments(since: float, settle: float = 0.0) -> int:
    """Remove MPICH segments created after ``since`` that no live process holds; return how many.

    With ``settle`` > 0, keep looking for up to that many seconds while new segments are still held:
    the ranks of an aborted run can outlive their launcher by a moment.
    """
    import time

    removed = 0
    deadline = time.monotonic() + settle
    while True:
        for entry in unheld_entries(since):
            if entry.name.startswith("mpich_shm_"):
                entry.unlink(missing_ok=True)
                removed += 1
        held = [e for e in SHM.glob("mpich_shm_*") if _mtime(e) >= since - 1]
        if not held or time.monotonic() >= deadline:
            return removed
        time.sleep(0.1)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0
