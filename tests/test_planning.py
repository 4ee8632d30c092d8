"""The planning step of a co-located run as a pure function: modes, fixed delays, the calibrated
scenario, and the miss-overhead correction of the source's bandwidth."""

from __future__ import annotations

import textwrap

import pytest

from hpcstagger.stagger.delays import plan_run, scenario_for
from hpcstagger.stagger.runplan import PlanInputs
from hpcstagger.spec.jobspec import PLAN_MODES, Spec
from hpcstagger.errors import ConfigError
from hpcstagger import config
from hpcstagger.model import Scenario, predict
from hpcstagger.model.plan import FLAT

from support.model_scenarios import small_toml

SCENARIO = small_toml({"a": 0.0005})  # b's sample time comes from the spec


def _spec(tmp_path, *, scenario=True, delays="{ b = 2.0 }", b_sample_time=""):
    (tmp_path / "s.toml").write_text(SCENARIO)
    return Spec.from_dict({
        "run": {"name": "p"},
        "plan": {"mode": "plan", "delays": {"b": 2.0} if delays else {},
                 **({"scenario": "s.toml"} if scenario else {})},
        "job": [{"name": "a", "command": "python a.py", "epochs": 2},
                {"name": "b", "command": "python b.py", **({"sample_time": b_sample_time} if b_sample_time else {})}],
    }, base_dir=tmp_path)


def test_simultaneous_and_fixed_without_a_model(tmp_path):
    spec = _spec(tmp_path, scenario=False)
    out = plan_run(spec, ["a", "b"], {}, "simultaneous").to_dict()
    assert out["delays"] == {"a": 0.0, "b": 0.0} and out["mode"] == "simultaneous" and "predicted" not in out
    assert plan_run(spec, ["a", "b"], {}, "fixed").to_dict()["delays"] == {"a": 0.0, "b": 2.0}  # the spec's delays
    # fixed delays passed in (the launcher's --delays) win over the spec's
    assert plan_run(spec, ["a", "b"], {}, "fixed",
                    PlanInputs(fixed={"a": 1.5})).to_dict()["delays"] == {"a": 1.5, "b": 0.0}
    with pytest.raises(ConfigError, match="fixed delays name unknown job"):
        plan_run(spec, ["a", "b"], {}, "fixed", PlanInputs(fixed={"z": 1.0})).to_dict()


def test_modes_that_cannot_run_in_one_world(tmp_path):
    spec = _spec(tmp_path, scenario=False)
    with pytest.raises(ConfigError, match="'sequential' runs the jobs one after another"):
        plan_run(spec, ["a", "b"], {}, "sequential").to_dict()
    with pytest.raises(ConfigError, match="plan mode must be one of " + ", ".join(PLAN_MODES)):
        plan_run(spec, ["a", "b"], {}, "staggered").to_dict()
    with pytest.raises(ConfigError, match="needs a calibrated scenario"):
        plan_run(spec, ["a", "b"], {}, "plan").to_dict()
    assert plan_run(spec.only(["a"]), ["a"], {}, "plan").to_dict()["delays"] == {"a": 0.0}  # one job: nothing to plan


def test_plan_mode_uses_the_calibrations_and_predicts_every_mode(tmp_path):
    spec = _spec(tmp_path)
    calib = {"a": {"sample_time": 0.0004}, "b": {"sample_time": 0.0002}}
    out = plan_run(spec, ["a", "b"], calib, "plan").to_dict()
    assert set(out["predicted"]) == {"plan", "simultaneous", "sequential"}
    assert out["predicted"]["plan"] <= out["predicted"]["simultaneous"] + 1e-9
    assert [j["sample_time"] for j in out["scenario"]["job"]] == [0.0004, 0.0002]
    assert [j["epochs"] for j in out["scenario"]["job"]] == [2, 1]  # epochs come from the spec
    assert out["calibrations"] == calib
    # the plan's predicted makespan is the model's for its delays
    sc = Scenario.from_dict(out["scenario"])
    assert predict(sc, out["delays"]).makespan == pytest.approx(out["predicted"]["plan"], rel=1e-9)
    fixed = plan_run(spec, ["a", "b"], calib, "fixed").to_dict()
    assert fixed["delays"] == {"a": 0.0, "b": 2.0} and fixed["predicted"]["fixed"] == pytest.approx(
        predict(sc, fixed["delays"]).makespan, rel=1e-9)


