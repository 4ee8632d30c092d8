"""What each run of a spec measured, kept for the next plan.

When the closed-loop watcher (:mod:`~hpcstagger.colocated.watcher`) ends, it writes one record of what it fitted into
``<workdir>/history/<time>-<pid>-<ns>.json`` (one writer per file, written atomically, so concurrent
runs of a spec never share a file):

- the factors on the calibrated scenario that explained the run: the source's bandwidth
  (``source``) and each running job's CPU costs (``jobs``), relative to the scenario file, which is
  named with its SHA-256 (``scenario``);
- what the source delivered: the mean reads in flight and the bandwidth a read got (``seen``);
- each job's start-up (``startup``): seconds from its release to its loop's first batch request,
  from the run's status and progress files (:func:`hpcstagger.spec.records.startups`). A job whose loop begins
  after the record is written (the last one released) is read from the run directory when the
  history is read, as long as that directory is there (``run_jobs`` names the run's jobs);
- the node (host name, CPU model and count, GPU model if any) and the date.

:func:`corrections` (pure) turns the records into the factors the next plan starts from: only
records made on the same kind of node (CPU model, CPU count and GPU model), against the same
scenario file, after it was written; the most recent record weighs most (each older one half as
much); factors are averaged geometrically and start-ups arithmetically. A calibration measures
a job's start-up once, alone, and it is mostly imports (``torch.optim`` alone takes about a
second), so it can be off by a few tenths of a second; the plan's gap between the jobs' loops
depends on exactly that. A new calibration (a new scenario file) starts a
new history. ``hpcstagger history SPEC`` shows the records; ``--clear`` removes them;
``[plan] history = false`` or ``hpcstagger launch --no-history`` plans without them.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
import socket
import time
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from hpcstagger import _io
from hpcstagger.nodeload import usable_cores
from hpcstagger.spec import runenv
from hpcstagger.spec.records import startups

__all__ = ["plan_history", "describe", "node_identity", "node_kind", "scenario_digest", "history_dir", "write_record",
           "read_history", "corrections", "clear_history"]

log = logging.getLogger(__name__)

VERSION = 1
DECAY = 0.5  # weight of each older record relative to the next newer one


def node_identity() -> dict[str, Any]:
    """This node: host name, CPU model and count (this process's affinity), GPU model or None."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    gpu = None
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as f:
                gpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("Model")), None)
        except OSError:
            continue
        if gpu:
            break
    return {"host": socket.gethostname(), "cpu": cpu, "cores": usable_cores(), "gpu": gpu}


def node_kind(node: Mapping[str, Any]) -> tuple[str, int, str]:
    """What makes two nodes the same kind: CPU model, CPU count, GPU model (a count that is no
    finite number, in a damaged record, is 0: no node's)."""
    cores = node.get("cores") or 0
    count = int(cores) if isinstance(cores, (int, float)) and math.isfinite(cores) else 0
    return (str(node.get("cpu") or ""), count, str(node.get("gpu") or ""))


def scenario_digest(path: str) -> str:
    """SHA-256 of a scenario file ('' when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return ""


def history_dir(workdir: str) -> str:
    """Where a spec's run records live."""
    return os.path.join(workdir, "history")


def write_record(workdir: str, record: Mapping[str, Any], *, path: str | None = None) -> str:
    """Write one run's record (see the module docstring), or replace the record at ``path`` (a run
    whose watcher fitted more after its first record); returns its path."""
    directory = history_dir(workdir)
    os.makedirs(directory, exist_ok=True)
    # the nanoseconds keep two records of one process in one second apart
    path = path or os.path.join(directory, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-"
                                           f"{time.time_ns() % 10**9:09d}.json")
    _io.atomic_write_json(path, _io.json_safe({"version": VERSION, **record}), durable=False)
    return path


def read_history(workdir: str) -> list[dict[str, Any]]:
    """Every readable record, oldest first (unreadable or foreign files are skipped, and logged)."""
    out = []
    for path in sorted(glob.glob(os.path.join(history_dir(workdir), "*.json"))):
        try:
            rec = _io.read_json(path)
        except (OSError, ValueError) as exc:
            log.warning("skipping history record %s: %s", path, exc)
            continue
        if isinstance(rec, dict) and rec.get("version") == VERSION and isinstance(rec.get("time"), (int, float)):
            if not _sound(rec):
                log.warning("skipping history record %s: a field has the wrong type (damaged?)", path)
                continue
            rec["path"] = path
            _fill_startups(rec)
            out.append(rec)
    return sorted(out, key=lambda r: r["time"])


