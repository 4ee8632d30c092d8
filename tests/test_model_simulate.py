"""The sample-level simulator against closed forms that its semantics imply exactly."""

from __future__ import annotations


import pytest

from hpcstagger.model import simulate

from support.model_scenarios import B, S, scenario


def test_single_job_io_bound_and_compute_bound_exact():
    # the loader's pipeline starts empty at every epoch (a DataLoader iterator per epoch): an
    # I/O-bound epoch ends with one compute, a compute-bound one starts with one read
    n, miss = 500, S / B
    io = scenario(n, jobs=((0.0004, 2),))
    r = simulate(io, {"j0": 1.5})
    assert r.finish["j0"] == pytest.approx(1.5 + 2 * (n * miss + 0.0004), rel=1e-12)
    assert r.misses["j0"] == 2 * n and r.hits["j0"] == 0
    cpu = scenario(n, jobs=((0.003, 2),))
    assert simulate(cpu).finish["j0"] == pytest.approx(2 * (miss + n * 0.003), rel=1e-12)


def test_processor_sharing_two_jobs_in_lockstep():
    n = 400
    sc = scenario(n, jobs=((0.0001, 1), (0.0001, 1)), bandwidth=(B, 0.6 * B))
    r = simulate(sc)
    per_read = S / (0.6 * B / 2)
    for name in ("j0", "j1"):
        assert r.finish[name] == pytest.approx(n * per_read + 0.0001, rel=1e-9)


def test_staggered_reader_alone_then_shared():
    # j0 reads alone at full bandwidth until j1 starts, then both share 0.6 B
    n = 400
    sc = scenario(n, jobs=((0.0001, 1), (0.0001, 1)), bandwidth=(B, 0.6 * B))
    d = 100 * S / B  # j0 reads exactly 100 samples alone
    r = simulate(sc, [0.0, d])
    shared = S / (0.3 * B)
    assert r.finish["j0"] == pytest.approx(d + 300 * shared + 0.0001, rel=1e-6)
    assert r.finish["j1"] == pytest.approx(d + 300 * shared + 100 * S / B + 0.0001, rel=1e-6)


def test_minio_hits_are_exact_and_prefetch_one_is_max_of_fetch_and_compute():
    n, c, t = 600, 0.4, 0.0007
    sc = scenario(n, jobs=((t, 3),), capacity=c, hit_bw=20 * B, prefetch=1)
    r = simulate(sc, seed=3)
    cached = int(c * n)
    assert r.hits["j0"] == 2 * cached and r.misses["j0"] == 3 * n - 2 * cached
    a, b = S / (20 * B), S / B
    # with a prefetch depth of 1 every sample costs max(fetch, compute), exactly, except the first
    # of each epoch (its fetch) and the last (its compute), the pipeline starting empty each epoch
    body = n * max(b, t) + 2 * (cached * max(a, t) + (n - cached) * max(b, t)) + 3 * t
    # epoch 0 starts with a miss; epochs 1 and 2 with a hit or a miss
    candidates = {round(body + b - max(b, t) + x - max(x, t) + y - max(y, t), 12) for x in (a, b) for y in (a, b)}
    assert min(abs(r.finish["j0"] - c) for c in candidates) <= 1e-9 * r.finish["j0"]


def test_lru_single_job_hits_follow_the_expected_count():
    n, c = 1000, 0.5
    sc = scenario(n, jobs=((0.0002, 3),), capacity=c, policy="lru")
    k_c = int(c * n)
    per_epoch = sum((k_c - k) / (n - k) for k in range(k_c))  # E[hits] in an epoch after the first
    hits = [simulate(sc, seed=s).hits["j0"] for s in range(4)]
    assert sum(hits) / len(hits) == pytest.approx(2 * per_epoch, rel=0.06)
    # lru with room for everything behaves as minio
    full = scenario(n, jobs=((0.0002, 2),), capacity=1.2, policy="lru")
    assert simulate(full).hits["j0"] == n


def test_shared_cache_between_jobs_and_policy_none():
    n = 500
    sc = scenario(n, jobs=((0.0002, 1), (0.0002, 1)), capacity=1.0)
    r = simulate(sc, [0.0, 10.0])  # j1 starts after j0 has cached everything
    assert r.misses["j0"] == n and r.hits["j1"] == n
    none = scenario(n, jobs=((0.0002, 1), (0.0002, 1)), capacity=1.0, policy="none")
    r = simulate(none, [0.0, 10.0])
    assert r.hits["j0"] == r.hits["j1"] == 0


def test_deterministic_for_a_seed_and_varies_across_seeds():
    sc = scenario(800, jobs=((0.0006, 2), (0.0009, 2)), bandwidth=(B, 0.7 * B), capacity=0.5)
    a, b = simulate(sc, [0, 0.1], seed=5), simulate(sc, [0, 0.1], seed=5)
    assert a == b
    assert simulate(sc, [0, 0.1], seed=6).finish != a.finish
    assert len(a.epoch_ends["j0"]) == 2 and a.epoch_ends["j0"][-1] == a.finish["j0"]
    assert a.makespan == max(a.finish.values())
