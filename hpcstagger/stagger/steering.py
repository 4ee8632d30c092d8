"""Closed-loop staggering: when to release each waiting job, from what the run shows (pure).

The plan's delays are the prior (for a guarded simultaneous plan, ``steer.prior``: the model's own
zeros, while the plan's delays only bound the wait for evidence). While jobs wait, the watcher
(:mod:`~hpcstagger.colocated.watcher`) looks at the run often and hands :class:`Steering` a
:class:`Look`: the source reads
counted by the shared cache (bytes and seconds, :meth:`ShmCache.count_read`), each started job's
progress (:mod:`~hpcstagger.colocated.progress`) and state. :meth:`Steering.decide` then:

1. **fits the source**: the bytes read over the last few seconds, against what the calibrated
   curve delivers in the time the cache counted with 1, 2, ... reads in flight, gives a factor on
   the source's bandwidth, taken relative to the same fit on the jobs' calibration runs
   (``[storage] fit_baseline``: the jobs' sparse reads need not get what the calibration's
   back-to-back readers got). Without counts, the mean number of reads in flight (read seconds
   per second) stands in. Where the page cache is the scenario's cache (``device``), the bytes are
   those read from the dataset's block device (:mod:`~hpcstagger.colocated.devreads`), with no
   baseline: a read of cached pages costs the device nothing, and one that misses reads its
   readahead as well, so the cache's own byte count runs from 1/readahead of the curve to several
   times it as the page cache fills. Such a fit takes a window of a second at least, and none
   where the page cache served most of the window's reads (:data:`DEVICE_SHARE`);
2. **fits each running job**: the factor on its CPU costs (``sample_time``, ``prep_time``,
   ``read_cpu``, ``handoff``) under which the model, with the source fitted and the job's loop started when it
   really did, predicts the progress the job has made (:func:`~hpcstagger.model.runfit.fit_scale`).
   A job whose predicted progress does not fall as its costs grow (it follows another job through
   the cache: slowed down, it hits more) keeps its factor: the window cannot tell its costs (for the
   history, :mod:`~hpcstagger.stagger.latefit` fits the jobs that waited over later windows);
3. **decides**: with the fitted model, the predicted makespan as a function of when the next group
   of waiting jobs starts (:func:`~hpcstagger.model.runfit.best_release`); the group is released
   when starting now is best. Later groups keep their planned gaps behind it in that prediction.
   Starts are compared over the plan's start-time spread (its ``jitter``), as the plan compared
   staggers: the best exact start is often on the edge of a cliff in the curve.

It looks every 0.25 s and re-fits at most every ``steer_interval`` seconds (and when the best
start it found comes due); a re-fit that took ``c`` CPU seconds puts the next ``c / steer_duty``
seconds off at least, so that a slow model's fits take at most that share of one core, except that
a fit made before the planned delay that holds the group past it is checked by a re-fit when the
planned delay comes. A re-fit does not make a release late: when the last re-fit took more than
half a look of wall time and the next would end past the release that is due (the fitted best
start, else the planned delay), the fit that stands decides (on a busy node a re-fit at a lowered
priority takes several times its CPU time; the first re-fit's time is not known beforehand). Where
the run counts the source's reads but they have given no evidence by the planned delay, the group
is released then, unfitted.
Without evidence yet (no loop older than 0.5 s) the prior holds: the group is released at its
planned delay. ``[plan] min_delay`` and ``max_delay`` bound every
release, and a group is released as soon as every job started before it has finished. Every
release says why (:attr:`Decision.reason`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from hpcstagger.model import Scenario
from hpcstagger.model.runfit import (best_release, counted_factor, fit_scale, passage_time, progress_series,
                                     source_factor)
from hpcstagger.spec.records import fraction_done, throughput
from hpcstagger.stagger.releases import Decision, Look, SteerLimits, release_groups, steer_record

__all__ = ["Look", "Decision", "Steering", "SteerLimits", "release_groups", "steer_record"]

log = logging.getLogger(__name__)

WINDOW = 3.0     # seconds of read counters the source fit uses
MIN_READS = 16   # reads the window needs before the source fit counts
# Fitting to the device's bytes: a block device's throttle or queue delivers in bursts (7.2 MB/s
# over a quarter second from a device throttled to 6), so the window is a second at least; and
# where the page cache served most of the window's reads (the device read less than this share
# of a readahead's worth for each), their time in flight is mostly not the device's (on a busy
# node, a read of cached pages waits for a core): such a window fits nothing
DEVICE_WINDOW = 1.0
DEVICE_SHARE = 0.5
MOVED = 0.05     # relative change of a fitted factor that asks for a new release curve
MATCH = 0.03     # a job's progress predicted this close needs no new factor
FIT_WINDOW = 2.0  # seconds of a job's recent progress its factor is fitted to
OBSERVE_MIN = 1.0  # seconds of reads, at least, that the source's fit after the last release takes
WARMUP = 0.5     # seconds of a job's loop before its progress and reads count as evidence
PROBES = 3       # factors a job's fit tries first, to see that its progress falls as its costs grow
ALPHA = (0.5, 2.0)  # the range of a job's fitted factor (a calibration off by more is not steered but redone)
_FLAT = 0.0  # fit_scale's answer where a job's progress hardly depends on its costs (no fit gives it)


def window_start(tb: float, loop_start: float, since: float = -math.inf) -> float:
    """Start of a job's fit window ending at ``tb`` (loop seconds): FIT_WINDOW back, past warm-up, from ``since``."""
    return max(WARMUP, tb - FIT_WINDOW, since - loop_start)


