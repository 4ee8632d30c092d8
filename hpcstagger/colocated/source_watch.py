"""The passive observer of a run that learns: each job's loop costs and its leader's looks at the source.

When a plan says the run is observed (``RunPlan.learn["observe"]``, set by
:mod:`hpcstagger.stagger.learning` for a spec without a calibration), :func:`attach` gives the
session a passive :class:`~hpcstagger.colocated.jobmeter.LoopMeter`, and each job leader a
:class:`SourceLooks` that records the shared cache's source-read counters. What they write is what
the next plan learns from.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
from typing import Any

from hpcstagger import _io
from hpcstagger.colocated.jobmeter import LoopMeter
from hpcstagger.colocated.watcher import Watcher
from hpcstagger.errors import CacheError
from hpcstagger.stagger.learning import LOOK_S, SERIES_MAX

__all__ = ["SourceLooks", "attach"]

log = logging.getLogger(__name__)


class SourceLooks:
    """A job leader's looks at the shared cache's source-read counters, written to
    ``<dir>/source.<job>.json`` every second and when the process exits."""

    def __init__(self, spec: Any, directory: str, job: str):
        self.watcher = Watcher(spec, "")
        self.path = os.path.join(directory, f"source.{job}.json")
        self.series: list[list[float]] = []
        self.last = 0.0
        self.written = 0.0

    def look(self) -> None:
        """Look now if LOOK_S has passed since the last look (called after each batch)."""
        now = time.time()
        if now - self.last < LOOK_S:
            return
        self.last = now
        try:
            seen = self.watcher.look(0.0, ())
        except (OSError, ValueError, CacheError) as exc:  # learning is advisory: never fail the job
            log.warning("cannot read the shared cache's counters (%s); this run's source is not observed", exc)
            self.last = math.inf
            return
        if seen.read_bytes is None or seen.read_seconds is None:
            return
        if len(self.series) >= SERIES_MAX:
            self.series = self.series[::2]
        self.series.append([round(now, 4), seen.read_bytes, seen.read_seconds])
        if now - self.written >= 1.0:
            self.write()

    def write(self) -> None:
        """Write the series (atomically; a failure is logged: learning is advisory)."""
        self.written = time.time()
        try:
            _io.atomic_write_json(self.path, {"series": self.series}, durable=False)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.path, exc)


def attach(session: Any) -> None:
    """Give ``session`` its passive observer when its plan says the run is observed."""
    directory = (session.plan.learn or {}).get("observe")
    if not directory or session.calibrating:
        return
    looks = None
    if session.is_leader:
        looks = SourceLooks(session.spec, directory, session.job)
        atexit.register(looks.write)
    session.observer = LoopMeter(session, os.path.join(directory, session.job), 0.0, passive=True,
                                 on_batch=looks.look if looks is not None else None)
