"""Bytes the kernel has read from the block device a dataset lives on.

Where the page cache holds the dataset, the closed loop's source is the device beneath it, and the
shared cache's source reads are not that device's reads: a read of a sample whose pages are cached
costs the device nothing, and a read that misses makes the kernel read its readahead's neighbours
as well (``[cache] readahead`` samples' worth, in a random order). With the pages dropped, the
first seconds of a run read about ``1 / readahead`` of the curve in samples' bytes, and once most
of the file is cached, several times the curve. The watcher then fits the source to the device's
own count of bytes read (``/sys/dev/block/MAJ:MIN/stat``), the quantity the calibrated curve
(read in file order, every byte of readahead used) and the model's readahead are in.

A file system without a block device of its own (NFS, Lustre, tmpfs, overlay) has no such count:
:func:`device_counter` returns None and the watcher fits the shared cache's counts. Reads of the
same device by other processes (another user's job on a shared scratch disk) count too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

__all__ = ["device_counter", "device_stat_path"]

log = logging.getLogger(__name__)

SECTOR = 512  # the block layer's stat files count 512-byte sectors, whatever the device's own size


def device_stat_path(path: str) -> str | None:
    """The kernel's I/O statistics file of the block device (or partition) holding ``path``, or
    None when it is on none (a network or virtual file system) or ``path`` does not exist."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:  # anonymous device numbers: NFS, Lustre, tmpfs, overlay, btrfs subvolumes
        return None
    stat = f"/sys/dev/block/{major}:{minor}/stat"
    return stat if os.path.exists(stat) else None


def _read_sectors(stat: str) -> float | None:
    try:
        with open(stat) as f:
            fields = f.read().split()
        return float(int(fields[2]) * SECTOR)  # the third field: sectors read
    except (OSError, ValueError, IndexError):
        return None


def device_counter(path: str) -> Callable[[], float | None] | None:
    """A function returning the bytes read so far from the device holding ``path`` (None once the
    count cannot be read), or None when ``path`` is on no block device the kernel counts."""
    stat = device_stat_path(path)
    if stat is None or _read_sectors(stat) is None:
        return None
    log.debug("source reads counted on the device: %s", stat)
    return lambda: _read_sectors(stat)
