"""Writing one rank's shard as an HDF5 file, and copying shard files between levels.

A shard file is plain HDF5 (readable by h5py and h5dump): root attributes say the format, step,
rank and shard count; each piece is one contiguous dataset named after its tensor's key, with
attributes ``dtype`` (the torch dtype, e.g. ``bfloat16``, or for a numpy array its dtype string,
e.g. ``<f4``), ``shape`` (the whole tensor's) and ``checksum`` (xxh3-64 of the piece's bytes). A
piece that is the whole tensor has the tensor's shape; a part of a tensor split between shards is
1-D and has a ``start`` attribute: its first element in the flattened tensor. Dtypes
numpy lacks (bfloat16, float8, complex32) are stored as unsigned integers of the same width.

How it is written: h5py creates the file structure with every dataset's space allocated up front
(contiguous, no fill; datasets of 64 KiB or more page-aligned), then the data goes in with
``os.pwrite`` at the datasets' file offsets: direct writes of ``ckpt_write_bytes`` (64 MiB),
buffered ones of ``ckpt_chunk_bytes``, each after asking the gate (through a :class:`Pacer`), and
hashed in chunks of ``ckpt_chunk_bytes``, asking the gate before each. The page-aligned parts
are written with ``O_DIRECT``, so that they are not copied into the page cache, where the file
system allows it (:mod:`._direct`). ``pwrite`` and xxh3 release the GIL, h5py does not, so the
training thread is held up only by the short structure step. While writing, the writer hashes
the file from start to end (structure bytes read back, data bytes from memory), giving the
whole-file checksum the manifest records. The file is written under a temporary name, fsynced,
renamed into place, and its directory fsynced.

Subclass :class:`ShardWriter` to inject faults: override :meth:`ShardWriter.write_shard` or
:meth:`ShardWriter.copy_shard` and raise for a chosen step and rank.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from hpcstagger import config
from hpcstagger._io import fsync_dir, temp_path
from hpcstagger.errors import CheckpointError
from hpcstagger.checkpoint import probe
from hpcstagger.checkpoint._direct import ALIGN, ALIGN_THRESHOLD, FileSink, aligned_buffer
from hpcstagger.checkpoint.gates import Gate
from hpcstagger.checkpoint.manifest import FORMAT, FORMAT_VERSION, dataset_name
from hpcstagger.checkpoint.sharding import Piece, TensorSpec

__all__ = ["Pacer", "ShardItem", "ShardWriter", "check_copy", "copy_hashed"]


class Pacer:
    """Asks the gate before each chunk; stops asking once :meth:`hurry` was called."""

    def __init__(self, gate: Gate | None, *, chunk_bytes: int | None = None, max_wait: float | None = None):
        self.gate = gate
        self.chunk_bytes = int(chunk_bytes or config.get("ckpt_chunk_bytes"))
        self.max_wait = float(config.get("ckpt_gate_max_wait") if max_wait is None else max_wait)
        self._hurry = threading.Event()
        self.chunks = 0
        self.waits = 0
        self.polls = 0  # the gate's wait_idle calls (10 ms slices) over all waits
        self.waited_s = 0.0

    def hurry(self) -> None:
        """The training is waiting for this write: stop deferring to the gate."""
        self._hurry.set()

    def hurried(self) -> bool:
        """True once :meth:`hurry` was called."""
        return self._hurry.is_set()

    def before_chunk(self) -> None:
        """Called before each chunk: wait (bounded) while the gate says the training is busy."""
        self.chunks += 1
        gate = self.gate
        if gate is None or self._hurry.is_set() or not gate.busy():
            return
        t = time.monotonic()
        deadline = t + self.max_wait
        while not self._hurry.is_set():  # in slices, so that hurry() takes effect within 10 ms
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.polls += 1
            if gate.wait_idle(min(left, 0.01)):
                break
        self.waits += 1
        self.waited_s += time.monotonic() - t

    def stats(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "gate_waits": self.waits, "gate_polls": self.polls,
                "gate_wait_s": round(self.waited_s, 6)}


@dataclass
class ShardItem:
    """One piece to write: its plan entry, its tensor's spec and metadata, and its bytes."""

    piece: Piece
    spec: TensorSpec
    kind: str
    storage: str
    data: Any  # numpy uint8 array (a view into the snapshot buffer)


