"""Planning a co-located run: the delays for a mode, and what the model predicts.

World rank 0 of :func:`hpcstagger.init` calls :func:`plan_run` with every job leader's
calibration and :class:`~hpcstagger.stagger.runplan.PlanInputs`: what the shared cache holds at
that moment (``cache_state``, looked up by the coordinator), the history and what was learned, and
for a partitioned cache the nodes the run spans (``partition``). It returns a
:class:`~hpcstagger.stagger.runplan.RunPlan`. Nothing here reads the environment or the cache,
starts a thread or talks to other ranks; the spec's scenario file is the only file it reads. So it
is tested as a plain function."""

from __future__ import annotations

import warnings
from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger import config
from hpcstagger.errors import ConfigError
from hpcstagger.spec.jobspec import Spec
from hpcstagger.spec.runenv import PLAN_MODES, PLAN_MODES_IN_WORLD, PLANNED_MODES
from hpcstagger.stagger.runplan import PlanInputs, RunPlan
from hpcstagger.stagger.scenario_build import fold_miss_overhead
from hpcstagger.stagger.learning import with_scenario
from hpcstagger.model import optimal_plan, predict, Scenario
from hpcstagger.model.plan import FLAT, unseen_loaders, unseen_reason
from hpcstagger.stagger.guard import Guard, guard_plan
from hpcstagger.stagger.steering import steer_record

__all__ = ["plan_run", "plan_delays", "simultaneous_reason", "scenario_for", "cached_fraction",
           "loader_representatives", "partition_cache"]


def _needs_scenario() -> ConfigError:
    return ConfigError("plan mode 'plan' needs a calibrated scenario: run 'hpcstagger calibrate' and set "
                       "[plan] scenario in the spec, or choose mode 'simultaneous' or 'fixed'")


def cached_fraction(entries: float, samples: float) -> float:
    """The fraction of a dataset of ``samples`` samples that ``entries`` cached entries are, in [0, 1]."""
    if samples <= 0:
        return 0.0
    return min(1.0, max(0.0, float(entries) / float(samples)))


def plan_delays(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
                mode: str, **inputs: Any) -> dict[str, Any]:
    """Deprecated: :func:`plan_run` with ``PlanInputs(**inputs)``, as a dictionary (:meth:`RunPlan.to_dict`)."""
    warnings.warn("plan_delays is deprecated; use hpcstagger.stagger.delays.plan_run, which returns a RunPlan",
                  DeprecationWarning, stacklevel=2)
    return plan_run(spec, order, calibrations, mode, PlanInputs(**inputs)).to_dict()


