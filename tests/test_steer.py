"""Closed-loop staggering, the pure parts: the model's progress and fits, the source factor, the
release decisions from synthetic looks at a run, and the progress records."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hpcstagger.colocated.progress import ProgressMeter
from hpcstagger.spec.records import fraction_done, read_progress, throughput
from hpcstagger.colocated.watcher import set_host
from hpcstagger.stagger.steering import release_groups, steer_record
from hpcstagger.stagger.steering import Look, SteerLimits, Steering
from hpcstagger.stagger.latefit import LateFits
from hpcstagger.errors import ModelError
from hpcstagger.model import Scenario, optimal_plan, predict
from hpcstagger.model.runfit import (best_release, counted_factor, fit_scale, passage_time, progress_at,
                                    progress_series, source_factor)

from support.model_scenarios import B, scenario

INF = math.inf


def pair(n=1500, bandwidth=(B, 0.55 * B)):
    """The HiPC setting: two I/O-heavy jobs, a cache that holds the data, a lossy source."""
    return scenario(n, ((0.0004, 3), (0.0004, 3)), bandwidth, 1.0, "minio", 20 * B)


def with_source(sc, factor):
    return replace(sc, storage=replace(sc.storage, bandwidth=tuple(b * factor for b in sc.storage.bandwidth)))


def with_cost(sc, name, factor):
    return replace(sc, jobs=tuple(replace(j, sample_time=j.sample_time * factor) if j.name == name else j
                                  for j in sc.jobs))


# ---------------------------------------------------------------------------------------- the model
def test_progress_at_follows_the_prediction():
    sc = pair()
    p = predict(sc, [0.0, 1.0])
    for t in (0.3, 1.5, p.finish["j0"] + 0.1):
        got = progress_at(sc, [0.0, 1.0], t)
        assert got[0] == pytest.approx(min(1.0, got[0]), abs=1e-9)
        assert 0.0 <= got[1] <= got[0] <= 1.0
    assert progress_at(sc, [0.0, 1.0], 0.9)[1] == 0.0  # not started yet
    assert progress_at(sc, [0.0, 1.0], p.makespan + 1.0) == [1.0, 1.0]
    # a slower source: less done by the same time
    assert progress_at(with_source(sc, 0.5), [0.0, INF], 1.0)[0] < progress_at(sc, [0.0, INF], 1.0)[0]
    with pytest.raises(ModelError, match="2 jobs"):
        progress_at(sc, [0.0], 1.0)


def test_fit_scale_recovers_a_known_factor_and_says_when_it_cannot():
    sc = pair()
    truth = with_source(sc, 0.7)
    def measure(s):
        return progress_at(s, [0.0, INF], 0.6)[0]

    seen = measure(truth)
    # the family "the source at 1/a of its calibrated speed": a comes back near 1/0.7
    a = fit_scale(lambda a: with_source(sc, 1.0 / a), measure, seen)
    assert a == pytest.approx(1 / 0.7, rel=0.03)
    # progress beyond what the range explains is clipped to its ends
    assert fit_scale(lambda a: with_source(sc, 1.0 / a), measure, 1.0) == 0.25
    assert fit_scale(lambda a: with_source(sc, 1.0 / a), measure, 0.0) == 4.0
    # a factor the progress does not depend on (an I/O-bound job's tiny CPU cost) stays 1
    assert fit_scale(lambda a: with_cost(sc, "j0", a), measure, seen, lo=0.9, hi=1.1, flat=0.5) == 1.0
    # over a window: the same factor from the progress between two times
    window = progress_series(truth, [0.0, INF], [0.3, 0.6])
    a = fit_scale(lambda a: with_source(sc, 1.0 / a),
                  lambda s: (lambda p: p[1][0] - p[0][0])(progress_series(s, [0.0, INF], [0.3, 0.6])),
                  window[1][0] - window[0][0])
    assert a == pytest.approx(1 / 0.7, rel=0.05)
    with pytest.raises(ModelError):
        fit_scale(lambda a: sc, measure, seen, lo=2.0)
    # with probes: a measure that falls everywhere gives the same factor; one that rises on the way
    # (a job that hits more when slowed down) gives None, however well one factor matches
    family = lambda a: with_source(sc, 1.0 / a)  # noqa: E731
    assert fit_scale(family, measure, seen, probes=3) == pytest.approx(1 / 0.7, rel=0.03)
    bump = {0.5: 0.6, 1.0: 0.7, 2.0: 0.3}
    nearest = lambda a: bump[min(bump, key=lambda k: abs(math.log(k / a)))]  # noqa: E731
    assert fit_scale(lambda a: a, nearest, 0.45, lo=0.5, hi=2.0, probes=3) is None
    assert fit_scale(lambda a: a, nearest, 0.45, lo=0.5, hi=2.0) is not None  # without probes it cannot tell
    # the probes fall on the bisection's first midpoints: each factor is run once, and the answer
    # is the one without probes
    calls = []
    falling = lambda a: calls.append(a) or 1.0 / a  # noqa: E731
    plain = fit_scale(lambda a: a, falling, 1 / 1.3, iterations=6)
    assert len(calls) == 2 + 6
    calls.clear()
    assert fit_scale(lambda a: a, falling, 1 / 1.3, iterations=6, probes=3) == pytest.approx(plain, rel=1e-12)
    assert len(calls) == 2 + 3 + 6 - 2 and len({round(math.log(a), 9) for a in calls}) == len(calls)


def test_passage_time_reads_the_models_progress_between_two_fractions():
    sc = scenario(1000, ((0.002, 1),))  # one job alone, compute-bound: 2 s, at a steady rate
    took = passage_time(sc, [0.5], 0, 0.25, 0.75, 4.0)
    assert took == pytest.approx(1.0, rel=0.02)
    assert passage_time(with_cost(sc, "j0", 1.5), [0.5], 0, 0.25, 0.75, 4.0) == pytest.approx(1.5, rel=0.02)
    assert passage_time(sc, [0.5], 0, 0.25, 0.75, 1.5) == math.inf  # not there by the horizon
    with pytest.raises(ModelError, match="lo < hi"):
        passage_time(sc, [0.5], 0, 0.75, 0.25, 4.0)


def test_best_release_matches_the_plan_and_moves_with_the_source():
    sc = pair()
    plan = optimal_plan(sc, jitter=0.0)
    planned = plan.delays["j0"] or plan.delays["j1"]
    late = "j0" if plan.delays["j0"] > 0 else "j1"
    k = sc.job_index(late)
    starts = [0.0, 0.0]
    r = best_release(sc, starts, {k: 0.0}, 0.0, 3 * planned)
    assert r.start == pytest.approx(planned, abs=0.1 * planned)
    assert r.makespan == pytest.approx(plan.makespan, rel=0.02) and r.if_now >= r.makespan
    # a slower source than calibrated: the best release comes later
    slow = best_release(with_source(sc, 0.7), starts, {k: 0.0}, 0.0, 3 * planned)
    assert slow.start > r.start * 1.15
    # asked past the best start, starting now is best
    now = best_release(sc, starts, {k: 0.0}, 2 * planned, 3 * planned)
    assert now.start == 2 * planned and now.makespan == now.if_now
    one = best_release(sc, starts, {k: 0.0}, 1.0, 1.0)  # no room: the earliest start, one point
    assert one.start == 1.0 and one.curve == ((1.0, one.if_now),)
    with pytest.raises(ModelError):
        best_release(sc, [0.0], {k: 0.0}, 0.0, 1.0)


# a calibrated pair (bench_steer's pair-w2-b64): a CPU-heavy job and a light one that follows it
# through the cache in the same order; its makespan curve falls steeply to the best release, then
# rises gently: a release a little early costs far more than one a little late
FOLLOWER = """
[dataset]
samples = 3072
sample_bytes = 3073.0
[storage]
bandwidth = [5.32e6, 3.08e6, 3.15e6, 3.19e6]
[cache]
capacity = 9777303.0
hit_bandwidth = 2.08e9
[node]
cores = 2
[[job]]
name = "cnn"
sample_time = 0.000323
epochs = 2
workers = 2
batch = 64
handoff = 0.00092
prep_time = 0.000112
startup = 0.82
order = "DistributedSampler(seed=0)"
[[job]]
name = "mlp"
sample_time = 0.0000379
epochs = 2
workers = 2
batch = 64
handoff = 0.00067
prep_time = 0.000046
startup = 0.98
order = "DistributedSampler(seed=0)"
"""


def test_best_release_over_a_start_spread_moves_off_the_cliff_edge():
    import tomllib

    sc = Scenario.from_dict(tomllib.loads(FOLLOWER))
    k, J = sc.job_index("mlp"), 0.25

    def at(x):
        return predict(sc, [max(0.0, x) if j == k else 0.0 for j in range(2)]).makespan

    def spread(x):
        return sum(at(x + u * J) for u in (-1.0, -0.5, 0.0, 0.5, 1.0)) / 5

    exact = best_release(sc, [0.0, 0.0], {k: 0.0}, 1.8, 10.0)
    assert at(exact.start - J) - at(exact.start) > 2 * (at(exact.start + J) - at(exact.start))  # the cliff
    wide = best_release(sc, [0.0, 0.0], {k: 0.0}, 1.8, 10.0, jitter=J)
    assert wide.start > exact.start + 0.05 and spread(wide.start) < spread(exact.start)
    assert wide.makespan == pytest.approx(at(wide.start), rel=0.02)  # the makespan at the start itself
    assert wide.optimum[0] == wide.start
    # with the plan's start as the prior, the band of starts within min_gain is judged by the spread
    prior = wide.start + 0.3
    gain = spread(prior) / spread(wide.start) - 1.0
    kept = best_release(sc, [0.0, 0.0], {k: 0.0}, 1.8, 10.0, jitter=J, prior=prior, min_gain=2 * gain + 0.005)
    assert kept.start == pytest.approx(prior) and kept.optimum[0] == wide.start
    # asked past the best start, starting now is still best
    late = best_release(sc, [0.0, 0.0], {k: 0.0}, wide.start + 2.0, 10.0, jitter=J)
    assert late.start == wide.start + 2.0


def test_spread_means_interpolate_and_hold_flat_beyond_the_ends():
    from hpcstagger.model.runfit import _spread_means

    curve = [(0.0, 10.0), (1.0, 6.0), (2.0, 7.0)]
    m = _spread_means(curve, 0.5, [1.0, 0.0, 2.0])
    assert m[1.0] == pytest.approx((8.0 + 7.0 + 6.0 + 6.25 + 6.5) / 5)
    assert m[0.0] == pytest.approx((10.0 + 10.0 + 10.0 + 9.0 + 8.0) / 5)
    assert m[2.0] == pytest.approx((6.5 + 6.75 + 7.0 + 7.0 + 7.0) / 5)


def test_best_release_keeps_the_prior_unless_moving_gains_enough():
    sc = pair()
    plan = optimal_plan(sc, jitter=0.0)
    late = max(sc.job_names, key=lambda n: plan.delays[n])
    k, planned = sc.job_index(late), plan.delays[late]
    free = best_release(with_source(sc, 0.85), [0.0, 0.0], {k: 0.0}, 0.0, 3 * planned)
    assert free.optimum == (free.start, free.makespan) and free.start > planned  # a little slower: later
    at_plan = predict(with_source(sc, 0.85), [planned if j == k else 0.0 for j in range(2)]).makespan
    gain = at_plan / free.makespan - 1.0
    assert 0.0 < gain < 0.05
    # a tolerance above the predicted gain: the plan's start is kept, the optimum still reported
    kept = best_release(with_source(sc, 0.85), [0.0, 0.0], {k: 0.0}, 0.0, 3 * planned,
                        prior=planned, min_gain=2 * gain + 0.001)
    assert kept.start == pytest.approx(planned) and kept.makespan >= kept.optimum[1]
    assert kept.optimum[0] == pytest.approx(free.start, abs=1e-9)
    # below it: the move stands (as near the prior as the tolerance allows, never past the optimum)
    moved = best_release(with_source(sc, 0.85), [0.0, 0.0], {k: 0.0}, 0.0, 3 * planned,
                         prior=planned, min_gain=gain / 4)
    assert planned < moved.start <= free.start and moved.makespan <= free.makespan * (1 + gain / 4)
    # a prior already passed: the earliest start is the nearest
    past = best_release(sc, [0.0, 0.0], {k: 0.0}, 1.5 * planned, 3 * planned, prior=planned, min_gain=0.5)
    assert past.start == 1.5 * planned


def test_source_factor_is_one_for_the_calibrated_curve_and_scales():
    curve = [4.7e6, 2.9e6, 3.0e6, 3.0e6]
    # one reader always reading: the 1-reader bandwidth
    assert source_factor(curve, 1, 4.7e6, 1.0, 1.0) == pytest.approx(1.0)
    # two readers always reading: each got half the 2-reader aggregate
    assert source_factor(curve, 2, 2.9e6, 2.0, 1.0) == pytest.approx(1.0, rel=1e-6)
    assert source_factor(curve, 2, 0.8 * 2.9e6, 2.0, 1.0) == pytest.approx(0.8, rel=1e-6)
    # between: under the product-form law, 1.5 reads in flight on average carry less than the
    # linear mix of the per-read bandwidths (a read sees the others more often than time does)
    k = 1.5
    got = source_factor(curve, 2, 1.0, 1.0, 1.0 / k)
    assert got is not None and got > 0
    assert source_factor(curve, 2, 0.0, 1.0, 1.0) is None and source_factor(curve, 0, 1.0, 1.0, 1.0) is None


# ------------------------------------------------------------------------------------- the decisions
def _steering(truth_factor=1.0, sc=None, truth=None, **kw):
    """A Steering over the pair (or ``sc``), with looks generated from the same scenario whose
    source runs at ``truth_factor`` of the calibrated speed (or from ``truth``); returns
    (steering, a function t -> Look, the planned delay, the waiting job)."""
    sc = sc or pair()
    plan = optimal_plan(sc, jitter=0.0)
    order = list(sc.job_names)
    truth = truth or with_source(sc, truth_factor)
    late = max(order, key=lambda n: plan.delays[n])
    first = [n for n in order if n != late][0]

    def build(beta, alpha):
        out = with_source(sc, beta)
        for name, a in alpha.items():
            out = with_cost(out, name, a)
        return out

    other = {k: kw.pop(k) for k in ("baseline", "jitter", "cpu_clock", "wall_clock", "device") if k in kw}
    other.setdefault("wall_clock", lambda: 0.0)  # re-fits take no time, unless a test says otherwise
    hold = kw.pop("hold", None)
    delays = dict(plan.delays)
    if hold is not None:  # a guarded plan: the model chose ``plan.delays``, the late job is held to ``hold``
        late = max(order, key=lambda n: plan.staggered.get(n, 0.0)) if not any(delays.values()) else late
        first = [n for n in order if n != late][0]
        other["priors"], delays = dict(plan.delays), {first: 0.0, late: hold}
    st = Steering(build, sc.storage.bandwidth, order, delays, {n: 3 for n in order},
                  SteerLimits(interval=0.25, **kw), **other)
    fetch_bw = truth.storage.bandwidth[0]  # one fetcher of the first job, always reading

    per = 500  # batches per epoch in the progress record
    starts = [0.0 if n == first else INF for n in order]

    def look(t):
        stamps = [0.25 * k for k in range(int(t / 0.25) + 1)]
        done = [p[order.index(first)] for p in progress_series(truth, starts, stamps)]
        epoch = min(3, int(done[-1] * 3) + 1)
        within = done[-1] * 3 - (epoch - 1)
        rec = {"loop_start": 1000.0, "epoch": epoch, "batches": round(within * per), "per_epoch": per,
               "history": [[x, d * 3 * per] for x, d in zip(stamps, done, strict=True)]}
        return Look(t=t, read_bytes=fetch_bw * t * 0.9, read_seconds=0.9 * t, progress={first: rec},
                    state={first: "started"})

    return st, look, delays[late], late


def _run(st, look, until=20.0, dt=0.25):
    t = 0.0
    for n in st.groups[0]:
        st.released[n] = 0.0
    while st.waiting and t < until:
        t += dt
        st.decide(look(t), 1000.0)
    return st.decisions


def test_a_right_calibration_releases_near_the_plan():
    st, look, planned, late = _steering(1.0)
    (d,) = _run(st, look)
    assert d.jobs == [late] and "fitted model" in d.reason
    assert d.at == pytest.approx(planned, abs=0.35)
    assert st.beta == pytest.approx(1.0, rel=0.05)


def test_a_slow_re_fit_puts_the_next_one_off_by_its_cost_over_the_duty():
    """Each re-fit charged 0.1 CPU-s (two clock reads, at its start and its end) against a duty of
    0.05 of a core: the next re-fit waits 2 s instead of one interval (0.25 s). With the source
    30% slower than calibrated, the release moves as it did with a re-fit at every interval."""
    reads = [0]

    def clock():
        reads[0] += 1
        return 0.1 * reads[0]

    def counted(st):
        calls = [0]
        refit = st._refit

        def counting(*args):
            calls[0] += 1
            return refit(*args)
        st._refit = counting
        return calls

    fast, look, planned, late = _steering(0.7)
    slow, look_slow, _, _ = _steering(0.7, duty=0.05, cpu_clock=clock)
    fast_fits, slow_fits = counted(fast), counted(slow)
    (df,) = _run(fast, look)
    (ds,) = _run(slow, look_slow)
    assert df.at > planned and ds.at == pytest.approx(df.at, abs=0.3)
    assert fast.gap == 0.25 and slow.gap == pytest.approx(2.0)
    assert reads[0] == 2 * slow_fits[0]  # the clock is read around each re-fit, and only there
    # from the first fit (0.75 s) to the release (2 s): every 0.25 s, or 2 s apart and once more at
    # the planned delay, where a hold past it is checked
    assert fast_fits[0] >= 5 and slow_fits[0] <= 4, (fast_fits, slow_fits)


def test_a_hold_past_the_plan_is_checked_when_the_planned_delay_comes():
    """The first fit sees a cold source (x0.3 of the calibration) and holds the late job seconds past
    its planned delay; each fit costs 0.5 CPU-s, which at a duty of 0.05 puts the next one 10 s off.
    From 1 s on the source runs as calibrated. When the planned delay comes, the hold is checked
    by a re-fit all the same, and the job goes then, not at the first fit's target."""
    reads = [0]

    def clock():
        reads[0] += 1
        return 0.5 * reads[0]

    st, look, planned, late = _steering(1.0, duty=0.05, cpu_clock=clock)
    _, cold, _, _ = _steering(0.3)
    (d,) = _run(st, lambda t: cold(t) if t <= 1.0 else look(t))
    first, second = st.fits[0], st.fits[1]
    assert first["t"] < planned and first["source"] == pytest.approx(0.3, rel=0.1)
    assert first["best_start"] > planned + 2.0  # the cold fit held the job well past the plan
    assert st.gap == pytest.approx(10.0)  # and the duty alone would re-fit only 10 s later
    assert second["t"] == pytest.approx(planned, abs=0.26) and second["source"] > 1.0
    assert d.jobs == [late] and d.at == pytest.approx(planned, abs=0.26) and "fitted model" in d.reason


