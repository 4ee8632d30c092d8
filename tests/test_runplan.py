"""The typed plan of a run: its dictionary form on the wire and in status files, and what reads it back."""

from __future__ import annotations

import json

import pytest

from hpcstagger.errors import ConfigError
from hpcstagger.spec.jobspec import Spec
from hpcstagger.stagger.delays import plan_run
from hpcstagger.stagger.runplan import PlanInputs, RunPlan
from support.spec_util import write_spec


def test_a_plan_survives_the_wire_and_omits_what_it_lacks(tmp_path, shm_root):
    spec = Spec.from_toml(write_spec(tmp_path, shm_root))
    order = list(spec.job_names)
    plan = plan_run(spec, order, {}, "plan", PlanInputs(cache_state={"entries": 0, "bytes": 0}))
    assert isinstance(plan, RunPlan) and set(plan.delays) == set(order) and plan.predicted
    wire = json.loads(json.dumps(plan.with_run_id("ab12").to_dict()))
    back = RunPlan.from_dict(wire)
    assert back == plan.with_run_id("ab12") and back.run_id == "ab12"
    bare = RunPlan(mode="simultaneous", delays={"a": 0.0})
    assert bare.to_dict() == {"mode": "simultaneous", "delays": {"a": 0.0}, "calibrations": {}}


def test_a_record_that_is_not_a_plan_is_refused_by_name():
    with pytest.raises(ConfigError, match="unknown parts \\['stagger'\\]"):
        RunPlan.from_dict({"mode": "plan", "delays": {}, "stagger": 1.0})
    with pytest.raises(ConfigError, match="no 'mode' or no 'delays'"):
        RunPlan.from_dict({"delays": {}})


def test_the_dictionary_form_is_deprecated_but_the_same():
    from hpcstagger.stagger.delays import plan_delays

    with pytest.warns(DeprecationWarning, match="plan_run"):
        old = plan_delays(None, ["a", "b"], {}, "fixed", fixed={"b": 1.0})
    assert old == plan_run(None, ["a", "b"], {}, "fixed", PlanInputs(fixed={"b": 1.0})).to_dict()
