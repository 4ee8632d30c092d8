"""Jobs whose loader hpcstagger cannot see: a job timed as a step factory is planned to wait on no
evidence (a simultaneous start, with why), and a job that never calls session.loader is named with
the line to add."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from hpcstagger.model import Scenario, optimal_plan
from hpcstagger.model.plan import unseen_loaders
from support.cli import run_cli
from support.model_scenarios import B, scenario
from support.spec_util import write_spec

pytestmark = pytest.mark.timeout(180)


def _staggering() -> Scenario:
    """Two jobs the model staggers: a long compute-bound job and a short I/O-bound one."""
    return scenario(1000, jobs=((0.00276, 3), (0.00034, 1)), bandwidth=(B, 0.5 * B), policy="none")


def test_a_job_whose_loader_was_not_seen_is_never_planned_to_wait():
    sc = _staggering()
    seen = optimal_plan(sc)
    assert max(seen.delays.values()) > 0  # with both loaders seen the model staggers them
    blind = dataclasses.replace(sc, jobs=(sc.jobs[0], dataclasses.replace(sc.jobs[1], loader_seen=False)))
    assert unseen_loaders(blind) == ["j1"]
    plan = optimal_plan(blind)
    assert set(plan.delays.values()) == {0.0}
    assert "loader of j1 was not measured" in plan.curve_label and "session.loader(loader)" in plan.curve_label
    assert plan.makespan == pytest.approx(plan.simultaneous)


def test_loader_seen_round_trips_through_the_scenario_file(tmp_path):
    sc = _staggering()
    blind = dataclasses.replace(sc, jobs=(dataclasses.replace(sc.jobs[0], loader_seen=False), sc.jobs[1]))
    path = tmp_path / "s.toml"
    path.write_text(blind.to_toml())
    assert "loader_seen = false" in path.read_text()
    assert Scenario.from_toml(path) == blind
    assert "loader_seen" not in sc.to_toml()  # the default is not written


def test_the_step_factory_route_marks_its_jobs_unseen(tmp_path):
    from hpcstagger.stagger.scenario_build import scenario_job

    job = scenario_job("a", {"route": "step", "sample_time": 0.001}, 2)
    assert job.loader_seen is False and job.epochs == 2


def test_a_planned_launch_of_a_blind_scenario_starts_together_and_says_why(tmp_path, shm_root):
    spec = write_spec(tmp_path, shm_root)
    sc = Scenario.from_toml(tmp_path / "s.toml")
    blind = dataclasses.replace(sc, jobs=(sc.jobs[0], dataclasses.replace(sc.jobs[1], loader_seen=False)))
    (tmp_path / "s.toml").write_text(blind.to_toml())
    out = run_cli("launch", spec, "--json", cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result["delays"].values()) == {0.0}
    assert "loader of b was not measured" in out.stderr  # the leaders' plan line


WITH_LOADER = textwrap.dedent("""
    from hpcstagger import init
    s = init()
    for batch in s.loader(range(5)):
        pass
    s.finish()
""")


def test_a_job_that_never_calls_session_loader_is_named_in_launch_and_status(tmp_path, shm_root):
    spec = write_spec(tmp_path, shm_root, scenario=False)  # work.py never calls session.loader
    (tmp_path / "looped.py").write_text(WITH_LOADER)
    text = (tmp_path / "spec.toml").read_text().replace('name = "b"\ncommand = "python work.py"',
                                                      'name = "b"\ncommand = "python looped.py"')
    (tmp_path / "spec.toml").write_text(text)
    out = run_cli("launch", spec, cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr
    line = "a never called session.loader"
    assert line in out.stdout and "for batch in session.loader(loader):" in out.stdout
    assert "b never called session.loader" not in out.stdout
    status = run_cli("status", spec, cwd=tmp_path)
    assert status.returncode == 0 and line in status.stdout
    js = json.loads(run_cli("status", spec, "--json", cwd=tmp_path).stdout)
    assert js["jobs"]["a"]["loader_seen"] is False and js["jobs"]["b"]["loader_seen"] is True
