"""The pack of named arrays that a sample made of several arrays is stored as.

Little-endian; every array's bytes start at a multiple of :data:`PACK_ALIGN` (64) from the start
of the pack, so the views :func:`unpack_arrays` returns are aligned wherever the pack itself is
64-byte aligned, as the cache's entries are::

    fixed (20 bytes)   magic b"HSRA", version u8 (1), flags u8 (0), count u16,
                       data_start u32 (where the first array starts), total u64 (the pack's length)
    count entries      offset u64, ndim u8, name_len u8, dtype_len u8, shape ndim x u64,
                       name (UTF-8), dtype (NumPy's ``dtype.str``, e.g. ``<f4``)
    zeros              up to data_start
    the arrays         in entry order, C order, each at its offset, zeros between them

:class:`Layout` is the fixed layout of one set of arrays (a source's rows): its header is made
once, and a row's pack is the header and the rows joined. :func:`unpack_arrays` checks the
header against the pack's length before it makes any view: a truncated or damaged pack raises
CacheError, never an out-of-bounds view. Parsed headers are kept (256 at most): the packs of one
source share one header, so decoding one costs a lookup of its header and a view per array.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hpcstagger.errors import CacheError, ConfigError

__all__ = ["PACK_ALIGN", "VERSION", "Layout", "pack_arrays", "unpack_arrays", "check_dtype", "nbytes_of"]

PACK_ALIGN = 64
_MAGIC = b"HSRA"
VERSION = 1
_FIXED = struct.Struct("<4sBBHIQ")
_ENTRY = struct.Struct("<QBBB")
_MAX_HEADER = 1 << 16
_DTYPE_STR = re.compile(r"[<>|][a-zA-Z?]\d*(\[\w+\])?")


def _align(n: int) -> int:
    return (n + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN


def nbytes_of(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """The bytes of an array of ``dtype`` and ``shape`` (Python integers: no overflow)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def check_dtype(dtype: np.dtype, what: str) -> None:
    """ConfigError unless ``dtype`` can travel in a pack (its ``dtype.str`` names it exactly)."""
    if dtype.hasobject:
        raise ConfigError(f"{what} holds Python objects (dtype {dtype}), which would have to be unpickled: "
                          f"store it as a numeric, fixed-length string (S or U) or boolean array")
    if dtype.itemsize == 0 or np.dtype(dtype.str) != dtype:
        raise ConfigError(f"{what} has dtype {dtype}, which a pack of arrays cannot describe: store each field "
                          f"of a structured array as its own array, with a fixed size")


class Layout:
    """The pack layout of a fixed set of named arrays: the header bytes, and where each array goes."""

    def __init__(self, fields: Sequence[tuple[str, np.dtype, tuple[int, ...]]]):
        if not fields:
            raise ConfigError("a pack needs at least one array")
        if len(fields) > 0xFFFF:
            raise ConfigError(f"a pack holds at most 65535 arrays, not {len(fields)}")
        names = [f[0] for f in fields]
        if len(set(names)) != len(names):
            raise ConfigError(f"the arrays of a pack need distinct names, not {names}")
        encoded = []
        for name, dtype, shape in fields:
            check_dtype(dtype, f"array {name!r}")
            nb, db = name.encode("utf-8"), dtype.str.encode("ascii")
            if not 0 < len(nb) < 256 or len(shape) > 255:
                raise ConfigError(f"array name {name!r}: a pack takes names of 1 to 255 UTF-8 bytes and "
                                  f"up to 255 dimensions")
            encoded.append((nb, db, shape, nbytes_of(dtype, shape)))
        size = _FIXED.size + sum(_ENTRY.size + 8 * len(s) + len(nb) + len(db) for nb, db, s, _ in encoded)
        self.data_start = _align(size)
        if self.data_start > _MAX_HEADER:
            raise ConfigError(f"a pack's header would take {self.data_start} bytes (at most {_MAX_HEADER}): "
                              f"fewer arrays, or shorter names")
        offsets, end = [], self.data_start
        for *_, nbytes in encoded:
            off = _align(end)
            offsets.append(off)
            end = off + nbytes
        self.total = end
        head = [_FIXED.pack(_MAGIC, VERSION, 0, len(fields), self.data_start, self.total)]
        for (nb, db, shape, _), off in zip(encoded, offsets, strict=True):
            head.append(_ENTRY.pack(off, len(shape), len(nb), len(db)) + struct.pack(f"<{len(shape)}Q", *shape)
                        + nb + db)
        header = b"".join(head)
        self.header = header + bytes(self.data_start - len(header))
        self.sizes = [e[3] for e in encoded]
        # zeros after each array, up to the next one (none after the last)
        ends = [off + n for off, n in zip(offsets, self.sizes, strict=True)]
        self.pads = [bytes(nxt - e) for e, nxt in zip(ends, offsets[1:] + [end], strict=True)]

    def join(self, rows: Sequence[bytes]) -> bytes:
        """The pack of one row of each array (``rows`` in field order, each of its exact size)."""
        parts = [self.header]
        for row, pad in zip(rows, self.pads, strict=True):
            parts.append(row)
            if pad:
                parts.append(pad)
        return b"".join(parts)