def test_modes_that_do_not_plan_predict_their_own_delays_without_a_search(tmp_path, monkeypatch):
    """Every rank waits while world rank 0 plans: modes simultaneous and fixed predict their own
    delays only (the search took 3 s of CPU for a 4-trial sweep, before a run that uses none of it)."""
    from hpcstagger.stagger import delays as delays_mod

    spec = _spec(tmp_path)
    calib = {"a": {"sample_time": 0.0004}, "b": {"sample_time": 0.0002}}

    def no_search(*args, **kwargs):
        raise AssertionError("searched a plan for a mode that does not use one")

    monkeypatch.setattr(delays_mod, "optimal_plan", no_search)
    together = plan_run(spec, ["a", "b"], calib, "simultaneous").to_dict()
    sc = Scenario.from_dict(together["scenario"])
    assert together["delays"] == {"a": 0.0, "b": 0.0} and "curve" not in together and "steer" not in together
    assert together["predicted"] == {"simultaneous": pytest.approx(predict(sc, {"a": 0.0, "b": 0.0}).makespan)}
    fixed = plan_run(spec, ["a", "b"], calib, "fixed").to_dict()
    assert fixed["predicted"] == {"fixed": pytest.approx(predict(sc, {"a": 0.0, "b": 2.0}).makespan)}
    with pytest.raises(AssertionError, match="searched"):
        plan_run(spec, ["a", "b"], calib, "plan")


def test_sample_time_comes_from_calibration_then_spec_then_scenario(tmp_path):
    spec = _spec(tmp_path, b_sample_time=0.003)
    sc = scenario_for(spec, ["a", "b"], {})
    assert [j.sample_time for j in sc.jobs] == [0.0005, 0.003]  # a from the scenario, b from the spec
    sc = scenario_for(spec, ["a", "b"], {"b": {"sample_time": 0.001}})
    assert sc.jobs[1].sample_time == 0.001
    with pytest.raises(ConfigError, match="no sample_time for job 'b'"):
        scenario_for(_spec(tmp_path), ["a", "b"], {})


def test_miss_overhead_slows_the_source_the_jobs_see(tmp_path):
    """Each read of S bytes with k readers takes S*k/bandwidth[k-1] + overhead (the mean of the
    jobs' reported overheads), so the planned bandwidth is k*S / (k*S/b + overhead)."""
    spec = _spec(tmp_path)
    calib = {"a": {"sample_time": 0.0004, "miss_overhead": 0.0008},
             "b": {"sample_time": 0.0002, "miss_overhead": 0.0012}}
    sc = scenario_for(spec, ["a", "b"], calib)
    o, size = 0.001, 1000.0
    assert sc.storage.bandwidth == pytest.approx((size / (size / 1.0e6 + o), 2 * size / (2 * size / 1.5e6 + o)))
    # no overhead reported (or zero): the scenario's bandwidth as calibrated
    plain = scenario_for(spec, ["a", "b"], {"a": {"sample_time": 0.0004, "miss_overhead": 0.0},
                                            "b": {"sample_time": 0.0002}})
    assert plain.storage.bandwidth == (1.0e6, 1.5e6)
    # and the correction changes the plan's prediction: a slower source, a longer makespan
    slow = plan_run(spec, ["a", "b"], calib, "simultaneous").to_dict()["predicted"]["simultaneous"]
    fast = plan_run(spec, ["a", "b"], {k: {"sample_time": v["sample_time"]} for k, v in calib.items()},
                    "simultaneous").to_dict()["predicted"]["simultaneous"]
    assert slow > fast


def test_the_cache_state_at_the_start_reaches_the_scenario(tmp_path):
    """The coordinator passes what the shared cache holds at plan time; the scenario starts from it
    (cache.initial = entries / dataset samples, clipped to [0, 1]) and the decision reports it."""
    from hpcstagger.stagger.delays import cached_fraction

    spec = _spec(tmp_path)
    calib = {"a": {"sample_time": 0.0004}, "b": {"sample_time": 0.0002}}
    assert scenario_for(spec, ["a", "b"], calib).cache.initial == 0.0  # nobody looked: the file's value
    sc = scenario_for(spec, ["a", "b"], calib, cache_state={"entries": 50, "bytes": 50_000})
    assert sc.cache.initial == pytest.approx(0.25)  # 50 of the scenario's 200 samples
    assert scenario_for(spec, ["a", "b"], calib, cache_state={"entries": 500}).cache.initial == 1.0  # clipped
    assert scenario_for(spec, ["a", "b"], calib, cache_state={"entries": 0}).cache.initial == 0.0
    assert cached_fraction(-3, 10) == 0.0 and cached_fraction(5, 0) == 0.0 and cached_fraction(5, 10) == 0.5

    out = plan_run(spec, ["a", "b"], calib, "plan",
                   PlanInputs(cache_state={"entries": 50, "bytes": 50_000, "exists": True})).to_dict()
    assert out["scenario"]["cache"]["initial"] == pytest.approx(0.25)
    assert out["cache"] == {"entries": 50, "bytes": 50_000, "exists": True, "fraction": pytest.approx(0.25),
                            "samples": 200, "initial_samples": 50}
    # without a scenario the state is still reported, with no fraction (the dataset's size is unknown)
    bare = plan_run(_spec(tmp_path, scenario=False), ["a", "b"], {}, "simultaneous",
                    PlanInputs(cache_state={"entries": 7, "bytes": 700})).to_dict()
    assert bare["cache"] == {"entries": 7, "bytes": 700} and "scenario" not in bare
    assert "cache" not in plan_run(spec, ["a", "b"], calib, "simultaneous").to_dict()  # no cache, no state


