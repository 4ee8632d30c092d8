"""Reads in flight from the source behind a cache, counted exactly across the node's processes.

A watcher that fits the source's bandwidth curve to what the jobs get needs to know how many reads
shared the source, and for how long. Read-seconds over elapsed time (Little's law) give only the
mean; jobs whose loaders read at very different rates make the same mean out of very different
mixes, and the curve is not linear. So every source read that :class:`~.dataset.CachedDataset`
makes is bracketed (:class:`Reading`), and the ledger integrates the wall time spent with 1, 2, ...
reads in flight on the node:

- ``H_FLIGHT_N``: reads in flight now; ``H_FLIGHT_T``: when that number last changed
  (``CLOCK_MONOTONIC`` ns, shared by every process);
- ``H_FLIGHT_NS + k - 1``: nanoseconds spent with ``k`` reads in flight (the last word: ``k`` or more,
  up to :data:`LEVELS`);
- a process slot's ``S_FLIGHT``: that process's reads in flight, so that a process killed in the
  middle of a read stops counting at the next sweep (every :data:`SWEEP_NS` per process, and in a
  recount).

Each change takes the ledger's lock (about 2 us here), so reads are counted only while somebody
looks: ``H_WATCHED`` holds until when (``CLOCK_MONOTONIC`` ns) a watcher asked for counting
(:func:`watch`, which the closed loop's watcher renews at every look). Outside that, a read pays
one clock read and one word read. Reads that began before the watching began are not counted;
reads counted when it lapses are still counted to their end. These words were zero in ledgers
made before them, so the format version stays 1.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hpcstagger.errors import CacheError
from hpcstagger.cache import _fs
from hpcstagger.cache._layout import (H_FLIGHT_N, H_FLIGHT_NS, H_FLIGHT_T, H_WATCHED, HEADER_BYTES, S_FLIGHT, S_PID,
                                      S_START, SLOT_WORDS)

__all__ = ["LEVELS", "Reading", "seconds", "sweep", "watch", "watched"]

log = logging.getLogger(__name__)

LEVELS = 32
SWEEP_NS = 500_000_000


class Reading:
    """Context manager around one read from the source: counted in flight from entry to exit."""

    __slots__ = ("led", "counted")

    def __init__(self, led: Any):
        self.led = led
        self.counted = False

    def __enter__(self) -> None:
        self.counted = watched(self.led) and change(self.led, 1)

    def __exit__(self, *exc: Any) -> None:
        if self.counted:
            change(self.led, -1)


def watched(led: Any) -> bool:
    """Whether a watcher wants reads counted now (read without the lock: one word)."""
    try:
        return led.lmap is not None and time.monotonic_ns() <= int(led.w[H_WATCHED])
    except (ValueError, TypeError):
        return False  # a ledger closed under us


def watch(led: Any, seconds: float) -> None:
    """Count the reads in flight for the next ``seconds`` at least (never shortens another watcher's)."""
    if led.lmap is None:
        raise CacheError("the cache is closed")
    until = time.monotonic_ns() + max(0, int(seconds * 1e9))
    with led.lock():
        if until > int(led.w[H_WATCHED]):
            led.w[H_WATCHED] = until


def change(led: Any, delta: int) -> bool:
    """One read of this process begins (+1) or ends (-1). False when nothing was counted (a
    closed ledger, no process slot left, or an end without its beginning): counting never makes a
    read fail."""
    try:
        return _change(led, delta)
    except (CacheError, OSError, ValueError) as exc:
        log.debug("a source read was not counted in flight: %s", exc)
        return False


def _change(led: Any, delta: int) -> bool:
    if led.lmap is None:
        return False
    b = led.base if led.base >= 0 else led.claim_slot()
    with led.lock():
        w = led.w
        own = int(w[b + S_FLIGHT]) + delta
        if own < 0:
            return False
        now = time.monotonic_ns()
        n = int(w[H_FLIGHT_N])
        if n > 0:
            w[H_FLIGHT_NS + min(n, LEVELS) - 1] += max(0, now - int(w[H_FLIGHT_T]))
        w[b + S_FLIGHT] = own
        if now - led.flight_swept >= SWEEP_NS:
            led.flight_swept = now
            n = sweep(led)
        else:
            n = max(0, n + delta)
        w[H_FLIGHT_N] = n
        w[H_FLIGHT_T] = now
    return True


def sweep(led: Any) -> int:
    """The reads in flight of the live processes, with dead processes' counts zeroed (under the lock)."""
    w = led.w
    first = HEADER_BYTES // 8
    counts = w[first + S_FLIGHT::SLOT_WORDS].tolist()
    total = 0
    for s, c in enumerate(counts):
        if c:
            b = first + s * SLOT_WORDS
            if _fs.alive(int(w[b + S_PID]), int(w[b + S_START])):
                total += c
            else:
                w[b + S_FLIGHT] = 0
    return total


def seconds(led: Any) -> list[float]:
    """Seconds spent with 1, 2, ... :data:`LEVELS` (or more) reads in flight, up to now. Read without
    the lock: cheap to poll, and a look that races a change is off by that change's interval."""
    w = led.w
    out = [int(w[H_FLIGHT_NS + k]) / 1e9 for k in range(LEVELS)]
    n, since = int(w[H_FLIGHT_N]), int(w[H_FLIGHT_T])
    if n > 0 and since > 0:
        out[min(n, LEVELS) - 1] += max(0, time.monotonic_ns() - since) / 1e9
    return out