def _hash_chunks(data: Any, pacer: Pacer) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    step = pacer.chunk_bytes
    for a in range(0, len(data), step):
        pacer.before_chunk()
        chunk = data[a:a + step]
        with probe.timed("hash", len(chunk)):
            h.update(chunk)
    return h.hexdigest()


def _hash_read(h: Any, fd: int, n: int, pos: int) -> int:
    """Read ``n`` bytes of ``fd`` at ``pos`` into hash ``h``; returns the bytes read."""
    with probe.timed("pread", n):
        block = os.pread(fd, n, pos)
    with probe.timed("hash", len(block)):
        h.update(block)
    return len(block)


def copy_hashed(src_fd: int, dst_fd: int, chunk_bytes: int, *, before: Callable[[], object] | None = None,
                after: Callable[[int], object] | None = None) -> tuple[int, str]:
    """Copy ``src_fd`` from its current position to ``dst_fd`` from byte 0, in chunks, hashing (xxh3-64)
    the bytes as they are written; returns (bytes copied, hex digest). ``before()`` runs after each
    chunk is read, before it is written (it may wait, or raise to stop); ``after(bytes so far)``
    after each chunk is written. The writes go around the page cache where they can (:mod:`._direct`)."""
    import numpy as np
    import xxhash

    h = xxhash.xxh3_64()
    buf = aligned_buffer(chunk_bytes)  # unmapped with its last view
    arr = np.frombuffer(buf, dtype=np.uint8)
    size = 0
    with FileSink(dst_fd) as sink:
        while True:
            n = os.readv(src_fd, [memoryview(buf)[:chunk_bytes]])
            if not n:
                return size, h.hexdigest()
            if before is not None:
                before()
            with probe.timed("hash", n):
                h.update(memoryview(buf)[:n])
            sink.write(arr[:n], size)
            size += n
            if after is not None:
                after(size)


def _create_structure(tmp: str, *, step: int, rank: int, nshards: int, items: Sequence[ShardItem],
                      checksums: Sequence[str], pacer: Pacer) -> list[int | None]:
    """Create the HDF5 file with every dataset allocated; returns each item's data offset."""
    import h5py
    import numpy as np

    offsets: list[int | None] = []
    with h5py.File(tmp, "w", libver="earliest", locking=False,
                   alignment_threshold=ALIGN_THRESHOLD, alignment_interval=ALIGN) as f:
        f.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                        "rank": rank, "nshards": nshards})
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
        for item, digest in zip(items, checksums, strict=True):
            p, spec = item.piece, item.spec
            shape = spec.shape if p.whole else (p.count,)
            space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
            tid = h5py.h5t.py_create(np.dtype(item.storage), logical=True)
            dsid = h5py.h5d.create(f.id, dataset_name(spec.key).encode(), tid, space, dcpl=dcpl, lcpl=lcpl)
            attrs = h5py.Dataset(dsid).attrs  # few attributes: HDF5 takes ~0.1 ms to add each one
            attrs["dtype"] = spec.dtype
            attrs["shape"] = np.asarray(spec.shape, dtype=np.int64)
            attrs["checksum"] = digest
            if not p.whole:
                attrs["start"] = p.start
            offsets.append(dsid.get_offset() if p.count else None)
            if len(offsets) % 8 == 0:
                pacer.before_chunk()  # h5py holds the GIL (~0.5 ms a dataset): defer to a busy training
    return offsets


@contextlib.contextmanager
def _published(path: str, failure: str) -> Iterator[str]:
    """Yield a temporary path beside ``path``; when the block succeeds, rename it over ``path`` and
    fsync the directory. On any failure the temporary file goes, and errors other than
    CheckpointError become one that starts with ``failure`` and keeps the cause."""
    tmp: str | None = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = temp_path(path)
        yield tmp
        with probe.timed("publish"):
            os.replace(tmp, path)
            tmp = None
            fsync_dir(os.path.dirname(path))
    except CheckpointError:
        raise
    except Exception as exc:  # reported with the path, cause kept
        raise CheckpointError(f"{failure}: {type(exc).__name__}: {exc}") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