def _run_slow_fits(fit_seconds, measured=True, slowed="_refit", blind=False, **kw):
    """Steer on a clock that a re-fit advances by ``fit_seconds`` (a fit at a lowered priority on a
    busy node); looks come when :meth:`Steering.until_next_look` says. The watcher measures the
    fits' wall time on that clock, or (``measured=False``) sees them take none. ``slowed`` names
    the step that takes the time (``"fit_jobs"``: only fits that reach the jobs); ``blind`` looks
    count reads but see none (the source gives no evidence). Returns the steering, the planned
    delay, the release and the clock when the release was sent."""
    clock = [0.0]
    st, look, planned, late = _steering(1.0, wall_clock=(lambda: clock[0]) if measured else (lambda: 0.0), **kw)
    step = getattr(st, slowed)

    def slow(*args):
        clock[0] += fit_seconds
        return step(*args)
    setattr(st, slowed, slow)
    for n in st.groups[0]:
        st.released[n] = 0.0
    while st.waiting and clock[0] < 20.0:
        clock[0] += max(0.01, st.until_next_look(clock[0]))
        seen = look(clock[0])
        ds = st.decide(replace(seen, read_bytes=0.0, read_seconds=0.0) if blind else seen, 1000.0)
        if ds:
            return st, planned, ds[0], clock[0]
    raise AssertionError("no release")


