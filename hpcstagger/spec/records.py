"""The record files of a co-located run, and their readers: what each job's leader publishes.

Every job's leader writes two small JSON records into the run directory (``HPCSTAGGER_RUN_DIR``):

- ``<job>.progress.json`` (:func:`progress_path`), written by
  :class:`hpcstagger.colocated.progress.ProgressMeter` every ``progress_interval`` seconds: the
  loop's start, the epoch and batches in it, and a thinned history of ``[seconds, total_batches]``;
- ``<job>.<rank>.json`` (:func:`status_path`), each rank's stage, timings, release and metrics,
  written by :class:`hpcstagger.Session`.

The readers are pure functions of those files: :func:`read_progress`, :func:`read_status`,
:func:`fraction_done` (the fraction of a job's samples done, which the watcher fits the model to),
:func:`throughput` and :func:`startups`. A damaged record reads as None, never as an error.
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Iterable, Mapping

from hpcstagger import _io

__all__ = ["progress_path", "status_path", "read_progress", "read_status", "misshapen_status", "throughput",
           "fraction_done", "startups"]


def progress_path(run_dir: str, job: str) -> str:
    """Where job ``job``'s leader publishes its progress."""
    return os.path.join(run_dir, f"{job}.progress.json")


def status_path(run_dir: str, job: str, rank: int = 0) -> str:
    """Where rank ``rank`` of job ``job`` records its stage and timings (rank 0: the job's leader)."""
    return os.path.join(run_dir, f"{job}.{rank}.json")


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
    record (when its loop began); for a job held at its first batch, which set itself up before
    its release, that set-up (``parked_setup``) as well. Jobs whose loop never began, or whose
    files are unreadable, are left out."""
    out = {}
    for job in jobs:
        record, status = read_progress(run_dir, job), read_status(run_dir, job)
        if record is None or status is None:
            continue
        try:
            begun = float(record.get("loop_start") or "nan")
            released = float(status["t0"]) + float(status["timings"]["started_at"])
            setup = float(status["timings"].get("parked_setup") or 0.0)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if 0.0 <= begun - released < 1e5:
            out[job] = begun - released + setup
    return out
