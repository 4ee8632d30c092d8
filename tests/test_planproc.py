"""World rank 0 plans in a child interpreter (hpcstagger.stagger.planproc) and gets the same plan."""

from __future__ import annotations

import logging

import pytest

from hpcstagger import config
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
