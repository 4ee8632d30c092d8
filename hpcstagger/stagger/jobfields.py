"""Turning a job's measurement files into the scenario's job fields (pure).

The files are those of :class:`~hpcstagger.colocated.jobmeter.LoopMeter` and
:class:`~hpcstagger.colocated.jobmeter.SampleMeter`: ``hpcstagger calibrate --spec`` reads them
after each job's calibration run, and a learning run (:mod:`hpcstagger.stagger.learning`) after a
run measured passively.
"""

from __future__ import annotations

import math
import os
from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger import _io
from hpcstagger.errors import ModelError

__all__ = ["SAMPLE_FIELDS", "HANDOFF_QUANTILE", "PROBE_EVERY", "STEP_DRIFT_WARN", "read_reports", "job_fields",
           "quantile", "startup_of"]

PROBE_EVERY = 4         # every 4th measured batch is fetched when it is surely ready: a pure handoff
HANDOFF_QUANTILE = 0.10
STEP_DRIFT_WARN = 1.5   # the last third's median step over the first third's from which the output warns
DRIFT_MIN_BATCHES = 12  # fewer measured batches than this: no drift is computed
SAMPLE_FIELDS = ("hits", "hit_bytes", "hit_get_s", "hit_transform_s", "misses", "miss_bytes", "miss_get_s",
                 "miss_read_s", "miss_read_cpu_s", "miss_insert_s", "miss_transform_s", "collates", "collate_samples",
                 "collate_s", "cpu_s")

def read_reports(directory: str) -> dict[str, Any]:
    """A job's calibration files: ``job`` (None when the job never called session.loader),
    ``loops`` (by rank) and ``samples`` (one per process)."""
    def load(name: str) -> Any:
        try:
            return _io.read_json(os.path.join(directory, name))
        except (OSError, ValueError):
            return None

    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    loops = [x for x in (load(n) for n in names if n.startswith("loop.") and n.endswith(".json")) if x]
    samples = [x for x in (load(n) for n in names if n.startswith("samples.") and n.endswith(".json")) if x]
    return {"job": load("job.json"), "loops": sorted(loops, key=lambda x: x["rank"]), "samples": samples}


def startup_of(job: Mapping[str, Any]) -> float:
    """A job's start-up from its ``job.json`` report: its set-up before its loop's first pass, and
    that pass's ``iter`` (starting the loader's workers)."""
    return float(job.get("setup_s") or 0.0) + float((job.get("iter_s") or [0.0])[0])


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _sum_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    return {f: float(sum(s.get(f, 0) for s in samples)) for f in SAMPLE_FIELDS}


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


def _full_speed(record: Sequence[float]) -> float:
    """A batch's step at full speed: its wall time, or its CPU time when less (records without CPU: wall)."""
    wall = float(record[1])
    if len(record) > 6 and record[6] > 0:
        return min(wall, float(record[6]))
    return wall


def _thirds(steps: Sequence[float]) -> tuple[float, float]:
    """The median step of the first and of the last third of the measured batches (both the overall
    median with fewer than DRIFT_MIN_BATCHES)."""
    if len(steps) < DRIFT_MIN_BATCHES:
        mid = quantile(steps, 0.5)
        return mid, mid
    k = len(steps) // 3
    return quantile(steps[:k], 0.5), quantile(steps[-k:], 0.5)


def _prep_time(c: Mapping[str, float], samples: Sequence[Mapping[str, Any]], workers: int,
               counted: Mapping[str, Any]) -> tuple[float, float, bool]:
    """``prep_time``, the workers' CPU per sample, and whether both came from the loop's own count."""
    done = c["hits"] + c["misses"]
    prep = _div(c["hit_transform_s"] + c["miss_transform_s"], done)
    if workers > 0:
        prep += _div(c["collate_s"], c["collate_samples"])
    w = _sum_samples([x for x in samples if x.get("worker")])
    w_done = w["hits"] + w["misses"]
    worker_cpu = _div(w["cpu_s"], w_done)
    if workers > 0 and w["cpu_s"] > 0 and w_done:
        spent = w["hit_get_s"] + w["miss_get_s"] + w["miss_insert_s"] + w["miss_read_cpu_s"]
        prep = max(0.0, worker_cpu - _div(spent, w_done))
    from_workers = workers > 0 and not done and counted.get("samples", 0) > 0 and counted.get("cpu_s", 0) > 0
    if from_workers:  # no CachedDataset counted the samples (an ImageFolder, say): the workers' CPU per sample
        worker_cpu = prep = float(counted["cpu_s"]) / float(counted["samples"])
    return prep, worker_cpu, from_workers


