"""Makespan model for co-located training jobs that share one dataset.

:class:`Scenario` describes the dataset, the shared source, the node-local cache and the jobs;
:func:`predict` is the fast fluid model, :func:`simulate` the sample-level simulator that checks
it, :func:`optimal_plan` picks the start delays, and :func:`calibrate` measures a scenario.

Semantics (followed by the model and the simulator alike):

- Each job runs its epochs; each epoch reads a fresh, independent random permutation of the n
  samples.
- A job's loader fetches one sample at a time, at most ``loader.prefetch`` samples (fetched or in
  flight) ahead of its compute, so I/O and compute overlap: fetch i starts once fetch i-1 is done
  and compute has taken sample i-P; compute takes ``sample_time`` per sample. The loader runs on
  across epoch boundaries.
- A miss reads ``sample_bytes`` from the source. Concurrent misses share the aggregate bandwidth
  for that many readers equally: each of k concurrent reads gets ``bandwidth[k-1] / k``
  (the last listed value holds for more readers), recomputed whenever a read starts or ends.
- A hit costs ``sample_bytes / hit_bandwidth`` and is not shared (unlimited by default: free).
- A miss is inserted when its read completes. minio inserts until the cache is full and never
  changes after; lru inserts and evicts the least recently used sample (a hit makes a sample
  most recently used); none never caches. Two jobs missing the same sample at once both read it.
- The cache holds ``floor(capacity / sample_bytes)`` samples; it starts empty.
"""

from __future__ import annotations

from .calibrate import Calibration, calibrate
from .fluid import Prediction, predict
from .plan import Plan, optimal_plan
from .scenario import Cache, Dataset, Job, Loader, Scenario, Storage
from .simulate import SimResult, simulate

__all__ = ["Scenario", "Dataset", "Storage", "Cache", "Loader", "Job", "Prediction", "predict",
           "SimResult", "simulate", "Plan", "optimal_plan", "Calibration", "calibrate"]
