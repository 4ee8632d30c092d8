"""The bytes the partitioned cache moves between nodes, packed and checked without pickle.

Lookups read the owner's index slots and entries as they lie in its files (see
:mod:`hpcstagger.cache._layout`): :func:`scan_slots` finds a key among fetched slots and
:func:`verify_entry` accepts a fetched entry only if its header names the key and the length the
slot gave, and its payload matches the xxh3-64 checksum. Anything else is a miss.

An insert sent to the owner is one message: a fixed header ``INSERT`` (magic, key hash hi and lo,
payload length, payload checksum, key kind, key length), the key (UTF-8 text, or the decimal digits
of an int), then the payload. :func:`unpack_insert` accepts it only if every length adds up, the
key hashes to the header's hash and the payload matches its checksum.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

from hpcstagger.cache._layout import ENTRY, ENTRY_HDR, ENTRY_MAGIC, LEN_MASK, LIVE, SLOT

__all__ = ["INSERT", "pack_insert", "unpack_insert", "scan_slots", "verify_entry", "FOUND", "ABSENT", "MORE"]

INSERT = struct.Struct("<8sQQQQII")
INSERT_MAGIC = b"HPCSINS1"
_STR, _INT = 1, 2
FOUND, ABSENT, MORE = "found", "absent", "more"
_checksum = xxhash.xxh3_64_intdigest


def pack_insert(key: str | int, hi: int, lo: int, data: memoryview) -> bytearray:
    """One insert message for ``key`` (hashed to ``hi``, ``lo``) carrying ``data``."""
    if isinstance(key, str):
        kind, kb = _STR, key.encode("utf-8", "surrogatepass")
    else:
        kind, kb = _INT, b"%d" % key
    n = data.nbytes
    out = bytearray(INSERT.size + len(kb) + n)
    INSERT.pack_into(out, 0, INSERT_MAGIC, hi, lo, n, _checksum(data), kind, len(kb))
    out[INSERT.size:INSERT.size + len(kb)] = kb
    out[INSERT.size + len(kb):] = data
    return out


def unpack_insert(buf: Any, key_hash: Any) -> tuple[str | int, memoryview] | None:
    """(key, payload) of a verified insert message, or None when anything does not add up.

    ``key_hash`` is :func:`hpcstagger.cache.store.key_hash`, to check the key against the header."""
    mv = memoryview(buf)
    if mv.nbytes < INSERT.size:
        return None
    magic, hi, lo, n, ck, kind, klen = INSERT.unpack_from(mv)
    if magic != INSERT_MAGIC or kind not in (_STR, _INT) or INSERT.size + klen + n != mv.nbytes:
        return None
    kb = bytes(mv[INSERT.size:INSERT.size + klen])
    try:
        key: str | int = kb.decode("utf-8", "surrogatepass") if kind == _STR else int(kb.decode("ascii"))
    except ValueError:  # UnicodeDecodeError is one
        return None
    payload = mv[INSERT.size + klen:]
    if key_hash(key) != (hi, lo) or _checksum(payload) != ck:
        return None
    return key, payload


def scan_slots(buf: Any, count: int, hi: int, lo: int) -> tuple[str, int, int]:
    """Look for the key among ``count`` consecutive index slots fetched into ``buf``.

    Returns (FOUND, offset, length) for a live entry, (ABSENT, 0, 0) when the chain ends (an empty
    slot, or the key's slot holds no live entry), (MORE, 0, 0) when every slot is taken by other keys.
    """
    for j in range(count):
        khi, klo, off, meta = SLOT.unpack_from(buf, j * SLOT.size)
        if khi == hi and klo == lo:
            if meta >> 56 == LIVE:
                return FOUND, off, meta & LEN_MASK
            return ABSENT, 0, 0
        if not (khi or klo):
            return ABSENT, 0, 0
    return MORE, 0, 0


def verify_entry(buf: Any, hi: int, lo: int, n: int) -> memoryview | None:
    """The payload of a fetched entry (header and ``n`` payload bytes), or None if it is not the
    key's intact entry."""
    mv = memoryview(buf)
    if mv.nbytes != ENTRY_HDR + n:
        return None
    magic, ehi, elo, elen, ck, _ = ENTRY.unpack_from(mv)
    if magic != ENTRY_MAGIC or ehi != hi or elo != lo or elen != n:
        return None
    payload = mv[ENTRY_HDR:]
    if _checksum(payload) != ck:
        return None
    return payload.toreadonly()