# Two I/O-bound jobs whose cache holds the whole dataset: cold, the second waits for the first.
IO_SCENARIO = textwrap.dedent("""
    [dataset]
    samples = 2000
    sample_bytes = 100000
    [storage]
    bandwidth = [2.0e7, 8.0e6]
    [cache]
    capacity = 2.0e8
    [[job]]
    name = "a"
    sample_time = 0.001
    [[job]]
    name = "b"
    sample_time = 0.0005
""")


def test_a_fully_warm_cache_plans_a_simultaneous_start(tmp_path):
    """Cold, the second job waits for the first to fill the cache; with every sample already
    cached there is nothing to wait for, and the plan starts both at once."""
    (tmp_path / "io.toml").write_text(IO_SCENARIO)
    jobs = [{"name": n, "command": "x", "epochs": 3} for n in ("a", "b")]
    spec = Spec.from_dict({"plan": {"mode": "plan", "scenario": "io.toml"}, "job": jobs}, base_dir=tmp_path)
    cold = plan_run(spec, ["a", "b"], {}, "plan", PlanInputs(cache_state={"entries": 0, "bytes": 0})).to_dict()
    warm = plan_run(spec, ["a", "b"], {}, "plan", PlanInputs(cache_state={"entries": 2000, "bytes": 2.0e8})).to_dict()
    assert max(cold["delays"].values()) > 1.0 and cold["cache"]["fraction"] == 0.0
    assert warm["delays"] == {"a": 0.0, "b": 0.0} and warm["cache"]["fraction"] == 1.0
    assert warm["predicted"]["plan"] < cold["predicted"]["plan"]


def test_the_specs_jitter_reaches_the_planner(tmp_path):
    from hpcstagger.model import optimal_plan

    (tmp_path / "s.toml").write_text(SCENARIO)
    base = {"run": {"name": "p"}, "job": [{"name": "a", "command": "python a.py", "epochs": 3},
                                          {"name": "b", "command": "python b.py", "epochs": 2}]}
    calib = {"a": {"sample_time": 0.0004}, "b": {"sample_time": 0.0002}}
    planned = []
    for jitter in (0.0, 0.1):  # exact starts start together here; a spread of 0.1 s delays b
        spec = Spec.from_dict({**base, "plan": {"mode": "plan", "scenario": "s.toml", "jitter": jitter}},
                              base_dir=tmp_path)
        assert spec.plan.jitter == jitter
        out = plan_run(spec, ["a", "b"], calib, "plan").to_dict()
        expected = optimal_plan(Scenario.from_dict(out["scenario"]), jitter=jitter)
        assert out["delays"] == pytest.approx(expected.delays)
        planned.append(out["delays"])
    assert planned[0] != planned[1]
    with pytest.raises(ConfigError, match="plan.jitter"):
        Spec.from_dict({**base, "plan": {"jitter": -1}}, base_dir=tmp_path)


def _three(tmp_path, loader):
    (tmp_path / "s.toml").write_text(SCENARIO)
    return Spec.from_dict({
        "run": {"name": "p"}, "plan": {"mode": "plan", "scenario": "s.toml"}, "loader": loader,
        "job": [{"name": "a", "command": "python a.py"}, {"name": "b", "command": "python b.py"},
                {"name": "c", "command": "python c.py", "loader": "solo"}],
    }, base_dir=tmp_path)


