"""Learning a spec that was never calibrated (hpcstagger.stagger.learning): the source's levels from
counter windows, the plan of a first and a later run, and two real launches of user-style jobs."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from hpcstagger import config
from hpcstagger.stagger import learning as L
from hpcstagger.stagger.delays import plan_run
from hpcstagger.stagger.runplan import PlanInputs
from hpcstagger.spec.jobspec import Spec
from hpcstagger.errors import ModelError
from hpcstagger.model import Scenario

from support.cli import cli_env, run_cli
from support.userjob import SCENARIO, write_run


def _windows(level: int, per_read: float, read_s: float, dt: float = 0.5) -> list[tuple[float, float, float]]:
    """Windows of ``dt`` seconds with ``level`` reads in flight at ``per_read`` bytes/s each."""
    n = max(1, round(read_s / (level * dt)))
    return [(dt, per_read * level * dt, level * dt)] * n


def test_source_levels_from_windows_interpolate_and_hold():
    # 2 in flight at 1.5 MB/s each (3 MB/s), 4 in flight at 0.75 MB/s each (3 MB/s)
    run = _windows(2, 1.5e6, 4.0) + _windows(4, 0.75e6, 8.0)
    levels, how = L.source_levels([run], 6)
    assert levels[1] == pytest.approx(3.0e6) and levels[3] == pytest.approx(3.0e6)
    assert levels[0] == pytest.approx(1.5e6)          # below the lowest: its per-read bandwidth
    assert levels[2] == pytest.approx(3 * 1.125e6)     # between: per-read interpolated
    assert levels[4] == levels[5] == pytest.approx(3.0e6)  # above the highest: the aggregate holds
    assert "2 in flight" in how and "4 in flight" in how


def test_source_levels_weigh_recent_runs_and_need_enough_reads():
    new, old = _windows(2, 2.0e6, 2.0), _windows(2, 1.0e6, 2.0)
    levels, _ = L.source_levels([new, old], 2)
    # the older run weighs half: per read (2*2 + 0.5*1*2) / (2 + 0.5*2) MB/s
    assert levels[1] == pytest.approx(2 * (2.0e6 * 2 + 0.5 * 1.0e6 * 2) / 3.0)
    few = _windows(3, 1.0e6, 0.3, dt=0.1)  # under MIN_READ_S read-seconds: not trusted
    with pytest.raises(ModelError, match="no source read"):
        L.source_levels([few], 4)
    # with a seed, the unseen levels are the seed's, scaled to agree with what was seen
    levels, how = L.source_levels([_windows(2, 1.0e6, 2.0)], 3, base=[4.0e6, 4.0e6, 4.0e6])
    assert levels == pytest.approx([2.0e6, 2.0e6, 2.0e6]) and "seed" in how


def test_counter_windows_skip_short_gaps_and_resets():
    looks = [[0.0, 0.0, 0.0], [0.05, 10.0, 0.01], [0.2, 100.0, 0.1], [0.4, 50.0, 0.05], [0.6, 250.0, 0.25]]
    w = L.counter_windows(looks)
    # 0.05 s is too short a window; the counters going back (a new cache) is skipped
    assert w[0] == pytest.approx((0.2, 100.0, 0.1))
    assert all(b >= 0 and s >= 0 for _, b, s in w) and len(w) == 2


def _spec_file(tmp_path, extra: str = "") -> Spec:
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "learn"
        [plan]
        mode = "plan"
        {extra}
        [[job]]
        name = "a"
        command = "true"
        [[job]]
        name = "b"
        command = "true"
        [[job]]
        name = "c"
        command = "true"
    """))
    return Spec.from_toml(str(path))


def test_resolve_the_first_run_staggers_and_observes(tmp_path):
    spec = _spec_file(tmp_path, "max_delay = 5.0")
    with config.override(learn_stagger=3.0):
        learned = L.resolve(spec, "plan", environ={})
    assert learned["scenario"] is None and learned["runs"] == 0 and learned["stagger"] == 3.0
    meta = json.load(open(os.path.join(learned["observe"], "meta.json")))
    assert meta["jobs"] == ["a", "b", "c"] and meta["node"]["cores"] >= 1
    out = plan_run(spec, ["a", "b", "c"], {}, "plan", PlanInputs(learned=learned)).to_dict()
    assert out["delays"] == {"a": 0.0, "b": 3.0, "c": 5.0}  # k * stagger, within max_delay
    assert out["learn"]["observe"] == learned["observe"] and "steer" not in out
    # learning is off: a scenario, no history, a mode that does not plan, or HPCSTAGGER_NO_HISTORY
    assert L.resolve(spec, "simultaneous", environ={}) is None
    assert L.resolve(spec, "plan", environ={"HPCSTAGGER_NO_HISTORY": "1"}) is None
    assert L.resolve(_spec_file(tmp_path, "history = false"), "plan", environ={}) is None
    (tmp_path / "s.toml").write_text(SCENARIO)
    assert L.resolve(_spec_file(tmp_path, 'scenario = "s.toml"'), "plan", environ={}) is None