def job_fields(name: str, job: Mapping[str, Any], loops: Sequence[Mapping[str, Any]],
               samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The scenario's fields for job ``name`` from its calibration files (see :func:`read_reports`).

    - ``sample_time``: the step per sample of the whole job at full speed. Per batch and rank the
      step is its wall time, or its process's CPU time when less (the job's own workers took the
      core for a while: the model shares the cores itself); per batch, the shortest of the ranks'
      (a rank that waited longer for its data made the others wait in the all-reduce), averaged
      over the measured batches, over ``ranks * batch`` samples;
    - ``handoff``: with workers, a low quantile (10%) of the waits in ``next()``: a wait is the
      handoff of a ready batch plus any time the batch was not ready yet, and every
      PROBE_EVERY-th batch is fetched when it surely is ready, so the low quantile is the handoff
      alone, without the bias of a minimum (timer and scheduler noise). Without workers the main
      process loads each batch itself, and the handoff is its collate per batch;
    - ``prep_time``: a worker's seconds per sample besides reading the bytes: with workers, their
      CPU seconds per sample less the lookups' and inserts' time and the reads' CPU (transform,
      collate, handing the batch over), or without CPU records the transform and the collate's
      share; without workers the transform. A hit costs it as much as a miss. Where no
      CachedDataset counted samples (an ImageFolder over ``cache.file_loader()``, any other
      Dataset), the DataLoader workers' CPU seconds per sample over the measured batches, as the
      job's loop counted them (``worker_cpu`` in ``job.json``), reads and decode included;
    - ``read_cpu``: the CPU seconds of a read from the source in the process that misses (the
      source's own work: a file system's copies, a format's decoding of its container);
    - ``miss_overhead``: what a miss costs besides the source's own read (the lookup and insert);
    - ``startup``: from the job's start (after its planned wait) to its loop's first batch request:
      its backend, model and DDP set-up, and starting the loader (``iter``, which spawns workers);
    - ``epoch_start``: a later epoch's ``iter``: the first one's when the workers are not
      persistent (they are spawned again every epoch), else nothing;
    - ``order``: the sampler's order (:func:`sampler_order`): jobs with the same one read the
      same permutation each epoch;
    - ``step_drift``: the median step of the last third of the measured batches over that of the
      first third (``step_first_s``, ``step_last_s``): well above 1 when the job's steps slowed while
      it was measured, which ``sample_time`` (their mean) does not say.

    Raises ModelError when no batch was measured after the warm-up.
    """
    shape = job["shape"]
    ranks, workers = int(shape["ranks"]), int(shape["workers"])
    count = min((len(lp["records"]) for lp in loops), default=0)
    rows = [i for i in range(count) if not any(lp["records"][i][3] for lp in loops)]
    if not rows:
        raise ModelError(f"job {name!r} gave no batch after its warm-up of its loader; give it more data or "
                         "a larger calibration budget")
    steps = [min(_full_speed(lp["records"][i]) for lp in loops) for i in rows]
    per_batch = [loops[0]["records"][i][2] for i in rows]
    waits = [lp["records"][i][0] for lp in loops for i in rows]
    c = _sum_samples(samples)
    done = c["hits"] + c["misses"]
    prep, worker_cpu, from_workers = _prep_time(c, samples, workers, job.get("worker_cpu") or {})
    batch = shape.get("batch") or max(1, round(sum(per_batch) / len(per_batch)))
    first_iter = float((job.get("iter_s") or [0.0])[0])
    first, last = _thirds(steps)
    return {
        "sample_time": sum(steps) / (max(1, sum(per_batch)) * ranks),
        "ranks": ranks, "workers": workers, "batch": int(batch), "prefetch": shape.get("prefetch"),
        "handoff": quantile(waits, HANDOFF_QUANTILE) if workers > 0 else _div(c["collate_s"], c["collates"]),
        "prep_time": prep, "worker_cpu_per_sample": worker_cpu, "read_cpu": _div(c["miss_read_cpu_s"], c["misses"]),
        "step_wall_s": sum(min(lp["records"][i][1] for lp in loops) for i in rows) / len(rows),
        "miss_overhead": _div(c["miss_get_s"] + c["miss_insert_s"], c["misses"]),
        "startup": startup_of(job),
        "epoch_start": first_iter if workers > 0 and not shape.get("persistent") else 0.0,
        "order": str(shape.get("order") or ""),
        "batches": len(rows), "step_s": sum(steps) / len(steps), "wait_median_s": quantile(waits, 0.5),
        "step_first_s": first, "step_last_s": last, "step_drift": last / first if first > 0 else 1.0,
        "probes": sum(1 for i in rows if loops[0]["records"][i][4]),
        "hits": int(c["hits"]), "misses": int(c["misses"]), "samples_seen": bool(done),
        "prep_from_workers": from_workers,
        "read_per_miss_s": _div(c["miss_read_s"], c["misses"]),
        "hit_get_s": _div(c["hit_get_s"], c["hits"]),
        "stopped": job.get("stopped") or "its training ended first",
    }
