"""Writing a checkpoint file's bulk bytes with ``O_DIRECT``, so that they are not copied into the page cache.

Why: on the 2-core VM a buffered ``pwrite`` of a 208 MB shard took about 0.2 s of CPU (the copy into
the page cache), which was half of the training's in-flight slowdown (benchmarks/RESULTS.md, issue
16). With ``O_DIRECT`` the device reads the snapshot buffer itself: a few milliseconds of CPU, no
208 MB of dirty pages for the kernel to write back, and nothing evicted from the page cache.

The rules ``O_DIRECT`` imposes: the file offset, the memory address and the length of a write are
multiples of the device's logical block size. :data:`ALIGN` (4096) satisfies 512-byte and 4 KiB
devices. :meth:`FileSink.write` writes the aligned middle of a region directly and its unaligned
head and tail through the ordinary (buffered) descriptor. The pages a direct write covers hold only
that region's bytes, and Linux keeps the page cache coherent with direct writes (it writes back and
drops cached pages in the range), so the two paths mix safely in one file.

A file system that refuses ``O_DIRECT`` (``EINVAL`` at open or at a write: tmpfs before Linux 6.6,
some FUSE and network file systems) turns direct writing off for that file: the bytes go through
the page cache as before. The ``ckpt_direct_io`` knob turns it off everywhere. The caller still
fsyncs: a direct write is on the device, but the file's size and extents are not durable without
it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from typing import Any

from hpcstagger import config
from hpcstagger.checkpoint import probe

__all__ = ["ALIGN", "ALIGN_THRESHOLD", "FileSink", "aligned_buffer"]

log = logging.getLogger(__name__)
ALIGN = 4096
# Regions of at least this many bytes are page-aligned in the HDF5 file (writer.py) and in the
# snapshot buffer (snapshot.py), so that they can be written directly.
ALIGN_THRESHOLD = 65536


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``nbytes`` (rounded up to whole pages)."""
    return mmap.mmap(-1, max(-(-nbytes // ALIGN) * ALIGN, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _address(data: Any) -> int:
    """The memory address of a numpy array's first byte."""
    return int(data.__array_interface__["data"][0])


class FileSink:
    """Writes regions of memory to one open file: the aligned middle with ``O_DIRECT`` where the
    file system allows it, the rest through ``fd`` (which the caller opened, owns and fsyncs)."""

    def __init__(self, fd: int, *, direct: bool | None = None):
        self.fd = fd
        self.dfd: int | None = None
        self.direct_bytes = 0
        self.buffered_bytes = 0
        if direct is None:
            direct = bool(config.get("ckpt_direct_io"))
        if direct and hasattr(os, "O_DIRECT"):
            try:  # a second open file description of the same file, with O_DIRECT
                self.dfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:
                log.debug("no O_DIRECT for checkpoint fd %d (%s): writing through the page cache", fd, exc)

    def __enter__(self) -> FileSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def direct(self) -> bool:
        """True while writes can still go around the page cache."""
        return self.dfd is not None

    def close(self) -> None:
        """Close the direct descriptor (``fd`` stays open: it is the caller's)."""
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def write(self, data: Any, offset: int) -> None:
        """Write all of ``data`` (a contiguous numpy uint8 array) at ``offset`` in the file."""
        view = memoryview(data).cast("B")
        if self.dfd is not None and len(view) >= ALIGN:
            head = -offset % ALIGN
            if (_address(data) + head) % ALIGN == 0:
                body = (len(view) - head) // ALIGN * ALIGN
                if body > 0:
                    self._buffered(view[:head], offset)
                    done = self._direct(view[head:head + body], offset + head)
                    view, offset = view[head + done:], offset + head + done
        self._buffered(view, offset)

    def _direct(self, view: memoryview, offset: int) -> int:
        """Write ``view`` directly; returns the bytes written (less on a refusal or an odd short write)."""
        done = 0
        with probe.timed("pwrite_direct", len(view)):
            while done < len(view) and self.dfd is not None:
                try:
                    n = os.pwrite(self.dfd, view[done:], offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    log.debug("O_DIRECT write refused (%s): writing through the page cache", exc)
                    self.close()
                    break
                done += n
                if n % ALIGN:  # a short write that leaves the rest unaligned: finish it buffered
                    break
        self.direct_bytes += done
        return done

    def _buffered(self, view: memoryview, offset: int) -> None:
        if not len(view):
            return
        with probe.timed("pwrite", len(view)):
            while len(view):
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
                self.buffered_bytes += n
