"""A job's progress, as its leader's loop sees it, published for the run's watcher.

``session.loader(loader)`` (outside calibration) passes each batch through :class:`ProgressMeter`
on the job's leader. Every ``progress_interval`` seconds, and at the end of each epoch, the meter
writes ``<run_dir>/<job>.progress.json``:

- ``loop_start``: wall time when the loop asked for its first batch (the job's real start);
- ``epoch``: how many epochs the loop has begun (each ``session.loader(...)`` call is one);
- ``batches`` and ``per_epoch``: batches taken in this epoch, and ``len(loader)`` (None when the
  iterable has no length);
- ``total_batches``, ``time``: all batches so far, and when the record was written;
- ``history``: ``[seconds since loop_start, total_batches]`` at each record (at most
  :data:`HISTORY` entries, thinned by half when full), for throughput over any window.

:func:`read_progress` reads the records back; :func:`fraction_done` turns one into the fraction
of the job's samples done, which is what the closed-loop watcher fits the model to.
:func:`read_status` reads a job leader's status record (``<run_dir>/<job>.0.json``, which the
session writes: :func:`status_path`), and :func:`startups` each job's start-up from both. Writing costs
one clock read per batch and one small file every ``progress_interval`` seconds.
"""

from __future__ import annotations

import os
import time
from typing import Any
from collections.abc import Iterable, Iterator, Mapping

from .. import _io, config
from ..errors import ConfigError

HISTORY = 500

__all__ = ["Counted", "ProgressMeter", "progress_path", "read_progress", "fraction_done", "throughput",
           "plain_metrics", "misshapen_status"]


def progress_path(run_dir: str, job: str) -> str:
    """Where job ``job``'s leader publishes its progress."""
    return os.path.join(run_dir, f"{job}.progress.json")


