"""The scenario of a spec's calibration (pure): its measurements in, the scenario and a comment
per value out (:func:`build_scenario`), for ``hpcstagger calibrate --spec``
(:mod:`hpcstagger.measure.spec_calibration`) and a learning run (:mod:`hpcstagger.stagger.learning`).

Every comment states the value the file holds, never an intermediate figure: ``[storage]
bandwidth`` holds the source's curve as the jobs see it (each level the median of its repeated
measurements, each counted by its window, with the cost a miss adds in the jobs folded in), and says so; the raw
measurements stay in the reports' ``measurements.json``. ``[storage] spread`` holds how far each
level's measurements lay apart.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from hpcstagger import config
from hpcstagger.errors import ConfigError
from hpcstagger.model.calibrate import capacity_bytes
from hpcstagger.model.source_probe import SPREAD_LIMIT, combine_levels
from hpcstagger.model.scenario import POLICIES, Cache, Dataset, Job, Loader, Node, Scenario, Storage
from hpcstagger.spec.cachesize import size_cache
from hpcstagger.spec.jobspec import Spec
from hpcstagger.model.runfit import counted_factor
from hpcstagger.stagger.steering import MIN_READS
from hpcstagger.stagger.jobfields import STEP_DRIFT_WARN

__all__ = ["BASELINE_RANGE", "build_scenario", "describe_job", "fit_baseline", "jobs_memory", "scenario_cache",
           "scenario_job", "source_read_cpu", "source_note", "fold_miss_overhead"]

BASELINE_RANGE = (0.5, 2.0)  # a fit baseline outside this is not a read pattern's: it is not used


def describe_job(f: Mapping[str, Any]) -> str:
    """One line: what a job's calibration measured."""
    loader = (f"{f['workers']} worker(s), prefetch {f['prefetch']}" if f["workers"] else "main-process loading")
    return (f"{f['batches']} batches on {f['ranks']} rank(s), batch {f['batch']}, {loader}: "
            f"{f['sample_time'] * 1e3:.3f} ms/sample, handoff {f['handoff'] * 1e3:.2f} ms/batch, "
            f"start-up {f['startup']:.2f} s (epoch restart {f['epoch_start']:.2f} s), "
            f"order {f.get('order') or 'its own'}, "
            f"prep {f['prep_time'] * 1e3:.3f} ms/sample, "
            + (f"a read's CPU {f.get('read_cpu', 0.0) * 1e3:.3f} ms, " if f["misses"] else
               "no source read (a read's CPU from the jobs that read), ")
            + f"miss overhead {f['miss_overhead'] * 1e3:.3f} ms "
            f"({f['hits']} hits, {f['misses']} misses; stopped: {f['stopped']})"
            + (f"; memory {f['memory'] / 1e6:.0f} MB anonymous"
               + (f" ({f['memory_producer'] / 1e6:.0f} MB its shared loader's producer)"
                  if f.get("memory_producer")
                  else "")
               + f", {f.get('memory_file', 0) / 1e6:.0f} MB mapped files" if f.get("memory") else "")
            + ("" if f["samples_seen"] else
               "; no CachedDataset sample costs seen: prep is its DataLoader workers' CPU per sample, reads and "
               "decode included, and the miss overhead is not measured" if f.get("prep_from_workers") else
               "; no CachedDataset sample costs seen (a loader that is no DataLoader over a CachedDataset, or "
               "workers started before session.loader): prep and miss overhead not measured")
            + _drift_note(f))


def _drift_note(f: Mapping[str, Any]) -> str:
    """A warning when the job's steps slowed while it was measured ('' otherwise)."""
    drift = float(f.get("step_drift") or 1.0)
    if drift < STEP_DRIFT_WARN:
        return ""
    return (f"; WARNING: its steps slowed while measured, the last third of the batches {drift:.1f}x as long as the "
            f"first (median {f['step_last_s'] * 1e3:.1f} against {f['step_first_s'] * 1e3:.1f} ms), and the scenario "
            "takes their mean, so its runs may differ from the plan: a model computing on denormal floats once it "
            "fits its data is one cause (torch.set_flush_denormal(True) in the script removes it), other work "
            "starting on the node another")


def _finite(bw: float) -> float:
    return bw if math.isfinite(bw) and bw > 0 else math.inf


