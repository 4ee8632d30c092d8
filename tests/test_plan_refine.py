"""Where the fluid model's curve is flat around its plan, the sample-level simulator picks among the
staggers it cannot tell apart (``hpcstagger.model._confirm.refine``)."""

from __future__ import annotations

import pytest

from hpcstagger import config
from hpcstagger.cli.cmd_plan import format_plan
from hpcstagger.model import Scenario, optimal_plan, predict, simulate
from hpcstagger.model import _confirm

from support.model_scenarios import scenario


def _half_cache_pair() -> Scenario:
    """Two jobs as ``hpcstagger calibrate --spec`` measured them on a 2-core VM: a CNN and an MLP with
    main-process loading (0 DataLoader workers, batches of 64, one sampler seed) over 3,072 samples
    of 3 KB from a source of 5.8 MB/s alone and 3.0 MB/s shared, a cache of half the dataset."""
    def job(name: str, step: float, prep: float, handoff: float, startup: float) -> dict:
        return dict(name=name, sample_time=step, prep_time=prep, handoff=handoff, startup=startup, epochs=2,
                    workers=0, batch=64, order="DistributedSampler(seed=0)")

    return Scenario.from_dict({
        "dataset": {"samples": 3072, "sample_bytes": 3073.0},
        "storage": {"bandwidth": [5767012.3, 2963596.9]},
        "cache": {"capacity": 4888651.0, "policy": "minio", "hit_bandwidth": 2.17e9},
        "loader": {"prefetch": 2}, "node": {"cores": 2},
        "job": [job("cnn", 2.9266e-4, 4.245e-5, 2.576e-4, 1.203), job("mlp", 4.462e-5, 3.753e-5, 3.082e-4, 1.002)]})


def test_on_a_flat_curve_the_simulator_picks_the_stagger():
    # the fluid model's curve lies within 2% from cnn +0.3 s to +2.7 s and its minimum is at 0.86 s;
    # the simulator puts cnn +2 s about 5% ahead of that, as the runs did (7.66 s against 8.19 s)
    sc = _half_cache_pair()
    with config.override(plan_replay=False):
        fluid = optimal_plan(sc)
    assert fluid.delays["mlp"] == 0 and 0.5 < fluid.delays["cnn"] < 1.2
    plan = optimal_plan(sc)
    assert plan.delays["mlp"] == 0 and 1.5 < plan.delays["cnn"] < 2.6
    assert plan.simulated["refined"] >= 3 and plan.simulated["moved"] == 1.0 and "picked" not in plan.simulated
    at = {k: simulate(sc, [d, 0.0], seed=0).makespan for k, d in (("fluid", fluid.delays["cnn"]),
                                                                    ("plan", plan.delays["cnn"]))}
    assert plan.simulated["plan"] == pytest.approx(at["plan"])
    assert at["plan"] < at["fluid"] * 0.97
    # the fluid model cannot tell the two apart; the plan reports its own prediction at its delays
    assert plan.makespan < fluid.makespan * (1 + _confirm.FLAT)
    assert plan.makespan == pytest.approx(predict(sc, [plan.delays["cnn"], 0.0]).makespan, rel=1e-3)
    assert plan.staggered == plan.delays


def test_the_refinement_keeps_the_plan_unless_the_simulator_finds_more_than_min_gain():
    sc = _half_cache_pair()
    memo: dict = {}
    flat = [[d, 0.0] for d in (0.5, 1.0, 1.5, 2.0, 2.5)]
    ratio = predict(sc, [0.86, 0.0]).makespan / predict(sc, [0.0, 0.0]).makespan
    chosen, n = _confirm.refine(sc, [0.86, 0.0], flat, memo, 0.01, ratio)
    assert n == len(flat)  # all 5 in the first pass: the halfway points are among them
    sims = {tuple(d): simulate(sc, d, seed=0).makespan for d in flat + [[0.86, 0.0]]}
    assert sims[tuple(chosen)] == min(sims[tuple(d)] for d in flat) < sims[(0.86, 0.0)] * 0.97
    # a min_gain larger than what the simulator finds keeps the plan, replays and all
    keep, n = _confirm.refine(sc, [0.86, 0.0], flat, memo, 0.5, ratio)
    assert keep == [0.86, 0.0] and n == len(flat)
    # a plan the replay refutes (the fluid model claiming 30% where the simulator finds 9%) is left to
    # the check, which drops it: no other stagger is replayed in its place
    assert _confirm.refine(sc, [0.86, 0.0], flat, {}, 0.01, 0.7) == ([0.86, 0.0], 0)
    assert _confirm.refine(sc, [0.86, 0.0], [], memo, 0.01, ratio) == ([0.86, 0.0], 0)