def test_a_re_fit_that_would_end_past_the_due_release_is_not_started():
    """Re-fits that take 0.3 s of wall time: a fit started less than that before the release that is
    due would make it late. The watcher keeps to the due time with the fit that stands."""
    st, planned, d, sent = _run_slow_fits(0.3, observe_only=True)
    assert st.fit_wall == pytest.approx(0.3)  # it fitted, and measured the fits' time
    assert d.at == pytest.approx(planned, abs=0.02) and sent == pytest.approx(d.at)
    _, _, late_d, late_sent = _run_slow_fits(0.3, measured=False, observe_only=True)  # blind to the fits' time
    assert late_sent > planned + 0.1, (late_sent, planned)  # ... the release comes a fit late
    st, planned, d, sent = _run_slow_fits(0.3)  # steering, with the calibration right
    assert d.at == pytest.approx(planned, abs=0.35) and sent == pytest.approx(d.at)
    assert "fitted model" in d.reason or "plan's delay" in d.reason


def test_without_the_sources_evidence_the_planned_delay_is_kept_on_time():
    """The cache counts reads, but none show by the planned delay (on a real file system, a page
    cache serving every read gives the device fit nothing). A fit of the jobs alone takes 0.5 s of
    wall time here (at a lowered priority on a busy node); the look before the delay costs little.
    No fit can say more than the plan then, so the group goes at its delay, not a fit later."""
    st, planned, d, sent = _run_slow_fits(0.5, slowed="fit_jobs", blind=True)
    assert sent == pytest.approx(planned, abs=0.02), "the release was sent a fit late"
    assert d.at == pytest.approx(planned, abs=0.02) and st.decisions == [d]
    assert d.reason == "the plan's delay (no evidence from the source yet)"
    assert not st.fits and not st.source_seen and st.beta == 1.0