def plan_run(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
             mode: str, inputs: PlanInputs | None = None) -> RunPlan:
    """The plan of a run in ``mode`` (world rank 0 calls this): the delays, and what the model predicts when it can.

    ``order`` lists the jobs in spec order; ``calibrations`` maps a job to what its leader
    measured (``sample_time``, optionally ``miss_overhead``); ``inputs`` holds the rest
    (:class:`~hpcstagger.stagger.runplan.PlanInputs`). ``inputs.fixed`` gives mode "fixed" its
    delays (default: the spec's ``[plan] delays``). ``inputs.cache_state`` is what the shared cache holds
    when the run starts (``entries``, ``bytes``; None when the run has no cache or nobody looked);
    it is returned as ``cache``, with the ``fraction`` of the dataset it covers when the scenario
    says how many samples the dataset has, and the plan starts from it (``cache.initial``).

    With a calibrated scenario (``[plan] scenario``), every mode also reports the predicted
    makespan of its delays (``predicted``) and the scenario it used, with each job's own calibration
    in it (``scenario``). Modes ``"plan"`` and ``"open"`` search the plan and also report the predicted
    makespan of the plan, a simultaneous start and sequential runs, with the ``curve``; the other
    modes do not search (each rank waits for planning: a 4-job search took 3 s of CPU on a
    20,000-sample lru model), so ``hpcstagger plan SPEC`` says what a plan would give them.
    Modes ``"plan"`` and ``"open"`` take the plan's delays; ``"plan"`` also adds
    ``steer`` when some job waits (:func:`~hpcstagger.stagger.steering.steer_record`, with the watcher's period
    ``steer_interval`` and the least predicted gain ``steer_min_gain`` that moves a release off
    the plan, 2% more for a stagger the simulator chose on the fluid model's flat curve): the run
    then releases waiting jobs on evidence. ``history`` (from
    :func:`~.history.corrections`) gives factors on the scenario's source and jobs, and the jobs'
    start-ups, that earlier runs measured; the plan starts from them, and returns them as
    ``history``. Jobs that share a loader are planned as one (:func:`loader_representatives`;
    their groups are returned as ``loader_groups``).

    ``learned`` (from :func:`~hpcstagger.stagger.learning.resolve`, for a spec without a scenario) is returned as
    ``learn``: with its ``scenario`` the plan is made from that learned scenario; without one
    (nothing learned yet) job ``k`` (spec order) starts ``k * learned["stagger"]`` seconds late,
    within ``[plan] min_delay`` and ``max_delay``.

    ``partition`` (the run's partitioned cache: ``nodes``, the nodes the run spans, and
    ``remote_bandwidth``, the default for a remote hit) makes the plan's scenario partitioned as
    :func:`scenario_for` says; it is returned as ``partition``, for the run's watcher.

    A plan of all zeros says why (:func:`simultaneous_reason`); mode "sequential" runs one job (one launch).
    """
    i = inputs or PlanInputs()
    return RunPlan.from_dict(_plan(spec, order, calibrations, mode, i))


def _plan(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
          mode: str, i: PlanInputs) -> dict[str, Any]:
    fixed, cache_state, history, learned, partition = i.fixed, i.cache_state, i.history, i.learned, i.partition
    steer_interval, steer_min_gain = i.steer_interval, i.steer_min_gain
    out: dict[str, Any] = {"mode": mode, "delays": _mode_delays(spec, order, mode, fixed),
                           "calibrations": {n: dict(c) for n, c in calibrations.items()}}
    out.update({k: dict(v) for k, v in (("partition", partition), ("cache", cache_state)) if v is not None})
    if learned is not None and spec is not None and not spec.plan.scenario:
        out["learn"] = dict(learned)
        if not learned.get("scenario"):  # the first run: a short stagger, observed
            out["delays"] = _learning_delays(spec, order, calibrations, float(learned.get("stagger") or 0.0))
            return out

        spec = with_scenario(spec, str(learned["scenario"]))
    if spec is None or not spec.plan.scenario:
        if mode in PLANNED_MODES and len(order) > 1:
            raise _needs_scenario()
        return out

    full_order, given, rep = list(order), dict(out["delays"]), loader_representatives(spec, order, calibrations)
    order = [n for n in order if rep[n] == n]
    if len(order) < len(full_order):
        out["loader_groups"], out["delays"] = spec.loader_groups(), {n: given[n] for n in order}
    h = history or {}
    scenario = scenario_for(spec, order, calibrations, cache_state=cache_state, source_scale=float(
        h.get("source") or 1.0), job_scales=h.get("jobs") or None, partition=partition, startups=h.get("startup"))
    if history:
        out["history"] = dict(history)
    if cache_state is not None:
        out["cache"].update(fraction=scenario.cache.initial, samples=scenario.dataset.samples,
                            initial_samples=scenario.initial_samples)
    if mode not in PLANNED_MODES:  # its own delays' makespan only: no search while every rank waits for it
        own = float(predict(scenario, out["delays"]).makespan)
        together = mode != "sequential" and not any(float(d) > 0 for d in out["delays"].values())
        out.update(predicted={mode: own, **({"simultaneous": own} if together else {})}, delays=given,
                   scenario=scenario.to_dict())
        return out
    p = optimal_plan(scenario, max_delay=spec.plan.max_delay, jitter=spec.plan.jitter)  # min_gain: plan_min_gain
    out["predicted"] = _predicted(p, mode)
    out["delays"] = {n: float(p.delays.get(rep[n], 0.0)) for n in full_order}
    order = full_order
    guard = guard_plan(spec, p, out["delays"], rep, scenario, steer_interval) if mode == "plan" else None
    if guard is not None:  # the model's choice is the watcher's prior; the held delays bound the wait
        out["delays"] = guard.delays
    if mode == "plan":
        # a stagger the simulator chose where the fluid model's curve is flat: the watcher, which
        # re-fits that model, moves its release only for a gain the model can tell (FLAT more)
        chosen = p.simulated.get("picked") or p.simulated.get("moved")
        out.update(_steer(spec, out["delays"], order, float(p.sequential), steer_interval,
                          steer_min_gain + (FLAT if chosen else 0.0), guard))
    out["scenario"] = scenario.to_dict()
    out["curve"] = p.to_dict()["curve"]
    out["jitter"] = float(p.jitter)  # the start-time spread the plan was made for (seconds)
    if p.simulated:
        out["simulated"] = dict(p.simulated)
    if guard is not None and guard.simultaneous:
        return {**out, "simultaneous_reason": guard.why}
    return _with_reason(out, spec, unseen_loaders(scenario))


