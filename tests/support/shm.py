"""/dev/shm hygiene: MPICH's segments that aborted runs leave, and entries a test left behind."""

from __future__ import annotations

from pathlib import Path

from hpcstagger.colocated._shm import remove_stale_mpich_segments, unheld_entries

__all__ = ["new_shm_entries", "remove_stale_mpich_segments"]


def new_shm_entries(since: float) -> list[Path]:
    """Entries of /dev/shm created after ``since`` that no live process holds."""
    return unheld_entries(since)