@pytest.mark.parametrize("factor, direction", [(0.7, "later"), (1.3, "earlier")])
def test_a_source_off_by_30_percent_moves_the_release(factor, direction):
    st, look, planned, late = _steering(factor)
    (d,) = _run(st, look)
    assert st.beta == pytest.approx(factor, rel=0.05)
    assert (d.at > planned + 0.2) if direction == "later" else (d.at < planned - 0.1)
    # the release is close to the best start for the truth
    truth_best = optimal_plan(with_source(pair(), factor), jitter=0.0).delays[late]
    assert d.at == pytest.approx(truth_best, abs=0.4)


def test_a_small_misfit_keeps_the_plan_under_steer_min_gain():
    # the source 15% slower than calibrated: the fitted model's best start is a little later, for a
    # small predicted gain; under a min_gain above it the plan's delay is kept, and the reason says so
    st, look, planned, late = _steering(0.85)
    (free,) = _run(st, look)
    assert free.at > planned + 0.1 and "nearest the plan" not in free.reason
    gains = [f["best"] / f["optimum"] - 1.0 for f in st.fits]
    assert all(abs(g) < 1e-9 for g in gains)  # min_gain 0: the start is the optimum
    st, look, planned, late = _steering(0.85, min_gain=0.2)
    (kept,) = _run(st, look)
    assert kept.at == pytest.approx(planned, abs=0.3) and kept.at < free.at
    assert "nearest the plan's delay" in kept.reason and "steer_min_gain 0.2" in kept.reason
    assert st.fits[-1]["optimum_start"] > st.fits[-1]["best_start"]


