"""Loader shapes (workers, batches, ranks, hand-off, prep) and the cache's starting state, in the
simulator (exact closed forms) and the fluid model (the same forms, and the simulator)."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from hpcstagger.model import Scenario, predict, simulate
from hpcstagger.model import _loader

from support.model_scenarios import B, S

MISS = S / B  # one read alone: 1 ms


def _sc(n, jobs, *, capacity=0.0, initial=0.0, bandwidth=(B,), hit_bw=math.inf, policy="minio"):
    cache = {"capacity": capacity * n * S, "policy": policy, "initial": initial}
    if math.isfinite(hit_bw):
        cache["hit_bandwidth"] = hit_bw
    return Scenario.from_dict({"dataset": {"samples": n, "sample_bytes": S}, "storage": {"bandwidth": list(bandwidth)},
                               "cache": cache, "job": [dict(name=f"j{i}", **j) for i, j in enumerate(jobs)]})


def test_without_workers_nothing_overlaps():
    # the main process reads each batch itself, then trains on it
    n, Bt, t, h = 640, 32, 0.0005, 0.002
    sc = _sc(n, [dict(sample_time=t, epochs=2, workers=0, batch=Bt, handoff=h)])
    steps = n // Bt
    exact = 2 * steps * (Bt * MISS + Bt * t + h)
    assert simulate(sc).makespan == pytest.approx(exact, rel=1e-9)
    assert predict(sc).makespan == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("ranks", [1, 2])
def test_compute_bound_workers_wait_only_for_the_first_batch(ranks):
    # everything cached from the start, hits free: a worker's sample costs its prep time only
    n, Bt, W, t, h, p = 1536, 16, 2, 0.0004, 0.001, 0.0002
    sc = _sc(n, [dict(sample_time=t, epochs=3, workers=W, batch=Bt, ranks=ranks, handoff=h, prep_time=p)],
             capacity=1.0, initial=1.0)
    step = ranks * Bt * t + h
    assert step > Bt * p / W  # compute-bound
    steps = n // (ranks * Bt)
    exact = 3 * (Bt * p + steps * step)
    r = simulate(sc)
    assert r.misses["j0"] == 0 and r.hits["j0"] == 3 * n
    assert r.makespan == pytest.approx(exact, rel=1e-9)
    assert predict(sc).makespan == pytest.approx(exact, rel=1e-6)


def test_loader_bound_workers_end_each_epoch_with_their_last_batches():
    n, Bt, W, t, p = 1024, 8, 4, 0.00005, 0.001
    sc = _sc(n, [dict(sample_time=t, epochs=2, workers=W, batch=Bt, prefetch=2, prep_time=p)],
             capacity=1.0, initial=1.0)
    step = Bt * t
    steps = n // Bt
    assert step < Bt * p / W and steps % W == 0  # loader-bound
    exact = 2 * (steps // W * Bt * p + W * step)
    assert simulate(sc).makespan == pytest.approx(exact, rel=1e-9)
    assert predict(sc).makespan == pytest.approx(exact, rel=1e-6)


def test_a_warm_cache_serves_its_samples_from_the_first_epoch():
    n = 1000
    jobs = [dict(sample_time=0.0002, epochs=1, workers=2, batch=16)]
    cold = _sc(n, jobs, capacity=0.5)
    warm = _sc(n, jobs, capacity=0.5, initial=0.4)
    full = _sc(n, jobs, capacity=0.5, initial=0.9)  # more than it holds: clipped to the capacity
    assert (cold.initial_samples, warm.initial_samples, full.initial_samples) == (0, 400, 500)
    assert simulate(cold).hits["j0"] == 0
    assert simulate(warm).hits["j0"] == 400 and simulate(full).hits["j0"] == 500
    assert predict(warm).makespan < predict(cold).makespan
    for sc in (warm, full):
        sim = statistics.fmean(simulate(sc, seed=k).makespan for k in range(3))
        assert predict(sc).makespan == pytest.approx(sim, rel=0.03)


def test_initial_beyond_the_dataset_is_a_clear_error():
    from hpcstagger.errors import ConfigError

    with pytest.raises(ConfigError, match="cache.initial"):
        _sc(100, [dict(sample_time=0.001)], capacity=1.0, initial=1.5)
    with pytest.raises(ConfigError, match=r"job\[0\].workers"):
        _sc(100, [dict(sample_time=0.001, workers=-1)])


def _brute_force(per_reader, size, F, Z):
    """Processor sharing in product form, every fetcher distinguishable (2^fetchers states)."""
    owners = [g for g, f in enumerate(F) for _ in range(f)]
    num = [0.0] * len(F)
    den = [0.0] * len(F)
    for state in itertools.product((0, 1), repeat=len(owners)):
        k = sum(state)
        w = 1.0
        for level in range(1, k + 1):
            w *= size / per_reader[level]
        for g, busy in zip(owners, state, strict=True):
            if not busy:
                w *= Z[g]
        for g, busy in zip(owners, state, strict=True):
            if busy:
                num[g] += w * per_reader[k]
                den[g] += w
    return [a / b for a, b in zip(num, den, strict=True)]


@pytest.mark.parametrize("F, Z", [((1, 1), (0.002, 0.0)), ((2, 3), (0.001, 0.004)), ((4, 1, 2), (0.0005, 0.01, 0.0)),
                                  ((1, 1, 1, 1), (0.003, 0.001, 0.002, 0.0007))])
def test_grouped_sharing_equals_the_distinguishable_fetchers(F, Z):
    total = sum(F)
    aggregate = [B * (1.0 - 0.4 * min(k - 1, 3) / 3) for k in range(1, total + 1)]  # falls, then holds
    per_reader = [0.0] + [aggregate[k - 1] / k for k in range(1, total + 1)]
    got, _ = _loader.Sharing(per_reader, S).solve(list(F), list(Z))
    assert got == pytest.approx(_brute_force(per_reader, S, F, Z), rel=1e-9)


@pytest.mark.parametrize("curve", ["falls", "rises"])
def test_sources_that_fall_or_rise_with_concurrency(curve):
    # a falling curve (an emulated contended source) and one that rises then saturates (a
    # parallel file system): the model follows the simulator on both
    bw = (B, 0.8 * B, 0.6 * B) if curve == "falls" else (0.4 * B, 0.7 * B, 0.9 * B, B)
    jobs = [dict(sample_time=0.0004, epochs=2, workers=2, batch=16),
            dict(sample_time=0.0008, epochs=2, workers=4, batch=32, prep_time=0.0002)]
    sc = _sc(1500, jobs, capacity=0.6, bandwidth=bw)
    for delays in ({}, {"j1": 0.5}):
        sim = statistics.fmean(simulate(sc, delays, seed=k).makespan for k in range(2))
        assert predict(sc, delays).makespan == pytest.approx(sim, rel=0.04)
    # more workers per job help on the rising curve: they keep more reads in flight
    if curve == "rises":
        one = _sc(1500, [dict(jobs[0], workers=1)], bandwidth=bw)
        four = _sc(1500, [dict(jobs[0], workers=4)], bandwidth=bw)
        assert predict(four).makespan < 0.8 * predict(one).makespan
        assert simulate(four).makespan < 0.8 * simulate(one).makespan


def test_start_up_and_epoch_restarts_delay_the_job():
    # the job asks for its first batch `startup` after it starts, and each later epoch's loader
    # takes `epoch_start` to start (workers spawned again): both in the simulator and the model
    n, Bt, W, t, p = 768, 16, 2, 0.0004, 0.0002
    job = dict(sample_time=t, epochs=3, workers=W, batch=Bt, prep_time=p)
    base = _sc(n, [job], capacity=1.0, initial=1.0)
    slow = _sc(n, [dict(job, startup=0.7, epoch_start=0.2)], capacity=1.0, initial=1.0)
    for delay in (0.0, 1.5):
        d = {"j0": delay}
        extra = 0.7 + 2 * 0.2
        assert simulate(slow, d).makespan == pytest.approx(simulate(base, d).makespan + extra, rel=1e-9)
        assert predict(slow, d).makespan == pytest.approx(predict(base, d).makespan + extra, rel=1e-6)
    assert Scenario.from_dict(slow.to_dict()) == slow