def _with_reason(out: dict[str, Any], spec: Spec, unseen: list[str]) -> dict[str, Any]:
    """A plan record ``out``, with its ``simultaneous_reason`` when the plan starts every job at once."""
    reason = unseen_reason(unseen) if unseen and len(out["delays"]) > 1 else simultaneous_reason(
        out["delays"], out["predicted"], out["curve"], max_delay=spec.plan.max_delay,
        min_gain=float(config.get("plan_min_gain")), jitter=float(out["jitter"]), simulated=out.get("simulated"))
    if reason:
        out["simultaneous_reason"] = reason
    return out


def _predicted(p: Any, mode: str) -> dict[str, float]:
    """A planned mode's predicted makespans: the plan's (its own), a simultaneous start's, sequential runs'."""
    return {"plan": float(p.makespan), "simultaneous": float(p.simultaneous), "sequential": float(p.sequential),
            mode: float(p.makespan)}


def simultaneous_reason(delays: Mapping[str, float], predicted: Mapping[str, float] | None,
                        curve: Mapping[str, Any] | None, *, min_gain: float, max_delay: float | None = None,
                        jitter: float = 0.0, simulated: Mapping[str, float] | None = None) -> str | None:
    """Why a plan starts every job at once, in one line; None when some job waits (or only one runs).

    ``delays`` are the plan's, ``predicted`` its predicted makespans (``simultaneous``, used when
    the curve lacks a stagger of 0), ``curve``
    the model's makespan-versus-stagger curve (``stagger``, ``makespan``: a signed stagger of the
    second job for 2 jobs, else the largest delay), ``min_gain`` the least gain for which a stagger
    is planned, ``max_delay`` the spec's bound on a delay, ``jitter`` the start-time spread (s) and
    ``simulated`` the sample-level simulator's makespans of the model's stagger (``plan``) and of a
    simultaneous start, when it replayed them (``Plan.simulated``).
    """
    names = list(delays)
    if len(names) < 2 or any(float(d) > 0 for d in delays.values()):
        return None
    if max_delay is not None and max_delay <= 0:
        return "a simultaneous start: [plan] max_delay is 0 s, which allows no stagger"
    points = list(zip((curve or {}).get("stagger") or (), (curve or {}).get("makespan") or (), strict=True))
    staggered = [(float(x), float(m)) for x, m in points if x != 0]
    # the curve's own simultaneous point first: the staggers are compared at the curve's accuracy
    sim = next((float(m) for x, m in points if x == 0), (predicted or {}).get("simultaneous"))
    if sim is None or not staggered:
        return (f"a simultaneous start: the model predicts no stagger gains more than {100 * min_gain:g}% "
                "over it" + (f" (predicted makespan {sim:.1f} s)" if sim is not None else ""))
    x, best = min(staggered, key=lambda p: (p[1], abs(p[0])))
    secs = f"{abs(x):.1f}" if abs(x) >= 0.1 else f"{abs(x):.2g}"  # a stagger of hundredths is not "+0.0"
    which = f"largest delay +{secs} s" if len(names) != 2 else f"{names[1] if x > 0 else names[0]} +{secs} s"
    figures = f"best stagger {which}: predicted makespan {best:.1f} s against {sim:.1f} s simultaneous"
    gain = 1.0 - best / sim if sim > 0 else 0.0
    if simulated:
        a, b = float(simulated["plan"]), float(simulated["simultaneous"])
        why = (f"the sample-level simulator does not confirm the model's stagger ({figures}; replayed, "
               f"{a:.1f} s against {b:.1f} s): the two models disagree by more than the simulator's gain")
    elif gain < 1e-3:  # a flat curve: the model's own accuracy
        why = f"the model predicts that no stagger shortens the makespan ({sim:.1f} s simultaneous)"
    elif gain <= min_gain:
        why = (f"the model predicts no stagger gains more than {100 * min_gain:g}% "
               f"({figures}: a gain of {100 * gain:.1f}%)")
    elif jitter > 0:
        why = (f"the best stagger's gain does not hold over starts that stray by up to {jitter:.2f} s "
               f"({figures}, with exact starts)")
    else:
        why = f"at full accuracy the best stagger gains less than {100 * min_gain:g}% ({figures})"
    if max_delay is not None and abs(x) >= max_delay * (1 - 1e-6):
        why += f"; [plan] max_delay ({max_delay:g} s) bounds the stagger"
    return f"a simultaneous start: {why}"


