"""``predict``: the fluid, rate-based makespan model of a scenario.

Samples are treated as a continuum and every job reads at a rate (samples/s) that changes only as
the cache and the other jobs change. The rules, all following the semantics stated in
:mod:`hpcstagger.model`:

- **Rate.** At every instant a running job reads at the rate its prefetch pipeline sustains: the
  lower of its compute rate and its loader's rate, less the loss a small prefetch buffer causes
  when fetch times vary (runs of hits fill the buffer and block the loader, runs of misses drain
  it and stall compute). The loss is tabulated from the exact recursion of the pipeline
  (:mod:`._pipeline`) for two fetch times, a hit or a miss; a miss's time also varies with how
  many other jobs read at once, so the table is given the two-point fetch time with the same mean
  and variance. With no variation, or a deep buffer, it is the plain ``min``. A job's DataLoader
  (workers, batches, ranks, hand-off, prep) enters through :mod:`._loader`: the pipeline's unit is
  then a step, and every epoch pauses the job while its empty pipeline fills.
- **Hit fraction.** A job's hit fraction is (cached samples it has yet to read this epoch) /
  (samples it has yet to read this epoch). It is the cached fraction when the job starts an
  epoch, grows when another job inserts a sample this job has yet to read, stays put on average
  as the job reads in random order, and (lru) shrinks when an eviction takes a sample the job has
  yet to read. The model keeps the joint state, how many samples each subset of jobs has yet to
  read, cached or not (and for lru in blocks ordered by last use), so the correlations between
  jobs are exact in expectation.
- **Bandwidth.** Misses share the source: each of k concurrent reads gets ``bandwidth[k-1] / k``.
  Each fetcher (a worker, or a rank without workers) alternates between reading a miss and
  "thinking" (hits, compute, a full buffer); the
  fraction of time each job reads and the bandwidth its reads get come from the product-form law
  of this processor-sharing network. When the aggregate bandwidth does not depend on the number
  of readers this is max-min fair sharing of a work-conserving source; the product form also
  captures that overlapping reads last longer, hence overlap more.
- **Partitioned cache.** A cache partitioned over M nodes is one cache of their total capacity;
  a hit takes the mean of a local hit (probability 1/M) and a remote one, and the spread of
  the two goes into the pipeline's fetch-time variance as a miss's does.
- **Integration.** Between events (job starts, epoch ends, the cache filling up) the rates are
  constant when the cache contents do not change (minio once full, no cache, lru holding the
  whole dataset), and the model jumps from event to event exactly. While minio fills or lru
  evicts, the state is integrated with adaptive second-order (midpoint) steps.

A single job's prediction is the closed form ``delay + sum over epochs of n * T(h_e)``, where
``T(h)`` is the pipeline's time per sample at hit fraction h, with ``h = 0`` in the first epoch
and ``min(capacity, n) / n`` after it (minio; lru with c < n samples: the hit fraction falls as
``(c - k) / (n - k)`` over the k-th sample of the epoch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence

from hpcstagger.errors import ModelError
from hpcstagger.model import _engine, _quality
from hpcstagger.model.scenario import Scenario

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    """The fluid model's answer for one set of delays.

    ``makespan`` and ``finish`` (job name -> seconds from the common start) are the prediction;
    ``start`` repeats the delays. The time series, sampled at ``times`` (seconds), are for plots:
    ``progress`` (fraction of a job's samples read), ``hit_rate`` (the job's hit fraction, nan
    while it is not running), ``bandwidth`` (bytes/s read from the source) and ``cached``
    (fraction of the dataset in the cache).
    """

    makespan: float
    finish: dict[str, float]
    start: dict[str, float]
    times: tuple[float, ...] = ()
    progress: dict[str, tuple[float, ...]] = field(default_factory=dict)
    hit_rate: dict[str, tuple[float, ...]] = field(default_factory=dict)
    bandwidth: tuple[float, ...] = ()
    cached: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        """The prediction as plain JSON-able types (the time series included)."""
        def clean(values: tuple[float, ...]) -> list[float | None]:
            return [None if math.isnan(v) else v for v in values]

        return {"makespan": self.makespan, "finish": dict(self.finish), "start": dict(self.start),
                "times": list(self.times), "progress": {k: list(v) for k, v in self.progress.items()},
                "hit_rate": {k: clean(v) for k, v in self.hit_rate.items()},
                "bandwidth": list(self.bandwidth), "cached": list(self.cached)}


def predict(scenario: Scenario, delays: Mapping[str, float] | Sequence[float] | None = None, *,
            series: bool = True) -> Prediction:
    """Predict every job's finish time and the makespan when job j starts ``delays[j]`` seconds late.

    ``delays`` is a dict job name -> seconds (missing names start at 0) or a sequence in job order;
    None starts every job at once. With ``series=False`` the time series are left empty. Raises
    ConfigError for bad delays, ModelError for more jobs than the model tracks (12) or a state it
    cannot integrate.
    """
    d = scenario.delay_vector(delays)
    eng = _engine.Engine(scenario, _quality.FINE, record=series)
    finish = eng.run(d)
    if not all(math.isfinite(t) for t in finish):
        raise ModelError("the fluid model did not finish every job; please report this scenario")
    names = scenario.job_names
    out = Prediction(makespan=max(finish), finish=dict(zip(names, finish, strict=True)),
                     start=dict(zip(names, d, strict=True)))
    if series and eng.series:
        rows = eng.series
        out = Prediction(
            makespan=out.makespan, finish=out.finish, start=out.start, times=tuple(r[0] for r in rows),
            progress={nm: tuple(r[1][j] for r in rows) for j, nm in enumerate(names)},
            hit_rate={nm: tuple(r[2][j] for r in rows) for j, nm in enumerate(names)},
            bandwidth=tuple(r[3] for r in rows), cached=tuple(r[4] for r in rows))
    return out
