"""``calibrate``: measure a :class:`~hpcstagger.model.Scenario` from short runs, within a time budget.

This is the step-factory route: the jobs are ``step(samples)`` callables timed on samples held in
memory. ``hpcstagger calibrate --spec SPEC`` measures each job from its own command instead (see
:mod:`hpcstagger.measure.spec_calibration`); both share the source measurement
(:mod:`hpcstagger.model.source_probe`) and the scenario writing here.

What is measured (the budget, 60 s by default (knob ``calibrate_budget``), is shared out in this
order):

1. **The dataset.** ``len(source)`` samples; the mean bytes of the samples read.
2. **The cache's hit bandwidth**, per reader: against a cache object with ``put(key, data)`` and
   ``get(key)`` (such as hpcstagger's ShmCache) when one is given, else by reading sample-sized
   files in a fresh directory under ``/dev/shm`` (what a node-local cache's hit costs).
3. **The source's aggregate bandwidth with 1, 2, ... k concurrent readers.** k separate processes
   (multiprocessing, ``spawn`` by default) each read their own subset of samples no reader has
   read before, with the files' pages dropped before each level (file sources); after a barrier,
   the bytes read inside the common window divided by its length give one measurement. Reads
   that straddle the window edges count in proportion to their overlap. Every level is measured
   twice; ``bandwidth[k-1]`` is the median of its measurements, each counted by its window (a
   measurement much shorter than its level's longest is not trusted) and ``spread[k-1]`` how far they
   lay apart (:func:`~hpcstagger.model.source_probe.combine_levels`).
4. **Each job's seconds per sample with the data in memory.** Its step function is called on
   batches of samples already read into memory; the first call (warm-up) is not counted.

A source is a map-style, picklable object: ``len(source)``, ``source[i] -> bytes`` and, for the
cache, ``source.key(i)``. A job is a callable ``step(samples: list[bytes])`` that trains on one
batch, for example a closure over the user's model and optimiser that decodes the bytes, runs
forward and backward and steps the optimiser.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from hpcstagger.errors import ConfigError, ModelError
from hpcstagger.model.source_probe import SamplePool, combine_levels, hit_bandwidth, measure_levels, preload
from hpcstagger.model.scenario import POLICIES, Cache, Dataset, Job, Loader, Scenario, Storage
from hpcstagger._io import atomic_write
from hpcstagger import config

__all__ = ["Calibration", "calibrate", "capacity_bytes", "check_out", "source_length", "reader_levels",
           "time_steps", "source_comment", "write_scenario"]

log = logging.getLogger(__name__)

# Shares of the budget: preload + hits, the source, the jobs.
_SHARE_PRELOAD, _SHARE_HITS, _SHARE_SOURCE = 0.10, 0.05, 0.45


@dataclass(frozen=True)
class Calibration:
    """The measured scenario, the raw measurements, and the file written (if any)."""

    scenario: Scenario
    measurements: dict[str, Any] = field(default_factory=dict)
    path: str | None = None


def _time_job(step: Callable[[list[bytes]], Any], samples: list[bytes], batch: int, seconds: float) -> dict[str, Any]:
    """Seconds per sample of ``step`` on in-memory batches (first call excluded)."""
    def batch_at(i: int) -> list[bytes]:
        return [samples[(i * batch + k) % len(samples)] for k in range(batch)]

    step(batch_at(0))  # warm-up
    calls, t_total = 0, 0.0
    start = time.perf_counter()
    while True:
        b = batch_at(calls + 1)
        t0 = time.perf_counter()
        step(b)
        t_total += time.perf_counter() - t0
        calls += 1
        if time.perf_counter() - start >= seconds and calls >= 2:
            break
    return {"sample_time": t_total / (calls * batch), "calls": calls, "batch": batch}


def capacity_bytes(capacity: float | str | None, n: int, sample_bytes: float) -> float:
    """A cache capacity given in bytes or as a percentage of the dataset ("60%"), in bytes (None: 0)."""
    if capacity is None:
        return 0.0
    if isinstance(capacity, str):
        text = capacity.strip()
        try:
            if text.endswith("%"):
                return float(text[:-1]) / 100.0 * n * sample_bytes
            return float(text)
        except ValueError:
            raise ConfigError(f"capacity must be bytes or a percentage of the dataset like '60%', "
                              f"got {capacity!r}") from None
    return float(capacity)


def _check_jobs(jobs: Mapping[str, Callable[[list[bytes]], Any]], known: dict[str, float], policy: str,
                budget: float, batch: int) -> None:
    """Raise ConfigError for bad jobs, known sample times, policy, budget or batch."""
    if not jobs and not known:
        raise ConfigError("calibrate needs at least one job: a mapping name -> step(samples), or known "
                          "seconds per sample (known={name: seconds})")
    for name, value in known.items():
        if name in jobs:
            raise ConfigError(f"job {name!r} is both measured (jobs) and known (known); give it once")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"known sample time of job {name!r} must be > 0 seconds, got {value!r}")
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not budget > 0:
        raise ConfigError(f"budget must be > 0 seconds, got {budget!r}")
    if int(batch) < 1:
        raise ConfigError(f"batch must be >= 1, got {batch!r}")
    for name, step in jobs.items():
        if not callable(step):
            raise ConfigError(f"job {name!r}: expected a callable step(samples), got {type(step).__name__}")


def source_length(source: Any) -> int:
    """``len(source)``; ConfigError if it has none or is empty."""
    try:
        n = len(source)
    except TypeError:
        raise ConfigError(f"the source must support len() and indexing, got {type(source).__name__}") from None
    if n < 1:
        raise ConfigError("the source is empty")
    return n


def reader_levels(readers: int | Sequence[int] | None, default: int) -> list[int]:
    """The reader counts to measure, 1, 2, ... k: ``readers`` (a count or the levels), else 1 ..
    ``default`` (at least 2). Raises ConfigError unless they are consecutive from 1."""
    if readers is None:
        levels = list(range(1, max(2, default) + 1))
    elif isinstance(readers, int):
        levels = list(range(1, max(1, readers) + 1))
    else:
        levels = sorted({int(k) for k in readers})
    if not levels or levels[0] != 1 or levels != list(range(1, levels[-1] + 1)):
        raise ConfigError(f"readers must be 1, 2, ... k (consecutive from 1), got {readers!r}")
    return levels


def time_steps(jobs: Mapping[str, Callable[[list[bytes]], Any]], samples: list[bytes], batch: int,
               seconds: float, bar: Any) -> dict[str, dict[str, Any]]:
    """Each job's seconds per sample on in-memory batches of ``batch`` of ``samples``, ``seconds``
    shared between them, reported on the progress ``bar``. Raises ModelError when a step fails."""
    per_job = max(0.05, seconds / max(1, len(jobs)))
    out: dict[str, dict[str, Any]] = {}
    for name, step in jobs.items():
        bar.set_postfix_str(f"job {name}")
        try:
            out[name] = _time_job(step, samples, int(batch), per_job)
        except Exception as exc:
            raise ModelError(f"job {name!r}: its step raised {type(exc).__name__}: {exc}") from exc
        bar.update(1)
    return out


def _measure(source: Any, n: int, jobs: Mapping[str, Callable[[list[bytes]], Any]], levels: list[int], *,
             budget: float, batch: int, cache: Any, ctx: Any, seed: int, bar: Any,
             t_start: float) -> dict[str, Any]:
    """Steps 1-4 (see the module docstring), reporting each on ``bar``: the raw measurements."""
    meas: dict[str, Any] = {"budget_s": budget, "samples": n}
    # 1. preload samples into memory (they also give the mean sample size)
    bar.set_postfix_str("reading samples into memory")
    read, held = preload(source, n, max(batch, 256), _SHARE_PRELOAD * budget, seed)
    meas["preloaded"] = len(held)
    meas["sample_bytes"] = sum(len(d) for _, d in held) / len(held)
    if meas["sample_bytes"] <= 0:
        raise ConfigError("the source's samples are empty (0 bytes)")
    bar.update(1)

    # 2. cache hits
    bar.set_postfix_str("cache hit bandwidth")
    meas["hits"] = hit_bandwidth(held[:64], cache, _SHARE_HITS * budget)
    bar.update(1)

    # 3. the source with 1, 2, ... readers, on samples no reader (nor the preload) has read
    apart = n - len(read) >= 16 * sum(levels)
    pool = SamplePool(n, seed, exclude=read if apart else ())
    pool.fresh = apart  # too small a dataset: the readers read the preloaded samples again
    meas["source"] = measure_levels(source, pool, levels + levels, _SHARE_SOURCE * budget, ctx, bar)  # twice

    # 4. jobs on in-memory data, in what is left of the budget
    remaining = budget - (time.monotonic() - t_start)
    meas["jobs"] = time_steps(jobs, [d for _, d in held], batch, remaining, bar)
    return meas


def _build_scenario(meas: dict[str, Any], jobs: Mapping[str, Any], known: dict[str, float],
                    epoch_map: dict[str, Any], capacity: float | str | None, policy: str,
                    prefetch: int) -> Scenario:
    """The scenario of the measurements ``meas``: one job per entry of ``epoch_map`` (name -> epochs),
    in its order; those in ``known`` take their given sample time."""
    n, sample_bytes = meas["samples"], meas["sample_bytes"]
    bandwidth, spread, _ = combine_levels(meas["source"])
    hit_bw = meas["hits"]["hit_bandwidth"]
    return Scenario(
        dataset=Dataset(samples=n, sample_bytes=sample_bytes),
        storage=Storage(tuple(bandwidth), spread=tuple(spread)),
        jobs=tuple(Job(name=name, sample_time=meas["jobs"][name]["sample_time"] if name in jobs else float(known[name]),
                       epochs=int(epoch_map[name]), loader_seen=False) for name in epoch_map),
        cache=Cache(capacity=capacity_bytes(capacity, n, sample_bytes), policy=policy,
                    hit_bandwidth=hit_bw if math.isfinite(hit_bw) and hit_bw > 0 else math.inf),
        loader=Loader(prefetch=int(prefetch)))


def source_comment(levels: Sequence[Mapping[str, Any]]) -> str:
    """How the source's bandwidth was measured, for the scenario file: one entry per level."""
    parts = [f"{m['readers']} reader(s): {m['bandwidth'] / 1e6:.1f} MB/s over {m['window_s']:.1f} s"
             for m in levels]
    fresh = all(m.get("fresh", True) for m in levels)
    dropped = any(m.get("dropped_files") for m in levels)
    how = ("fresh samples" if fresh else "some samples read again (small dataset)") + \
        (", page cache dropped before each level" if dropped else "")
    return f"measured with {', '.join(parts)} ({how})"