def test_a_guarded_hold_is_released_at_the_first_evidence_when_starting_at_once_was_right():
    """The model chose a simultaneous start (a fast source) and the plan holds a job to +6 s as a
    guard: the run confirms the model, and the watcher releases the job at its first fit."""
    fast = with_source(pair(), 3.0)
    assert not any(optimal_plan(fast, jitter=0.0).delays.values())
    st, look, held, late = _steering(1.0, sc=fast, hold=6.0, min_gain=0.01)
    (d,) = _run(st, look)
    assert held == 6.0 and d.at < 2.0 and "fitted model" in d.reason, d
    assert st.priors == {n: 0.0 for n in st.order} and st.planned[late] == 6.0


def test_a_guarded_hold_keeps_the_job_waiting_when_the_source_is_slower_than_calibrated():
    """The guard's case: calibrated, the source looked fast enough to start together; the run
    shows it 3x slower, and the held job waits for the fitted model's best start, not the prior."""
    fast = with_source(pair(), 3.0)
    st, look, held, late = _steering(1 / 3.0, sc=fast, hold=6.0, min_gain=0.01)
    (d,) = _run(st, look)
    truth_best = optimal_plan(pair(), jitter=0.0).delays[late]
    assert st.beta == pytest.approx(1 / 3.0, rel=0.1)
    assert truth_best > 0.75 and d.at == pytest.approx(truth_best, abs=0.3), (d, truth_best)


def test_the_next_look_comes_when_a_release_may_come_due():
    planned_hi = 50.0
    st, look, planned, late = _steering(1.0, hi=planned_hi)
    for n in st.groups[0]:
        st.released[n] = 0.0
    assert st.until_next_look(0.0) == st.look  # nothing due within a look
    assert st.until_next_look(planned - 0.1) == pytest.approx(0.1)  # the plan's delay, exactly
    assert st.until_next_look(planned + 0.01) == st.look  # past it: the look period again
    st.target = planned + 0.5
    assert st.until_next_look(planned + 0.4) == pytest.approx(0.1)  # the best start found
    assert st.until_next_look(planned_hi - 0.05) == pytest.approx(0.05)  # the upper bound
    st.released[late] = planned
    assert not st.waiting and st.until_next_look(0.0) == st.look


def test_after_releases_that_came_before_any_evidence_the_run_is_still_fitted():
    # a plan's delay shorter than the jobs' start-up: every group is out before the loops say
    # anything; the watcher fits afterwards so that the history still learns from the run
    st, look, planned, late = _steering(0.7)
    for n in st.order:
        st.released[n] = 0.0
    assert not st.waiting and not st.fits

    def counted(t):  # the reads counted in flight: one at a time, 0.9 of the time
        return replace(look(t), flight=[0.9 * t] + [0.0] * 31)

    assert not st.observe(counted(0.25), 1000.0)  # the loop is not warm yet: no evidence
    t, done = 0.25, False
    while not done and t < 10.0:
        t += 0.25
        done = st.observe(counted(t), 1000.0)
    assert done and 3.5 <= t < 4.0  # a full window after the warm-up
    assert st.source_seen and st.beta == pytest.approx(0.7, rel=0.1)
    assert st.fits[-1]["after_release"] and st.fits[-1]["source"] == st.beta and st.cpu_seconds > 0
    assert st.source_seen["estimator"] == "reads in flight counted"
    # the same run with its reads not counted in flight (jobs that load in their main process):
    # the source is fitted to the mean in flight
    st, look, planned, late = _steering(0.7)
    for n in st.order:
        st.released[n] = 0.0
    t, done = 0.25, False
    while not done and t < 10.0:
        t += 0.25
        done = st.observe(replace(look(t), flight=None), 1000.0)
    assert done and st.source_seen["estimator"] == "mean in flight" and st.fits[-1]["after_release"]


