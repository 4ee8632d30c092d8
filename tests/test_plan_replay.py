"""A planned stagger replayed by the sample-level simulator before it is recommended
(``hpcstagger.model._confirm``, the ``plan_replay`` knob)."""

from __future__ import annotations

import pytest

from hpcstagger import config
from hpcstagger.model import Scenario, optimal_plan, predict, simulate
from hpcstagger.model import _confirm
from hpcstagger.stagger.delays import simultaneous_reason

from support.model_scenarios import scenario


def _sweep() -> Scenario:
    """Four trials of one sweep as ``hpcstagger calibrate --spec`` measured them on a 2-core VM: one
    ImageFolder of 3,343 JPEGs through the page cache (20 MB/s, reads coalescing), one sampler
    seed, 2 DataLoader workers each, the decode about twice the step."""
    def trial(name: str, step: float, prep: float, handoff: float, startup: float) -> dict:
        return dict(name=name, sample_time=step, prep_time=prep, handoff=handoff, startup=startup, epochs=2,
                    workers=2, batch=64, prefetch=2, order="RandomSampler(seed=0)")

    return Scenario.from_dict({
        "dataset": {"samples": 3343, "sample_bytes": 29912.7},
        "storage": {"bandwidth": [19.8e6, 20.1e6, 19.9e6, 20.3e6, 20.7e6, 20.2e6, 19.9e6, 20.0e6]},
        "cache": {"capacity": 99998062.0, "policy": "minio", "hit_bandwidth": 4.81e9, "coalesce": True,
                  "readahead": 1.0314},
        "loader": {"prefetch": 2}, "node": {"cores": 2},
        "job": [trial("lr0.02", 0.000210, 0.000579, 0.000138, 0.057),
                trial("lr0.05", 0.000220, 0.000480, 0.001005, 0.064),
                trial("lr0.1", 0.000211, 0.000487, 0.000130, 0.045),
                trial("lr0.2", 0.000176, 0.000505, 0.000119, 0.053)]})


def test_a_stagger_the_simulator_does_not_confirm_is_dropped():
    # the fluid model alone staggers these trials (it sees the leader's decode starved by trials that
    # are in fact waiting for its reads); the simulator, like the runs, finds no gain in it
    sc = _sweep()
    with config.override(plan_replay=False):
        alone = optimal_plan(sc)
    assert any(alone.delays.values()) and alone.gain > 0.05 and not alone.simulated
    plan = optimal_plan(sc)
    assert not any(plan.delays.values())
    # the stagger replayed is the one this search found (the search keeps to a CPU budget, so two
    # searches of one scenario can end on different staggers of about the same predicted gain)
    assert plan.staggered and plan.staggered_makespan < plan.makespan * 0.95
    sims = {k: simulate(sc, d, seed=0).makespan for k, d in (("plan", list(plan.staggered.values())),
                                                               ("simultaneous", [0.0] * 4))}
    assert plan.simulated == pytest.approx(sims)
    assert sims["plan"] > sims["simultaneous"] * 0.99  # what the check rests on
    assert plan.makespan == pytest.approx(predict(sc, [0.0] * 4).makespan, rel=1e-3)
    assert plan.to_dict()["simulated"] == pytest.approx(sims)
    reason = simultaneous_reason(plan.delays, {"simultaneous": plan.simultaneous}, plan.to_dict()["curve"],
                                 min_gain=0.01, simulated=plan.simulated)
    assert reason is not None and "sample-level simulator does not confirm" in reason


def test_a_scan_s_best_stagger_the_simulator_finds_slower_ends_the_search(monkeypatch):
    """The replay runs on the scan's best start before the coordinate descent: where the simulator
    finds it slower than a simultaneous start the search stops there, the jobs start together, and
    the plan reports that stagger and its replay. Where the simulator finds it ahead, the search goes on."""
    sc = _sweep()
    plan = optimal_plan(sc)
    assert not any(plan.delays.values()) and plan.staggered
    assert plan.simulated["plan"] > plan.simulated["simultaneous"]
    stopped = plan.evaluations
    assert stopped <= 4  # the simultaneous start and the scan's two best starts, at planning accuracy
    real, real_simulate = _confirm.replay, _confirm.simulate
    calls, simulated = [], []

    def ahead(s, d, memo=None):  # the simulator's replays, the stagger made to look 0.5% ahead
        out = real(s, d, memo)
        calls.append(list(d))
        return {**out, "plan": out["simultaneous"] * 0.995}

    def counting(s, d, seed=0):
        simulated.append(list(d))
        return real_simulate(s, d, seed=seed)

    monkeypatch.setattr(_confirm, "replay", ahead)
    monkeypatch.setattr(_confirm, "simulate", counting)
    # a budget that a loaded node's CPU clock cannot cut short before the descent moves off the scan's start
    searched = optimal_plan(sc, budget=2.0)
    assert searched.evaluations > stopped + 4  # the coordinate descent ran
    # the scan's best start; the search's stagger last (refuted: 0.5% is too little), after the points of
    # its flat curve that the refinement replayed (each as far ahead, so none replaced it)
    assert len(calls) >= 2 and calls[-1] == list(searched.staggered.values()) != calls[0]
    assert not any(searched.delays.values())
    assert simulated.count([0.0] * 4) == 1  # the simultaneous start replayed once for both checks