def plain_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``session.finish``'s metrics as JSON values: a tensor or NumPy scalar becomes its number
    (``.item()``, which needs no ``float()`` on a tensor that requires grad), a sequence a list.
    Raises ConfigError naming a metric that is none of these."""
    import json

    out: dict[str, Any] = {}
    for name, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
        elif hasattr(value, "tolist"):
            value = value.tolist()
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            raise ConfigError(f"session.finish: metric {name!r} is a {type(value).__name__}, which a status file "
                              f"cannot hold; pass numbers, strings, lists or dicts of them") from None
        out[name] = value
    return out


def status_path(run_dir: str, job: str, rank: int = 0) -> str:
    """Where rank ``rank`` of job ``job`` records its stage and timings (rank 0: the job's leader)."""
    return os.path.join(run_dir, f"{job}.{rank}.json")


class ProgressMeter:
    """Counts one job's batches on its leader and publishes them (see the module docstring)."""

    def __init__(self, run_dir: str, job: str, *, interval: float | None = None):
        self.path = progress_path(run_dir, job)
        self.job = job
        self.interval = float(config.get("progress_interval") if interval is None else interval)
        self.loop_start: float | None = None
        self.epoch = 0
        self.batches = 0
        self.per_epoch: int | None = None
        self.total = 0
        self._written = 0.0
        self.history: list[list[float]] = []

    def record(self) -> dict[str, Any]:
        """The current progress record."""
        now = time.time()
        if self.loop_start is not None:
            if len(self.history) >= HISTORY:
                self.history = self.history[::2]
            self.history.append([round(now - self.loop_start, 4), self.total])
        return {"job": self.job, "pid": os.getpid(), "loop_start": self.loop_start, "epoch": self.epoch,
                "batches": self.batches, "per_epoch": self.per_epoch, "total_batches": self.total,
                "time": now, "history": self.history}

    def publish(self) -> None:
        """Write the record now (atomically; a failure is ignored: progress is advisory)."""
        self._written = time.monotonic()
        try:
            _io.atomic_write_json(self.path, self.record(), durable=False)
        except OSError:
            pass

    def counted(self, iterable: Iterable[Any]) -> Counted:
        """``iterable``, counted by this meter each time it is iterated."""
        return Counted(iterable, self)

    def wrap(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable``'s items, counted as one epoch of this job's loop."""
        try:
            self.per_epoch = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            self.per_epoch = None
        if self.loop_start is None:
            self.loop_start = time.time()
        self.epoch += 1
        self.batches = 0
        self.publish()
        for item in iterable:
            self.batches += 1
            self.total += 1
            if time.monotonic() - self._written >= self.interval:
                self.publish()
            yield item
        self.publish()


class Counted:
    """An iterable whose iterations a :class:`ProgressMeter` (or any meter with ``wrap(iterable)``)
    counts; ``len()`` and every other attribute are the wrapped iterable's (so
    ``session.loader(loader)`` still looks like ``loader``)."""

    def __init__(self, inner: Iterable[Any], meter: Any):
        self.inner = inner
        self.meter = meter

    def __iter__(self) -> Iterator[Any]:
        return self.meter.wrap(self.inner)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _read_record(path: str) -> dict[str, Any] | None:
    try:
        record = _io.read_json(path)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_progress(run_dir: str, job: str) -> dict[str, Any] | None:
    """Job ``job``'s latest progress record, or None (none yet, or unreadable)."""
    return _read_record(progress_path(run_dir, job))


def read_status(run_dir: str, job: str) -> dict[str, Any] | None:
    """Job ``job``'s leader's latest status record (:func:`status_path`), or None (none yet, or unreadable)."""
    return _read_record(status_path(run_dir, job))


def misshapen_status(rec: Mapping[str, Any]) -> str:
    """The fields of a rank's status record (with ``job`` and ``state``) whose values have not the
    types its writer gives them, comma-separated; "" for a sound record. Readers skip a damaged one."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    timings, release, plan = rec.get("timings", {}), rec.get("release") or {}, rec.get("plan") or {}
    checks = {"job": isinstance(rec.get("job"), str) and isinstance(rec.get("state"), str),
              "rank": number(rec.get("rank", 0)), "delay": number(rec.get("delay", 0.0)),
              "mode": isinstance(rec.get("mode", ""), str), "metrics": isinstance(rec.get("metrics", {}), dict),
              "timings": isinstance(timings, dict) and all(number(v) for v in timings.values()),
              "release": isinstance(release, dict) and all(number(release.get(k, 0.0)) for k in ("at", "planned")),
              "plan": isinstance(plan, dict)
              and all(isinstance(plan.get(k) or {}, dict) for k in ("predicted", "scenario", "curve", "cache", "learn"))
              and all(number(v) for v in (plan.get("predicted") or {}).values())}
    return ", ".join(k for k, ok in checks.items() if not ok)


def throughput(record: dict[str, Any] | None, start: float, end: float) -> float | None:
    """Batches per second of a progress record's history between ``start`` and ``end`` (seconds
    since its loop started; linear between records), or None when the history does not cover it."""
    hist = (record or {}).get("history") or []
    if len(hist) < 2 or end <= start or start < hist[0][0] or end > hist[-1][0]:
        return None

    def at(t: float) -> float:
        for (t0, b0), (t1, b1) in zip(hist, hist[1:], strict=False):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return float(hist[-1][1])

    return (at(end) - at(start)) / (end - start)


def fraction_done(record: dict[str, Any] | None, epochs: int) -> float | None:
    """The fraction of a job's ``epochs`` epochs its loop has done, or None when the record cannot
    say (no record, or an iterable without a length)."""
    if not record or not record.get("per_epoch") or epochs <= 0:
        return None
    begun = int(record.get("epoch") or 0)
    if begun <= 0:
        return 0.0
    within = min(1.0, float(record.get("batches") or 0) / float(record["per_epoch"]))
    return min(1.0, (begun - 1 + within) / epochs)


def startups(run_dir: str, jobs: Iterable[str]) -> dict[str, float]:
    """Each job's start-up in the run ``run_dir``: seconds from its release to its loop's first batch
    request, from its leader's status file (time zero and when it was released) and its progress
    record (when its loop began). Jobs whose loop never began, or whose files are unreadable, are
    left out."""
    out = {}
    for job in jobs:
        record, status = read_progress(run_dir, job), read_status(run_dir, job)
        if record is None or status is None:
            continue
        try:
            begun = float(record.get("loop_start") or "nan")
            released = float(status["t0"]) + float(status["timings"]["started_at"])
        except (ValueError, KeyError, TypeError):
            continue
        if 0.0 <= begun - released < 1e5:
            out[job] = begun - released
    return out