def test_jobs_sharing_a_loader_are_planned_as_their_slowest_member(tmp_path):
    calib = {"a": {"sample_time": 0.0002}, "b": {"sample_time": 0.0006}, "c": {"sample_time": 0.0003}}
    spec = _three(tmp_path, {"share": True})
    assert spec.loader_groups() == {"p": ["a", "b"]}  # c has a loader of its own: no group
    out = plan_run(spec, ["a", "b", "c"], calib, "plan").to_dict()
    assert out["loader_groups"] == {"p": ["a", "b"]}
    assert out["delays"]["a"] == out["delays"]["b"]  # released as one
    # the model saw the group once, as b (the slower), beside c
    assert [(j["name"], j["sample_time"]) for j in out["scenario"]["job"]] == [("b", 0.0006), ("c", 0.0003)]
    sc = Scenario.from_dict(out["scenario"])
    assert predict(sc, {n: out["delays"][n] for n in ("b", "c")}).makespan == pytest.approx(
        out["predicted"]["plan"], rel=1e-9)
    if "steer" in out:  # a group is one release group
        assert any(set(g) >= {"a", "b"} for g in out["steer"]["groups"])
    # without sharing, the three jobs are planned one by one
    plain = plan_run(_three(tmp_path, {"share": False}), ["a", "b", "c"], calib, "plan").to_dict()
    assert "loader_groups" not in plain and len(plain["scenario"]["job"]) == 3
    # fixed delays stay the user's
    fixed = plan_run(spec, ["a", "b", "c"], calib, "fixed", PlanInputs(fixed={"b": 1.0})).to_dict()
    assert fixed["delays"] == {"a": 0.0, "b": 1.0, "c": 0.0}


CURVE = {"stagger": [-4.0, -2.0, 0.0, 2.0, 4.0], "makespan": [16.0, 15.9, 15.9, 15.8, 15.85]}


def test_simultaneous_reason_names_why_and_the_figures():
    """A plan that starts every job at once says why, with the predicted makespans it compared."""
    from hpcstagger.stagger.delays import simultaneous_reason

    sim = {"plan": 15.9, "simultaneous": 15.9}
    # the best stagger (b +2 s, 15.8 s) gains 0.6%: under a min_gain of 1%
    why = simultaneous_reason({"a": 0.0, "b": 0.0}, sim, CURVE, min_gain=0.01)
    assert why == ("a simultaneous start: the model predicts no stagger gains more than 1% (best stagger b +2.0 s: "
                   "predicted makespan 15.8 s against 15.9 s simultaneous: a gain of 0.6%)")
    # a staggered plan, or a single job, needs no reason
    assert simultaneous_reason({"a": 0.0, "b": 2.0}, sim, CURVE, min_gain=0.01) is None
    assert simultaneous_reason({"a": 0.0}, sim, CURVE, min_gain=0.01) is None
    # the best stagger is job a's when the curve is lowest on its negative side
    left = {"stagger": CURVE["stagger"], "makespan": [15.0, 15.9, 15.9, 15.9, 15.9]}
    why = simultaneous_reason({"a": 0.0, "b": 0.0}, {"simultaneous": 15.9}, left, min_gain=0.1, max_delay=4.0)
    assert "best stagger a +4.0 s: predicted makespan 15.0 s against 15.9 s" in why
    assert why.endswith("[plan] max_delay (4 s) bounds the stagger")
    # a gain above min_gain that the plan dropped: over the start-time spread, or at full accuracy
    assert "does not hold over starts that stray by up to 0.30 s" in simultaneous_reason(
        {"a": 0.0, "b": 0.0}, {"simultaneous": 15.9}, left, min_gain=0.01, jitter=0.3)
    assert "at full accuracy the best stagger gains less than 1%" in simultaneous_reason(
        {"a": 0.0, "b": 0.0}, {"simultaneous": 15.9}, left, min_gain=0.01)
    # a flat curve, a max_delay of 0, and three jobs (their curve is the largest delay)
    flat = {"stagger": [0.0, 1.0, 2.0], "makespan": [6.0, 6.0, 6.0]}
    assert simultaneous_reason({"a": 0.0, "b": 0.0}, {"simultaneous": 6.0}, flat, min_gain=0.01) == (
        "a simultaneous start: the model predicts that no stagger shortens the makespan (6.0 s simultaneous)")
    near = {"stagger": [0.0, 0.03, 1.0], "makespan": [10.9, 10.88, 11.5]}
    assert "best stagger b +0.03 s: predicted makespan 10.9 s" in simultaneous_reason(
        {"a": 0.0, "b": 0.0}, {"simultaneous": 10.9}, near, min_gain=0.01)
    # the staggers are compared with the curve's own simultaneous point; without one, the predicted
    no_zero = {"stagger": [1.0, 2.0], "makespan": [15.85, 15.8]}
    assert "against 16.0 s simultaneous" in simultaneous_reason(
        {"a": 0.0, "b": 0.0}, {"simultaneous": 16.0}, no_zero, min_gain=0.02)
    assert "against 15.9 s simultaneous" in simultaneous_reason(
        {"a": 0.0, "b": 0.0}, {"simultaneous": 16.0}, CURVE, min_gain=0.02)
    assert "max_delay is 0 s" in simultaneous_reason({"a": 0.0, "b": 0.0}, sim, CURVE, min_gain=0.01, max_delay=0.0)
    three = simultaneous_reason({"a": 0.0, "b": 0.0, "c": 0.0}, {"simultaneous": 15.9}, CURVE, min_gain=0.01)
    assert "gains more than 1% (best stagger largest delay +2.0 s" in three