class ShardWriter:
    """Writes and copies shard files. Every method raises CheckpointError naming the path."""

    def write_shard(self, *, step: int, rank: int, nshards: int, path: str, items: Sequence[ShardItem],
                    pacer: Pacer) -> dict[str, Any]:
        """Write ``items`` durably to ``path``; returns the shard's record for the manifest."""
        with _published(path, f"writing checkpoint shard {path} failed") as tmp:
            checksums = [_hash_chunks(it.data, pacer) for it in items]
            with probe.timed("h5_structure"):
                offsets = _create_structure(tmp, step=step, rank=rank, nshards=nshards, items=items,
                                            checksums=checksums, pacer=pacer)
            size, digest = self._fill(tmp, items, offsets, pacer)
        pieces = [{"key": it.spec.key, "dataset": dataset_name(it.spec.key), "start": it.piece.start,
                   "count": it.piece.count, "checksum": c} for it, c in zip(items, checksums, strict=True)]
        return {"rank": rank, "file": os.path.basename(path), "size": size, "checksum": digest, "pieces": pieces}

    def _fill(self, tmp: str, items: Sequence[ShardItem], offsets: Sequence[int | None],
              pacer: Pacer) -> tuple[int, str]:
        """pwrite every item's bytes at its offset (directly where it can, see :mod:`._direct`), in
        direct writes of ``ckpt_write_bytes`` (buffered ones of the pacer's chunks) hashed by chunks
        of the pacer's (a look at the gate before each), hashing the whole file in order; fsync.
        Large direct writes, because the device gets each whole, as many requests at once."""
        import xxhash

        regions = sorted((off, it.data) for off, it in zip(offsets, items, strict=True) if off is not None)
        h = xxhash.xxh3_64()
        fd = os.open(tmp, os.O_RDWR)
        sink = FileSink(fd)
        # a direct write of ``span`` bytes reaches the device as many requests at once; a buffered one
        # is a copy on this thread's CPU, so it stays a chunk, with a look at the gate before each
        span = pacer.chunk_bytes
        if sink.direct:
            span = max(span, int(config.get("ckpt_write_bytes")) // ALIGN * ALIGN)
        try:
            size = os.fstat(fd).st_size
            pos = 0
            for off, data in regions:
                if off < pos or off + len(data) > size:
                    raise CheckpointError(f"HDF5 placed a dataset at bytes {off}..{off + len(data)} of {tmp}, "
                                          f"outside the file ({size} bytes) or over another; report this bug")
                if off > pos:
                    _hash_read(h, fd, off - pos, pos)
                for a in range(0, len(data), span):
                    piece = data[a:a + span]
                    pacer.before_chunk()
                    sink.write(piece, off + a)
                    for b in range(0, len(piece), pacer.chunk_bytes):
                        if b:
                            pacer.before_chunk()
                        chunk = piece[b:b + pacer.chunk_bytes]
                        with probe.timed("hash", len(chunk)):
                            h.update(chunk)
                pos = off + len(data)
            while pos < size:
                n = _hash_read(h, fd, min(size - pos, 1 << 20), pos)
                if not n:
                    break
                pos += n
            with probe.timed("fsync"):
                os.fsync(fd)
        finally:
            sink.close()
            os.close(fd)
        return size, h.hexdigest()

    def copy_shard(self, *, step: int, rank: int, src: str, dst: str, expect: dict[str, Any],
                   pacer: Pacer) -> dict[str, Any]:
        """Copy shard ``src`` durably to ``dst``, checking it against its record ``expect``."""
        with _published(dst, f"flushing checkpoint shard {src} to {dst} failed") as tmp:
            with open(src, "rb", buffering=0) as fin:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    size, digest = copy_hashed(fin.fileno(), fd, pacer.chunk_bytes, before=pacer.before_chunk)
                    with probe.timed("fsync"):
                        os.fsync(fd)
                finally:
                    os.close(fd)
            check_copy(src, size, digest, expect)
        return dict(expect, file=os.path.basename(dst))


def check_copy(src: str, size: int, digest: str, expect: dict[str, Any]) -> None:
    """Raise CheckpointError unless a copy of staged shard ``src`` has the size and checksum of its
    record ``expect``."""
    if size != expect["size"] or digest != expect["checksum"]:
        raise CheckpointError(f"staged shard {src} changed before it was flushed "
                              f"({size} bytes, xxh3 {digest}; expected {expect['size']} bytes, "
                              f"xxh3 {expect['checksum']}); the fast level is damaged")