def _steer(spec: Spec, delays: Mapping[str, float], order: Sequence[str], sequential: float,
           interval: float, min_gain: float, guard: Guard | None = None) -> dict[str, Any]:
    """Mode "plan"'s ``steer`` record (:func:`~hpcstagger.stagger.steering.steer_record`) when a job waits, else {}."""
    steer = steer_record(delays, order, lo=spec.plan.min_delay, hi=spec.plan.max_delay,
                         horizon=max(sequential, 1.0), interval=interval, observe_only=not spec.plan.steer,
                         min_gain=min_gain, prior=guard.prior if guard else None, guard=guard.why if guard else None,
                         park=guard.park if guard else ())
    return {"steer": steer} if steer else {}


def loader_representatives(spec: Spec, order: Sequence[str],
                           calibrations: Mapping[str, Mapping[str, float]]) -> dict[str, str]:
    """Job -> the job the model plans for it: the slowest member of its shared-loader group (by
    calibrated, else the spec's, ``sample_time``; the first in spec order on a tie), else itself.

    Jobs that share a loader (``[loader]``, :meth:`Spec.loader_groups`) progress together: one
    producer prepares and reads each batch once for all of them, at the pace of the slowest. So the
    model plans each group as its slowest member, and every member gets that member's delay: the
    group is released as one. Staggering jobs *within* a group would only make the later ones join
    the stream later (at a segment boundary) while reading nothing less."""
    rep = {n: n for n in order}
    for members in spec.loader_groups().values():
        present = [n for n in members if n in rep]
        if len(present) < 2:
            continue

        def slowness(n: str) -> float:
            t = (calibrations.get(n) or {}).get("sample_time") or spec.job(n).sample_time
            return float(t or 0.0)

        slowest = max(present, key=lambda n: (slowness(n), -present.index(n)))
        rep.update({n: slowest for n in present})
    return rep


