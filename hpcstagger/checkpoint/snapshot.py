"""The in-memory snapshot: this rank's pieces of the state, copied into reusable host buffers.

:class:`SnapshotBuffers` keeps one flat, page-aligned host buffer holding the bytes of every piece
this rank writes, each piece at a 64-byte aligned offset and pieces of 64 KiB or more at a page
boundary, so that the writer can hand them to the device with ``O_DIRECT`` (:mod:`._direct`). It
is allocated on the first save and reused while the layout stays the same (reallocated, old one
freed first, when it changes), so at most one snapshot is in memory. When any source tensor is on
a CUDA device the buffer is pinned, the copies are issued asynchronously on the current stream of
each source device (ordered after the kernels that produced the values), and the streams are
synchronised before :meth:`SnapshotBuffers.copy` returns, so the snapshot is complete and the
training may change its tensors at once. CPU sources are copied with numpy (a single memcpy per
piece).

The buffer is a private anonymous mapping of the snapshot's size (in whole pages), unmapped when
it is released and not inherited by forked children (DataLoader workers forked after the first
save would otherwise share its pages copy-on-write, and the next snapshot would copy every page
once more). With CUDA sources it is page-locked with ``cudaHostRegister`` and unpinned when
released. It does not come from torch's pinned allocator (``pin_memory=True``), which rounds every
block up to a power of two (a 1.2 GB snapshot took 2 GiB there) and keeps a freed block cached,
still pinned, until the process ends, so that a layout change would leave the old buffer pinned
beside the new one (benchmarks/RESULTS.md, section Checkpoints).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from typing import Any
from collections.abc import Sequence

from hpcstagger.checkpoint._direct import ALIGN_THRESHOLD
from hpcstagger.checkpoint.sharding import Piece
from hpcstagger.checkpoint.state import Leaf

__all__ = ["SnapshotBuffers"]

log = logging.getLogger(__name__)
_ALIGN = 64
_PAGE = 4096


def _unregister(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)


def _mapped(nbytes: int) -> Any:
    """A uint8 host tensor of ``nbytes`` over a private anonymous mapping of its own (page-aligned,
    shared with no other allocation, returned to the system when its last view goes), which forked
    children do not inherit."""
    import torch

    size = -(-nbytes // _PAGE) * _PAGE
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_DONTFORK"):
        mem.madvise(mmap.MADV_DONTFORK)
    return torch.frombuffer(mem, dtype=torch.uint8, count=nbytes)  # (the tensor keeps the mapping)


def _pinned(nbytes: int) -> tuple[Any, int | None]:
    """A :func:`_mapped` tensor of ``nbytes`` page-locked by cudaHostRegister, and the pointer to
    unregister; (a tensor from torch's pinned allocator, None) if registering fails."""
    import torch

    buf = _mapped(nbytes)
    size = -(-nbytes // _PAGE) * _PAGE
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0))
    if err == 0:
        return buf, buf.data_ptr()
    # The failed call left its error as this thread's last CUDA error, which torch would raise at
    # its next kernel launch: a throwaway launch takes it now.
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")
    log.warning("cudaHostRegister of the %d-byte checkpoint snapshot buffer failed (CUDA error %d); using "
                "torch's pinned allocator, which rounds the buffer up to a power of two", size, err)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None


class SnapshotBuffers:
    """Preallocated host memory for one rank's share of a snapshot."""

    def __init__(self) -> None:
        self._buf: Any = None      # torch.uint8 tensor
        self._np: Any = None       # numpy view of it
        self._key: Any = None
        self._offsets: list[int] = []
        self.pinned = False
        self.allocations = 0       # how often a buffer was (re)allocated
        self._unpin: weakref.finalize | None = None  # unregisters a pinned buffer (once)

    @property
    def nbytes(self) -> int:
        """Size of the current buffer in bytes."""
        return 0 if self._buf is None else int(self._buf.numel())

    def touch(self) -> None:
        """Write zeros over the whole buffer, so that its pages are mapped now rather than during
        the first copy into it (call it after :meth:`ensure`; a no-op without a buffer)."""
        if self._np is not None:
            self._np[:] = 0

    def release(self) -> None:
        """Free the buffer (unpinned first)."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._buf = self._np = self._key = None
        self._offsets = []

    def ensure(self, entries: Sequence[tuple[Piece, Leaf]]) -> None:
        """Make the buffer fit ``entries`` (pieces with their leaves); reuse it if it already does."""
        import torch

        pin = any(leaf.device.startswith("cuda") for _, leaf in entries) and torch.cuda.is_available()
        key = (tuple((p.key, p.start, p.count, leaf.spec.itemsize) for p, leaf in entries), pin)
        if key == self._key:
            return
        self.release()  # at most one snapshot in memory: drop the old buffer before allocating
        offsets, pos = [], 0
        for p, leaf in entries:
            nbytes = p.count * leaf.spec.itemsize
            if nbytes >= ALIGN_THRESHOLD:
                pos = -(-pos // _PAGE) * _PAGE
            offsets.append(pos)
            pos += -(-nbytes // _ALIGN) * _ALIGN
        if pin:
            self._buf, ptr = _pinned(max(pos, _ALIGN))
            if ptr is not None:  # unpinned by release(), or when this object goes
                self._unpin = weakref.finalize(self, _unregister, ptr)
        else:
            self._buf = _mapped(max(pos, _ALIGN))
        self._np = self._buf.numpy()
        self._offsets = offsets
        self._key = key
        self.pinned = pin
        self.allocations += 1

    def copy(self, entries: Sequence[tuple[Piece, Leaf]]) -> list[Any]:
        """Copy every piece into the buffer; returns a numpy uint8 view of each piece's bytes.

        Call :meth:`ensure` with the same entries first.
        """
        import numpy as np
        import torch

        devices = set()
        views = []
        for (p, leaf), off in zip(entries, self._offsets, strict=True):
            a, b = p.byte_range(leaf.spec.itemsize)
            if b > a:
                dst = self._buf[off:off + (b - a)]
                if leaf.device.startswith("cuda"):
                    dst.copy_(leaf.raw[a:b], non_blocking=self.pinned)
                    devices.add(leaf.raw.device)
                else:  # numpy's copy is one plain memcpy: faster here than torch's OpenMP copy, and
                    # free of its thread wake-ups, which cost milliseconds per tensor on a busy node
                    np.copyto(self._np[off:off + (b - a)], leaf.raw.numpy()[a:b])
            views.append(self._np[off:off + (b - a)])
        for dev in devices:  # (tests/test_ckpt_cuda.py, on a GPU)
            torch.cuda.current_stream(dev).synchronize()
        return views
