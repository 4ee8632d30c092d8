"""The fluid model: closed forms, the pipeline table, agreement with the simulator, snapshots."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from hpcstagger.errors import ModelError
from hpcstagger.model import predict, simulate
from hpcstagger.model import _engine, _quality, _pipeline

from support.model_scenarios import B, S, scenario


@pytest.mark.parametrize("policy, capacity, t, epochs, prefetch, delay", [
    ("minio", 0.4, 0.0007, 3, 2, 0.0),
    ("minio", 1.3, 0.0004, 2, 1, 2.5),
    ("minio", 0.0, 0.0015, 2, 4, 0.0),
    ("none", 0.8, 0.0008, 3, 2, 1.0),
    ("lru", 1.0, 0.0009, 3, 8, 0.0),   # lru that holds the dataset is minio
    ("minio", 0.7, 0.0012, 4, 3, 0.3),
])
def test_single_job_matches_the_closed_form(policy, capacity, t, epochs, prefetch, delay):
    n = 2000
    hit_bw = 25 * B
    sc = scenario(n, jobs=((t, epochs),), capacity=capacity, policy=policy, hit_bw=hit_bw, prefetch=prefetch)
    a, b = S / hit_bw, S / B
    h = sc.cache_samples / n
    # each epoch: n samples at the pipeline's rate, plus the time its empty pipeline costs at the
    # start (one fetch, or one compute when that is shorter)
    closed = delay + n * _pipeline.sample_time(prefetch, 0.0, a, b, t) + min(b, t) \
        + (epochs - 1) * (n * _pipeline.sample_time(prefetch, h, a, b, t) + min(h * a + (1 - h) * b, t))
    assert predict(sc, {"j0": delay}).makespan == pytest.approx(closed, rel=1e-9)
    # the simulator, an independent implementation of the semantics, agrees
    sim = statistics.fmean(simulate(sc, {"j0": delay}, seed=k).makespan for k in range(2))
    assert sim == pytest.approx(closed, rel=0.02)


def test_single_job_lru_follows_the_falling_hit_fraction():
    n, c, t, P = 2000, 0.5, 0.0006, 2
    sc = scenario(n, jobs=((t, 3),), capacity=c, policy="lru")
    k_c = sc.cache_samples
    b = S / B
    later = sum(_pipeline.sample_time(P, max(k_c - k, 0) / (n - k), 0.0, b, t) for k in range(n))
    closed = n * _pipeline.sample_time(P, 0.0, 0.0, b, t) + 2 * later
    assert predict(sc).makespan == pytest.approx(closed, rel=0.005)


def test_pipeline_table_depth_one_is_the_exact_expectation():
    # P = 1: each sample costs max(fetch, compute) exactly, so T = E[max(X, t)]
    for m, lo, t in [(0.3, 0.0, 0.2), (0.5, 0.05, 0.6), (0.8, 0.1, 0.9), (0.15, 0.02, 0.3), (0.6, 0.0, 1.4)]:
        exact = m * max(1.0, t) + (1 - m) * max(lo, t)
        assert _pipeline.sample_time(1, 1 - m, lo, 1.0, t) == pytest.approx(exact, rel=0.015)


def test_pipeline_table_agrees_with_the_recursion_off_grid():
    import numpy as np

    pts = [(2, 0.33, 0.013, 0.71), (4, 0.58, 0.0, 0.93), (3, 0.12, 0.05, 0.4), (6, 0.77, 0.02, 1.1),
           (10, 0.45, 0.0, 0.8), (24, 0.2, 0.0, 0.3)]
    for P, m, lo, t in pts:
        excess = float(_pipeline.simulate_pipeline(P, np.array([m]), lo, 1.0, np.array([t]), samples=120_000,
                                                   seed=7)[0])
        tau = m + (1 - m) * lo
        measured = max(tau, t) * (1 + excess)
        assert _pipeline.sample_time(P, 1 - m, lo, 1.0, t) == pytest.approx(measured, rel=0.03), (P, m, lo, t)
    # no variation in fetch time (all misses, all hits) or a free compute: no loss
    assert _pipeline.sample_time(2, 0.0, 0.1, 1.0, 0.5) == 1.0
    assert _pipeline.sample_time(2, 1.0, 0.1, 1.0, 0.5) == 0.5
    # the loss shrinks with a deeper buffer
    losses = [_pipeline.sample_time(P, 0.5, 0.0, 1.0, 0.5) for P in (1, 2, 4, 8, 16, 64, 256)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.51 < losses[0]


RANDOM = [
    # (jobs, bandwidth, capacity, policy)
    (((0.0006, 2), (0.0011, 1)), (B, 0.7 * B), 0.6, "minio"),
    (((0.0003, 1), (0.0003, 2), (0.002, 1)), (B, 0.8 * B, 0.6 * B), 1.2, "minio"),
    (((0.0009, 2), (0.0005, 2)), (B, 0.5 * B), 0.5, "lru"),
    (((0.0004, 1), (0.0014, 2), (0.0007, 1), (0.0002, 1)), (B, 0.9 * B, 0.75 * B), 0.3, "minio"),
    (((0.0008, 2), (0.0008, 2)), (B, 0.6 * B), 0.0, "none"),
]


@pytest.mark.parametrize("case", range(len(RANDOM)))
def test_predict_agrees_with_the_simulator(case):
    jobs, bw, cap, pol = RANDOM[case]
    sc = scenario(1500, jobs=jobs, bandwidth=bw, capacity=cap, policy=pol, hit_bw=20 * B)
    for delays in ([0.0] * len(jobs), [0.0] + [0.4 * (k + 1) for k in range(len(jobs) - 1)]):
        sim = statistics.fmean(simulate(sc, delays, seed=k).makespan for k in range(2))
        assert predict(sc, delays, series=False).makespan == pytest.approx(sim, rel=0.04)


def test_prediction_series_and_dict():
    sc = scenario(1000, jobs=((0.0005, 2), (0.0009, 1)), bandwidth=(B, 0.6 * B), capacity=0.5, hit_bw=20 * B)
    p = predict(sc, {"j1": 0.5})
    assert p.start == {"j0": 0.0, "j1": 0.5}
    assert p.makespan == max(p.finish.values()) and p.finish["j1"] > 0.5
    assert list(p.times) == sorted(p.times) and p.times[-1] == pytest.approx(p.makespan)
    for name in sc.job_names:
        prog = p.progress[name]
        assert prog[0] == 0.0 and prog[-1] == pytest.approx(1.0) and list(prog) == sorted(prog)
    assert max(p.cached) <= 0.5 + 1e-9 and max(p.bandwidth) <= B * 1.000001
    assert math.isnan(p.hit_rate["j1"][0])  # not started yet
    json.dumps(p.to_dict(), allow_nan=False)
    assert predict(sc, series=False).times == ()


def test_resumed_runs_equal_fresh_runs():
    sc = scenario(1000, jobs=((0.0004, 2), (0.0007, 2), (0.0003, 1)), bandwidth=(B, 0.7 * B), capacity=0.4,
                  policy="lru", hit_bw=20 * B)
    eng = _engine.Engine(sc, _quality.COARSE)
    keep: list = []
    first = eng.run([0.0, 0.8, 1.5], keep=keep)
    new = [0.0, 0.8, 2.2]
    snap = [s for s in keep if s.t < 1.5][-1]
    resumed = eng.run(new, resume=snap)
    fresh = _engine.Engine(sc, _quality.COARSE).run(new)
    assert resumed == fresh and resumed != first


def test_too_many_jobs_is_a_model_error():
    sc = scenario(100, jobs=tuple((0.001, 1) for _ in range(_engine.MAX_JOBS + 1)))
    with pytest.raises(ModelError, match="at most 12 jobs"):
        predict(sc)