def _sound(rec: Mapping[str, Any]) -> bool:
    """Whether a record's fields have the types a run's watcher writes them with."""
    node = rec.get("node") or {}
    return (isinstance(rec.get("scenario") or {}, dict) and isinstance(node, dict)
            and isinstance(rec.get("run_jobs") or [], list)
            and all(isinstance(rec.get(k) or {}, dict) for k in ("jobs", "startup", "seen"))
            and (rec.get("source") is None or isinstance(rec["source"], (int, float))))


def _fill_startups(rec: dict[str, Any]) -> None:
    """Add the start-ups of the record's jobs that it lacks, from its run directory when that is there."""
    have: dict[str, Any] = rec["startup"] if isinstance(rec.get("startup"), dict) else {}
    missing = [n for n in rec.get("run_jobs") or () if isinstance(n, str) and n not in have]
    if missing and isinstance(rec.get("run_dir"), str) and os.path.isdir(rec["run_dir"]):
        rec["startup"] = {**have, **startups(rec["run_dir"], missing)}


def clear_history(workdir: str) -> int:
    """Remove every record; returns how many."""
    paths = glob.glob(os.path.join(history_dir(workdir), "*.json"))
    for p in paths:
        os.unlink(p)
    return len(paths)


def _geo(values: Sequence[tuple[float, float]]) -> float | None:
    total = sum(w for _, w in values)
    if total <= 0:
        return None
    return math.exp(sum(w * math.log(v) for v, w in values) / total)


def corrections(records: Sequence[Mapping[str, Any]], *, digest: str, kind: tuple[str, int, str],
                since: float) -> dict[str, Any] | None:
    """The factors the next plan starts from (pure): ``{"runs", "source", "jobs", "startup", "latest"}``,
    or None when no record applies (see the module docstring): records on a node of ``kind``,
    against the scenario with SHA-256 ``digest``, made after ``since`` (the file's time)."""
    usable = [r for r in records if r.get("scenario", {}).get("sha256") == digest and digest
              and node_kind(r.get("node") or {}) == kind and float(r.get("time", 0)) > since]
    usable.sort(key=lambda r: float(r["time"]), reverse=True)
    if not usable:
        return None
    weights = [DECAY ** k for k in range(len(usable))]
    source = _geo([(float(r["source"]), w) for r, w in zip(usable, weights, strict=True)
                   if isinstance(r.get("source"), (int, float)) and r["source"] > 0])
    jobs = {n: v for n, pairs in _by_job(usable, weights, "jobs", lambda x: x > 0).items()
            if (v := _geo(pairs)) is not None}
    starts = {n: sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
              for n, pairs in _by_job(usable, weights, "startup", lambda x: x >= 0).items()}
    return {"runs": len(usable), "source": source or 1.0, "jobs": jobs, "startup": starts,
            "latest": float(usable[0]["time"])}


def _by_job(records: Sequence[Mapping[str, Any]], weights: Sequence[float], key: str,
            valid: Callable[[float], bool]) -> dict[str, list[tuple[float, float]]]:
    """Per job named under the records' ``key``: its (value, weight) pairs, from the records whose
    value is a number that is ``valid``; jobs with none are left out."""
    out: dict[str, list[tuple[float, float]]] = {}
    for n in sorted({n for r in records for n in (r.get(key) or {})}):
        pairs = [(float(r[key][n]), w) for r, w in zip(records, weights, strict=True)
                 if isinstance((r.get(key) or {}).get(n), (int, float)) and valid(r[key][n])]
        if pairs:
            out[n] = pairs
    return out


def plan_history(spec: Any, mode: str, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The corrections for planning ``spec`` in ``mode`` on this node (world rank 0 calls this), or
    None: no scenario, ``[plan] history = false``, ``HPCSTAGGER_NO_HISTORY=1``, a mode that does
    not plan, or no record that applies."""
    env = os.environ if environ is None else environ
    if (spec is None or not spec.plan.scenario or not spec.plan.history or mode not in ("plan", "open")
            or env.get(runenv.NO_HISTORY) == "1"):
        return None
    try:
        since = os.path.getmtime(spec.plan.scenario)
        return corrections(read_history(spec.run.workdir), digest=scenario_digest(spec.plan.scenario),
                           kind=node_kind(node_identity()), since=since)
    except OSError as exc:
        log.warning("cannot read the run history of %r, planning without it: %s", spec.run.name, exc)
        return None


def describe(corr: Mapping[str, Any]) -> str:
    """``source x0.80, cnn x1.10; start-up cnn 0.98 s``: :func:`corrections` in one line."""
    jobs = "".join(f", {n} x{v:.2f}" for n, v in sorted((corr.get("jobs") or {}).items()))
    starts = ", ".join(f"{n} {v:.2f} s" for n, v in sorted((corr.get("startup") or {}).items()))
    return f"source x{float(corr.get('source') or 1.0):.2f}{jobs}" + (f"; start-up {starts}" if starts else "")
