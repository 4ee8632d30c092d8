"""Prefetching in the wait: a waiting job fills the shared cache with what nobody has read yet,
in the source bandwidth the running jobs leave idle.

With ``[plan] prefetch = true``, the leader of the job planned to start last (the watcher's host
in mode ``plan``) runs a :class:`Prefetcher` as idle work while it waits. It walks the dataset
in index order, skips what the cache holds (:meth:`ShmCache.contains`, which counts no lookup),
and reads the rest from the spec's source (the same shared emulated source as the jobs, when the
spec throttles) into the cache. It is paced by what the source does for the others: every
``look_s`` (20 ms) it reads the cache's source-read counters (:meth:`ShmCache.read_counters`,
which only the jobs' misses feed, not the prefetcher's reads); when the others had less than
``prefetch_idle`` reads in flight on average over the last ``window_s`` (5 looks, 100 ms; knob
``prefetch_idle``, 0.1: the source idle at least 90% of the time), it reads for at most one more
``look_s``, else it waits. The window spans several looks because a read is counted when it ends:
one look can fall between two reads of a busy job. A source that the running jobs keep busy is
left to them.

The prefetched share of the dataset is what the watcher's release decision adds to the cache the
model starts the waiting job from (:meth:`~hpcstagger.stagger.steering.Steering`'s ``prefetched``). The session's
status records what was prefetched (``timings``: ``prefetch_samples``, ``prefetch_bytes``,
``prefetch_busy_s``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import Any

from hpcstagger import config
from hpcstagger.stagger.steering import release_groups

__all__ = ["Prefetcher", "prefetcher_for"]

log = logging.getLogger(__name__)

STEP_S = 0.1  # longest a call runs (idle work is called again while the wait lasts)


class Prefetcher:
    """Idle work (``Callable[[float], bool]``) that fills ``cache`` from ``source`` in the source's
    idle time (see the module docstring)."""

    def __init__(self, source: Any, cache: Any, *, look_s: float = 0.02, window_s: float | None = None,
                 idle_below: float | None = None):
        self.source, self.cache = source, cache
        self.look_s = float(look_s)
        self.window_s = 5 * self.look_s if window_s is None else float(window_s)
        self.idle_below = float(config.get("prefetch_idle") if idle_below is None else idle_below)
        self.n = len(source)
        self.next = 0
        self.samples = 0
        self.bytes = 0
        self.busy_s = 0.0      # seconds it held back because the others were reading
        self.read_s = 0.0      # seconds it spent reading
        self.done = False
        self._looks: deque[tuple[float, float]] = deque()  # (monotonic time, source-read seconds)

    def close(self) -> None:
        """Detach from the cache (the cache and what was prefetched stay)."""
        close = getattr(self.cache, "close", None)
        if close is not None:
            close()
        self.done = True

    def fraction(self) -> float:
        """The share of the dataset this prefetcher put into the cache."""
        return self.samples / self.n if self.n else 0.0

    def stats(self) -> dict[str, float]:
        """What it did, for the session's status."""
        return {"prefetch_samples": float(self.samples), "prefetch_bytes": float(self.bytes),
                "prefetch_busy_s": self.busy_s, "prefetch_read_s": self.read_s}

    def _others_idle(self) -> bool:
        """True when the others had fewer than ``idle_below`` reads in flight on average over the last
        ``window_s``; False until a whole window has been seen."""
        now = time.monotonic()
        _, seconds = self.cache.read_counters()
        looks = self._looks
        looks.append((now, seconds))
        while len(looks) > 2 and now - looks[1][0] >= self.window_s:
            looks.popleft()  # keep the newest look at least a window old as the window's start
        t0, s0 = looks[0]
        if now - t0 < self.window_s:
            return False
        return (seconds - s0) / (now - t0) < self.idle_below

    def __call__(self, left: float) -> bool:
        """Prefetch for at most ``min(left, STEP_S)`` seconds; False once there is nothing left."""
        if self.done:
            return False
        end = time.monotonic() + max(0.0, min(left, STEP_S))
        try:
            while time.monotonic() < end and self.next < self.n:
                if not self._others_idle():
                    pause = min(self.look_s, max(0.0, end - time.monotonic()))
                    time.sleep(pause)
                    self.busy_s += pause
                    continue
                self._read_for(min(end, time.monotonic() + self.look_s))
        except Exception as exc:  # idle work never fails the job: log it and stop prefetching
            log.warning("prefetching stopped after %d samples: %s: %s", self.samples, type(exc).__name__, exc)
            self.done = True
            return False
        if self.next >= self.n:
            self.done = True
        return not self.done

    def _read_for(self, until: float) -> None:
        """Read uncached samples into the cache until ``until`` (monotonic seconds)."""
        t0 = time.monotonic()
        while time.monotonic() < until and self.next < self.n:
            i = self.next
            self.next += 1
            key = self.source.key(i)
            if self.cache.contains(key):
                continue
            # another process reading the sample already is waited for, not read again
            data, cached, here = self.cache.read_through(key, functools.partial(self.source.__getitem__, i))
            if cached and here:
                self.samples += 1
                self.bytes += len(data)
        self.read_s += time.monotonic() - t0


def prefetcher_for(session: Any) -> Prefetcher | None:
    """The session's prefetcher when it should prefetch: ``[plan] prefetch``, a job that waits, its
    leader, and the job planned to start last (the first of the last group); else None."""
    spec = session.spec
    if (spec is None or not spec.plan.prefetch or session.delay <= 0 or not session.is_leader
            or session.calibrating or not spec.dataset.path):
        return None
    if session.job != release_groups(session.delays, list(session.jobs))[-1][0]:
        return None
    if spec.cache.partitioned:
        log.warning("[plan] prefetch does not fill a partitioned [cache] (it would keep other nodes' samples here)")
        return None
    cache = spec.make_cache()
    if cache is None:
        log.warning("[plan] prefetch needs a shared [cache]: not prefetching")
        return None
    return Prefetcher(spec.make_source(), cache)