def check_out(out: str | os.PathLike[str]) -> None:
    """Raise ConfigError unless a scenario can be written to ``out``: not a directory, in an existing,
    writable folder. Called before measuring, so that a bad path costs no measurement."""
    path = os.path.abspath(os.fspath(out))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise ConfigError(f"the output {out} is a directory; give a file path, e.g. "
                          f"-o {os.path.join(out, 'scenario.toml')}")
    if not os.path.isdir(folder):
        raise ConfigError(f"the output's folder {folder} does not exist; create it (mkdir -p {folder}) or give "
                          "another -o")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"the output's folder {folder} is not writable by this user; give another -o")


def write_scenario(out: str | os.PathLike[str], scenario: Scenario, comments: Mapping[str, str],
                   elapsed: float, what: str = "hpcstagger calibrate", notes: Sequence[str] = ()) -> str:
    """Write ``scenario`` to ``out`` atomically with ``comments`` (dotted key -> how it was measured),
    a header line and a comment line per note; return the path."""
    text = (f"# {what}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {elapsed:.0f} s\n"
            + "".join(f"# {note}\n" for note in notes) + scenario.to_toml(comments))
    path = os.fspath(out)
    atomic_write(path, text.encode())
    return path


def _comments(meas: dict[str, Any], jobs: Mapping[str, Any], known: dict[str, float]) -> dict[str, str]:
    """How each value of the factory route's scenario was measured."""
    curve, spread, untrusted = combine_levels(meas["source"])
    comments = {
        "dataset.sample_bytes": f"mean of {meas['preloaded']} samples read",
        "storage.bandwidth": (f"holds {', '.join(f'{b / 1e6:.1f}' for b in curve)} MB/s with 1 .. {len(curve)} "
                              "readers: per level the median of its measurements, each counted by its window "
                              "(each level measured twice)"
                              + untrusted),
        "storage.spread": ("how far each level's measurements lay apart, (max - min) / median: "
                           + ", ".join(f"{x * 100:.0f}%" for x in spread)),
        "cache.hit_bandwidth": f"measured per reader with {meas['hits']['how']}",
    }
    for name in jobs:
        j = meas["jobs"][name]
        comments[f"job.{name}"] = (f"{j['sample_time'] * 1e3:.3f} ms/sample measured over {j['calls']} "
                                   f"in-memory batches of {j['batch']}")
    for name in known:
        comments[f"job.{name}"] = "sample_time given, not measured"
    return comments


