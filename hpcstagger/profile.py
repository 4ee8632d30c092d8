"""``StallProfiler``: where a training loop's time goes, waiting for data or computing.

In the spirit of DS-Analyzer (Mohan et al., VLDB 2021), the profiler splits each iteration of a
training loop into the time spent **waiting** for the next batch (fetching from storage or the
cache, and any preprocessing the loader's workers do that is not ready in time), time spent
**preparing** data in the loop itself (when the user marks it) and time spent **computing**::

    prof = StallProfiler("resnet")
    for x, y in prof.wrap(loader):      # times next(loader) and the loop body
        with prof.prep():               # optional: data work done in the loop
            x = augment(x)
        train_step(x, y)
    prof.save("resnet.profile.json")

``hpcstagger profile resnet.profile.json [--scenario s.toml]`` then says whether the job is
I/O-bound, prep-bound or compute-bound, and what caching and staggering would gain (with a
scenario, from the makespan model).

Rule: an iteration's stall is its wait plus its marked prep. A job whose stalls are at most
``STALL_THRESHOLD`` (10%) of its time is compute-bound; otherwise it is prep-bound when the marked
prep is at least the wait, else I/O-bound. A wait also includes preprocessing done by loader
workers that fell behind; to tell the two apart, ``hpcstagger calibrate --spec`` measures the loop
and the workers' costs separately for the planner (through ``session.loader(loader)``, which takes
a profiler too: ``session.loader(loader, profiler=prof)``).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from typing import Any
from collections.abc import Callable, Iterable, Iterator

from hpcstagger._io import atomic_write_json, read_json
from hpcstagger.errors import ConfigError
from hpcstagger.model import Cache, optimal_plan, predict

__all__ = ["StallProfiler", "STALL_THRESHOLD", "batch_size_of", "shared_loader_gain"]

STALL_THRESHOLD = 0.10
_FORMAT = "hpcstagger-stall-profile"


def batch_size_of(item: Any) -> int:
    """Samples in a batch: first dimension of a tensor/array, or of the first element of a tuple."""
    probe = item
    if isinstance(item, (tuple, list)) and item and (hasattr(item[0], "shape") or isinstance(item[0], (list, tuple))):
        probe = item[0]
    if isinstance(probe, dict) and probe:
        probe = next(iter(probe.values()))
    shape = getattr(probe, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    if isinstance(probe, (list, tuple)):
        return len(probe)
    return 1


def _count(label: str, v: Any) -> int:
    """``v`` as a whole number >= 0 (numpy's integers too); ConfigError naming ``label`` otherwise."""
    x = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
    if not (math.isfinite(x) and x == int(x) and x >= 0):
        raise ConfigError(f"{label} must be a whole number >= 0, got {v!r}")
    return int(x)


class StallProfiler:
    """Records, per iteration, seconds waiting for data, preparing it (marked) and computing.

    ``warmup`` iterations at the start (loader workers starting, first batches) are recorded but
    left out of :meth:`summary`.
    """

    def __init__(self, name: str = "job", *, warmup: int = 1):
        if not isinstance(name, str) or not name:
            raise ConfigError(f"the profile's name must be a non-empty string, got {name!r}")
        self.name = name
        self.warmup = _count("warmup", warmup)
        self.wait: list[float] = []
        self.prep_time: list[float] = []
        self.compute: list[float] = []
        self.samples: list[int] = []
        self._prep_open = 0.0  # prep seconds marked in the current iteration

    # ---- recording ----------------------------------------------------------------------------
    def record(self, wait: float, compute: float, prep: float = 0.0, samples: int = 1) -> None:
        """Add one iteration by hand (seconds waiting, computing, preparing; samples in the batch)."""
        for label, v in (("wait", wait), ("compute", compute), ("prep", prep)):
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ConfigError(f"{label} must be a finite number of seconds >= 0, got {v!r}")
        n = _count("samples", samples)
        self.wait.append(float(wait))
        self.compute.append(float(compute))
        self.prep_time.append(float(prep))
        self.samples.append(n)

    @contextlib.contextmanager
    def prep(self) -> Iterator[None]:
        """Mark data preparation done in the loop body (it is taken out of the compute time)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._prep_open += time.perf_counter() - t0

    def wrap(self, iterable: Iterable[Any], samples: int | Callable[[Any], int] | None = None) -> Iterator[Any]:
        """Iterate ``iterable`` (a DataLoader, a generator), timing each ``next`` and each loop body.

        ``samples`` gives the batch size (a number or a function of the batch); by default it is
        the first dimension of the batch (or of its first element).
        """
        it = iter(iterable)
        body_start = None
        wait = 0.0
        n = 1
        while True:
            t0 = time.perf_counter()
            if body_start is not None:
                prep, self._prep_open = self._prep_open, 0.0
                self.record(wait, max(0.0, t0 - body_start - prep), prep, n)
            try:
                item = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            wait = t1 - t0
            n = samples(item) if callable(samples) else (int(samples) if samples else batch_size_of(item))
            self._prep_open = 0.0
            body_start = time.perf_counter()
            yield item

    # ---- results ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Totals, shares and the verdict over the iterations after the warm-up."""
        k = min(self.warmup, max(len(self.wait) - 1, 0))
        wait, prep, comp, samp = (self.wait[k:], self.prep_time[k:], self.compute[k:], self.samples[k:])
        total_wait, total_prep, total_comp = sum(wait), sum(prep), sum(comp)
        total = total_wait + total_prep + total_comp
        n = sum(samp)
        out: dict[str, Any] = {
            "name": self.name, "iterations": len(wait), "warmup_left_out": k, "samples": n,
            "seconds": total, "wait_s": total_wait, "prep_s": total_prep, "compute_s": total_comp,
            "wait_share": total_wait / total if total > 0 else 0.0,
            "prep_share": total_prep / total if total > 0 else 0.0,
            "compute_share": total_comp / total if total > 0 else 0.0,
            "compute_per_sample_s": total_comp / n if n else math.nan,
            "prep_per_sample_s": total_prep / n if n else math.nan,
            "samples_per_s": n / total if total > 0 else math.nan,
            "prep_marked": any(p > 0 for p in self.prep_time),
        }
        stall = out["wait_share"] + out["prep_share"]
        if not wait:
            out["verdict"] = "no data"
        elif stall <= STALL_THRESHOLD:
            out["verdict"] = "compute-bound"
        elif total_prep >= total_wait:
            out["verdict"] = "prep-bound"
        else:
            out["verdict"] = "I/O-bound"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": _FORMAT, "version": 1, "name": self.name, "warmup": self.warmup,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "iterations": {"wait": self.wait, "prep": self.prep_time, "compute": self.compute,
                               "samples": self.samples}}

    def save(self, path: str) -> None:
        """Write the profile as JSON, atomically."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> StallProfiler:
        """Rebuild a profile from :meth:`to_dict`'s output; raises ConfigError naming what is wrong."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ConfigError(f"not a stall profile (expected \"format\": \"{_FORMAT}\"); write one with "
                              "StallProfiler.save")
        if data.get("version") != 1:
            raise ConfigError(f"stall profile version {data.get('version')!r} is not supported (1 is)")
        prof = cls(str(data.get("name") or "job"), warmup=data.get("warmup", 1))
        it = data.get("iterations")
        if not isinstance(it, dict):
            raise ConfigError("stall profile: missing \"iterations\"")
        cols = [it.get(k) for k in ("wait", "prep", "compute", "samples")]
        lists = [c for c in cols if isinstance(c, list)]
        if len(lists) != len(cols) or len({len(c) for c in lists}) != 1:
            raise ConfigError("stall profile: \"iterations\" needs lists wait, prep, compute and samples of one length")
        for w, p, c, s in zip(*lists, strict=True):
            prof.record(w, c, p, s)
        return prof

    @classmethod
    def load(cls, path: str) -> StallProfiler:
        """Read a profile written by :meth:`save`. Raises ConfigError for a missing or bad file."""
        try:
            data = read_json(path)
        except OSError as exc:
            raise ConfigError(f"cannot read stall profile {path!r}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"stall profile {path!r} is not valid JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


def shared_loader_gain(summary: dict[str, Any], jobs: int) -> dict[str, Any]:
    """What a shared loader (:mod:`hpcstagger.loader`) would gain ``jobs`` co-located jobs like this one.

    The estimate assumes the stall (waiting plus marked prep) is work that sharing divides among the
    jobs: batch preparation, in the loop or in DataLoader workers that fell behind, and reads. One
    producer prepares each batch once for all ``jobs``, so an iteration takes ``compute + stall /
    jobs`` instead of ``compute + stall``. The speedup applies to each job and to their aggregate
    throughput. A stall that is storage bandwidth alone is the shared cache's to remove first.
    """
    if jobs < 1:
        raise ConfigError(f"jobs must be >= 1, got {jobs}")
    comp, stall = summary["compute_s"], summary["wait_s"] + summary["prep_s"]
    total = comp + stall
    speedup = total / (comp + stall / jobs) if total > 0 and comp + stall / jobs > 0 else 1.0
    verdict = summary.get("verdict")
    return {"jobs": jobs, "speedup": speedup, "recommended": bool(verdict == "prep-bound" and jobs > 1),
            "worth_trying": bool(verdict == "I/O-bound" and jobs > 1)}


def estimate_gains(summary: dict[str, Any], scenario: Any = None, job: str | None = None,
                   jobs: int | None = None) -> dict[str, Any]:
    """What caching, staggering and a shared loader would gain this job, from its profile summary.

    ``jobs``: how many co-located jobs would share a loader (default: the scenario's jobs, else 2).

    Without a scenario: an upper bound for caching (every wait removed) and no estimate for
    staggering. With a scenario: the job's measured seconds per sample (compute plus marked prep)
    replaces the scenario's, and the model predicts the makespan with no cache, with the
    scenario's cache at a simultaneous start, and with the cache and the delays planned for
    exact starts (the gain staggering can give).
    """
    out: dict[str, Any] = {"caching_upper_bound": summary["wait_share"]}
    n_jobs = jobs if jobs is not None else (len(scenario.jobs) if scenario is not None else 2)
    out["shared_loader"] = shared_loader_gain(summary, n_jobs)
    if scenario is None:
        return out
    from dataclasses import replace

    name = job or summary["name"]
    if name not in scenario.job_names:
        raise ConfigError(f"job {name!r} is not in the scenario (jobs: {', '.join(scenario.job_names)}); "
                          "give --job NAME to match the profile to one")
    per_sample = summary["compute_per_sample_s"] + summary["prep_per_sample_s"]
    if not per_sample > 0:
        raise ConfigError("the profile has no compute time per sample to put into the scenario")
    new_jobs = tuple(replace(j, sample_time=per_sample) if j.name == name else j for j in scenario.jobs)
    sc = replace(scenario, jobs=new_jobs)
    no_cache = predict(replace(sc, cache=Cache(0.0, "none")), series=False)
    cached = predict(sc, series=False)
    plan = optimal_plan(sc, jitter=0.0)  # what staggering can gain: exact starts
    out.update({
        "job": name, "sample_time": per_sample,
        "no_cache": no_cache.makespan, "cache": cached.makespan, "planned": plan.makespan,
        "delays": plan.delays, "job_finish": {"no_cache": no_cache.finish[name], "cache": cached.finish[name],
                                              "planned": plan.finish[name]},
        "caching_gain": 1 - cached.makespan / no_cache.makespan,
        "staggering_gain": 1 - plan.makespan / cached.makespan,
    })
    return out