def test_the_refinement_keeps_to_its_reads(monkeypatch):
    sc = scenario(n=600, jobs=((0.0005, 2), (0.0005, 2)), bandwidth=(1.31072e8, 0.8e8), capacity=1.0)
    calls = []
    real = _confirm.simulate

    def counting(s, delays, seed=0):
        calls.append(list(delays))
        return real(s, delays, seed=seed)

    monkeypatch.setattr(_confirm, "simulate", counting)
    # 2 * READS: the reads of 4 replays, 4 of the 11 flat points spread over them, besides the plan's and
    # the simultaneous start's (a ratio of 1: the fluid model claims no gain, so the replay cannot refute it)
    monkeypatch.setattr(_confirm, "READS", 2 * _confirm.reads(sc))
    flat = [[0.0, x / 10] for x in range(1, 12)]
    _, n = _confirm.refine(sc, [0.0, 0.65], flat, {}, 0.01, 1.0)
    assert n == 4 and len(calls) == 2 + n and calls[2:] == [flat[i] for i in (0, 3, 7, 10)]
    calls.clear()
    monkeypatch.setattr(_confirm, "READS", 2 * _confirm.reads(sc) // (600 // _confirm.MIN_WINDOWS) - 1)
    assert _confirm.refine(sc, [0.0, 0.65], flat, {}, 0.01, 1.0) == ([0.0, 0.65], 0)  # no replay runs at all
    assert calls == []


def test_the_flat_points_of_a_curve():
    curve = [(-2.0, 10.5), (-1.0, 10.05), (0.0, 11.0), (0.5, 10.0), (1.0, 10.1), (3.0, 12.0)]
    assert _confirm.flat(curve, [0.0, 0.5]) == [[1.0, 0.0], [0.0, 0.5], [0.0, 1.0]]
    # more jobs: the largest delay along the plan's delays scaled together
    curve3 = [(0.0, 11.0), (2.0, 10.1), (4.0, 10.0), (5.0, 10.15), (6.4, 10.9)]
    assert _confirm.flat(curve3, [4.0, 0.0, 2.0]) == [[2.0, 0.0, 1.0], [4.0, 0.0, 2.0], [5.0, 0.0, 2.5]]
    assert _confirm.flat([], [1.0, 0.0]) == []


def _paced_pair() -> Scenario:
    """Two jobs of 2 DataLoader workers over a source that loses half its bandwidth to a second
    reader, no cache: one with batches of 128, one with batches of 8 whose step takes about as long
    as a worker's batch read alone. The fluid model lets each job's workers overlap at random."""
    def job(name: str, t: float, batch: int, prefetch: int, handoff: float) -> dict:
        return dict(name=name, sample_time=t, epochs=2, workers=2, batch=batch, prefetch=prefetch, handoff=handoff)

    return Scenario.from_dict({
        "dataset": {"samples": 1000, "sample_bytes": 131072.0},
        "storage": {"bandwidth": [2.0e8, 1.0366e8]},
        "cache": {"capacity": 0.0, "policy": "none", "hit_bandwidth": 5.5e9},
        "loader": {"prefetch": 2},
        "job": [job("wide", 2.4887e-4, 128, 4, 9.048e-3), job("narrow", 6.1714e-4, 8, 1, 8.628e-4)]})


def test_on_a_flat_curve_around_a_simultaneous_start_the_simulator_picks_a_stagger():
    sc = _paced_pair()
    with config.override(plan_replay=False):
        fluid = optimal_plan(sc)
    assert fluid.delays == {"wide": 0.0, "narrow": 0.0}
    curve = dict(zip(fluid.curve_stagger, fluid.curve_makespan, strict=True))
    assert max(m for x, m in curve.items() if abs(x) <= 1.2) < curve[0.0] * (1 + _confirm.FLAT)  # flat
    plan = optimal_plan(sc)
    assert any(plan.delays.values()) and plan.simulated["picked"] == 1.0 and plan.simulated["refined"] >= 3
    delays = [plan.delays["wide"], plan.delays["narrow"]]
    assert plan.simulated["plan"] == pytest.approx(simulate(sc, delays, seed=0).makespan)
    assert plan.simulated["plan"] < simulate(sc, [0.0, 0.0], seed=0).makespan * 0.9
    # kept on the simulator's word: the fluid model finds it no faster than a simultaneous start
    assert plan.makespan > plan.simultaneous * (1 - 0.01)
    assert plan.staggered == plan.delays
    text = format_plan("paced.toml", sc, plan)  # hpcstagger plan's table says whose choice it is
    assert "the model finds no stagger faster" in text and "the simulator replayed" in text
    # more than 2 jobs: a simultaneous plan is not refined (no flat stretch is searched around it)
    assert _confirm.pick(sc, [0.0, 0.0, 0.0], [(0.0, 1.0), (1.0, 1.0)], {}, 0.01) == ([0.0, 0.0, 0.0], 0, "")