class Steering:
    """Decides when each waiting group is released (see the module docstring).

    ``build(source_scale, job_scales)`` makes the scenario (already with the spec's jobs, the
    cache's state and each job's calibration) with those factors applied; ``bandwidth`` is the
    calibrated source curve the source factor multiplies; ``epochs`` each job's epochs; ``delays``
    the plan; ``limits`` bound every release and set the pace (:class:`SteerLimits`).
    ``baseline`` is what the counted source fit gave on the jobs' own reads while calibrated
    (the scenario's ``[storage] fit_baseline``): a fit is taken relative to it. ``jitter`` is the
    start-time spread the plan was made for: release times are compared over it as the plan's were.
    ``priors`` are the delays the model chose where the plan holds jobs past them (a guarded
    simultaneous plan, :func:`steer_record`'s ``prior``): a release keeps nearest to them, and
    ``delays`` only bound the wait for evidence. With ``device`` the source is fitted to the looks'
    ``device_bytes`` where they have them (see the module docstring).
    """

    def __init__(self, build: Callable[[float, Mapping[str, float]], Scenario], bandwidth: Sequence[float],
                 order: Sequence[str], delays: Mapping[str, float], epochs: Mapping[str, int],
                 limits: SteerLimits | None = None, *, baseline: float = 1.0, jitter: float = 0.0,
                 priors: Mapping[str, float] | None = None, cpu_clock: Callable[[], float] = time.thread_time,
                 wall_clock: Callable[[], float] = time.perf_counter, device: bool = False):
        lim = limits or SteerLimits()
        lo, hi, interval, horizon, look = lim.lo, lim.hi, lim.interval, lim.horizon, lim.look
        observe_only, min_gain = lim.observe_only, lim.min_gain
        self.build = build
        self.bandwidth = list(bandwidth)
        self.order = list(order)
        self.planned = {n: float(delays[n]) for n in order}
        # the delays the model chose, which a release keeps nearest to; a guarded plan holds a job
        # past them (``planned``) until the run shows whether its own choice was right
        self.priors = {n: float((priors or delays)[n]) for n in order}
        self.epochs = dict(epochs)
        self.lo, self.hi, self.interval = float(lo), float(hi), float(interval)
        self.observe_only = observe_only  # fit and record, but release at the planned delays
        self.min_gain = max(0.0, float(min_gain))  # least predicted gain that moves a release off the plan
        # what the counted source fit gave on the jobs' own calibration runs: "as calibrated"
        self.baseline = float(baseline) if baseline and math.isfinite(baseline) and baseline > 0 else 1.0
        self.device = bool(device)  # the source is fitted to the bytes read from the dataset's device
        self.jitter = float(jitter) if math.isfinite(jitter) and jitter > 0 else 0.0  # the plan's start spread
        self.look = min(float(look), self.interval)  # seconds between looks (a look is cheap, a re-fit is not)
        self.duty = max(0.0, float(lim.duty))
        self.cpu_clock = cpu_clock  # the re-fits' cost, for ``duty``
        self.gap = self.interval  # seconds from one re-fit to the next: the interval, or more for a slow model
        self._wall = wall_clock
        self.fit_wall = 0.0  # the last re-fit's wall time: a re-fit that would end past a due release waits
        self.groups = release_groups(self.planned, self.order)
        self.released: dict[str, float] = {}
        self.decisions: list[Decision] = []
        self.looks: list[Look] = []
        self.fits: list[dict[str, Any]] = []  # every re-fit that asked the model for a release curve
        self.source_seen: dict[str, Any] = {}
        self.cpu_seconds = 0.0  # the watcher's own CPU time in decide()
        self.prefetched: Callable[[], float] | None = None  # the share a waiting job prefetched (.prefetch)
        self.beta = 1.0
        self.alpha: dict[str, float] = {}
        self._curve_at: tuple[float, dict[str, float]] | None = None
        self.target: float | None = None
        self._best = math.nan  # the predicted makespan at the target
        self._optimum = (math.nan, math.nan)  # the best (start, makespan) found; the target may be nearer the plan
        prior = build(1.0, {})
        self._sample_bytes = float(prior.dataset.sample_bytes)
        self._readahead = max(1.0, float(prior.cache.readahead))  # device bytes a read that misses costs, in samples
        self._fetch = {j.name: j.fetchers() for j in prior.jobs}
        plan_span = max(self.planned.values(), default=0.0)
        self.horizon = float(horizon) if horizon else max(2.0 * plan_span, 10.0)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def waiting(self) -> list[list[str]]:
        """The groups not yet released, in release order."""
        return [g for g in self.groups if not all(n in self.released for n in g)]

    def until_next_look(self, now: float) -> float:
        """Seconds from ``now`` to the next look: the look period, or less when a release may come
        due before it (the best start found, the next group's planned delay or a bound), so that a
        release at the plan's delay is not a look late."""
        if not self.waiting:
            return self.look
        planned = min(self.planned[n] for n in self.waiting[0])
        due = [t for t in (max(planned, self.lo), self.hi, self.target) if t is not None and t > now]
        return min([self.look] + [t - now for t in due])

    def release(self, jobs: list[str], now: float, reason: str, predicted: float | None = None) -> Decision:
        """Record the release of ``jobs`` at ``now``."""
        planned = min(self.planned[n] for n in jobs)
        fit = {"source": self.beta, "jobs": dict(self.alpha)}
        d = Decision(list(jobs), float(now), planned, reason, predicted, fit)
        for n in jobs:
            self.released[n] = float(now)
        self.decisions.append(d)
        self._curve_at = None
        self.target = None
        log.info("releasing %s at +%.2f s (planned +%.2f s): %s", ", ".join(jobs), now, planned, reason)
        return d

    # ---- fitting -------------------------------------------------------------------------------
    def _fetchers(self) -> int:
        """Reads the started jobs can have in flight (their ranks times their workers)."""
        return max(1, sum(self._fetch.get(n, 1) for n in self.released))

    def _fit_source(self, since: float, min_window: float = 0.0) -> bool:
        """Fit the source from the read counters of the looks since ``since`` (the loops warmed up),
        over ``min_window`` seconds at least."""
        looks = [lk for lk in self.looks if lk.read_bytes is not None and lk.read_seconds is not None
                 and lk.t >= since]
        # the window ends at the last look that saw new reads: once the jobs stop reading (the cache
        # holds what they need) the time without reads says nothing about the source
        while len(looks) >= 2 and looks[-1].read_bytes == looks[-2].read_bytes:
            looks.pop()
        if len(looks) < 2:
            return False
        last = looks[-1]
        first = next((lk for lk in looks if lk.t >= last.t - WINDOW), looks[0])
        if first is last:
            first = looks[-2]
        assert last.read_bytes is not None and first.read_bytes is not None
        assert last.read_seconds is not None and first.read_seconds is not None
        nbytes = last.read_bytes - first.read_bytes
        secs = last.read_seconds - first.read_seconds
        size = self._sample_bytes
        if (size > 0 and nbytes / size < MIN_READS) or last.t - first.t < min_window:
            return False
        device = self._device_delta(first, last)
        if device is not None and (last.t - first.t < DEVICE_WINDOW or (size > 0 and device / size < MIN_READS)
                                   or device < DEVICE_SHARE * self._readahead * nbytes):
            return False
        # where the page cache is the scenario's cache, the device's bytes are the source's (no baseline)
        fitted, baseline, what = (nbytes, None, "") if device is None else (device, 1.0, "device bytes, ")
        scale, how = self._counted_factor(first, last, fitted, secs, baseline=baseline), "reads in flight counted"
        if scale is None:
            scale = source_factor(self.bandwidth, self._fetchers(), fitted, secs, last.t - first.t)
            how = "mean in flight"
        how = what + how
        if scale is None:
            return False
        self.source_seen = {"readers": secs / (last.t - first.t), "bytes_per_s": nbytes / (last.t - first.t),
                            "per_read": nbytes / secs if secs > 0 else None, "window": last.t - first.t,
                            "estimator": how, "baseline": 1.0 if device is not None else self.baseline,
                            **({"device_bytes_per_s": device / (last.t - first.t)} if device is not None else {})}
        self.beta = min(4.0, max(0.25, scale))
        return True

    def _counted_factor(self, first: Look, last: Look, nbytes: float, secs: float,
                        baseline: float | None = None) -> float | None:
        """The source factor from the cache's exact count of reads in flight: the ``nbytes`` read over
        what the curve delivers in the time spent at each count, relative to the same fit on the
        jobs' calibration runs (``baseline``, default :attr:`baseline`), or None when the reads were
        not counted (a cache or a loader that does not bracket its reads) over most of the window's
        ``secs`` read-seconds."""
        if not first.flight or not last.flight:
            return None
        spent = [max(0.0, b - a) for a, b in zip(first.flight, last.flight, strict=True)]
        scale = counted_factor(self.bandwidth, spent, nbytes, secs)
        return None if scale is None else scale / (self.baseline if baseline is None else baseline)

    def _device_delta(self, first: Look, last: Look) -> float | None:
        """Bytes read from the dataset's device between two looks, where the source is fitted to them
        (``device``) and both looks counted them; else None."""
        if not self.device or first.device_bytes is None or last.device_bytes is None:
            return None
        return max(0.0, last.device_bytes - first.device_bytes)

    def loop_starts_at(self, look: Look, t0_wall: float) -> dict[str, float]:
        out = {}
        for n in self.released:
            rec = look.progress.get(n)
            if rec and rec.get("loop_start"):
                out[n] = float(rec["loop_start"]) - t0_wall
        return out

    def scenario(self, loop_starts: Mapping[str, float],
                 alpha: Mapping[str, float] | None = None) -> tuple[Scenario, list[float]]:
        """The fitted scenario (with the job factors ``alpha``, default the fitted ones) and the
        start times of the started jobs (inf for the others): a job whose loop has begun starts
        then, with no start-up left."""
        sc = self.build(self.beta, self.alpha if alpha is None else alpha)
        jobs, starts = [], []
        for job in sc.jobs:
            if job.name in loop_starts:
                jobs.append(replace(job, startup=0.0))
                starts.append(max(0.0, loop_starts[job.name]))
            else:
                jobs.append(job)
                starts.append(self.released.get(job.name, math.inf))
        return replace(sc, jobs=tuple(jobs)), starts

    def fit_jobs(self, look: Look, loop_starts: Mapping[str, float], only: Sequence[str] | None = None,
                  min_window: float = WARMUP, since: float = -math.inf) -> set[str]:
        """Each running job's factor (of ``only``, when given), from its progress over the last
        ``FIT_WINDOW`` seconds of its record's history, from ``since`` (seconds after time zero) on,
        ``min_window`` at least (a window: how its loop began does not bias it); kept when the model
        with the current factor predicts that progress within ``MATCH`` (``only``'s jobs are always
        fitted). Returns the jobs whose fit told their costs (a factor within the bounds)."""
        told: set[str] = set()
        for name, start in loop_starts.items():
            if only is not None and name not in only:
                continue
            rec = look.progress.get(name) or {}
            hist = rec.get("history") or []
            per = (rec.get("per_epoch") or 0) * self.epochs.get(name, 1)
            if len(hist) < 2 or per <= 0:
                continue
            tb = float(hist[-1][0])
            ta = window_start(tb, start, since)
            if tb - ta < min_window:
                continue
            observed = (throughput(rec, ta, tb) or 0.0) * (tb - ta) / per  # fraction done in the window
            if observed <= 0:
                continue

            def make(a: float, name: str = name, full: bool = False) -> Scenario:
                sc = self.scenario(loop_starts, {**self.alpha, name: a})[0]
                return replace(sc, cache=replace(sc.cache, initial=1.0)) if full else sc

            sc0, starts = self.scenario(loop_starts)
            index = sc0.job_index(name)
            window = [start + ta, start + tb]

            def progress(sc: Scenario, index: int = index, starts: list[float] = starts,
                         window: list[float] = window) -> float:
                pa, pb = progress_series(sc, starts, window)
                return pb[index] - pa[index]

            measure: Callable[[Scenario], float] = progress
            if only is not None:  # after the releases, the rate over the window's fractions: near a job's end
                # the model's progress over a fixed window saturates (a faster job finishes and shows less of it)
                fa = ((throughput(rec, float(hist[0][0]), ta) or 0.0) * (ta - float(hist[0][0])) + hist[0][1]) / per
                span = min(1.0 - 1e-6, fa + observed) - fa  # a job the model finishes is at 1 - ulp, or at 1
                if span <= 0:
                    continue

                def rate(sc: Scenario, index: int = index, starts: list[float] = starts, fa: float = fa,
                         span: float = span, horizon: float = start + 2.5 * tb) -> float:
                    took = passage_time(sc, starts, index, fa, fa + span, horizon, points=200)
                    return span / took if took > 0 else math.inf

                measure, observed = rate, observed / (tb - ta)
            elif abs(measure(sc0) - observed) <= MATCH * observed:
                continue
            a = fit_scale(make, measure, observed, lo=ALPHA[0], hi=ALPHA[1], iterations=6, flat=0.1, probes=PROBES,
                          flat_value=_FLAT)
            if only is not None and a in (None, _FLAT):  # after the releases the window has every sample cached:
                # so may the model, where a faster job would otherwise catch its leader up and go no faster
                a = fit_scale(lambda x: make(x, full=True), measure, observed, lo=ALPHA[0], hi=ALPHA[1],
                              iterations=6, flat=0.1, probes=PROBES, flat_value=_FLAT)
            if a == _FLAT and only is None:  # something else bounds it: its costs as calibrated (not seen)
                self.alpha[name] = 1.0
            # None: its progress is not one-to-one with its speed (it follows another job through the cache),
            # so the window says nothing of its costs; at a bound the model cannot explain it. Keep what there was
            elif a is not None and ALPHA[0] < a < ALPHA[1]:
                self.alpha[name] = a
                told.add(name)
        return told

    # ---- deciding ------------------------------------------------------------------------------
    def decide(self, look: Look, t0_wall: float) -> list[Decision]:
        """The releases due at ``look.t`` (usually none or one group), recorded."""
        cpu = time.thread_time()
        try:
            return self._decide(look, t0_wall)
        finally:
            self.cpu_seconds += time.thread_time() - cpu

    def _keep(self, look: Look) -> None:
        self.looks.append(look)
        self.looks = [lk for lk in self.looks if lk.t >= look.t - 4 * WINDOW] or [look]

    def observe(self, look: Look, t0_wall: float) -> bool:
        """After the last release, fit without deciding: the source, then each running job, once
        the loops give evidence: one fit, over a full window (``WINDOW`` seconds) after the last loop
        has warmed up, or over what there was once the source reads have stopped, if that is
        ``OBSERVE_MIN`` at least (a quarter second of reads put a source at x1.89, and the next
        plan with it). A run whose releases all came before any evidence (a plan's delay shorter
        than the jobs' start-up) thus still measures what the history needs. True once done: the
        source fitted, or, when the run has no read counters, the jobs."""
        cpu = time.thread_time()
        try:
            self._keep(look)
            loop_starts = self.loop_starts_at(look, t0_wall)
            if not loop_starts or look.t < max(loop_starts.values()) + WARMUP:
                return False
            counted = [lk.read_bytes for lk in self.looks[-3:]]
            stopped = len(counted) == 3 and counted[0] is not None and counted[0] == counted[1] == counted[2]
            if look.t < max(loop_starts.values()) + WARMUP + WINDOW and not stopped:
                return False
            if not self._fit_source(max(loop_starts.values()) + WARMUP, OBSERVE_MIN) and look.read_bytes is not None:
                return False
            self.fit_jobs(look, loop_starts)
            self.fits.append({"t": look.t, "loops": dict(loop_starts), "seen": dict(self.source_seen),
                              "source": self.beta, "jobs": dict(self.alpha), "after_release": True})
            return True
        finally:
            self.cpu_seconds += time.thread_time() - cpu

    def _decide(self, look: Look, t0_wall: float) -> list[Decision]:
        self._keep(look)
        out: list[Decision] = []
        for group in self.waiting:
            d = self._decide_group(group, look, t0_wall)
            if d is None:
                break
            out.append(d)
        return out

    def _decide_group(self, group: list[str], look: Look, t0_wall: float) -> Decision | None:
        now = look.t
        planned = min(self.planned[n] for n in group)
        if now < self.lo:
            return None
        if now >= self.hi:
            return self.release(group, now, f"upper bound: max_delay {self.hi:g} s reached")
        if self.observe_only and now >= max(planned, self.lo):
            return self.release(group, now, "the plan's delay (observing only: [plan] steer = false)")
        started = [n for n in self.released]
        if started and not self.observe_only and all(look.state.get(n) in ("done", "exited") for n in started):
            return self.release(group, now, "every job started before it has finished")
        loop_starts = self.loop_starts_at(look, t0_wall)
        evidence = any(look.t - s >= WARMUP for s in loop_starts.values())
        if not evidence:
            if now >= planned:
                return self.release(group, now, "the plan's delay (no evidence from the run yet)")
            return None
        due = (self._curve_at is None or now - self._curve_at[0] >= self.gap
               or (self.target is not None and now >= self.target - self.look / 2)
               or self._hold_to_confirm(planned, now))
        if not due:
            return None
        at = self._due_at(planned)
        if self.fit_wall > self.look / 2 and now + self.fit_wall > at:  # a re-fit would end past the due release
            if now < at - self.look / 2:
                return None  # the next look comes at the due time (until_next_look): the fit that stands decides
            if self.target is not None:
                return self.release(group, now, self._why_target(), self._best)
            return self.release(group, now, f"the plan's delay (a re-fit, {self.fit_wall:.2f} s, would end past it)")
        cpu = self.cpu_clock() if self.duty > 0 else 0.0
        wall = self._wall()
        try:
            return self._refit(group, look, planned, loop_starts)
        finally:
            self.fit_wall = max(0.0, self._wall() - wall)
            if self.duty > 0:
                self.gap = max(self.interval, (self.cpu_clock() - cpu) / self.duty)

    def _hold_to_confirm(self, planned: float, now: float) -> bool:
        """Whether the planned delay has come while the standing fit, made before it, holds the group
        past it: such a hold is confirmed by a re-fit then, whatever ``duty`` says. A fit on the first
        second of a cold source can be off several times over (x0.3, then x2.1 to x2.5 three seconds
        later, on ext4 with the page cache dropped), and a hold is the decision that costs most."""
        return (self.target is not None and self._curve_at is not None and self.target > planned + self.look / 2
                and self._curve_at[0] < planned <= now)

    def _due_at(self, planned: float) -> float:
        """When the first waiting group is released unless a re-fit moves it: the fitted best start,
        else the planned delay (no sooner than ``lo``); no later than ``hi``."""
        return min(self.hi, self.target if self.target is not None else max(planned, self.lo))

    def _refit(self, group: list[str], look: Look, planned: float,
               loop_starts: Mapping[str, float]) -> Decision | None:
        """Fit the source and the running jobs, and release ``group`` when the fitted model says now."""
        now = look.t
        self._fit_source(max(loop_starts.values()) + WARMUP)
        if look.read_bytes is not None and not self.source_seen:
            # the cache counts reads, but the source has given no evidence yet: wait for it, and at the
            # plan's delay keep the plan (the jobs' fits alone would only make the release a fit late)
            if now < planned:
                return None
            return self.release(group, now, "the plan's delay (no evidence from the source yet)")
        self.fit_jobs(look, loop_starts)
        extra = min(1.0, max(0.0, self.prefetched())) if self.prefetched is not None else 0.0
        fitted = {"source": self.beta, "prefetch": 1.0 + extra, **{f"job:{k}": v for k, v in self.alpha.items()}}
        moved = (self._curve_at is None
                 or any(abs(v / self._curve_at[1].get(k, 1.0) - 1.0) > MOVED for k, v in fitted.items()))
        if not moved and self._curve_at is not None and self.target is not None:
            self._curve_at = (now, self._curve_at[1])  # the fit stands: no new curve
            if now >= self.target - self.look / 2 and not self.observe_only:
                return self.release(group, now, self._why_target(), self._best)
            return None
        sc, starts = self.scenario(loop_starts)
        if extra > 0:  # what the waiting job prefetched is in the cache too (as if from the start: approximate)
            sc = replace(sc, cache=replace(sc.cache, initial=min(1.0, sc.cache.initial + extra)))
        waiting = [n for g in self.waiting for n in g]
        moving = {sc.job_index(n): self.planned[n] - planned for n in waiting}
        latest = min(self.hi, max(now, planned + self.horizon))
        prior = min(self.priors[n] for n in group)
        r = best_release(sc, starts, moving, max(now, self.lo), latest, prior=prior, min_gain=self.min_gain,
                         jitter=self.jitter)
        self._curve_at = (now, fitted)
        self.target, self._best = r.start, r.makespan
        self._optimum = r.optimum
        done = {n: fraction_done(look.progress.get(n), self.epochs.get(n, 1)) for n in loop_starts}
        self.fits.append({"t": now, "loops": dict(loop_starts), "done": done, "seen": dict(self.source_seen),
                          "source": self.beta, "jobs": dict(self.alpha), "best_start": r.start, "best": r.makespan,
                          "if_now": r.if_now, "optimum_start": r.optimum[0], "optimum": r.optimum[1],
                          "jitter": self.jitter})
        if r.start <= now + self.look / 2 and not self.observe_only:
            return self.release(group, now, self._why_target(now=True), r.if_now)
        return None

    def _why_target(self, *, now: bool = False) -> str:
        """Why the group is released at the current target."""
        s, m = self._optimum
        if self.target is not None and abs(self.target - s) > 1e-9:  # held nearer the plan than the optimum
            return (f"nearest the plan's delay: the fitted model's best start (+{s:.1f} s, predicted makespan "
                    f"{m:.1f} s) gains less than steer_min_gain {self.min_gain:g} (source x{self.beta:.2f})")
        if now:
            return (f"the fitted model: starting now is best (predicted makespan {self._best:.1f} s; "
                    f"source x{self.beta:.2f})")
        return (f"the fitted model's best start has come (predicted makespan {self._best:.1f} s; "
                f"source x{self.beta:.2f})")
