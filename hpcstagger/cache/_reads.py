"""The read side of :class:`~hpcstagger.cache.store.ShmCache`: key hashing, ``get``, ``get_many`` and
the careful path.

A hit takes no lock: the key's 128-bit hash is looked up in the index (linear probing from slot
``lo & mask``); the slot must be live and its entry must lie below the arena's written top; the
entry's header must carry the magic, the key's hash and the slot's length; and the payload must
match the header's xxh3-64 checksum. The caller then gets a read-only view of the arena. A hit in
the key's home slot is settled inline; every other lookup goes to :meth:`Reads._find`, which follows
the chain for :data:`FAST_PROBES` slots (a chain that ends in an empty slot or a tombstone is a
miss) and hands everything else (a generation that changed, an entry that fails verification, a
longer chain) to the careful path :meth:`Reads._read`, which remaps, probes the whole chain and
drops a corrupt entry under the lock. Hits and misses are then counted in this process's slot of
the shared ledger under the ledger's thread lock (``Ledger.clock``, a ``threading.Lock``: each
process counts only in its own slot, so no lock between processes is needed): one acquisition per
``get``, and one per ``get_many`` batch.
"""

from __future__ import annotations

import logging
import operator
import os
import struct
from collections.abc import Iterable
from typing import Any

import xxhash

from hpcstagger.cache._layout import (ENTRY_HDR, ENTRY_MAGIC, H_GEN, H_TOP, LEN_MASK, LIVE, SLOT, S_CORRUPT, S_HITS,
                                      S_MISSES, TOMB)
from hpcstagger.cache._wire import verify_entry

__all__ = ["Reads", "key_hash", "key_digest", "FAST_PROBES"]

log = logging.getLogger(__name__)

_checksum = xxhash.xxh3_64_intdigest
_hash128 = xxhash.xxh3_128_digest
_unpack_slot, _unpack_hash = SLOT.unpack_from, struct.Struct("<QQ").unpack
# The hit path compares key hashes as the 16 bytes of the digest, which the index slot and the entry
# header hold as they are (two little-endian words hi, lo), and the entry's magic and key hash as one
# 24-byte string: a comparison of bytes instead of several of ints.
_slot_fields = struct.Struct("<16sQQ").unpack_from  # (key hash, offset, meta) of an index slot
_entry_fields = struct.Struct("<24sQQ").unpack_from  # (magic + key hash, length, xxh3-64) of an entry
_lo_word = struct.Struct("<8xQ").unpack  # lo of a digest: where its chain starts
_ENTRY_MAGIC = ENTRY_MAGIC.to_bytes(8, "little")
_EMPTY = bytes(16)
# meta ^ _LIVE_TAG is the length of a live slot's entry, and 2**56 or more (past any arena) otherwise
_LIVE_TAG = LIVE << 56
# Slots a lookup probes before it hands the key to the careful path. At the index's load factor (at
# most 1/2) nearly every chain is shorter.
FAST_PROBES = 8
_PROBES = range(FAST_PROBES)


def _digest(key: str | int) -> bytes:
    """The 16-byte xxh3-128 digest of a key (TypeError for keys that are neither str nor int)."""
    if isinstance(key, str):
        return _hash128(str(key).encode("utf-8", "surrogatepass"), 1)
    try:
        return _hash128(b"%d" % operator.index(key), 2)
    except TypeError:
        raise TypeError(f"cache keys are str or int, not {type(key).__name__}") from None


def _split(d: bytes) -> tuple[int, int]:
    hi, lo = _unpack_hash(d)
    return hi, lo if (hi or lo) else 1  # (0, 0) marks an empty slot: that one hash is stored as (0, 1)


def key_digest(key: str | int) -> tuple[bytes, int, int]:
    """A key's 16-byte digest as the index holds it, and its hash (hi, lo) (:func:`key_hash`)."""
    d = _digest(key)
    return (d, *_split(d))


def key_hash(key: str | int) -> tuple[int, int]:
    """The 128-bit xxh3 hash (hi, lo) a key is stored under; str and int keys never collide by type.

    Raises TypeError for keys that are neither str nor int (anything with ``__index__`` is an int).
    """
    return _split(_digest(key))


