"""The node's cores as a shared resource (``[node] cores``): exact closed forms in the simulator and
the fluid model, no effect with enough cores or without the table, and the model against the
simulator where jobs contend for the CPU."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from hpcstagger.errors import ConfigError
from hpcstagger.model import Node, Scenario, predict, simulate
from hpcstagger.model import _cpu

from support.model_scenarios import B, S


def _sc(n, jobs, *, cores=None, capacity=1.0, initial=0.0, bandwidth=(B,), hit_bw=math.inf):
    cache = {"capacity": capacity * n * S, "initial": initial}
    if math.isfinite(hit_bw):
        cache["hit_bandwidth"] = hit_bw
    d = {"dataset": {"samples": n, "sample_bytes": S}, "storage": {"bandwidth": list(bandwidth)},
         "cache": cache, "job": [dict(name=f"j{i}", **j) for i, j in enumerate(jobs)]}
    if cores is not None:
        d["node"] = {"cores": cores}
    return Scenario.from_dict(d)


def _both(sc, delays):
    return predict(sc, delays).makespan, simulate(sc, delays).makespan


def test_node_table_is_validated_and_round_trips(tmp_path):
    jobs = [dict(sample_time=0.001)]
    assert _sc(10, jobs).node == Node(cores=0.0)
    assert _sc(10, jobs, cores=4).node.cores == 4.0
    with pytest.raises(ConfigError, match=r"node\.cores must be >= 0"):
        _sc(10, jobs, cores=-1)
    with pytest.raises(ConfigError, match="unknown key.*threads.*cores"):
        Scenario.from_dict({**_sc(10, jobs).to_dict(), "node": {"threads": 2}})
    sc = _sc(10, jobs, cores=3)
    path = tmp_path / "s.toml"
    path.write_text(sc.to_toml())
    assert Scenario.from_toml(path) == sc
    assert "[node]" not in _sc(10, jobs).to_toml()  # no table: CPU not shared, as before


def test_cpu_bound_jobs_share_one_core():
    # everything cached, hits free, no workers: each job is pure CPU work of n * epochs * t
    n, t = 1000, 0.001
    jobs = [dict(sample_time=t, epochs=2, workers=0, batch=10)] * 2
    alone = 2 * n * t
    for cores, makespan in ((1, 2 * alone), (2, alone), (0, alone)):
        p, s = _both(_sc(n, jobs, cores=cores, initial=1.0), [0, 0])
        assert s == pytest.approx(makespan, rel=1e-9)
        assert p == pytest.approx(makespan, rel=1e-6)


def test_start_up_is_cpu_work_shared_with_running_jobs():
    # one core: j0 starts up (0.5 s) and runs 0.5 s alone; j1's start-up then shares the core:
    # it ends at 2.0 (j0 has 1.0 s left), both share until j0 ends at 4.0, j1 alone until 5.0
    n, t = 1000, 0.001
    jobs = [dict(sample_time=t, epochs=2, workers=0, batch=10, startup=0.5)] * 2
    sc = _sc(n, jobs, cores=1, initial=1.0)
    res = simulate(sc, [0, 1.0])
    assert res.finish["j0"] == pytest.approx(4.0, rel=1e-9)
    assert res.finish["j1"] == pytest.approx(5.0, rel=1e-9)
    pred = predict(sc, [0, 1.0])
    assert pred.finish["j0"] == pytest.approx(4.0, rel=1e-6)
    assert pred.finish["j1"] == pytest.approx(5.0, rel=1e-6)
    # without cores the start-up is a plain delay
    assert predict(_sc(n, jobs, initial=1.0), [0, 1.0]).makespan == pytest.approx(3.5, rel=1e-6)


def test_enough_cores_change_nothing():
    jobs = [dict(sample_time=0.0004, epochs=2, workers=2, batch=16, prep_time=0.0002, handoff=0.001, startup=0.3),
            dict(sample_time=0.0002, epochs=1, workers=0, batch=8, prep_time=0.0001)]
    plain = _sc(800, jobs, capacity=0.5, bandwidth=(B, 1.5 * B))
    many = _sc(800, jobs, capacity=0.5, bandwidth=(B, 1.5 * B), cores=64)
    for delays in ([0, 0], [0, 0.4], [0.7, 0]):
        assert simulate(many, delays).makespan == pytest.approx(simulate(plain, delays).makespan, rel=1e-9)
        assert predict(many, delays).makespan == pytest.approx(predict(plain, delays).makespan, rel=1e-6)


def test_cpu_sharing_slows_co_located_jobs_and_not_a_lone_job_below_its_cores():
    jobs = [dict(sample_time=0.0005, epochs=2, workers=1, batch=16, prep_time=0.0004)] * 2
    lone = _sc(1000, jobs[:1], cores=2, initial=1.0)
    assert predict(lone).makespan == pytest.approx(predict(_sc(1000, jobs[:1], initial=1.0)).makespan, rel=1e-6)
    shared = _sc(1000, jobs, cores=2, initial=1.0)
    free = _sc(1000, jobs, initial=1.0)
    for model in (predict, simulate):
        assert model(shared, [0, 0]).makespan > 1.3 * model(free, [0, 0]).makespan


def test_groups_follow_the_loader():
    from hpcstagger.model import _loader

    sc = _sc(100, [dict(sample_time=0.001, ranks=2, workers=3, batch=4, prep_time=0.0002, handoff=0.002),
                   dict(sample_time=0.001, workers=0, batch=4, prep_time=0.0001)], cores=2)
    shapes = _loader.shapes(sc)
    speed = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    groups, where = _cpu.groups(shapes, speed, 0.0, [0, 1], [100.0, 50.0], [0.0, 0.0], {})
    assert where == [(0, 0), (0, 1), (1, 0)]
    steps, workers, main = groups
    assert (steps.F, steps.gang) == (2, True) and steps.work == pytest.approx(2 * 4 * 0.001 + 0.002)
    assert steps.think == pytest.approx(2 * 4 / 100.0 - steps.work)
    assert (workers.F, workers.work) == (6, pytest.approx(0.0002))
    assert main.work == pytest.approx(4 * 0.001 + 4 * 0.0001)  # it fetches its own batches
    assert _cpu.CpuShare(2, 10).speeds([_cpu.Group(1, 1.0, 0.0), _cpu.Group(1, 1.0, 0.0)]) == [1.0, 1.0]
    two_on_one = _cpu.CpuShare(1, 10).speeds([_cpu.Group(1, 1.0, 0.0), _cpu.Group(1, 1.0, 0.0)])
    assert two_on_one == [pytest.approx(0.5), pytest.approx(0.5)]


def _random_cpu_scenario(rng):
    n = rng.choice([400, 800])
    jobs = []
    for i in range(rng.choice([2, 3])):
        workers = rng.choice([0, 1, 2, 4])
        jobs.append(dict(name=f"j{i}", sample_time=rng.uniform(0.2, 1.5) * 1e-3, epochs=rng.choice([1, 2]),
                         workers=workers, batch=rng.choice([4, 16, 32]), prep_time=rng.uniform(0, 1.0) * 1e-3,
                         handoff=rng.uniform(0, 2) * 1e-3, startup=rng.uniform(0, 0.4)))
    return Scenario.from_dict({
        "dataset": {"samples": n, "sample_bytes": S},
        "storage": {"bandwidth": [B * f for f in (1.0, rng.uniform(0.6, 1.6))]},
        "cache": {"capacity": rng.choice([0.5, 1.0]) * n * S},
        "node": {"cores": rng.choice([1, 2, 3])},
        "job": jobs})


def test_fluid_model_tracks_the_simulator_under_cpu_contention():
    rng = random.Random(7)
    errors = []
    for _ in range(12):
        sc = _random_cpu_scenario(rng)
        delays = [0.0] + [rng.uniform(0, 1.0) for _ in sc.jobs[1:]]
        sim = statistics.mean(simulate(sc, delays, seed=k).makespan for k in range(2))
        errors.append(abs(predict(sc, delays).makespan / sim - 1))
    assert statistics.median(errors) < 0.04, errors
    assert max(errors) < 0.12, errors


def test_a_reads_cpu_lasts_within_the_read_and_loads_the_cores():
    # one fetcher, no cache: a read of S at B takes r; its CPU work c lasts within it (c < r: the
    # same run), or makes it last c (c > r: as a source of half the bandwidth when c = 2r)
    n, r = 400, S / B
    job = dict(sample_time=0.0002, epochs=1, workers=1, batch=4, prep_time=0.0001)
    plain = _sc(n, [job], capacity=0.0)
    inside = _sc(n, [{**job, "read_cpu": 0.5 * r}], capacity=0.0)
    longer = _sc(n, [{**job, "read_cpu": 2 * r}], capacity=0.0)
    halved = _sc(n, [job], capacity=0.0, bandwidth=(B / 2,))
    for model, rel in ((simulate, 1e-9), (predict, 1e-6)):
        assert model(inside, [0]).makespan == pytest.approx(model(plain, [0]).makespan, rel=rel)
        assert model(longer, [0]).makespan == pytest.approx(model(halved, [0]).makespan, rel=rel)
    # on one core the reads' CPU slows a job that computes beside them, in both models
    busy = dict(sample_time=0.002, epochs=1, workers=0, batch=4)
    free = _sc(n, [{**job, "read_cpu": 0.0}, busy], capacity=0.0, cores=1)
    loaded = _sc(n, [{**job, "read_cpu": 0.8 * r}, busy], capacity=0.0, cores=1)
    for model in (predict, simulate):
        assert model(loaded, [0, 0]).finish["j1"] > 1.08 * model(free, [0, 0]).finish["j1"]
    sim, fluid = simulate(loaded, [0, 0]).makespan, predict(loaded, [0, 0]).makespan
    assert fluid == pytest.approx(sim, rel=0.08)
    assert "read_cpu = " in loaded.to_toml() and "read_cpu" not in free.to_toml()


def test_fluid_model_tracks_the_simulator_with_reads_cpu():
    rng = random.Random(11)
    errors = []
    for _ in range(10):
        sc = _random_cpu_scenario(rng)
        read = S / sc.storage.bandwidth[0]
        sc = Scenario.from_dict({**sc.to_dict(), "job": [{**j, "read_cpu": rng.uniform(0.1, 0.9) * read}
                                                         for j in sc.to_dict()["job"]]})
        delays = [0.0] + [rng.uniform(0, 1.0) for _ in sc.jobs[1:]]
        sim = statistics.mean(simulate(sc, delays, seed=k).makespan for k in range(2))
        errors.append(abs(predict(sc, delays).makespan / sim - 1))
    assert statistics.median(errors) < 0.04, errors
    assert max(errors) < 0.12, errors
