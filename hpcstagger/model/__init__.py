"""Makespan model for co-located training jobs that share one dataset.

:class:`Scenario` describes the dataset, the shared source, the node-local cache and the jobs;
:func:`predict` is the fast fluid model, :func:`simulate` the sample-level simulator that checks
it, :func:`optimal_plan` picks the start delays, and :func:`calibrate` measures a scenario.
Names are imported on first use, so ``import hpcstagger.model`` imports no numpy;
``hpcstagger.model.simulate`` and ``.calibrate`` are the functions (``importlib.import_module``
gives the modules of the same names).

Semantics (followed by the model and the simulator alike; docs/model.md has them in full):

- Each job runs its epochs; each epoch reads a fresh random permutation of the n samples,
  ``ranks * batch`` samples per step, split between the job's ranks. Jobs with the same
  non-empty ``order`` read the same permutation in the same epoch; others are independent.
- Each rank's loader is a DataLoader: ``workers`` worker processes (0: the main process reads
  each batch itself) fetch whole batches one sample at a time (a lookup, then ``prep_time``), up
  to ``workers * prefetch`` batches in flight; a step starts when every rank's batch is ready and
  the previous step is done, and costs ``handoff`` plus ``sample_time`` per sample. Each epoch's
  pipeline starts empty. A job without loader fields is one reader fetching one sample at a time.
- A miss reads ``sample_bytes`` from the source. Concurrent misses (all jobs, ranks, workers)
  share the aggregate bandwidth for that many readers equally: each of k concurrent reads gets
  ``bandwidth[k-1] / k`` (the last listed value holds for more readers), recomputed whenever a
  read starts or ends. A read also costs its fetcher ``read_cpu`` of CPU work, done while it
  lasts: the read ends when both are done.
- A hit costs ``sample_bytes / hit_bandwidth`` and is not shared (unlimited by default: free).
- A miss is inserted when its read completes. minio inserts until the cache is full and never
  changes after; lru inserts and evicts the least recently used sample (a hit makes a sample
  most recently used); none never caches. Two readers missing the same sample at once both read it,
  unless ``cache.coalesce`` (the page cache, a ShmCache): the second waits for the first's read.
- ``cache.readahead = a`` (the page cache's; 1 by default): a miss reads ``a`` samples' worth of
  bytes, the sample and ``a - 1`` other uncached samples not being read, at random, inserted with it.
- The cache holds ``floor(capacity / sample_bytes)`` samples; it starts with ``cache.initial`` of
  the dataset (a random subset).
- A partitioned cache over M nodes (``cache.partitioned``, ``cache.nodes``) is M such caches, every
  sample owned by one node, where its miss is inserted and its lookups look: the scenario's jobs
  and source are those of all M nodes, the jobs' ranks spread evenly, and a hit is local (the
  fetcher's node owns it, probability 1/M) or remote, ``sample_bytes / remote_bandwidth``.
- With ``[node] cores = C`` the CPU is processor-shared too: each rank's step, each sample's CPU
  work in its fetcher (hit time or ``read_cpu``, and ``prep_time``) and each rank's start-up are tasks; while
  tasks totalling k run, each runs at ``min(1, C / k)`` of its speed.
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Scenario": "hpcstagger.model.scenario",
    "Dataset": "hpcstagger.model.scenario",
    "Storage": "hpcstagger.model.scenario",
    "Cache": "hpcstagger.model.scenario",
    "Loader": "hpcstagger.model.scenario",
    "Node": "hpcstagger.model.scenario",
    "Job": "hpcstagger.model.scenario",
    "Prediction": "hpcstagger.model.fluid",
    "predict": "hpcstagger.model.fluid",
    "SimResult": "hpcstagger.model.simulate",
    "simulate": "hpcstagger.model.simulate",
    "Plan": "hpcstagger.model.plan",
    "optimal_plan": "hpcstagger.model.plan",
    "Calibration": "hpcstagger.model.calibrate",
    "calibrate": "hpcstagger.model.calibrate",
}

__all__ = ["Scenario", "Dataset", "Storage", "Cache", "Loader", "Node", "Job", "Prediction", "predict",
           "SimResult", "simulate", "Plan", "optimal_plan", "Calibration", "calibrate"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
