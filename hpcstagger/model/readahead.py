"""How many bytes the kernel reads for a sample read in a random order: the page cache's readahead.

A job with a shuffled sampler reads a file source in a random order. Each read that misses the
page cache makes the kernel read more than the sample: the rest of its pages, and readahead
around it. Those bytes are other samples, at random in the job's order, which later reads then
find in the page cache. So the first epoch moves the whole file early (reads wait on the source)
and ends on page-cache hits (reads and compute no longer overlap), although it reads the file's
bytes once. On a small HDF5 file of 3 KiB rows on ext4, the whole file was read by the time a
third of the rows had been. The model takes this as ``[cache] readahead``: the samples' worth of
bytes one miss reads (:mod:`hpcstagger.model`).

:func:`readahead_factor` measures it: with the files' pages dropped, it reads samples in a
random order in the calling thread and divides the bytes the kernel read for that thread
(``read_bytes`` of ``/proc/thread-self/io``, counted where the block reads are issued) by the
samples' bytes; given the dataset's size, it fits the model's curve instead. In the model one
reader of a random order who has read a share x of the samples has had the share ``1 - (1 -
x)^a`` of the file read for it (``a`` the factor), so a bytes share B read by then gives ``a =
ln(1 - B) / ln(1 - x)``: the ratio for a short read, and on a small file, where the reads can
cover much of it, a factor that also counts the larger windows of the kernel's readahead once
neighbouring pages are cached (on the file above the ratio over its first 8% of rows was 2.8,
and the curve fitted over its first quarter 4 to 5). Where the kernel counts nothing (no such
file, a network or FUSE file system that bypasses the block layer) the factor is 1 and the result
says why.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any
from collections.abc import Callable, Sequence

from hpcstagger.model.source_probe import drop_pages

__all__ = ["io_read_bytes", "readahead_factor", "fit_factor", "MAX_READAHEAD", "READAHEAD_MOST"]

log = logging.getLogger(__name__)

# A factor above this is taken as metadata or another reader's bytes, not readahead.
MAX_READAHEAD = 64.0
# The most samples read (and, for a directory of files, the most files whose pages are dropped).
READAHEAD_MOST = 4096


def io_read_bytes(path: str = "/proc/thread-self/io") -> int | None:
    """Bytes the kernel has read from storage for the calling thread, or None where not counted."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == "read_bytes":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def readahead_factor(source: Any, indices: Sequence[int], seconds: float, *, seed: int = 0,
                     dataset: tuple[int, float] | None = None,
                     counter: Callable[[], int | None] = io_read_bytes) -> dict[str, Any]:
    """The samples' worth of bytes the kernel reads per sample of ``source``, read in a random
    order of ``indices`` with the files' pages dropped first (at most ``seconds`` and
    :data:`READAHEAD_MOST` samples, at least 8): ``{"readahead": factor, "samples": read,
    "bytes": counted, "how": ...}``. With ``dataset`` (samples, bytes) the factor is the model's
    curve through the share read (:func:`fit_factor`), else the ratio of the bytes."""
    order = list(indices)
    random.Random(seed).shuffle(order)
    del order[READAHEAD_MOST:]
    if not order:
        return {"readahead": 1.0, "samples": 0, "bytes": 0, "how": "not measured: no samples to read"}
    drop_pages(source, order)
    before = counter()
    if before is None:
        return {"readahead": 1.0, "samples": 0, "bytes": 0,
                "how": "not measured: the kernel's per-thread read counter (/proc/thread-self/io) is not there"}
    useful = reads = 0
    deadline = time.monotonic() + seconds
    for i in order:
        useful += len(source[i])
        reads += 1
        if reads >= 8 and time.monotonic() > deadline:
            break
    after = counter()
    counted = (after - before) if after is not None else 0
    if counted <= 0 or useful <= 0:
        return {"readahead": 1.0, "samples": reads, "bytes": counted,
                "how": f"not measured: the kernel counted no bytes for {reads} reads (pages not dropped, or a file "
                       "system whose reads bypass the block layer)"}
    raw = counted / useful if dataset is None else fit_factor(reads / dataset[0], counted / dataset[1])
    factor = min(max(raw, 1.0), MAX_READAHEAD)
    if raw > MAX_READAHEAD:
        log.warning("%d random reads of %d bytes made the kernel read %d bytes (%.0fx); taking %.0fx", reads,
                    useful, counted, raw, MAX_READAHEAD)
    return {"readahead": factor, "samples": reads, "bytes": counted,
            "how": f"{counted / 1e6:.2f} MB read by the kernel for {reads} samples ({useful / 1e6:.2f} MB) read in "
                   "a random order with the pages dropped" + ("" if dataset is None else
                                                              f", {counted / dataset[1]:.0%} of the dataset")}


def fit_factor(share_read: float, bytes_share: float) -> float:
    """The factor ``a`` of the model's curve ``1 - (1 - x)^a`` through (``share_read``, ``bytes_share``):
    a reader who has read that share of the samples in a random order has had that share of the
    bytes read for it (inf when the curve cannot reach it: all bytes read, or none of the samples)."""
    if bytes_share <= 0.0:
        return 0.0
    if bytes_share >= 1.0 or share_read <= 0.0:
        return math.inf
    if share_read >= 1.0:
        return 1.0
    return math.log1p(-bytes_share) / math.log1p(-share_read)
