"""The closed loop's fits after the last release, for the history (pure, like :mod:`.steering`).

A job that waited for its release was never fitted before its loop began, and its first windows
often cannot tell its costs: it follows another job through the cache in its first epoch (slowed
down, it hits more), or something else bounds it. Yet its costs decide where it catches its leader
up, and with it the best stagger: on an emulated pair of 0-worker jobs, a CNN calibrated 15 to 25%
slower than it then ran was planned on the edge of that cliff. Once the source reads stop (a cache
that holds the dataset is full), every job reads what is cached on its own costs, so
:class:`LateFits` fits each such job over its progress since then (:meth:`Steering.fit_jobs`: the
rate at which it went through those samples, which near its end a fixed window's progress cannot
tell, as a faster job finishes and shows less of it), and once more over its whole record when it
has ended. The watcher's thread after the releases (:mod:`~hpcstagger.colocated.watcher`) calls it
at every look and rewrites the run's history record with what it fits.
"""

from __future__ import annotations

import math
import time

from hpcstagger.stagger.releases import Look
from hpcstagger.stagger.steering import FIT_WINDOW, Steering, window_start

__all__ = ["LATE_WINDOW", "LateFits"]

LATE_WINDOW = 0.5  # seconds of progress since the source reads stopped, at least, that a fit takes


class LateFits:
    """Fits, for ``steering`` (its factors), each running job that waited for its release until a fit
    tells its costs (:attr:`seen`; it replaces what earlier windows fitted), over its progress since
    the source reads stopped: its latest ``FIT_WINDOW`` seconds once it has them, every ``interval``
    seconds at most (and as ``duty`` paces re-fits), or all it has, ``LATE_WINDOW`` at least, when it
    has ended."""

    def __init__(self, steering: Steering):
        self.st = steering
        self.at, self.gap = -math.inf, steering.interval  # the last fit, and the time until the next
        self.ended: set[str] = set()  # jobs seen to end (fitted one last time)
        self.seen: set[str] = set()  # jobs whose costs a fit here has told
        self.bytes: tuple[float | None, float] = (None, math.inf)  # the source's read bytes, and since when

    def observe(self, look: Look, t0_wall: float) -> bool:
        """Fit what is due at ``look``; True when no job is left to fit (or the run has no cache)."""
        st = self.st
        loop_starts = st.loop_starts_at(look, t0_wall)
        waited = [n for n in st.released if n not in self.seen | self.ended and n not in st.groups[0]]
        ended = [n for n in waited if look.state.get(n) in ("done", "exited")]
        self.ended.update(ended)  # an ended job's whole record: one last fit, whatever the pace
        todo = [n for n in waited if n in loop_starts]  # a job whose loop has not begun yet: later
        if look.read_bytes is None:
            return True
        if look.read_bytes != self.bytes[0]:  # the source still reads: the window starts later
            self.bytes = (look.read_bytes, look.t)
        since = self.bytes[1]

        def window(n: str) -> float:
            tb = float(((look.progress.get(n) or {}).get("history") or [[0.0]])[-1][0])
            return tb - window_start(tb, loop_starts[n], since)

        # a full window, or all there was once the job ended (a half-second window fitted cnn at x0.59 once)
        ready = [n for n in todo if window(n) >= (LATE_WINDOW if n in ended else FIT_WINDOW - 1e-9)]
        if ready and (ended or look.t >= self.at + self.gap):
            cpu, spent, before = time.thread_time(), st.cpu_clock() if st.duty > 0 else 0.0, dict(st.alpha)
            self.at = look.t
            self.seen |= st.fit_jobs(look, loop_starts, only=ready, min_window=LATE_WINDOW, since=since)
            if st.alpha != before:
                st.fits.append({"t": look.t, "loops": dict(loop_starts), "seen": dict(st.source_seen),
                                "source": st.beta, "jobs": dict(st.alpha), "after_release": True,
                                "late": sorted(n for n in ready if n in self.seen), "since": since})
            st.cpu_seconds += time.thread_time() - cpu
            if st.duty > 0:  # the jobs' cores: fits that cost c CPU-s come c / duty apart at the soonest
                self.gap = max(st.interval, (st.cpu_clock() - spent) / st.duty)
        return all(n in self.seen | self.ended for n in waited)