def test_a_simultaneous_plan_carries_its_reason_and_a_staggered_one_none(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCSTAGGER_PLAN_MIN_GAIN", raising=False)
    monkeypatch.delenv("HPCSTAGGER_PLAN_JITTER", raising=False)
    (tmp_path / "io.toml").write_text(IO_SCENARIO)
    jobs = [{"name": n, "command": "x", "epochs": 3} for n in ("a", "b")]

    def plan(cache_entries, **pl):
        spec = Spec.from_dict({"plan": {"mode": "plan", "scenario": "io.toml", **pl}, "job": jobs},
                              base_dir=tmp_path)
        return plan_run(spec, ["a", "b"], {}, "plan",
                        PlanInputs(cache_state={"entries": cache_entries, "bytes": 0})).to_dict()

    cold = plan(0)
    assert max(cold["delays"].values()) > 1.0 and "simultaneous_reason" not in cold
    warm = plan(2000)  # every sample cached: no stagger shortens the run
    assert warm["delays"] == {"a": 0.0, "b": 0.0}
    assert warm["simultaneous_reason"].startswith("a simultaneous start: the model predicts that no stagger")
    assert plan(0, max_delay=0.0)["simultaneous_reason"] == (
        "a simultaneous start: [plan] max_delay is 0 s, which allows no stagger")
    # the same reason the pure function gives for the plan's own figures
    from hpcstagger.stagger.delays import simultaneous_reason

    assert warm["simultaneous_reason"] == simultaneous_reason(warm["delays"], warm["predicted"], warm["curve"],
                                                              min_gain=0.01, jitter=warm["jitter"])
    # a mode that takes no plan gives no reason
    bare = Spec.from_dict({"plan": {"mode": "plan", "scenario": "io.toml"}, "job": jobs}, base_dir=tmp_path)
    assert "simultaneous_reason" not in plan_run(bare, ["a", "b"], {}, "simultaneous").to_dict()


def test_one_launch_of_a_sequential_run_is_labelled_sequential(tmp_path):
    """``hpcstagger launch --mode sequential`` starts each job in a world of its own, in mode
    sequential: it starts at once and its records say sequential, not simultaneous."""
    spec = _spec(tmp_path)
    out = plan_run(spec.only(["a"]), ["a"], {"a": {"sample_time": 0.0004}}, "sequential").to_dict()
    assert out["mode"] == "sequential" and out["delays"] == {"a": 0.0}
    sc = Scenario.from_dict(out["scenario"])
    assert out["predicted"] == {"sequential": pytest.approx(predict(sc, {"a": 0.0}).makespan, rel=1e-9)}
    with pytest.raises(ConfigError, match="'sequential' runs the jobs one after another"):
        plan_run(spec, ["a", "b"], {}, "sequential").to_dict()


def test_a_barely_simultaneous_plan_holds_the_stagger_and_lets_the_closed_loop_decide(tmp_path, monkeypatch):
    """The model predicts its best stagger within plan_guard of a simultaneous start: mode plan
    holds that stagger's waiting job, with the model's own delays (zeros) as the watcher's prior;
    mode open, steer = false, plan_guard 0 and a warm cache (whose best stagger is too short to
    give evidence) start together as the model chose."""
    monkeypatch.delenv("HPCSTAGGER_PLAN_GUARD", raising=False)
    monkeypatch.setenv("HPCSTAGGER_PLAN_JITTER", "0")
    # the fluid model's choice alone: on this flat curve the simulator would pick a stagger itself
    # (tests/test_plan_refine.py), and the guard is for the curves where it finds none
    monkeypatch.setenv("HPCSTAGGER_PLAN_REPLAY", "0")
    (tmp_path / "io.toml").write_text(IO_SCENARIO.replace("[2.0e7, 8.0e6]", "[2.0e7, 2.0e7]"))
    jobs = [{"name": n, "command": "x", "epochs": 1} for n in ("a", "b")]

    def plan(mode="plan", entries=0, **pl):
        spec = Spec.from_dict({"plan": {"mode": "plan", "scenario": "io.toml", **pl}, "job": jobs},
                              base_dir=tmp_path)
        return plan_run(spec, ["a", "b"], {}, mode, PlanInputs(cache_state={"entries": entries, "bytes": 0})).to_dict()

    guarded = plan()
    curve = dict(zip(guarded["curve"]["stagger"], guarded["curve"]["makespan"], strict=True))
    assert guarded["delays"]["a"] == 0.0 and guarded["delays"]["b"] > 1.5
    assert guarded["predicted"]["plan"] == pytest.approx(guarded["predicted"]["simultaneous"])  # the model's choice
    assert min(m for x, m in curve.items() if x) > curve[0.0] * (1 - 0.01)  # no stagger gains plan_min_gain
    assert guarded["steer"]["prior"] == {"a": 0.0, "b": 0.0} and guarded["steer"]["groups"] == [["a"], ["b"]]
    assert guarded["simultaneous_reason"].startswith("a simultaneous start, guarded: ")
    assert "plan_guard 2%" in guarded["steer"]["guard"] and "b up to +" in guarded["steer"]["guard"]
    assert plan("open")["delays"] == {"a": 0.0, "b": 0.0}
    assert plan(steer=False)["delays"] == {"a": 0.0, "b": 0.0}
    assert plan(max_delay=1.0)["delays"] == {"a": 0.0, "b": 0.0}  # a hold of 1 s is shorter than any evidence
    assert plan(entries=2000)["delays"] == {"a": 0.0, "b": 0.0}
    # jobs that take 0.4 s to set up: the held one waits at its first batch, its hold and prior
    # the time its loop may begin (its start-up later than the model's delays)
    (tmp_path / "io.toml").write_text(IO_SCENARIO.replace("[2.0e7, 8.0e6]", "[2.0e7, 2.0e7]").replace(
        "sample_time = 0.0005", "sample_time = 0.0005\nstartup = 0.4").replace(
        "sample_time = 0.001", "sample_time = 0.001\nstartup = 0.4"))
    parked = plan()
    assert parked["steer"]["park"] == ["b"] and parked["steer"]["prior"] == {"a": 0.0, "b": 0.4}
    assert parked["delays"]["a"] == 0.0 and parked["delays"]["b"] > 1.9
    assert "b's loop up to +" in parked["steer"]["guard"] and "at its first batch" in parked["steer"]["guard"]
    assert parked["simultaneous_reason"].startswith("a simultaneous start, guarded: ")
    monkeypatch.setenv("HPCSTAGGER_PLAN_GUARD", "0")
    off = plan()
    assert off["delays"] == {"a": 0.0, "b": 0.0} and "steer" not in off
    assert off["simultaneous_reason"].startswith("a simultaneous start: the model predicts no stagger gains")


SHORT_SCENARIO = textwrap.dedent("""
    [dataset]
    samples = 500
    sample_bytes = 100000
    [storage]
    bandwidth = [2.0e7, 1.7e7]
    [cache]
    capacity = 2.0e9
    [[job]]
    name = "a"
    sample_time = SAMPLE_A
    startup = STARTUP
    [[job]]
    name = "b"
    sample_time = SAMPLE_B
    startup = STARTUP
""")


def _short_planner(tmp_path, monkeypatch):
    """plan(sample_a, sample_b, startup, mode="plan", **plan_table) on SHORT_SCENARIO, as a dictionary."""
    monkeypatch.setenv("HPCSTAGGER_PLAN_JITTER", "0")
    monkeypatch.setenv("HPCSTAGGER_PLAN_REPLAY", "0")
    monkeypatch.delenv("HPCSTAGGER_PLAN_GUARD", raising=False)
    jobs = [{"name": n, "command": "x", "epochs": 2} for n in ("a", "b")]

    def plan(a, b, startup, mode="plan", **pl):
        text = SHORT_SCENARIO.replace("SAMPLE_A", a).replace("SAMPLE_B", b).replace("STARTUP", startup)
        (tmp_path / "io.toml").write_text(text)
        spec = Spec.from_dict({"plan": {"mode": "plan", "scenario": "io.toml", **pl}, "job": jobs},
                              base_dir=tmp_path)
        return plan_run(spec, ["a", "b"], {}, mode, PlanInputs(cache_state={"entries": 0, "bytes": 0})).to_dict()

    return plan


def test_a_short_stagger_is_held_at_the_first_batch_where_its_loop_would_begin_past_the_first_evidence(
        tmp_path, monkeypatch):
    """With plan_park on (the default), the held job sets itself up during the hold and waits at its
    first batch: its hold and the watcher's prior are when its loop may begin (its delay plus its
    start-up). A stagger whose loop begins after the first evidence is held with no stretch, and
    one that must stretch reaches the evidence a start-up sooner, so that a curve too steep to
    hold the job before its set-up can still be held at its first batch."""
    monkeypatch.delenv("HPCSTAGGER_PLAN_PARK", raising=False)
    plan = _short_planner(tmp_path, monkeypatch)
    # b's planned delay plus its 2 s start-up comes after the first evidence (2 + 0.5 + 1 s): no stretch
    parked = plan("0.003", "0.0005", "2.0")
    steer = parked["steer"]
    assert steer["park"] == ["b"] and parked["delays"] == steer["prior"]
    own = steer["prior"]["b"] - 2.0  # the model's delay for b
    assert 0.0 < own < 3.5 < steer["prior"]["b"]
    sc = Scenario.from_dict(parked["scenario"])
    assert parked["predicted"]["plan"] == pytest.approx(predict(sc, {"a": 0.0, "b": own}).makespan, rel=1e-6)
    assert f"b's loop up to +{own + 2.0:.1f} s (planned +{own:.1f} s and its 2.0 s start-up)" in steer["guard"]
    assert "is held at its first batch (set up meanwhile)" in steer["guard"]
    # a stagger stretched until b's loop begins at the first evidence (1 + 0.5 + 1 s): from its
    # delay to 1.5 s costs the model less than plan_guard, where holding it to 2.5 s does not
    stretched = plan("0.004", "0.003", "1.0")
    steer = stretched["steer"]
    assert steer["park"] == ["b"] and stretched["delays"] == {"a": 0.0, "b": pytest.approx(2.5)}
    own = steer["prior"]["b"] - 1.0
    assert 0.0 < own < 1.5
    sc = Scenario.from_dict(stretched["scenario"])
    assert predict(sc, {"a": 0.0, "b": 1.5}).makespan <= predict(sc, {"a": 0.0, "b": own}).makespan * 1.02
    assert predict(sc, {"a": 0.0, "b": 2.5}).makespan > predict(sc, {"a": 0.0, "b": own}).makespan * 1.02
    monkeypatch.setenv("HPCSTAGGER_PLAN_PARK", "0")
    unparked = plan("0.004", "0.003", "1.0")
    assert unparked["delays"]["b"] == pytest.approx(own) and "prior" not in unparked["steer"]
    assert "park" not in unparked["steer"]


def test_a_stagger_shorter_than_the_first_evidence_is_held_until_the_run_shows_it(tmp_path, monkeypatch):
    """The model plans a stagger that ends before the run can show whether it was right (the first
    job's start-up, the watcher's warm-up and one re-fit): the closed loop would have nothing to
    act on. Where the model's curve is flat out to the first evidence (within plan_guard), mode
    plan holds the late job until then, with the model's delay as the watcher's prior; where the
    curve rises past plan_guard, or in mode open, with steer = false or plan_guard 0, the plan's
    own delays stand. (Here the held job waits before its set-up: plan_park off.)"""
    monkeypatch.setenv("HPCSTAGGER_PLAN_PARK", "0")
    plan = _short_planner(tmp_path, monkeypatch)
    evidence = 2.0 + 0.5 + 1.0  # a's start-up, the watcher's warm-up, one re-fit (steer_interval)
    guarded = plan("0.003", "0.0005", "2.0")
    planned = guarded["steer"]["prior"]
    assert planned["a"] == 0.0 and 0.0 < planned["b"] < evidence
    assert guarded["delays"] == {"a": 0.0, "b": pytest.approx(evidence)}
    sc = Scenario.from_dict(guarded["scenario"])
    own, held = predict(sc, planned).makespan, predict(sc, guarded["delays"]).makespan
    assert guarded["predicted"]["plan"] == pytest.approx(own, rel=1e-6)  # the model's choice is what is predicted
    assert own <= held <= own * 1.02
    assert guarded["steer"]["groups"] == [["a"], ["b"]] and "simultaneous_reason" not in guarded
    assert guarded["steer"]["guard"].startswith("a short stagger, guarded: ")
    assert f"b up to +{evidence:.1f} s (planned +{planned['b']:.1f} s)" in guarded["steer"]["guard"]
    assert plan("0.003", "0.0005", "2.0", "open")["delays"] == planned
    assert plan("0.003", "0.0005", "2.0", steer=False)["delays"] == planned
    bounded = plan("0.003", "0.0005", "2.0", max_delay=3.0)  # the first evidence lies past max_delay: no hold
    assert 0.0 < bounded["delays"]["b"] <= 3.0 and "prior" not in bounded["steer"]
    steep = plan("0.006", "0.005", "1.0")  # holding b to 2.5 s costs more than plan_guard here
    assert 0.0 < steep["delays"]["b"] < 2.5 and "prior" not in steep["steer"]
    monkeypatch.setenv("HPCSTAGGER_PLAN_GUARD", "0")
    assert plan("0.003", "0.0005", "2.0")["delays"] == planned


def test_a_flat_curve_the_simulator_also_finds_flat_is_still_guarded(tmp_path, monkeypatch):
    """With the simulator's replay on: one DataLoader worker per job, batches of 8. The simulator
    replays the flat curve's points around a simultaneous start and picks none, so the plan is a
    simultaneous start; both models rest on the same calibration, so the guard still holds the
    fluid model's best stagger for the closed loop to decide (a stagger the simulator refuted is
    not held: Plan.simulated is then set)."""
    from hpcstagger.model import _confirm

    monkeypatch.setenv("HPCSTAGGER_PLAN_JITTER", "0")
    monkeypatch.delenv("HPCSTAGGER_PLAN_REPLAY", raising=False)
    monkeypatch.delenv("HPCSTAGGER_PLAN_GUARD", raising=False)
    text = IO_SCENARIO.replace("[2.0e7, 8.0e6]", "[2.0e7, 2.0e7]")
    text = text.replace("sample_time = 0.001\n", "sample_time = 0.001\nworkers = 1\nbatch = 8\n")
    text = text.replace("sample_time = 0.0005\n", "sample_time = 0.0005\nworkers = 1\nbatch = 8\n")
    (tmp_path / "io.toml").write_text(text)
    replayed = []
    real = _confirm.refine

    def refine(*args, **kwargs):
        out = real(*args, **kwargs)
        replayed.append(out[1])
        return out

    monkeypatch.setattr(_confirm, "refine", refine)
    jobs = [{"name": n, "command": "x", "epochs": 1} for n in ("a", "b")]
    spec = Spec.from_dict({"plan": {"mode": "plan", "scenario": "io.toml"}, "job": jobs}, base_dir=tmp_path)
    out = plan_run(spec, ["a", "b"], {}, "plan", PlanInputs(cache_state={"entries": 0, "bytes": 0})).to_dict()
    assert replayed and replayed[0] >= 2  # the simulator replayed the flat points ...
    assert "picked" not in out.get("simulated", {})  # ... and picked none
    assert out["predicted"]["plan"] == pytest.approx(out["predicted"]["simultaneous"])
    assert out["steer"]["prior"] == {"a": 0.0, "b": 0.0} and out["delays"]["b"] > 1.5
    assert out["simultaneous_reason"].startswith("a simultaneous start, guarded: ")


def test_a_stagger_the_simulator_picked_on_a_flat_curve_is_steered_with_a_wider_margin(tmp_path, monkeypatch):
    """The same flat curve with the simulator's replay on: the simulator picks a stagger the fluid
    model finds no faster than a simultaneous start, and the watcher, which re-fits the fluid model,
    moves that release only for a gain larger than the curve's flatness (FLAT) on top of
    steer_min_gain."""
    monkeypatch.setenv("HPCSTAGGER_PLAN_JITTER", "0")
    monkeypatch.delenv("HPCSTAGGER_PLAN_REPLAY", raising=False)
    (tmp_path / "io.toml").write_text(IO_SCENARIO.replace("[2.0e7, 8.0e6]", "[2.0e7, 2.0e7]"))
    jobs = [{"name": n, "command": "x", "epochs": 1} for n in ("a", "b")]
    spec = Spec.from_dict({"plan": {"mode": "plan", "scenario": "io.toml"}, "job": jobs}, base_dir=tmp_path)
    inputs = PlanInputs(cache_state={"entries": 0, "bytes": 0}, steer_min_gain=0.01)
    out = plan_run(spec, ["a", "b"], {}, "plan", inputs).to_dict()
    assert any(out["delays"].values()) and out["simulated"]["picked"] == 1.0
    assert out["simulated"]["plan"] < out["simulated"]["simultaneous"] * 0.99
    assert out["predicted"]["plan"] > out["predicted"]["simultaneous"] * 0.99  # the fluid model: no gain
    assert out["steer"]["min_gain"] == pytest.approx(0.01 + FLAT)
    assert "simultaneous_reason" not in out
    with config.override(plan_replay=False):  # the fluid model's own plan is steered with steer_min_gain
        fluid = plan_run(spec, ["a", "b"], {}, "plan", inputs).to_dict()
    assert fluid["steer"]["min_gain"] == pytest.approx(0.01) and "picked" not in fluid.get("simulated", {})
