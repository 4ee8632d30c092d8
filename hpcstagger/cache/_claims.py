"""Misses of one sample coalesced across the node's processes: one process reads it, the others wait.

Jobs that read the same sample order (PyTorch samplers with the same seed) and run level with each
other miss the same samples at about the same time. Read independently, each sample then comes from
the source once per job, and the copies share the source's bandwidth: two jobs in step go at half
the speed one would. So a process that misses a sample first *claims* it, under the ledger's lock,
in a small table in the ledger's header; a process that misses the same sample while the claim
stands waits for the claimant's insert instead of reading it (the page cache treats concurrent
reads of one page the same way).

The table holds :data:`MAX_CLAIMS` claims of three words from ``H_CLAIMS`` on: the key hash (lo,
hi) and the owner, ``pid << 16 | process slot``, taken under the ledger's lock and released
without it. A claim ends when its owner has inserted the sample (or had the insert refused). A
waiter polls lock-free with a growing sleep, and reads the sample itself when the claim ends
without an entry (a full cache), when the owner died (its slot no longer holds its pid, or the pid
is not alive), or after :data:`WAIT_LIMIT` seconds. A full table
means no claim: the miss is read as before. ``H_COALESCED`` counts the misses served by another
process's read. These header words were spare (zero) in ledgers made before them, so the format
version stays 1; a process that does not know them reads its misses itself, as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hpcstagger.cache import _flight, _fs
from hpcstagger.cache._layout import (H_CLAIMS, H_COALESCED, H_FLIGHT_NS, HEADER_BYTES, MAX_CLAIMS, SLOT_WORDS, S_PID,
                                      S_START)

__all__ = ["OWN", "BUSY", "NONE", "claim", "release", "state", "count_coalesced", "Waiter", "WAIT_LIMIT"]

log = logging.getLogger(__name__)

OWN, BUSY, NONE = 1, 2, 0
WAIT_LIMIT = 30.0  # seconds a waiter waits for a live owner before reading the sample itself
_FIRST_SLOT = HEADER_BYTES // 8
_END = H_CLAIMS + 3 * MAX_CLAIMS
assert H_CLAIMS >= H_FLIGHT_NS + _flight.LEVELS  # the table begins after the reads-in-flight levels


def _owner_alive(w: Any, owner: int) -> bool:
    pid, slot = owner >> 16, owner & 0xFFFF
    b = _FIRST_SLOT + slot * SLOT_WORDS
    return pid > 0 and int(w[b + S_PID]) == pid and _fs.alive(pid, int(w[b + S_START]))


def claim(led: Any, hi: int, lo: int, base: int, pid: int) -> tuple[int, int]:
    """Claim the sample with key hash (``hi``, ``lo``) for this process (slot ``base``, ``pid``), under
    the lock: ``(OWN, i)`` (read it, then :func:`release` ``i``), ``(BUSY, i)`` (a live process holds
    claim ``i``: wait for it) or ``(NONE, -1)`` (the table is full: read it unclaimed)."""
    me = (pid << 16) | ((base - _FIRST_SLOT) // SLOT_WORDS)
    with led.lock():
        w = led.w
        los = w[H_CLAIMS:_END:3].tolist()  # one slice each, not a Python loop over the table's words
        owners = w[H_CLAIMS + 2:_END:3].tolist()
        k = -1
        while True:
            try:
                k = los.index(lo, k + 1)
            except ValueError:
                break
            i = H_CLAIMS + 3 * k
            if owners[k] and int(w[i + 1]) == hi:
                if owners[k] != me and _owner_alive(w, owners[k]):
                    return BUSY, i
                w[i + 2] = me  # its owner died (or is us, from a read that never released it): take it over
                return OWN, i
        try:
            k = owners.index(0)
        except ValueError:  # full: take a dead owner's claim of another sample, if there is one
            k = next((k for k, owner in enumerate(owners) if not _owner_alive(w, owner)), -1)
            if k < 0:
                return NONE, -1
        i = H_CLAIMS + 3 * k
        w[i], w[i + 1], w[i + 2] = lo, hi, me
        return OWN, i


def release(led: Any, i: int, hi: int, lo: int) -> None:
    """End claim ``i`` of the sample (``hi``, ``lo``), if it is still that sample's. Without the lock:
    the key's words are zeroed before the owner's, and an entry is free only once its owner is zero,
    so a claim made meanwhile is never overwritten (claims only spare reads; what a reader gets is
    always the verified entry)."""
    if led.lmap is None:
        return
    w = led.w
    if int(w[i]) == lo and int(w[i + 1]) == hi and int(w[i + 2]):
        w[i] = 0
        w[i + 1] = 0
        w[i + 2] = 0


def state(led: Any, i: int, hi: int, lo: int, check_owner: bool) -> bool:
    """Whether claim ``i`` still stands for the sample (``hi``, ``lo``), read without the lock (a look
    that races a change sees it at the next poll); ``check_owner`` also requires its owner alive."""
    w = led.w
    owner = int(w[i + 2])
    if owner == 0 or int(w[i]) != lo or int(w[i + 1]) != hi:
        return False
    return not check_owner or _owner_alive(w, owner)


def count_coalesced(led: Any) -> None:
    """One miss served by another process's read (under the lock)."""
    with led.lock():
        led.w[H_COALESCED] += 1


class Waiter:
    """The backoff of one wait: :meth:`pause` sleeps 0.1 ms, then twice as long each time, up to 2 ms."""

    __slots__ = ("delay", "start", "next_check")

    def __init__(self) -> None:
        self.delay = 1e-4
        self.start = time.monotonic()
        self.next_check = self.start + 0.05

    def pause(self) -> None:
        time.sleep(self.delay)
        self.delay = min(2e-3, self.delay * 2)

    def owner_check_due(self) -> bool:
        """True every 50 ms: whether to check the owner is alive (a read of /proc) at this poll."""
        now = time.monotonic()
        if now >= self.next_check:
            self.next_check = now + 0.05
            return True
        return False

    def expired(self) -> bool:
        return time.monotonic() - self.start > WAIT_LIMIT