def _mode_delays(spec: Spec | None, order: Sequence[str], mode: str,
                 fixed: Mapping[str, float] | None) -> dict[str, float]:
    """The delays of a mode before any plan: mode "fixed"'s, else none; ConfigError for a bad mode.

    Mode "sequential" is one job per launch: a world of one job of a sequential run starts it at once."""
    if mode not in PLAN_MODES_IN_WORLD and not (mode == "sequential" and len(order) == 1):
        if mode == "sequential":
            raise ConfigError("plan mode 'sequential' runs the jobs one after another, each in its own launch: "
                              "use 'hpcstagger launch --mode sequential' (or the rendered Slurm script), not "
                              "one MPI world")
        raise ConfigError(f"plan mode must be one of {', '.join(PLAN_MODES)}, not {mode!r}")
    if mode != "fixed":
        return {n: 0.0 for n in order}
    if fixed is None:
        fixed = dict(spec.plan.delays) if spec else {}
    unknown = sorted(set(fixed) - set(order))
    if unknown:
        raise ConfigError(f"fixed delays name unknown job(s) {', '.join(unknown)}; jobs: {', '.join(order)}")
    return {n: float(fixed.get(n, 0.0)) for n in order}


def _learning_delays(spec: Spec, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
                     step: float) -> dict[str, float]:
    """A first learning run's delays: job ``k`` ``k * step`` seconds late, within the spec's bounds
    (it shows each job's reads alone as well as together); jobs sharing a loader count as one."""
    hi = spec.plan.max_delay if spec.plan.max_delay is not None else float("inf")
    rep = loader_representatives(spec, order, calibrations)
    heads = [n for n in order if rep[n] == n]
    steps = {n: min(hi, max(spec.plan.min_delay, k * max(0.0, step))) if k else 0.0 for k, n in enumerate(heads)}
    return {n: steps[rep[n]] for n in order}