@pytest.mark.parametrize("more, late_by", [(4, 0.3), (9, 0.3), (3, 1.2)])
def test_a_job_that_follows_through_the_cache_is_fitted_after_the_releases_on_its_own_costs(more, late_by):
    # j0 reads the source (1 ms a sample alone); j1 computes 0.3 ms a sample (0.24 ms in truth),
    # starts 0.3 s later and catches j0 up: until the cache is full its progress is j0's, whatever
    # its costs, and only later, reading what is cached, does it show them. j1 runs ``more`` epochs:
    # 4 end 1.25 s after the reads stop, 9 run 2 s past that. Started 1.2 s late, 3 epochs: j1 ends
    # 1 s after the reads stop, its window from its first epoch on, where the model's j1 at half its
    # costs would have caught j0 up and gone no faster
    sc = scenario(1500, ((0.0002, 2), (0.0003, more)), (B, 0.55 * B), 1.0, "minio", 20 * B)
    truth, starts, order, per, epochs = with_cost(sc, "j1", 0.8), [0.0, late_by], ["j0", "j1"], 100, [2, more]
    epochs_of = {"j0": 2, "j1": more}

    def build(beta, alpha):
        out = with_source(sc, beta)
        for name, a in alpha.items():
            out = with_cost(out, name, a)
        return out

    st = Steering(build, sc.storage.bandwidth, order, {"j0": 0.0, "j1": late_by}, epochs_of,
                  SteerLimits(interval=0.5), wall_clock=lambda: 0.0)
    st.released = {"j0": 0.0, "j1": late_by}
    st.alpha["j1"] = 1.3  # what a window of its first epoch gave: the late fit replaces it
    late = LateFits(st)

    def look(t):  # each job's record ends where it finished; the source reads j0's first epoch
        stamps = [0.05 * k for k in range(int(t / 0.05) + 1)]
        series = progress_series(truth, starts, stamps)
        progress, state = {}, {}
        for i, n in enumerate(order):
            hist = [[x - starts[i], p[i] * epochs[i] * per] for x, p in zip(stamps, series, strict=True)
                    if x >= starts[i]]
            ended = [k for k, h in enumerate(hist) if h[1] >= epochs[i] * per - 1e-9]
            progress[n] = {"loop_start": 1000.0 + starts[i], "per_epoch": per, "history": hist[:ended[0] + 1]
                           if ended else hist}
            state[n] = "done" if ended else "started"
        read = min(1.0, 2.0 * series[-1][0]) * sc.dataset.samples * sc.dataset.sample_bytes
        return Look(t=t, read_bytes=read, read_seconds=0.0, progress=progress, state=state)

    t, tried, stopped = 0.5, [], None
    while "j1" not in late.seen and t < 6.0:
        t += 0.25
        before, seen = st.cpu_seconds, look(t)
        stopped = stopped or (t if seen.read_bytes >= sc.dataset.samples * sc.dataset.sample_bytes else None)
        done = late.observe(seen, 1000.0)
        tried += [t] if st.cpu_seconds > before else []
        assert done == ("j1" in late.seen)
    # no fit while the source reads (j1 follows j0 then), nor on less than 2 s after: one fit, of all
    # j1's progress since the reads stopped when it has ended, or of 2 s of it while it runs on
    assert stopped and len(tried) == 1 and tried[0] > stopped + 0.5, (stopped, tried)
    assert look(tried[0]).state["j1"] == ("started" if more == 9 else "done")
    assert more != 9 or tried[0] == pytest.approx(stopped + 2.0, abs=0.26)
    assert st.alpha == {"j1": pytest.approx(0.8, rel=0.05)}, st.alpha  # j0 did not wait: not fitted
    assert st.fits[-1]["after_release"] and st.fits[-1]["late"] == ["j1"]
    before = st.cpu_seconds
    assert late.observe(look(t + 1.0), 1000.0) and st.cpu_seconds == before  # nothing left to fit
    # the same run seen only until j1 ended, 0.25 s after the reads stopped: too short a window, no
    # factor, and nothing left to do; a run without a cache has nothing to fit
    short = Steering(build, sc.storage.bandwidth, order, {"j0": 0.0, "j1": late_by}, epochs_of,
                     SteerLimits(interval=0.5), wall_clock=lambda: 0.0)
    short.released, short_late = dict(st.released), LateFits(short)
    for x in (stopped - 0.25, stopped):
        assert not short_late.observe(look(x), 1000.0)
    assert short_late.observe(replace(look(stopped + 0.25), state={"j0": "done", "j1": "done"}), 1000.0)
    assert not short.alpha and LateFits(short).observe(replace(look(t), read_bytes=None), 1000.0)


def test_a_compute_bound_job_off_by_30_percent_is_fitted():
    # the first job computes 1.5 ms a sample (reads take 1 ms): its progress tells its CPU speed
    sc = scenario(1500, ((0.0015, 3), (0.0004, 3)), (B, 0.55 * B), 1.0, "minio", 20 * B)
    first = sc.job_names[0]
    st, look, planned, late = _steering(sc=sc, truth=with_cost(sc, first, 0.7))
    assert late != first  # the I/O-heavy job waits for the compute-bound one
    _run(st, look)
    assert st.alpha[first] == pytest.approx(0.7, rel=0.08)


def test_bounds_and_the_prior_without_evidence():
    st, look, planned, late = _steering(1.0, hi=0.5)
    (d,) = _run(st, look)
    assert d.at == pytest.approx(0.5) and "max_delay" in d.reason
    st, look, planned, late = _steering(1.0, lo=planned + 1.0)
    (d,) = _run(st, look)
    assert d.at >= planned + 1.0
    # no evidence at all (no counters, no progress): released at the plan's delay
    st, _, planned, late = _steering(1.0)
    (d,) = _run(st, lambda t: Look(t=t))
    assert d.at == pytest.approx(planned, abs=0.26) and "no evidence" in d.reason
    # every job started before has finished: released at once
    st, look, planned, late = _steering(1.0)
    done = lambda t: Look(t=t, state={n: "done" for n in st.order})  # noqa: E731
    (d,) = _run(st, done)
    assert d.at == 0.25 and "finished" in d.reason