def calibrate(source: Any, jobs: Mapping[str, Callable[[list[bytes]], Any]], *,
              epochs: int | Mapping[str, int] = 1, capacity: float | str | None = None, policy: str = "minio",
              readers: int | Sequence[int] | None = None, budget: float | None = None, batch: int = 16,
              prefetch: int = 2, cache: Any = None, out: str | os.PathLike[str] | None = None,
              progress: bool = True, mp_context: str = "spawn", seed: int = 0,
              known: Mapping[str, float] | None = None) -> Calibration:
    """Measure a scenario from ``source`` and ``jobs`` within ``budget`` seconds (see the module docstring;
    default: the ``calibrate_budget`` knob, 60 s).

    ``jobs`` maps job names to step callables; ``epochs`` is a number or a name -> number map.
    ``capacity`` is the cache size in bytes or a percentage of the dataset ("60%"; default none);
    ``readers`` the concurrency levels to measure (default 1 and 2, and up to the number of jobs,
    at most 4). ``cache`` is an object with ``put``/``get`` to time hits against (default: files in
    /dev/shm). With ``out`` the scenario is written there atomically. ``known`` adds jobs whose
    seconds per sample are already known (name -> seconds; not measured). Raises ConfigError
    for bad arguments and ModelError when a measurement fails.
    """
    t_start = time.monotonic()
    if budget is None:
        budget = float(config.get("calibrate_budget"))
    if out is not None:
        check_out(out)
    known = dict(known or {})
    _check_jobs(jobs, known, policy, budget, batch)
    n = source_length(source)
    levels = reader_levels(readers, min(len(jobs) + len(known), 4))
    names = list(jobs) + list(known)
    epoch_map = {name: (epochs.get(name, 1) if isinstance(epochs, Mapping) else epochs) for name in names}

    import multiprocessing
    from tqdm import tqdm

    ctx = multiprocessing.get_context(mp_context)
    bar = tqdm(total=2 + 2 * len(levels) + len(jobs), desc="calibrate", unit="step", file=sys.stderr,
               disable=not progress, leave=True)
    try:
        meas = _measure(source, n, jobs, levels, budget=budget, batch=batch, cache=cache, ctx=ctx, seed=seed,
                        bar=bar, t_start=t_start)
    finally:
        bar.close()

    scenario = _build_scenario(meas, jobs, known, epoch_map, capacity, policy, prefetch)
    meas["elapsed_s"] = time.monotonic() - t_start
    path = write_scenario(out, scenario, _comments(meas, jobs, known), meas["elapsed_s"]) if out is not None else None
    return Calibration(scenario=scenario, measurements=meas, path=path)