def scenario_for(spec: Spec | None, order: Sequence[str], calibrations: Mapping[str, Mapping[str, float]],
                 *, cache_state: Mapping[str, Any] | None = None, source_scale: float = 1.0,
                 job_scales: Mapping[str, float] | None = None, partition: Mapping[str, Any] | None = None,
                 startups: Mapping[str, float] | None = None) -> Any:
    """The scenario to plan with: the spec's calibrated scenario file, with each job's epochs from
    the spec, its sample time from the job's own calibration when it sent one, and the cache's
    contents at the start when ``cache_state`` gives them: ``cache.initial`` is then its
    ``entries`` over the dataset's samples, clipped to [0, 1] (the file's value otherwise); for a
    cache partitioned over M nodes ``cache_state`` is one node's cache, which holds the samples
    that node owns, so its entries count M times.

    A job's calibration may also report ``miss_overhead``: seconds each read that goes to the source
    costs the job beyond the source's own time (its cache insert, its loader's work). The source is
    then planned with the bandwidth the jobs actually see: with ``k`` readers each read of ``S``
    bytes takes ``S * k / bandwidth[k-1] + overhead``, the mean of the reported overheads.

    The closed-loop watcher (:mod:`~hpcstagger.colocated.watcher`) refits the model with ``source_scale`` (a factor
    on the source's bandwidth, before the overhead is added) and ``job_scales`` (job -> a factor on its
    ``sample_time``, ``prep_time``, ``read_cpu`` and ``handoff``). ``startups`` (job -> seconds, from the run
    history) replaces those jobs' ``startup``.

    A run whose cache is partitioned (the spec's ``[cache] partitioned``, or a ``partition`` given:
    the coordinator gives one for the ``cache_partitioned`` knob too) is planned with a partitioned
    cache, whatever the file says: see :func:`partition_cache` for where ``nodes`` and
    ``remote_bandwidth`` come from. A spec's ``capacity = "auto"`` cache sized smaller for this run
    than at calibration (less memory free now) is planned at this run's size.
    """
    if spec is None or not spec.plan.scenario:
        raise _needs_scenario()
    base = Scenario.from_toml(spec.plan.scenario).to_dict()
    known = {j["name"]: j for j in base.get("job", [])}
    jobs = []
    for name in order:
        entry = dict(known.get(name, {}))
        js = spec.job(name)
        entry["name"] = name
        entry["epochs"] = js.epochs
        measured = calibrations.get(name, {}).get("sample_time")
        sample_time = measured or js.sample_time or entry.get("sample_time")
        if not sample_time:
            raise ConfigError(f"no sample_time for job {name!r}: the scenario {spec.plan.scenario} lacks it, the spec "
                              "gives none, and the job sent no calibration")
        entry["sample_time"] = float(sample_time)
        scale = float((job_scales or {}).get(name, 1.0))
        for key in ("sample_time", "prep_time", "read_cpu", "handoff"):
            if key in entry:
                entry[key] = float(entry[key]) * scale
        if name in (startups or {}):
            entry["startup"] = float((startups or {})[name])
        jobs.append(entry)
    base["job"] = jobs
    if spec.cache.auto and base.get("cache") and not _page_cache(base["cache"]):
        base["cache"]["capacity"] = min(float(base["cache"].get("capacity", 0)), float(spec.cache.capacity))
    if (spec.cache.partitioned or partition is not None) and base.get("cache"):
        base["cache"] = partition_cache(base["cache"], partition, calibrations)
    if cache_state is not None:
        samples = float(base["dataset"]["samples"])
        cache = base.setdefault("cache", {})
        share = int(cache.get("nodes") or 1) if cache.get("partitioned") else 1  # one node holds its share
        cache["initial"] = cached_fraction(float(cache_state.get("entries") or 0) * share, samples)
    if source_scale != 1.0:
        base["storage"]["bandwidth"] = [float(b) * source_scale for b in base["storage"]["bandwidth"]]
    overheads = [float(c["miss_overhead"]) for c in calibrations.values() if c.get("miss_overhead", 0) > 0]
    if overheads:
        base["storage"]["bandwidth"] = fold_miss_overhead(base["storage"]["bandwidth"],
                                                          float(base["dataset"]["sample_bytes"]),
                                                          sum(overheads) / len(overheads))
    return Scenario.from_dict(base)


def _page_cache(cache: Mapping[str, Any]) -> bool:
    """Whether a scenario's ``[cache]`` (as a dict) is the page cache (:attr:`Cache.page_cache`)."""
    return bool(cache.get("coalesce")) and not cache.get("shm")


def partition_cache(cache: Mapping[str, Any], partition: Mapping[str, Any] | None,
                    calibrations: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """A scenario's ``[cache]`` (as a dict) for a run whose cache is partitioned.

    What the run knows wins over the scenario file: ``partitioned`` is true, and ``nodes`` is
    ``partition["nodes"]`` (the nodes the run spans) when given, else the file's (default 1).
    ``remote_bandwidth`` is a measured one when a job's calibration reports it (the lowest of
    them), else the file's, else ``partition["remote_bandwidth"]`` (the ``cache_remote_bandwidth``
    knob's default, which the coordinator passes). A cache that is the page cache (``coalesce``
    without ``shm``, the whole dataset on every node) is left node-local: the model does not
    partition it."""
    out = dict(cache)
    if _page_cache(out):
        return out
    out.pop("coalesce", None)  # a ShmCache's claims are per node: a partitioned cache reads its misses itself
    out.pop("shm", None)
    p = partition or {}
    out["partitioned"] = True
    out["nodes"] = int(p.get("nodes") or out.get("nodes") or 1)
    measured = [float(c["remote_bandwidth"]) for c in calibrations.values() if (c.get("remote_bandwidth") or 0) > 0]
    if measured:
        out["remote_bandwidth"] = min(measured)
    elif out.get("remote_bandwidth") is None and p.get("remote_bandwidth"):
        out["remote_bandwidth"] = float(p["remote_bandwidth"])
    return out