def scenario_cache(meas: Mapping[str, Any], spec: Spec, capacity: float | str | None,
           policy: str | None) -> tuple[Cache, dict[str, str]]:
    """The scenario's cache, and how its capacity and hit bandwidth were found (comments)."""
    n, size, pc = meas["samples"], meas["sample_bytes"], meas["page_cache"]
    shm = meas["hits"]["hit_bandwidth"]
    if pc["holds"]:
        page = pc["hit_bandwidth"]
        has_shm = spec.cache.capacity > 0 and spec.cache.policy != "none"
        notes = {"cache.capacity": f"the page cache: the dataset ({pc['dataset_bytes'] / 1e6:.0f} MB) is below half "
                                   f"of the available memory ({pc['mem_available'] / 1e6:.0f} MB: MemAvailable, or "
                                   "the memory cgroup's room if smaller), so the node keeps all of it once read, a "
                                   "cache shared by every job",
                 "cache.hit_bandwidth": f"the page cache's ({page / 1e9:.2f} GB/s, {pc['how']})" +
                                        (f" or the ShmCache's ({shm / 1e9:.2f} GB/s), the slower" if has_shm else "")}
        hit = min(page, shm) if has_shm else page
        notes["cache.coalesce"] = "the page cache: a reader of a page being read waits for that read"
        ahead = pc.get("readahead", {"readahead": 1.0, "how": "not measured"})
        notes["cache.readahead"] = f"samples' worth of bytes one random read brings into the page cache: {ahead['how']}"
        return Cache(capacity=n * size, policy="minio", hit_bandwidth=_finite(hit), coalesce=True,
                     readahead=float(ahead["readahead"])), notes
    sized: Any = meas.get("cache_sizing")
    auto = capacity is None and spec.cache.auto and sized is not None
    cap = capacity_bytes(capacity, n, size) if capacity is not None else float(sized.capacity if auto
                                                                                 else spec.cache.capacity)
    if cap <= 0 and policy is None and pc.get("beside_jobs") is not None and "hit_bandwidth" in pc:
        return _page_cache_beside_jobs(pc, n, size)
    pol = policy or (spec.cache.policy if cap > 0 else "none")
    if pol not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {pol!r}")
    notes = {"cache.hit_bandwidth": f"measured per reader with {meas['hits']['how']}"}
    entries = spec.cache_entries()
    if entries < min(n, cap // size):  # the index fills before the arena
        notes["cache.capacity"] = (f"{entries} entries of {size:.0f} bytes: the cache's index ([cache] max_entries) "
                                   f"holds fewer samples than {cap:.0f} bytes would")
        return _partitioned(spec, Cache(capacity=entries * size, policy=pol, hit_bandwidth=_finite(shm)), notes), notes
    if auto:
        notes["cache.capacity"] = f'[cache] capacity "auto": {sized.why}'
    elif not pc["holds"] and pc["source"] != "other":
        notes["cache.capacity"] = ("the spec's [cache] (the source is emulated: no page cache)" if pc["emulated"] else
                                   "the spec's [cache]: the dataset is too large for the page cache to keep")
    # A ShmCache reads a sample once for the node: a reader missing a sample being read waits for
    # that read (ShmCache.read_through). It can only for the samples it inserts, so the scenario says
    # so where it holds the whole dataset; a partitioned cache reads its misses on each node.
    coalesce = pol != "none" and cap >= n * size and not spec.cache_partitioned()
    if coalesce:
        notes["cache.coalesce"] = "the ShmCache: a reader of a sample being read waits for that read"
    return _partitioned(spec, Cache(capacity=cap, policy=pol, hit_bandwidth=_finite(shm), coalesce=coalesce,
                                    shm=coalesce), notes), notes


def _page_cache_beside_jobs(pc: Mapping[str, Any], n: int, size: float) -> tuple[Cache, dict[str, str]]:
    """The page cache where it holds only part of the dataset, what the memory leaves beside the jobs
    (``pc["beside_jobs"]`` bytes): the least recently used pages go first, and jobs that read the
    same samples at about the same time share each read."""
    room = max(0.0, min(float(pc["beside_jobs"]), n * size))
    page = float(pc["hit_bandwidth"])
    notes = {"cache.capacity": f"the page cache: the {room / 1e6:.0f} MB the memory leaves beside the jobs (their "
                               f"measured memory, [node] jobs_memory), {room / (n * size):.0%} of the dataset",
             "cache.policy": "the page cache: the least recently used pages are dropped first",
             "cache.hit_bandwidth": f"the page cache's ({page / 1e9:.2f} GB/s, {pc['how']})",
             "cache.coalesce": "the page cache: a reader of a page being read waits for that read"}
    return Cache(capacity=room, policy="lru" if room > 0 else "none", hit_bandwidth=_finite(page),
                 coalesce=room > 0), notes


def _partitioned(spec: Spec, cache: Cache, notes: dict[str, str]) -> Cache:
    """``cache`` partitioned when the spec's cache is (``[cache] partitioned`` or the knob), with the
    default remote-hit bandwidth: calibration runs on one node and cannot measure a remote hit."""
    if not spec.cache_partitioned() or cache.capacity <= 0:
        return cache
    remote = float(config.get("cache_remote_bandwidth"))
    notes["cache.capacity"] = notes.get("cache.capacity", "the spec's [cache]") + "; per node (partitioned)"
    notes["cache.nodes"] = "calibration runs on one node; a run plans with the nodes it spans"
    notes["cache.remote_bandwidth"] = (f"NOT MEASURED (calibration runs on one node): the cache_remote_bandwidth "
                                       f"knob ({remote / 1e9:.2f} GB/s); set your network's remote-hit throughput")
    return replace(cache, partitioned=True, nodes=1, remote_bandwidth=remote)


def source_read_cpu(jobs: Iterable[Mapping[str, Any]]) -> float:
    """The CPU seconds of one source read, over the jobs' calibrations that read from the source
    (weighted by their misses): the source's own work, the same whichever job misses, and measured
    only by the jobs that missed (one calibrated after another on a warm cache hits)."""
    missed = [(float(m.get("misses") or 0), float(m.get("read_cpu") or 0.0)) for m in jobs]
    total = sum(n for n, _ in missed)
    return sum(n * c for n, c in missed) / total if total else 0.0


def scenario_job(name: str, m: Mapping[str, Any], epochs: int, read_cpu: float | None = None) -> Job:
    """A job of the scenario from its measurement (a step factory's keeps the loader defaults, and
    ``loader_seen = false``); ``read_cpu`` (:func:`source_read_cpu`) overrides the job's own."""
    sample_time = max(float(m["sample_time"]), 1e-9)
    if m["route"] == "step":  # its loader unseen: a plan makes no job wait on it
        return Job(name=name, sample_time=sample_time, epochs=epochs, loader_seen=False)
    return Job(name=name, sample_time=sample_time, epochs=epochs, ranks=m["ranks"], workers=m["workers"],
               batch=m["batch"], prefetch=m["prefetch"], handoff=m["handoff"], prep_time=m["prep_time"],
               read_cpu=m.get("read_cpu", 0.0) if read_cpu is None else read_cpu, startup=m["startup"],
               epoch_start=m["epoch_start"], order=m.get("order", ""))


def fit_baseline(jobs: Mapping[str, Mapping[str, Any]], curve: tuple[float, ...],
                 sample_bytes: float) -> tuple[float, str]:
    """What the jobs' own source reads, counted in flight while each ran alone in calibration, got of
    ``curve`` (:func:`~hpcstagger.model.runfit.counted_factor`, pooled over the jobs), and a comment.
    1 when they read too little (fewer than :data:`~hpcstagger.stagger.steering.MIN_READS` samples) or were not counted;
    1 as well, with the figure in the comment, outside :data:`BASELINE_RANGE`: the jobs' reads
    then differ from the measured curve by more than a read pattern explains."""
    counted = [m["source_reads"] for m in jobs.values() if m.get("source_reads")]
    nbytes = sum(float(r["bytes"]) for r in counted)
    seconds = sum(float(r["seconds"]) for r in counted)
    spent = [sum(v) for v in zip(*[r["flight"] for r in counted], strict=True)] if counted else []
    if not counted or sample_bytes <= 0 or nbytes / sample_bytes < MIN_READS:
        return 1.0, (f"not measured: the jobs read {nbytes / max(sample_bytes, 1.0):.0f} sample(s) from the source "
                     "while calibrated" if counted else "not measured: no cache counted the jobs' source reads")
    factor = counted_factor(curve, spent, nbytes, seconds)
    if factor is None:
        return 1.0, "not measured: the jobs' source reads were not counted in flight"
    lo, hi = BASELINE_RANGE
    if not lo <= factor <= hi:
        return 1.0, (f"not used: the jobs' {nbytes / sample_bytes:.0f} source reads got {factor:.2f} of the curve, "
                     f"outside {lo}-{hi}; check the source or calibrate again")
    return factor, (f"the jobs' {nbytes / sample_bytes:.0f} source reads, counted in flight while each ran alone, got "
                    f"this share of the curve; the closed-loop watcher fits the source relative to it")


def _mbs(values: Any) -> str:
    return ", ".join(f"{b / 1e6:.1f}" for b in values)


def source_note(meas: Mapping[str, Any]) -> tuple[list[float], list[float], str, str]:
    """The source's curve as measured (each level's median, by window), its spread, the comment on ``[storage]
    spread`` and a line for the summary when levels still disagree ("" otherwise)."""
    measured, spread, _ = combine_levels(meas["source"])
    wide = [k for k, s in enumerate(spread, start=1) if s > SPREAD_LIMIT]
    comment = ("how far each level's measurements lay apart, (max - min) / median: "
               + ", ".join(f"{s * 100:.0f}%" for s in spread))
    line = ""
    if wide:
        how = _how_often(meas, wide)
        comment += (f"; with {', '.join(map(str, wide))} reader(s) they still disagree {how}: the "
                    "source varies (other users, a busy node, a source that delivers in bursts); calibrate again "
                    "at a quieter time or with a larger --budget (longer windows)")
        line = (f"the source's measurements disagree with {', '.join(map(str, wide))} reader(s) by "
                + ", ".join(f"{spread[k - 1] * 100:.0f}%" for k in wide) + f" {how} "
                f"(more than {SPREAD_LIMIT * 100:.0f}%): the scenario keeps each level's median")
    return measured, spread, comment, line


def _how_often(meas: Mapping[str, Any], wide: list[int]) -> str:
    """How the disagreeing levels ``wide`` were measured: again, or (the budget spent) twice only."""
    twice = [k for k in wide if sum(1 for m in meas["source"] if int(m["readers"]) == k) < 3]
    if not twice:
        return "after measuring again"
    if len(twice) == len(wide):
        return "in their two measurements (the budget had no time left for a third)"
    return (f"after measuring again ({', '.join(map(str, twice))} reader(s) measured twice only: the budget had "
            "no time left for a third)")


def _storage_comment(meas: Mapping[str, Any], curve: tuple[float, ...], overhead: float) -> str:
    """What ``[storage] bandwidth`` holds, and how it was found (no other figure: see the module docstring)."""
    counts = sorted({sum(1 for m in meas["source"] if int(m["readers"]) == k) for k in range(1, len(curve) + 1)})
    levels = meas["source"]
    fresh = all(m.get("fresh", True) for m in levels)
    reread = any(str(m.get("how", "")).startswith("the dataset read again") for m in levels)
    dropped = any(m.get("dropped_files") for m in levels)
    _, _, untrusted = combine_levels(levels)
    return (f"holds {_mbs(curve)} MB/s with 1 .. {len(curve)} readers: per level the median (by window) of its "
            f"{' or '.join(map(str, counts))} measurements with concurrent reader processes"
            + (" less the time a miss costs the jobs besides the read (lookup and insert), folded in"
               if overhead else "")
            + "; " + ("fresh samples" if fresh
                      else "fresh samples for the first level, then samples read again" if reread
                      else "some samples read again (small dataset)")
            + (", page cache dropped before each level" if dropped else "")
            + ("; in file order, each reader a contiguous run (the page cache keeps what readahead brings in)"
               if meas["page_cache"]["holds"] else "")
            + ("; more readers hold the last level (the jobs can have more reads in flight)"
               if meas.get("reader_cap") else "")
            + ("; a measurement read over too short a window was not trusted (measurements.json)"
               if untrusted else ""))


def build_scenario(meas: dict[str, Any], spec: Spec, epochs: int | Mapping[str, int] | None,
                   capacity: float | str | None, policy: str | None) -> tuple[Scenario, dict[str, str]]:
    """The scenario of the measurements, and a comment per value saying how it was measured; sets
    ``meas``'s ``miss_overhead``, ``fit_baseline``, ``source_curve`` and ``source_spread``."""
    size = meas["sample_bytes"]
    measured, spread, comments_spread, meas["source_disagree"] = source_note(meas)
    overheads = [m["miss_overhead"] for m in meas["jobs"].values()
                 if m["route"] == "command" and m["misses"] and m["miss_overhead"] > 0]
    overhead = sum(overheads) / len(overheads) if overheads else 0.0
    meas.update(miss_overhead=overhead, source_measured=measured, source_spread=spread)
    memory, memory_note = jobs_memory(meas["jobs"], spec.loader_groups())
    pc = meas["page_cache"]
    sized = size_cache(pc.get("mem_available"), memory, pc.get("dataset_bytes"),
                       file_source=pc.get("source", "other") != "other" and not pc.get("emulated"))
    meas.update(jobs_memory=memory, cache_sizing=sized)
    if pc["holds"] and sized.page_room is not None and pc["dataset_bytes"] > sized.page_room:
        pc.update(holds=False, beside_jobs=sized.page_room)  # the page cache keeps what the jobs leave it, not all
    cache, comments = scenario_cache(meas, spec, capacity, policy)
    comments["node.jobs_memory"] = memory_note
    comments["dataset.sample_bytes"] = f"mean of {meas['preloaded']} samples read"
    jobs = []
    read_cpu = source_read_cpu(m for m in meas["jobs"].values() if m["route"] == "command")
    for j in spec.jobs:
        m = meas["jobs"][j.name]
        n_epochs = (epochs.get(j.name, j.epochs) if isinstance(epochs, Mapping) else epochs) or j.epochs
        jobs.append(scenario_job(j.name, m, int(n_epochs), read_cpu))
        comments[f"job.{j.name}"] = ("measured from its command: " + describe_job(m) if m["route"] == "command" else
                                     f"its step factory: {m['sample_time'] * 1e3:.3f} ms/sample over {m['calls']} "
                                     f"in-memory batches of {m['batch']}")
    cores = float(meas["cores"])
    if cores:
        comments["node.cores"] = meas["cores_how"]
    curve = tuple(fold_miss_overhead(measured, size, overhead))
    meas["source_curve"] = list(curve)
    comments["storage.bandwidth"] = _storage_comment(meas, curve, overhead)
    comments["storage.spread"] = comments_spread
    baseline, comments["storage.fit_baseline"] = fit_baseline(meas["jobs"], curve, size)
    meas["fit_baseline"] = baseline
    scenario = Scenario(dataset=Dataset(samples=meas["samples"], sample_bytes=size),
                        storage=Storage(curve, fit_baseline=baseline, spread=tuple(spread)), jobs=tuple(jobs),
                        cache=cache, loader=Loader(prefetch=2), node=Node(cores=cores, jobs_memory=memory))
    return scenario, comments


def jobs_memory(jobs: Mapping[str, Mapping[str, Any]], shared: Mapping[str, Sequence[str]] | None = None
                ) -> tuple[float, str]:
    """The bytes the jobs hold together, co-located, and a comment: each job's anonymous memory at
    its peak (its processes followed while it ran alone in calibration), added up, and the mapped
    file pages of the job that maps the most (their libraries, which the jobs share). Jobs that share
    a loader (``shared``: loader -> its jobs) hold their DataLoader workers' memory once, as one
    loader's workers: the largest of theirs; and its producer once (``memory_producer``, what the
    producer each job's calibration run consumed from held: the largest; the others' consumers then
    hold the pages their producers shared with them by fork). 0 and why when a job's memory was not
    measured."""
    unmeasured = [name for name, m in jobs.items() if not m.get("memory")]
    if unmeasured or not jobs:
        return 0.0, f"not measured (job(s) {', '.join(unmeasured)} not run from their command)"
    anon = sum(float(m["memory"]) for m in jobs.values())
    files = max(float(m.get("memory_file", 0)) for m in jobs.values())
    spared = 0.0
    for names in (shared or {}).values():
        for part in ("memory_workers", "memory_producer"):
            each = [float(jobs[n].get(part, 0)) for n in names if n in jobs]
            spared += sum(each) - max(each, default=0.0)
    total = anon - spared + files
    return total, (f"{total / 1e6:.0f} MB: each job's processes followed alone, their anonymous memory at its peak "
                   f"added up ({anon / 1e6:.0f} MB"
                   + (f", less {spared / 1e6:.0f} MB of DataLoader workers and producers that a shared loader runs "
                      "once" if spared else "")
                   + f"), and the most mapped files any job held ({files / 1e6:.0f} MB: libraries the jobs share)")


def fold_miss_overhead(bandwidth: Sequence[float], sample_bytes: float, overhead: float) -> list[float]:
    """The source's aggregate bandwidth as the jobs see it when each read of ``sample_bytes`` costs
    them ``overhead`` seconds more (its cache insert, ...): with ``k`` readers a read then takes
    ``sample_bytes * k / bandwidth[k-1] + overhead``."""
    size = float(sample_bytes)
    return [k * size / (k * size / float(b) + overhead) for k, b in enumerate(bandwidth, start=1)]
