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

The readers of these records, and of each rank's status file, are in
:mod:`hpcstagger.spec.records`. Writing costs one clock read per batch
and one small file every ``progress_interval`` seconds.
"""

from __future__ import annotations

import os
import time
from typing import Any
from collections.abc import Iterable, Iterator

from hpcstagger import _io, config
from hpcstagger.errors import ConfigError
from hpcstagger.spec.records import progress_path

HISTORY = 500

__all__ = ["Counted", "ProgressMeter", "plain_metrics"]


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