class Reads:
    """``get``, ``get_many``, ``contains`` and ``in`` of :class:`~hpcstagger.cache.store.ShmCache`
    (a base class of it; it provides ``_led``, ``_stores``, ``name`` and ``_count``)."""

    _led: Any
    _stores: bool
    name: str

    def _count(self, field: int, n: int = 1, field2: int = -1, n2: int = 0) -> None:
        raise NotImplementedError

    def get(self, key: str | int) -> memoryview | None:
        """The sample stored under ``key`` as a read-only memoryview, or None (a miss).

        The view is verified against its checksum before it is returned and never changes
        afterwards (entries are never rewritten in place). A corrupt entry counts as a miss, is
        dropped, and is replaced by the next ``put``. Raises TypeError for a key that is neither
        str nor int, CacheError if the cache was closed.
        """
        # A hit in the key's home slot is written out flat here and in get_many: at samples of a few
        # KB every call, attribute lookup and bytecode shows. Everything else goes to _find.
        if type(key) is int:
            d = _hash128(b"%d" % key, 2)
        elif type(key) is str:
            d = _hash128(key.encode("utf-8", "surrogatepass"), 1)
        else:
            d = _digest(key)
        led = self._led
        w = led.w
        view = None
        if self._stores and w[H_GEN] == led.gen:
            ks, off, meta = _slot_fields(led.imv, (_lo_word(d)[0] & led.mask) << 5)
            if ks == d:
                n = meta ^ _LIVE_TAG
                start = off + ENTRY_HDR
                end = start + n
                if end <= w[H_TOP]:  # a live slot, and never read unwritten arena (see _files.create_file)
                    mk, elen, ck = _entry_fields(led.amv, off)
                    if elen == n and mk == _ENTRY_MAGIC + d:
                        v = led.amv[start:end]
                        if _checksum(v) == ck:
                            view = v
        if view is None:
            view = self._find(d)
        b = led.base
        if b < 0:
            b = led.claim_slot()
        lock = led.clock
        lock.acquire()
        try:
            if view is None:
                w[b + S_MISSES] += 1
            else:
                w[b + S_HITS] += 1
        finally:
            lock.release()
        return view

    def get_many(self, keys: Iterable[str | int]) -> list[memoryview | None]:
        """The samples stored under ``keys``, in order: for each key what :meth:`get` returns (a
        verified read-only memoryview, or None for a miss), from one call.

        Each key is one lookup in :meth:`stats` (a hit or a miss), as if ``get`` had been called
        for each in turn; a key given twice is looked up twice. The batch is counted with one
        acquisition of the counters' lock. A corrupt entry is a miss and is dropped, as in ``get``.
        Raises TypeError for a key that is neither str nor int (the keys before it are counted),
        CacheError if the cache was closed.
        """
        led = self._led
        w = led.w
        if self._stores and w[H_GEN] != led.gen:
            self.regions()
        imv, amv, mask = led.imv, led.amv, led.mask
        if not self._stores:
            mask = -1  # no index: every key goes to _find, a miss
        out: list[memoryview | None] = []
        append = out.append
        hits = 0
        try:
            # The generation is checked once per batch, and again by _find (every key not settled
            # in its home slot), which maps a new one: a clear() during the batch is seen from the
            # key where it is noticed on, as by single gets that ran into it there.
            for key in keys:
                if type(key) is int:
                    d = _hash128(b"%d" % key, 2)
                elif type(key) is str:
                    d = _hash128(key.encode("utf-8", "surrogatepass"), 1)
                else:
                    d = _digest(key)
                if mask >= 0:
                    ks, off, meta = _slot_fields(imv, (_lo_word(d)[0] & mask) << 5)
                    if ks == d:
                        n = meta ^ _LIVE_TAG
                        start = off + ENTRY_HDR
                        end = start + n
                        if end <= w[H_TOP]:
                            mk, elen, ck = _entry_fields(amv, off)
                            if elen == n and mk == _ENTRY_MAGIC + d:
                                v = amv[start:end]
                                if _checksum(v) == ck:
                                    append(v)
                                    hits += 1
                                    continue
                view = self._find(d)
                if view is not None:
                    hits += 1
                append(view)
                imv, amv = led.imv, led.amv  # _find may have mapped a new generation
            return out
        finally:
            if out:
                b = led.base
                if b < 0:
                    b = led.claim_slot()
                lock = led.clock
                lock.acquire()
                try:
                    w[b + S_HITS] += hits
                    w[b + S_MISSES] += len(out) - hits
                finally:
                    lock.release()

    def _find(self, d: bytes) -> memoryview | None:
        """The verified entry of the key with digest ``d``, or None: the lookup of every key that a
        hit in its home slot did not settle (probed along its chain, then the careful path)."""
        if not self._stores:
            return None
        led = self._led
        w = led.w
        if w[H_GEN] == led.gen:
            imv, mask = led.imv, led.mask
            i = _lo_word(d)[0] & mask
            for _ in _PROBES:
                ks, off, meta = _slot_fields(imv, i << 5)
                if ks == d:
                    n = meta ^ _LIVE_TAG
                    start = off + ENTRY_HDR
                    if start + n <= w[H_TOP]:
                        mk, elen, ck = _entry_fields(led.amv, off)
                        if elen == n and mk == _ENTRY_MAGIC + d:
                            view = led.amv[start:start + n]
                            if _checksum(view) == ck:
                                return view
                    elif meta >> 56 == TOMB:
                        return None  # a dropped entry: a miss
                    break  # anything else that matched takes the careful path
                if ks == _EMPTY:
                    return None  # the chain ends: a miss
                i = (i + 1) & mask
        return self._read(*_split(d))

    def contains(self, key: str | int) -> bool:
        """Whether a valid entry is stored under ``key``; unlike :meth:`get` it counts no lookup."""
        return self._read(*key_hash(key)) is not None

    def regions(self) -> tuple[memoryview, memoryview, int]:
        """(index, arena, generation): this process's read-only mappings of the current index and
        arena files, which :mod:`hpcstagger.cache.partitioned` exposes to the other nodes."""
        led = self._led
        if led.w[H_GEN] != led.gen:
            with led.lock():
                led.map_generation()
        return led.imv, led.amv, led.gen

    def _read(self, hi: int, lo: int, retry: bool = True) -> memoryview | None:
        """The careful path: the key's verified entry, or None; drops a corrupt entry."""
        led = self._led
        if led.w[H_GEN] != led.gen:
            self.regions()
        i, state = self._probe(hi, lo)
        if state != LIVE:
            return None
        imv = led.imv
        _, _, off, meta = _unpack_slot(imv, i << 5)  # the entry check below catches a slot that moved on
        if meta >> 56 != LIVE:
            return None
        n = meta & LEN_MASK
        if off + ENTRY_HDR + n <= led.w[H_TOP]:
            view = verify_entry(led.amv[off:off + ENTRY_HDR + n], hi, lo, n)
            if view is not None:
                return view
        if self._drop_corrupt(i, hi, lo, off, meta, imv) or not retry:
            return None
        return self._read(hi, lo, retry=False)  # the slot changed under us: look again

    def _drop_corrupt(self, i: int, hi: int, lo: int, off: int, meta: int, imv: Any) -> bool:
        """Under the lock: if slot ``i`` still holds this entry and it is still bad, tombstone it."""
        led = self._led
        with led.lock():
            if led.imv is not imv or SLOT.unpack_from(imv, i << 5) != (hi, lo, off, meta):
                return False
            n = meta & LEN_MASK
            try:
                data = os.pread(led.arena_fd, ENTRY_HDR + n, off) if off + ENTRY_HDR + n <= led.w[H_TOP] else b""
            except OSError:
                data = b""
            if verify_entry(data, hi, lo, n) is not None:
                return False  # a torn read of a slot being published, not corruption
            os.pwrite(led.index_fd, ((TOMB << 56) | n).to_bytes(8, "little"), (i << 5) + 24)
            # The region is abandoned (someone may still hold a view of it). The index's own length
            # may be what was corrupt, so recount the occupancy rather than subtract it.
            led.recount()
        log.warning("cache %s: entry at offset %d failed verification; dropped it", self.name, off)
        self._count(S_CORRUPT)
        return True

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has a live entry (its checksum is not verified; not counted as a lookup)."""
        if not self._stores:
            return False
        try:
            hi, lo = key_hash(key)  # type: ignore[arg-type]  # any object may be tested; TypeError if not a key
        except TypeError:
            return False
        led = self._led
        if led.w[H_GEN] != led.gen:
            self.regions()
        found = self._probe(hi, lo)
        return found[1] == LIVE

    def _probe(self, hi: int, lo: int) -> tuple[int, int]:
        """(slot, state): the slot holding ``key`` (state LIVE or TOMB) or the empty slot ending its chain."""
        led = self._led
        imv, mask = led.imv, led.mask
        i = lo & mask
        for _ in range(led.index_slots):
            khi, klo, _, meta = _unpack_slot(imv, i << 5)
            if klo == lo and khi == hi:
                return i, meta >> 56
            if not (khi or klo):
                return i, 0
            i = (i + 1) & mask
        return -1, 0