def test_the_source_fit_ignores_the_time_after_the_reads_stop():
    # reads at the 1-reader bandwidth x 0.7 until t = 1 s, then none (the cache holds everything)
    st, _, _, _ = _steering(1.0, lo=100.0)
    bw = st.bandwidth[0] * 0.7
    for k in range(1, 30):
        t = 0.25 * k
        busy = min(t, 1.0)
        st.looks.append(Look(t=t, read_bytes=bw * busy, read_seconds=busy))
        if st._fit_source(0.0):
            assert st.beta == pytest.approx(0.7, rel=0.02), (t, st.beta)
    assert st.source_seen["window"] <= 1.0


def test_the_source_fit_uses_the_counted_reads_in_flight_when_it_has_them():
    # the source at 0.7 of its calibration; per second, 0.6 s with one read in flight and 0.4 s
    # with three (a job that reads often beside one that seldom does: a mix the mean cannot tell)
    st, _, _, late = _steering(1.0, lo=100.0)
    st.released.update({n: 0.0 for n in st.order})
    st._fetch = {n: 2 for n in st.order}  # two jobs of two fetchers each
    bw = list(st.bandwidth) + [st.bandwidth[-1]]
    per_s = 0.7 * (0.6 * bw[0] + 0.4 * bw[2])
    looks = [Look(t=0.25 * k, read_bytes=per_s * 0.25 * k, read_seconds=(0.6 + 3 * 0.4) * 0.25 * k,
                  flight=[0.6 * 0.25 * k, 0.0, 0.4 * 0.25 * k] + [0.0] * 29) for k in range(1, 13)]
    st.looks = looks
    assert st._fit_source(0.0)
    assert st.beta == pytest.approx(0.7, rel=1e-6) and st.source_seen["estimator"] == "reads in flight counted"
    # the same counters without the count: the mean-in-flight law, which this mix fools
    st.looks = [replace(lk, flight=None) for lk in looks]
    assert st._fit_source(0.0)
    assert st.source_seen["estimator"] == "mean in flight" and abs(st.beta / 0.7 - 1) > 0.03
    # counts that cover too little of the read time (reads not bracketed) are not trusted
    st.looks = [replace(lk, flight=[0.1 * x for x in lk.flight]) for lk in looks]
    assert st._fit_source(0.0) and st.source_seen["estimator"] == "mean in flight"


def test_the_counted_source_fit_is_taken_relative_to_the_calibrations_baseline():
    # the jobs' reads got 0.85 of the curve while calibrated, and get 0.85 of it now: as calibrated
    st, _, _, _ = _steering(1.0, lo=100.0, baseline=0.85)
    st.released.update({n: 0.0 for n in st.order})
    bw = st.bandwidth[0]
    st.looks = [Look(t=0.25 * k, read_bytes=0.85 * bw * 0.25 * k, read_seconds=0.25 * k,
                     flight=[0.25 * k] + [0.0] * 31) for k in range(1, 13)]
    assert st._fit_source(0.0)
    assert st.beta == pytest.approx(1.0, rel=1e-6) and st.source_seen["baseline"] == 0.85
    # a source at 0.7 of its calibration is still 0.7 against that baseline
    st.looks = [replace(lk, read_bytes=0.7 * 0.85 * bw * lk.t) for lk in st.looks]
    assert st._fit_source(0.0) and st.beta == pytest.approx(0.7, rel=1e-6)
    # the mean-in-flight fallback has no baseline: the calibration measured the counted fit only
    st.looks = [replace(lk, flight=None) for lk in st.looks]
    plain, _, _, _ = _steering(1.0, lo=100.0)
    plain.released, plain.looks = dict(st.released), list(st.looks)
    assert st._fit_source(0.0) and plain._fit_source(0.0) and st.source_seen["estimator"] == "mean in flight"
    assert st.beta == plain.beta
    # a baseline that is not a positive number is ignored
    for bad in (0.0, -1.0, float("nan")):
        assert _steering(1.0, baseline=bad)[0].baseline == 1.0


