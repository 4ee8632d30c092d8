"""The in-memory snapshot: this rank's pieces of the state, copied into reusable host buffers.

:class:`SnapshotBuffers` keeps one flat host buffer holding the bytes of every piece this rank
writes, each piece at a 64-byte aligned offset. It is allocated on the first save and reused while
the layout stays the same (reallocated, old one freed first, when it changes), so at most one
snapshot is in memory. When any source tensor is on a CUDA device the buffer is pinned, the copies
are issued asynchronously on the current stream of each source device (ordered after the kernels
that produced the values), and the streams are synchronised before :meth:`SnapshotBuffers.copy`
returns, so the snapshot is complete and the training may change its tensors at once. CPU sources
are copied with numpy (a single memcpy per piece).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from .sharding import Piece
from .state import Leaf

__all__ = ["SnapshotBuffers"]

_ALIGN = 64


class SnapshotBuffers:
    """Preallocated host memory for one rank's share of a snapshot."""

    def __init__(self) -> None:
        self._buf: Any = None      # torch.uint8 tensor
        self._np: Any = None       # numpy view of it
        self._key: Any = None
        self._offsets: list[int] = []
        self.pinned = False
        self.allocations = 0       # how often a buffer was (re)allocated

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
        """Free the buffer."""
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
            offsets.append(pos)
            pos += -(-(p.count * leaf.spec.itemsize) // _ALIGN) * _ALIGN
        self._buf = torch.empty(max(pos, _ALIGN), dtype=torch.uint8, pin_memory=pin)
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
        for dev in devices:  # untested here: no GPU on the development machine
            torch.cuda.current_stream(dev).synchronize()
        return views