def test_a_stagger_the_simulator_confirms_stands_with_its_replay():
    # two jobs reading everything from a source that loses under concurrency: both models stagger
    sc = scenario(n=600, jobs=((0.0005, 2), (0.0005, 2)), bandwidth=(1.31072e8, 0.8e8), capacity=1.0)
    plan = optimal_plan(sc)
    assert any(plan.delays.values())
    assert {"plan", "simultaneous"} <= set(plan.simulated) <= {"plan", "simultaneous", "refined"}
    assert plan.simulated["plan"] < plan.simulated["simultaneous"] * 0.99


def test_a_replay_too_costly_is_skipped_and_the_plan_stands(monkeypatch):
    sc = scenario(n=600, jobs=((0.0005, 2), (0.0005, 2)), bandwidth=(1.31072e8, 0.8e8), capacity=1.0)
    # even at a scale that leaves each job MIN_WINDOWS windows (one sample each here) the replay reads too much
    monkeypatch.setattr(_confirm, "READS", 2 * _confirm.reads(sc) // (600 // _confirm.MIN_WINDOWS) - 1)
    plan = optimal_plan(sc)
    assert any(plan.delays.values()) and plan.simulated == {}


def test_a_large_dataset_is_replayed_at_a_scale_that_keeps_to_the_reads(monkeypatch):
    sc = scenario(n=600, jobs=((0.0005, 2), (0.0005, 2)), bandwidth=(1.31072e8, 0.8e8), capacity=1.0)
    seen = []
    real = _confirm.simulate

    def counting(s, delays, seed=0):
        seen.append((s.dataset.samples, s.cache.capacity, list(delays)))
        return real(s, delays, seed=seed)

    monkeypatch.setattr(_confirm, "simulate", counting)
    monkeypatch.setattr(_confirm, "READS", _confirm.reads(sc) // 2)  # both replays need 4x the reads: scale 1/4
    plan = optimal_plan(sc)
    assert plan.simulated["scale"] == 4.0
    assert len(seen) >= 2 and {n for n, _, _ in seen} == {150}  # the check's two replays, the refinement's
    assert seen[0][1] == pytest.approx(sc.cache.capacity / 4)
    assert any(max(d) == pytest.approx(max(plan.staggered.values()) / 4) for _, _, d in seen)
    assert any(plan.delays.values())  # the scaled replay confirms what the full one does
    assert plan.simulated["plan"] < plan.simulated["simultaneous"] * 0.99


def test_the_sweep_over_a_larger_dataset_is_checked_at_a_scale_and_starts_together():
    # the trials above over 5,015 JPEGs: one replay at full size reads more than READS allows; at half
    # size the simulator finds a fraction of the fluid model's gain, and the runs found none
    d = _sweep().to_dict()
    d["dataset"]["samples"] = 5015
    d["cache"]["capacity"] = 150.0e6
    sc = Scenario.from_dict(d)
    assert 2 * _confirm.reads(sc) > _confirm.READS
    with config.override(plan_replay=False):
        alone = optimal_plan(sc)
    assert any(alone.delays.values()) and alone.gain > 0.03
    plan = optimal_plan(sc)
    assert plan.simulated.get("scale", 1.0) > 1.0
    assert not any(plan.delays.values())


@pytest.mark.parametrize("sim_gain, fluid_gain, refuted", [
    (0.002, 0.09, True),    # the fluid model's 9% is not there
    (0.05, 0.09, False),    # smaller, but a gain larger than the two models' disagreement
    (0.014, 0.069, True),   # a gain, but smaller than the disagreement: no evidence of one
    (0.035, 0.08, True),    # a gain of 3.5% against a disagreement of 4.5%
    (0.09, 0.094, False),   # both models agree
    (0.12, 0.09, False),    # the simulator finds more than the fluid model
    (0.005, 0.012, False),  # both marginal: within min_gain of each other
    (0.0, 0.0, False),      # a stagger kept for a start-time spread gains nothing at exact starts in either
])
def test_a_stagger_is_refuted_where_the_models_disagree_by_more_than_the_simulator_s_gain(sim_gain, fluid_gain,
                                                                                           refuted):
    assert _confirm.disagree({"plan": 10.0 * (1 - sim_gain), "simultaneous": 10.0}, 1 - fluid_gain, 0.01) is refuted
