"""The binary layout of a cache's files (see :mod:`hpcstagger.cache._ledger` for what they mean).

Word indexes ``H_*`` address the ledger header (64-bit little-endian words), ``S_*`` a process
slot; ``SLOT`` is one index slot ``(key hash hi, key hash lo, offset, length | state << 56)``;
``ENTRY`` is the start of an entry's 64-byte header in the arena
``(magic, key hash hi, key hash lo, length, xxh3-64 of the payload, generation)``.
"""

from __future__ import annotations

import struct

__all__ = ["ALIGN", "COUNTERS", "ENTRY", "ENTRY_HDR", "ENTRY_MAGIC", "HEADER_BYTES", "H_ARENA_BYTES",
           "H_CAPACITY", "H_CLAIMS", "H_COALESCED",
           "H_CREATED", "H_DIRTY", "H_ENTRIES", "H_GEN", "H_HOLES", "H_FLIGHT_N",
           "H_FLIGHT_NS", "H_FLIGHT_T", "H_WATCHED", "H_INDEX_SLOTS", "H_INDEX_USED", "H_MAGIC", "H_MAX_ENTRIES",
           "H_NHOLES", "H_NSLOTS", "H_POLICY", "H_RESERVED", "H_RESERVED_ENTRIES", "H_TOP", "H_USED",
           "H_VERSION", "H_WASTED", "LEDGER_BYTES", "LEN_MASK", "LIVE", "MAGIC", "MAX_CLAIMS", "MAX_HOLES", "NSLOTS",
           "SLOT", "SLOT_WORDS", "S_CORRUPT", "S_DUPLICATES", "S_FLIGHT", "S_HITS", "S_INSERTS",
           "S_INSERT_BYTES", "S_MISSES", "S_PID", "S_READ_BYTES", "S_READ_NS", "S_REFUSED", "S_RES_GEN",
           "S_RES_OFF", "S_RES_PAYLOAD", "S_RES_SIZE", "S_START", "TOMB", "VERSION", "align", "sizes_for"]

MAGIC = int.from_bytes(b"HPCSLDG1", "little")
ENTRY_MAGIC = int.from_bytes(b"HPCSENT1", "little")
VERSION = 1
HEADER_BYTES = 4096
NSLOTS = 2048
SLOT_WORDS = 16
LEDGER_BYTES = HEADER_BYTES + NSLOTS * SLOT_WORDS * 8
ENTRY_HDR = 64
ALIGN = 64
LEN_MASK = (1 << 56) - 1
LIVE, TOMB = 1, 2
MAX_HOLES = 128

# header words
(H_MAGIC, H_VERSION, H_CAPACITY, H_POLICY, H_MAX_ENTRIES, H_INDEX_SLOTS, H_ARENA_BYTES, H_GEN,
 H_USED, H_ENTRIES, H_TOP, H_RESERVED, H_RESERVED_ENTRIES, H_DIRTY, H_WASTED, H_CREATED,
 H_NSLOTS, H_INDEX_USED, H_NHOLES) = range(19)
H_HOLES = 32  # MAX_HOLES (offset, size) pairs
# reads in flight from the source (see _flight): the number now, when it last changed, and from
# word H_FLIGHT_NS on the nanoseconds spent at each number (words that were spare in version 1)
H_FLIGHT_N, H_FLIGHT_T, H_FLIGHT_NS = 19, 20, H_HOLES + 2 * MAX_HOLES
# until when (CLOCK_MONOTONIC ns) a watcher wants the reads in flight counted (spare in version 1 too)
H_WATCHED = 21
# misses served by another process's read, and the claims of samples being read (see _claims; the
# words after the reads-in-flight levels, to the header's end: spare in version 1 too)
H_COALESCED = 22
H_CLAIMS = H_FLIGHT_NS + 32
MAX_CLAIMS = (HEADER_BYTES // 8 - H_CLAIMS) // 3
# process slot words
(S_PID, S_START, S_HITS, S_MISSES, S_INSERTS, S_REFUSED, S_DUPLICATES, S_CORRUPT,
 S_RES_OFF, S_RES_SIZE, S_RES_PAYLOAD, S_RES_GEN, S_INSERT_BYTES, S_READ_BYTES, S_READ_NS, S_FLIGHT) = range(16)
# S_READ_*: source reads reported with ShmCache.count_read (words that were spare in version 1: a
# ledger made before them reads 0 there, so the version stays 1)
COUNTERS = {"hits": S_HITS, "misses": S_MISSES, "inserts": S_INSERTS, "refused": S_REFUSED,
            "duplicates": S_DUPLICATES, "corrupt": S_CORRUPT, "insert_bytes": S_INSERT_BYTES,
            "read_bytes": S_READ_BYTES, "read_ns": S_READ_NS}

SLOT = struct.Struct("<QQQQ")
ENTRY = struct.Struct("<QQQQQQ")


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def sizes_for(capacity: int, max_entries: int, stores: bool) -> tuple[int, int]:
    """(index slots, arena bytes) for a cache: load factor <= 1/2, room for every header."""
    if not stores:
        return 0, 0
    return max(128, _pow2_at_least(2 * max_entries)), capacity + max_entries * 2 * ALIGN + ENTRY_HDR