def test_where_the_page_cache_is_the_cache_the_source_is_fitted_to_the_devices_bytes():
    # readahead of 4 samples' worth with the pages dropped: each sample read costs the device four
    # samples' bytes, so the cache counts 1/4 of the curve in samples while the device delivers all
    # of it; once the page cache holds most of the file, the cache counts several times the curve
    sc = pair()
    sc = replace(sc, cache=replace(sc.cache, readahead=4.0, coalesce=True))
    st, _, _, _ = _steering(1.0, sc=sc, lo=100.0, baseline=0.85, device=True)
    st.released.update({n: 0.0 for n in st.order})
    bw = st.bandwidth[0]

    def looks(counted, device, n=13):  # bytes/s in samples counted by the cache, and read by the device
        return [Look(t=0.25 * k, read_bytes=counted * bw * 0.25 * k, read_seconds=0.25 * k,
                     flight=[0.25 * k] + [0.0] * 31, device_bytes=1e9 + device * bw * 0.25 * k) for k in range(1, n)]

    st.looks = cold = looks(0.9 / 4, 0.9)
    assert st._fit_source(0.0)
    assert st.beta == pytest.approx(0.9, rel=1e-6)  # the device's bytes, with no calibration baseline
    assert st.source_seen["estimator"] == "device bytes, reads in flight counted" and st.source_seen["baseline"] == 1.0
    assert st.source_seen["device_bytes_per_s"] == pytest.approx(0.9 * bw)
    # the same looks fitted to the cache's count: a quarter of the curve, what a cold first fit held a job on
    plain, _, _, _ = _steering(1.0, sc=sc, lo=100.0)
    plain.released, plain.looks = dict(st.released), list(cold)
    assert plain._fit_source(0.0) and plain.beta == 0.25  # 0.225, at the fit's lower bound
    # the page cache serving 2 of 5 reads: still the device's speed
    st.looks = looks(0.9 / 4 / 0.6, 0.9)
    assert st._fit_source(0.0) and st.beta == pytest.approx(0.9, rel=1e-6)
    # serving most of them (the cache counts 3x the curve): their time in flight is not the device's,
    # so nothing is fitted; nor where the device read nothing
    for counted, device in ((3.0, 0.9), (3.0, 0.0)):
        st.beta = 1.3
        st.looks = looks(counted, device)
        assert not st._fit_source(0.0) and st.beta == 1.3
        plain.looks = looks(counted, device)
        assert plain._fit_source(0.0) and plain.beta > 2.5
    # a window under a second: the device's bursts; the cache's count fits it
    st.looks = plain.looks = cold[:4]
    assert not st._fit_source(0.0) and plain._fit_source(0.0)
    # looks without the device's count (a file system without a block device): the cache's count
    st.looks = [replace(lk, device_bytes=None) for lk in cold]
    assert st._fit_source(0.0) and st.source_seen["estimator"] == "reads in flight counted"
    assert st.beta == pytest.approx(0.9 / 4 / 0.85, rel=1e-6)


def test_counted_factor():
    bw = [4.0e6, 6.0e6, 6.0e6]
    # 1 s with one read in flight, 1 s with two, 0.5 s with four (the curve's last value holds)
    spent = [1.0, 1.0, 0.0, 0.5]
    expected = 4.0e6 + 6.0e6 + 0.5 * 6.0e6
    read_seconds = 1.0 + 2.0 + 4 * 0.5
    assert counted_factor(bw, spent, 0.9 * expected, read_seconds) == pytest.approx(0.9)
    # counts covering less than half of the reads' time are not trusted, nor nothing read
    assert counted_factor(bw, spent, expected, 2.01 * read_seconds) is None
    assert counted_factor(bw, spent, 0.0, read_seconds) is None
    assert counted_factor([], spent, expected, read_seconds) is None
    assert counted_factor(bw, [0.0] * 4, expected, 0.0) is None


def test_observing_only_keeps_the_planned_delay():
    st, look, planned, late = _steering(0.7, observe_only=True)
    (d,) = _run(st, look)
    assert d.at == pytest.approx(planned, abs=0.26) and "observing only" in d.reason
    assert st.fits and st.beta == pytest.approx(0.7, rel=0.05)  # it fitted all the same


def test_release_groups_steer_record_and_host():
    assert release_groups({"a": 0.0, "b": 2.0, "c": 2.0, "d": 1.0}, "abcd") == [["a"], ["d"], ["b", "c"]]
    assert steer_record({"a": 0.0, "b": 0.0}, "ab", lo=0, hi=None, horizon=5, interval=1) is None
    rec = steer_record({"a": 0.0, "b": 2.0, "c": 3.0}, "abc", lo=0.5, hi=4.0, horizon=10, interval=1)
    assert rec["groups"] == [["a"], ["b"], ["c"]] and rec["host"] is None
    assert rec["latest"] == {"b": 4.0, "c": 4.0}
    set_host(rec, {"a": [0, 1], "b": [2], "c": [3, 4]})
    assert rec["host"] == 3  # the leader of the job planned to start last
    json.dumps(rec)  # travels in the plan record


# ---------------------------------------------------------------------------------------- progress
def test_progress_meter_publishes_counts_and_fraction(tmp_path):
    meter = ProgressMeter(str(tmp_path), "cnn", interval=0.0)
    data = list(range(10))
    counted = meter.counted(data)
    assert len(counted) == 10 and counted.count(3) == 1  # still looks like the list
    for epoch in range(2):
        for k, _ in enumerate(counted, start=1):
            rec = read_progress(str(tmp_path), "cnn")
            assert rec["epoch"] == epoch + 1 and rec["batches"] in (k - 1, k)
    rec = read_progress(str(tmp_path), "cnn")
    assert rec["epoch"] == 2 and rec["batches"] == 10 and rec["total_batches"] == 20 and rec["per_epoch"] == 10
    assert fraction_done(rec, 4) == pytest.approx(0.5)
    assert fraction_done(rec, 2) == pytest.approx(1.0)
    assert fraction_done({"epoch": 1, "batches": 5, "per_epoch": None}, 2) is None
    assert fraction_done(None, 2) is None and read_progress(str(tmp_path), "other") is None
    # an iterable without a length is counted, but says no fraction
    for _ in meter.counted(iter(range(3))):
        pass
    assert fraction_done(read_progress(str(tmp_path), "cnn"), 3) is None


def test_throughput_from_a_progress_history():
    rec = {"history": [[0.0, 0], [1.0, 10], [2.0, 30], [4.0, 50]]}
    assert throughput(rec, 0.0, 1.0) == pytest.approx(10.0)
    assert throughput(rec, 0.5, 3.0) == pytest.approx((40 - 5) / 2.5)
    assert throughput(rec, 0.0, 5.0) is None and throughput(rec, 2.0, 2.0) is None
    assert throughput(None, 0.0, 1.0) is None