def pack_arrays(arrays: Mapping[str, Any]) -> bytes:
    """The pack of ``arrays`` (name -> array-like), in the mapping's order, each in C order.

    Raises ConfigError for an empty mapping, an array of Python objects, a structured dtype, or a
    name that is empty or longer than 255 UTF-8 bytes.
    """
    arrs = {name: np.asarray(a) for name, a in arrays.items()}
    layout = Layout([(name, a.dtype, tuple(a.shape)) for name, a in arrs.items()])
    return layout.join([np.ascontiguousarray(a).tobytes() for a in arrs.values()])


_Field = tuple[str, np.dtype, tuple[int, ...], int, int]  # name, dtype, shape, offset, item count


def _bad(why: str) -> CacheError:
    return CacheError(f"not a valid pack of arrays: {why}; if it came from the cache, clear the cache "
                      f"(`hpcstagger cache clear NAME`); else check that this data came from a pack source")


@functools.lru_cache(maxsize=256)
def _parse_header(header: bytes) -> tuple[_Field, ...]:
    """The fields a pack's header describes, every one checked to lie within the pack."""
    _, _, _, count, start, total = _FIXED.unpack_from(header)
    pos, end, fields, seen = _FIXED.size, start, [], set()
    for k in range(count):
        if pos + _ENTRY.size > start:
            raise _bad(f"entry {k} runs past the header")
        off, ndim, nlen, dlen = _ENTRY.unpack_from(header, pos)
        pos += _ENTRY.size
        if pos + 8 * ndim + nlen + dlen > start:
            raise _bad(f"entry {k} runs past the header")
        shape = struct.unpack_from(f"<{ndim}Q", header, pos)
        pos += 8 * ndim
        try:
            name = header[pos:pos + nlen].decode("utf-8")
            dstr = header[pos + nlen:pos + nlen + dlen].decode("ascii")
        except UnicodeDecodeError:
            raise _bad(f"entry {k} has an undecodable name or dtype") from None
        pos += nlen + dlen
        if not name or name in seen:
            raise _bad(f"entry {k} has an empty or repeated name {name!r}")
        seen.add(name)
        try:
            dtype = np.dtype(dstr) if _DTYPE_STR.fullmatch(dstr) else None
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or dtype.hasobject or dtype.itemsize == 0 or dtype.str != dstr:
            raise _bad(f"entry {k} ({name!r}) has an unusable dtype {dstr!r}")
        nbytes = nbytes_of(dtype, shape)
        if off % PACK_ALIGN or off < end or off + nbytes > total:
            raise _bad(f"array {name!r} at offset {off} of {nbytes} bytes lies outside the pack's {total} "
                       f"bytes, overlaps another or is not aligned")
        fields.append((name, dtype, shape, off, nbytes // dtype.itemsize))
        end = off + nbytes
    if end != total:
        raise _bad(f"the arrays end at byte {end}, the header says the pack has {total}")
    return tuple(fields)


def unpack_arrays(data: Any) -> dict[str, np.ndarray]:
    """The arrays of a pack (``bytes``, a ``memoryview`` from the cache, ...), by name in pack
    order: views of ``data``, not copies (read-only when ``data`` is). Raises CacheError if ``data``
    is not a complete, intact pack: never an out-of-bounds view."""
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise _bad("the buffer is not contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    n = mv.nbytes
    if n < _FIXED.size:
        raise _bad(f"{n} bytes, fewer than a header")
    magic, version, flags, count, start, total = _FIXED.unpack_from(mv)
    if magic != _MAGIC:
        raise _bad(f"it starts with {bytes(mv[:4])!r}, not {_MAGIC!r}")
    if version != VERSION or flags:
        raise _bad(f"version {version}, flags {flags}, where this hpcstagger reads version {VERSION} with no "
                   f"flags (a newer hpcstagger wrote it, or it is damaged)")
    if total != n:
        raise _bad(f"{n} bytes where the header says {total} (truncated or padded)")
    if not count or not _FIXED.size <= start <= min(n, _MAX_HEADER) or start % PACK_ALIGN:
        raise _bad(f"{count} arrays from byte {start}")
    out = {}
    for name, dtype, shape, off, items in _parse_header(bytes(mv[:start])):
        out[name] = np.frombuffer(mv, dtype, items, off).reshape(shape)
    return out
