"""optimal_plan: the limiting cases, exactly, and the plan's structure.

The design states "with no cache, or no concurrency loss, simultaneous start is optimal". Under the
semantics (a read shares the source equally with the other reads in flight) that holds for
identical jobs, which is what these tests pin down. For different jobs it does not: a short
I/O-bound job then takes bandwidth from a long, compute-bound one, and starting it later shortens
the makespan even with no cache and no loss. The last test shows this in the simulator too.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from hpcstagger import config
from hpcstagger.errors import ConfigError
from hpcstagger.model import optimal_plan, predict, simulate

from support.model_scenarios import B, S, scenario as _scenario


def scenario(n=1000, jobs=((0.002, 1),), bandwidth=(B,), capacity=0.0, policy="minio", hit_bw=20 * B):
    return _scenario(n, jobs, bandwidth, capacity, policy, hit_bw)


@pytest.mark.parametrize("jobs, bandwidth, capacity, policy", [
    (((0.012, 2), (0.018, 1)), (B, 0.5 * B), 0.5, "minio"),
    (((0.024, 1), (0.016, 3), (0.02, 2)), (B, 0.7 * B, 0.4 * B), 0.3, "lru"),
    (((0.036, 2), (0.036, 2), (0.027, 1), (0.054, 1)), (B, 0.45 * B), 1.2, "minio"),
    (((0.008, 1), (0.011, 2)), (B, 0.6 * B), 0.0, "none"),
])
def test_compute_bound_jobs_get_delays_of_zero(jobs, bandwidth, capacity, policy):
    # every job stays compute-bound even when all of them miss at once at the lowest bandwidth
    sc = scenario(jobs=jobs, bandwidth=bandwidth, capacity=capacity, policy=policy)
    assert all(t > 2 * len(jobs) * S / min(bandwidth) for t, _ in jobs)
    plan = optimal_plan(sc)
    assert all(d == 0.0 for d in plan.delays.values()), plan.delays
    assert plan.makespan == plan.simultaneous
    longest = max(e * sc.dataset.samples * t for t, e in jobs)
    assert plan.makespan == pytest.approx(longest, rel=2e-3)


@pytest.mark.parametrize("count, t, epochs, capacity, policy", [
    (2, 0.0006, 2, 0.0, "none"),
    (3, 0.0012, 1, 0.0, "none"),
    (2, 0.0004, 3, 0.7, "minio"),
    (3, 0.0009, 2, 1.1, "minio"),
    (2, 0.0007, 3, 0.5, "lru"),
    (4, 0.0005, 2, 0.3, "minio"),
])
def test_identical_jobs_without_concurrency_loss_start_together(count, t, epochs, capacity, policy):
    sc = scenario(jobs=tuple((t, epochs) for _ in range(count)), bandwidth=(B,), capacity=capacity, policy=policy)
    plan = optimal_plan(sc)
    assert all(d == 0.0 for d in plan.delays.values()), plan.delays
    assert plan.makespan == plan.simultaneous <= plan.sequential * (1 + 1e-9)


def test_identical_io_bound_jobs_without_cache_but_with_loss_run_one_after_another():
    # no cache and a source that loses 40% under concurrency: running alone is worth the wait
    n, t = 1000, 0.0003
    sc = scenario(n, jobs=((t, 2), (t, 2)), bandwidth=(B, 0.6 * B), policy="none")
    plan = optimal_plan(sc)
    solo = 2 * (n * S / B + t)  # two epochs, each ending with one compute (its pipeline drains)
    closed = 2 * solo  # two solo runs back to back
    # (the second may start during the first's last compute: its own first read overlaps it)
    assert closed - 2 * t <= plan.makespan <= closed * (1 + 1e-6)
    assert plan.sequential == pytest.approx(closed, rel=1e-9)
    assert plan.simultaneous == pytest.approx(2 * (n * S / (0.3 * B) + t), rel=1e-6)
    assert sorted(plan.delays.values()) == [0.0, pytest.approx(solo, abs=2 * t)]


def test_plan_structure_and_dict():
    sc = scenario(jobs=((0.0004, 3), (0.0005, 2)), bandwidth=(B, 0.6 * B), capacity=1.0)
    plan = optimal_plan(sc)
    assert min(plan.delays.values()) == 0.0 and plan.order[0] in plan.delays
    assert plan.makespan < plan.simultaneous * 0.99          # caching pays here
    assert plan.makespan <= plan.sequential
    assert max(plan.finish.values()) == pytest.approx(plan.makespan)
    # the curve is the predicted makespan against the signed stagger, and the plan is its minimum
    xs, ys = plan.curve_stagger, plan.curve_makespan
    assert list(xs) == sorted(xs) and 0.0 in xs and len(xs) >= 30
    assert min(ys) >= plan.makespan * (1 - 0.02)
    check = predict(sc, plan.delays, series=False).makespan
    assert check == pytest.approx(plan.makespan, rel=1e-9)
    # every point of the curve is a full prediction (none is cut short by the search)
    for x, y in list(zip(xs, ys, strict=True))[::6]:
        d = {"j0": 0.0, "j1": x} if x >= 0 else {"j0": -x, "j1": 0.0}
        assert y == pytest.approx(predict(sc, d, series=False).makespan, rel=0.01), x
    assert max(ys) > 1.1 * plan.makespan  # the far ends are much worse, and shown as such
    d = plan.to_dict()
    assert {"delays", "makespan", "simultaneous", "sequential"} <= set(d)
    json.dumps(d, allow_nan=False)
    # bounds: no delay beyond max_delay; max_delay 0 means start together
    limited = optimal_plan(sc, max_delay=0.2)
    assert max(limited.delays.values()) <= 0.2 + 1e-12
    assert all(v == 0.0 for v in optimal_plan(sc, max_delay=0.0).delays.values())
    for bad in ({"max_delay": -1}, {"max_delay": math.inf}, {"min_gain": 1.5}):
        with pytest.raises(ConfigError):
            optimal_plan(sc, **bad)


def test_single_job_plan_is_trivial():
    sc = scenario(jobs=((0.0005, 2),), capacity=0.5)
    plan = optimal_plan(sc)
    assert plan.delays == {"j0": 0.0} and plan.makespan == plan.simultaneous == plan.sequential


@pytest.mark.slow
def test_plan_is_near_the_simulators_best_and_beats_simultaneous():
    # the setting of the HiPC 2023 study: two jobs, a cache that holds the data, a lossy source
    n = 1500
    sc = scenario(n, jobs=((0.0004, 3), (0.0004, 3)), bandwidth=(B, 0.55 * B), capacity=1.0)
    plan = optimal_plan(sc)
    assert max(plan.delays.values()) > 0

    def sim(delays):
        return statistics.fmean(simulate(sc, delays, seed=k).makespan for k in range(2))

    planned = sim([plan.delays[j] for j in sc.job_names])
    grid = [sim([0.0, s]) for s in [0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3, 1.6, 2.0]]
    assert planned <= sim([0.0, 0.0]) * 0.95
    assert planned <= min(grid) * 1.03


@pytest.mark.slow
def test_different_jobs_gain_from_staggering_without_cache_or_loss():
    # a long compute-bound job and short I/O-bound ones: starting the short ones later lets the
    # long one have the bandwidth it needs; the simulator confirms the model
    n = 1000
    sc = scenario(n, jobs=((0.00276, 3), (0.00273, 1), (0.00034, 1), (0.00044, 2)), bandwidth=(B,), policy="none")
    plan = optimal_plan(sc)
    assert plan.gain > 0.08

    def sim(delays):
        return statistics.fmean(simulate(sc, delays, seed=k).makespan for k in range(2))

    assert sim([plan.delays[j] for j in sc.job_names]) < 0.93 * sim([0.0] * 4)


def _spread_mean(sc, stagger, jitter):
    """The mean predicted makespan, as the test sees it, over the 2-job spread around ``stagger``:
    the stagger itself once and +-jitter/2, +-jitter twice each (one job or the other moved)."""
    def f(s):
        d = {"j0": 0.0, "j1": s} if s >= 0 else {"j0": -s, "j1": 0.0}
        return predict(sc, d, series=False).makespan

    around = [stagger + u * jitter for u in (-1.0, -0.5, 0.5, 1.0)]
    return (f(stagger) + 2 * sum(f(s) for s in around)) / 9


def test_start_jitter_defaults_to_a_share_of_the_start_ups_and_rejects_bad_values():
    from dataclasses import replace

    from hpcstagger import config
    from hpcstagger.model.plan import start_jitter

    sc = scenario(jobs=((0.0004, 2), (0.0005, 2)), bandwidth=(B, 0.6 * B), capacity=1.0)
    assert start_jitter(sc) == 0.0  # no start-ups: exact starts
    sc = replace(sc, jobs=(replace(sc.jobs[0], startup=1.0), replace(sc.jobs[1], startup=2.0)))
    assert start_jitter(sc) == pytest.approx(0.25 * 1.5)
    assert start_jitter(sc, 0.7) == 0.7
    with config.override(plan_jitter=0.0):
        assert start_jitter(sc) == 0.0
    with config.override(plan_jitter=-1.0), pytest.raises(ConfigError, match="plan_jitter"):
        start_jitter(sc)
    for bad in (-0.1, math.inf, math.nan, True, "1"):
        with pytest.raises(ConfigError, match="jitter"):
            optimal_plan(sc, jitter=bad)


def test_a_wait_before_a_cliff_is_padded_by_the_start_jitter():
    # two identical I/O-bound jobs, no cache, a source that loses 60% under concurrency: the best
    # exact stagger is the first job's whole run, where the curve has a kink. Starting a little
    # early costs about three times what starting a little late does, so with uncertain starts
    # the plan waits longer, and its mean makespan over the spread is lower than the exact plan's.
    n, t = 1000, 0.0003
    sc = scenario(n, jobs=((t, 2), (t, 2)), bandwidth=(B, 0.4 * B), policy="none")
    exact = optimal_plan(sc, jitter=0.0)
    jitter = 0.2
    robust = optimal_plan(sc, jitter=jitter)
    s_exact = exact.delays["j1"] - exact.delays["j0"]
    s_robust = robust.delays["j1"] - robust.delays["j0"]
    assert abs(s_robust) > abs(s_exact) + 0.05
    assert robust.makespan >= exact.makespan * (1 - 1e-6)  # it pays for exact starts...
    mean_exact, mean_robust = _spread_mean(sc, s_exact, jitter), _spread_mean(sc, s_robust, jitter)
    assert mean_robust < mean_exact * 0.99  # ...and wins over the spread
    # the reported makespans are for the planned delays themselves
    d = {"j0": robust.delays["j0"], "j1": robust.delays["j1"]}
    assert robust.makespan == pytest.approx(predict(sc, d, series=False).makespan, rel=1e-9)


@pytest.mark.parametrize("jobs, bandwidth, capacity", [
    (((0.0004, 3), (0.0005, 2)), (B, 0.6 * B), 1.0),
    (((0.0003, 2), (0.0006, 2)), (B, 0.5 * B), 0.5),
])
def test_plans_with_a_start_jitter_are_no_worse_over_the_spread(jobs, bandwidth, capacity):
    sc = scenario(jobs=jobs, bandwidth=bandwidth, capacity=capacity)
    jitter = 0.15
    exact, robust = optimal_plan(sc, jitter=0.0), optimal_plan(sc, jitter=jitter)
    s_exact = exact.delays["j1"] - exact.delays["j0"]
    s_robust = robust.delays["j1"] - robust.delays["j0"]
    # the search runs the model coarser than this check: allow half a percent
    assert _spread_mean(sc, s_robust, jitter) <= _spread_mean(sc, s_exact, jitter) * 1.005
    assert _spread_mean(sc, s_robust, jitter) <= _spread_mean(sc, 0.0, jitter) * 1.005


# three user-style jobs as `hpcstagger calibrate --spec` measured them (benchmarks/bench_userjobs.py
# three-jobs): 2 cores, start-ups, one sample order. Each prediction takes tens of milliseconds.
_THREE_JOBS = {
    "dataset": {"samples": 3072, "sample_bytes": 3073.0},
    "storage": {"bandwidth": [4.75e6, 3.88e6, 3.02e6, 3.08e6, 3.19e6, 3.23e6]},
    "cache": {"capacity": 9777303.0, "hit_bandwidth": 1.52e9, "policy": "minio"},
    "loader": {"prefetch": 2}, "node": {"cores": 2},
    "job": [{"name": "cnn", "batch": 64, "epochs": 2, "handoff": 0.00117, "order": "s0", "prep_time": 0.000138,
             "sample_time": 0.000427, "startup": 1.31, "workers": 2},
            {"name": "mlp", "batch": 32, "epochs": 2, "handoff": 0.00092, "order": "s0", "prep_time": 0.0000957,
             "sample_time": 0.0000794, "startup": 1.26, "workers": 2},
            {"name": "wide", "batch": 16, "epochs": 1, "handoff": 0.00116, "order": "s0", "prep_time": 0.000174,
             "sample_time": 0.00285, "startup": 1.29, "workers": 2}]}


def _charge_model_runs(monkeypatch, cost):
    """The planner's budget clock advances by ``cost`` CPU seconds per run of the model, and by
    nothing else: the search goes as far as on a machine where a run costs that much."""
    from hpcstagger.model import _engine
    from hpcstagger.model import plan as plan_mod

    clock = [0.0]
    real_run = _engine.Engine.run

    def charged_run(self, *args, **kwargs):
        clock[0] += cost
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(_engine.Engine, "run", charged_run)
    monkeypatch.setattr(plan_mod, "_cpu_clock", lambda: clock[0])


@pytest.mark.slow
@pytest.mark.parametrize("cost, grid_per_job", [(0.01, 6), (0.026, 2)])
def test_a_slow_model_still_gets_a_search_over_every_job(monkeypatch, cost, grid_per_job):
    """The solo runs and the scan used to eat the whole budget here, and the plan fell back to a
    simultaneous start although the model itself predicts a stagger 5% faster. Each run of the model
    is charged a fixed CPU cost (10 ms and 26 ms were measured on two machines) so that the search's
    budget, not the speed of the machine running the test, decides how far it gets."""
    from hpcstagger.model import Scenario

    _charge_model_runs(monkeypatch, cost)
    sc = Scenario.from_dict(_THREE_JOBS)
    plan = optimal_plan(sc, jitter=0.0)
    assert any(plan.delays.values()), plan.delays
    assert plan.makespan < plan.simultaneous * 0.97
    assert plan.evaluations >= 3 * grid_per_job, plan.evaluations  # a grid over each job's delay at least


@pytest.mark.slow
def test_a_model_slow_to_run_gets_a_coarser_first_sweep(monkeypatch):
    """Each run of the model costing 0.1 s of CPU against the 0.45 s budget: the first sweep of
    coordinate descent takes the fewest grid points (2 per job) instead of 6, and the scaled curve 4
    points instead of 8. An lru page-cache model of 20,000 samples took 0.27 s a run, and its
    4-job plan 8 s, while every job of the run waited for it."""
    from hpcstagger.model import Scenario
    from hpcstagger.model import plan as plan_mod

    _charge_model_runs(monkeypatch, 0.1)
    sc = Scenario.from_dict(_THREE_JOBS)
    slow = optimal_plan(sc, jitter=0.0)
    # the two starts at planning accuracy, then per job a grid of 2 points (its current point cached)
    assert slow.evaluations <= 2 + 3 * 2 + 3 + 4, slow.evaluations  # + tie-break + the scaled curve
    if any(slow.delays.values()):
        assert len(slow.curve_stagger) <= 5, slow.curve_stagger  # 4 scales and the best point
    monkeypatch.setattr(plan_mod, "_cpu_clock", lambda: 0.0)  # a model that costs nothing: the full grid
    fast = optimal_plan(sc, jitter=0.0)
    assert fast.evaluations >= 3 * 6, fast.evaluations
    assert slow.makespan <= slow.simultaneous  # coarser, still a plan that does not lose


def test_a_default_spread_below_the_model_s_finest_step_is_planned_as_exact_starts():
    """Start-ups of 0.13 s (four trials whose imports came before the plan) gave a default spread
    of 0.03 s, under the model's finest step (1/64 of the shortest epoch): weighing it cost half of
    the plan's time and could not change it. Above the step, and for an explicit jitter, the spread
    is planned for."""
    from dataclasses import replace

    from hpcstagger.model import Scenario
    from hpcstagger.model import plan as plan_mod

    sc = Scenario.from_dict(_THREE_JOBS)
    step = plan_mod._finest_step(sc, plan_mod._solo_times(sc))
    assert step > 0

    def starting_in(seconds):  # start-ups whose default spread (plan_jitter 0.25 of their mean) is ``seconds``
        return replace(sc, jobs=tuple(replace(j, startup=seconds / 0.25) for j in sc.jobs))

    with config.override(plan_jitter=0.25):
        one = starting_in(step / 2)
        alone = optimal_plan(replace(one, jobs=one.jobs[:1]))  # one job (jobs sharing one loader): nothing to weigh
        assert alone.delays == {"cnn": 0.0}
        assert optimal_plan(starting_in(step / 2)).jitter == 0.0
        assert optimal_plan(starting_in(step / 2), jitter=step / 2).jitter == pytest.approx(step / 2)
        assert optimal_plan(starting_in(step * 2)).jitter == pytest.approx(step * 2)
