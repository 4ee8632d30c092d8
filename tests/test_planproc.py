"""World rank 0 plans in a child interpreter (hpcstagger.stagger.planproc) and gets the same plan."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from hpcstagger import config
from hpcstagger.spec import runenv
from hpcstagger.spec.jobspec import Spec
from hpcstagger.stagger import delays, planproc
from hpcstagger.stagger.runplan import PlanInputs

SCENARIO = """
[dataset]
samples = 4000
sample_bytes = 100000
[storage]
bandwidth = [2.0e7, 2.4e7]
[cache]
capacity = 4.2e8
[node]
cores = 2
[[job]]
name = "big"
sample_time = 0.002
epochs = 2
[[job]]
name = "small"
sample_time = 0.0005
epochs = 2
"""

SPEC = """
[run]
name = "apart"
[plan]
mode = "plan"
scenario = "scenario.toml"
[[job]]
name = "big"
command = "true"
epochs = 2
[[job]]
name = "small"
command = "true"
epochs = 2
"""


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "scenario.toml").write_text(SCENARIO)
    (tmp_path / "spec.toml").write_text(SPEC)
    return Spec.from_toml(tmp_path / "spec.toml")


def test_the_child_plans_what_this_process_would(spec, monkeypatch):
    here = delays.plan_run(spec, ["big", "small"], {}, "plan", PlanInputs())

    def not_here(*args, **kwargs):
        raise AssertionError("planned in this process")

    monkeypatch.setattr(planproc, "plan_run", not_here)
    apart = planproc.plan_apart(spec, ["big", "small"], {}, "plan", PlanInputs())
    assert apart.delays == here.delays and apart.predicted == here.predicted  # the model's figures, to the bit
    assert apart.curve == here.curve and apart.scenario == here.scenario


def test_a_failed_child_or_the_knob_off_plans_here(spec, tmp_path, caplog):
    order, inputs = ["big", "small"], PlanInputs()
    here = delays.plan_run(spec, order, {}, "plan", inputs)
    with config.override(plan_apart=False):
        assert planproc.plan_apart(spec, order, {}, "plan", inputs).delays == here.delays
    (tmp_path / "spec.toml").unlink()  # the child cannot read the spec
    with caplog.at_level(logging.WARNING, logger="hpcstagger.stagger.planproc"):
        assert planproc.plan_apart(spec, order, {}, "plan", inputs).delays == here.delays
    assert "the planning process failed" in caplog.text and "spec" in caplog.text


def _ahead_file(tmp_path, request, plan=None, error=None):
    made = {"request": request, **({"plan": plan.to_dict()} if plan is not None else {"error": error})}
    path = tmp_path / "plan-ahead.json"
    path.write_text(json.dumps(made))
    return path


def test_the_launcher_s_plan_is_taken_for_the_same_request_only(spec, tmp_path, monkeypatch, caplog):
    """hpcstagger launch planned ahead (a file naming the request and its plan): world rank 0 takes
    that plan without planning when its own request is the same, and plans itself when it is not
    (here a job reported a calibration the launcher could not know)."""
    order, inputs = ["big", "small"], PlanInputs()
    calib = {"big": {}, "small": {}}
    request = planproc.plan_request(spec, order, calib, "plan", inputs)
    made = delays.plan_run(spec, order, calib, "plan", inputs)
    path = _ahead_file(tmp_path, request, made)
    monkeypatch.setenv(runenv.PLAN_AHEAD, f"{os.getpid()}:{path}")

    def no_child(*args, **kwargs):
        raise AssertionError("started a planning process")

    monkeypatch.setattr(planproc.subprocess, "run", no_child)
    taken = planproc.plan_apart(spec, order, calib, "plan", inputs)
    assert taken.planned_ahead is True and taken.delays == made.delays and taken.predicted == made.predicted

    monkeypatch.undo()
    monkeypatch.setenv(runenv.PLAN_AHEAD, f"{os.getpid()}:{path}")
    other = {"big": {"sample_time": 0.004}, "small": {}}
    with caplog.at_level(logging.INFO, logger="hpcstagger.stagger.planproc"):
        mine = planproc.plan_apart(spec, order, other, "plan", inputs)
    assert not mine.planned_ahead
    assert mine.calibrations == other
    assert "the launcher planned for other inputs (calibrations differ)" in caplog.text


def test_a_failed_or_vanished_launcher_plan_is_planned_here_without_waiting(spec, tmp_path, monkeypatch, caplog):
    order, inputs = ["big", "small"], PlanInputs()
    request = planproc.plan_request(spec, order, {}, "plan", inputs)
    path = _ahead_file(tmp_path, request, error="ModelError: no answer")
    monkeypatch.setenv(runenv.PLAN_AHEAD, f"{os.getpid()}:{path}")
    with caplog.at_level(logging.INFO, logger="hpcstagger.stagger.planproc"):
        assert not planproc.plan_apart(spec, order, {}, "plan", inputs).planned_ahead
    assert "the launcher's planning failed (ModelError: no answer)" in caplog.text

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs, and a file it never wrote
    monkeypatch.setenv(runenv.PLAN_AHEAD, f"{dead.pid}:{tmp_path / 'never.json'}")
    t = time.monotonic()
    assert not planproc.plan_apart(spec, order, {}, "plan", inputs).planned_ahead
    assert time.monotonic() - t < 30  # planned here, not after the launcher's 120 s timeout