def test_a_learned_scenario_is_planned_from(tmp_path):
    spec = _spec_file(tmp_path)
    path = tmp_path / "learned.toml"
    path.write_text(SCENARIO.replace('name = "b"', 'name = "b"\n') +
                    '[[job]]\nname = "c"\nsample_time = 0.0003\nbatch = 8\n')
    out = plan_run(spec, ["a", "b", "c"], {}, "plan",
                   PlanInputs(learned={"scenario": str(path), "observe": str(tmp_path / "obs"),
                                       "why": "learned"})).to_dict()
    assert out["learn"]["scenario"] == str(path) and out["predicted"]["plan"] > 0
    assert {j["name"] for j in out["scenario"]["job"]} == {"a", "b", "c"}


def test_a_job_never_measured_is_named(tmp_path):
    spec = _spec_file(tmp_path)
    obs = tmp_path / "obs"
    obs.mkdir()
    with pytest.raises(ModelError, match="job 'a' was not measured.*session.loader"):
        L.build_scenario(spec, [{"dir": str(obs), "time": 0.0, "meta": {}}])


# ---------------------------------------------------------------------------- real launches

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_launches_learn_then_plan_from_what_they_saw(tmp_path, shm_root):
    spec = write_run(tmp_path, shm_root, name="learning", plan='mode = "plan"', workers=1)
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm_root, HPCSTAGGER_LEARN_STAGGER="1.5")
    first = run_cli("launch", spec, "--cold-cache", "--json", cwd=tmp_path, env=env, timeout=200)
    assert first.returncode == 0, first.stderr
    r1 = json.loads(first.stdout)
    assert r1["delays"] == {"a": 0.0, "b": 1.5} and r1["learn"]["scenario"] is None
    # the DataLoader workers exit without detaching from the emulated source; the launcher removes its table
    assert not os.path.exists(os.path.join(shm_root, ".throttle", "learning-source"))
    obs = r1["learn"]["observe"]
    for name in ("a", "b"):
        assert os.path.exists(os.path.join(obs, name, "job.json"))
        assert os.path.exists(os.path.join(obs, name, "loop.0.json"))
        series = json.load(open(os.path.join(obs, f"source.{name}.json")))["series"]
        assert len(series) >= 3 and series[-1][1] > 0  # the source's bytes, as the cache counted them
    second = run_cli("launch", spec, "--cold-cache", "--json", cwd=tmp_path, env=env, timeout=200)
    assert second.returncode == 0, second.stderr
    r2 = json.loads(second.stdout)
    learned = r2["learn"]["scenario"]
    assert learned.endswith("learned.toml") and "learned from 1 observed run" in r2["learn"]["why"]
    sc = Scenario.from_toml(learned)
    assert [j.name for j in sc.jobs] == ["a", "b"] and sc.dataset.samples == 300
    assert sc.dataset.sample_bytes == pytest.approx(2000, rel=0.01)
    assert all(j.workers == 1 and j.batch == 8 for j in sc.jobs)
    # the emulated source gives 200 kB/s alone and 100 kB/s to two readers; the run saw some of it
    assert 3e4 < max(sc.storage.bandwidth) < 6e5, sc.storage.bandwidth
    assert r2["predicted"]["plan"] > 0
    # sweep --history runs the learned plan (steered and open) beside the fixed staggers; both are observed
    sweep = run_cli("sweep", spec, "--history", "--staggers", "1", "--json", str(tmp_path / "sweep.json"),
                    cwd=tmp_path, env=env, timeout=280)
    assert sweep.returncode == 0, sweep.stderr
    runs = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert sorted(r["mode"] for r in runs) == ["fixed", "fixed", "open", "plan", "simultaneous"], runs
    assert all(r["ok"] for r in runs)
    hist = run_cli("history", spec, "--json", cwd=tmp_path, env=env)
    assert len(json.loads(hist.stdout)["learning"]["observed"]) == 4
    cleared = run_cli("history", spec, "--clear", cwd=tmp_path, env=env)
    assert cleared.returncode == 0 and "4 observed run(s)" in cleared.stdout
    assert not os.path.exists(learned)


def test_calibrate_history_needs_a_spec(tmp_path):
    out = run_cli("calibrate", "--history", "--source", "mod:func", "--job", "a=mod:func", cwd=tmp_path)
    assert out.returncode != 0 and "--history seeds a spec's run history: give --spec SPEC" in out.stderr
