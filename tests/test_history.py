"""The run history of a spec: records, the corrections the next plan starts from, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
import math
import os
import time

import pytest

from hpcstagger.stagger import history as H
from hpcstagger.stagger.delays import plan_run
from hpcstagger.stagger.runplan import PlanInputs
from hpcstagger.spec.jobspec import Spec
from support.cli import run_cli
from support.spec_util import write_spec

KIND = ("EPYC", 2, "")
NODE = {"host": "n1", "cpu": "EPYC", "cores": 2, "gpu": None}


def rec(t, source=None, jobs=None, digest="abc", node=NODE):
    return {"version": 1, "time": t, "scenario": {"sha256": digest}, "node": node, "source": source,
            "jobs": jobs or {}}


def test_corrections_weigh_recent_runs_and_filter_what_does_not_apply():
    assert H.corrections([], digest="abc", kind=KIND, since=0) is None
    # one run: its factors
    one = H.corrections([rec(10, 0.8, {"a": 1.2})], digest="abc", kind=KIND, since=0)
    assert one == {"runs": 1, "source": pytest.approx(0.8), "jobs": {"a": pytest.approx(1.2)}, "startup": {},
                   "latest": 10.0}
    # two runs: the newer weighs twice the older, geometrically
    two = H.corrections([rec(10, 0.5), rec(20, 1.0)], digest="abc", kind=KIND, since=0)
    assert two["runs"] == 2 and two["source"] == pytest.approx(math.exp((2 * 0 + 1 * math.log(0.5)) / 3))
    # another calibration, another kind of node, or a record older than the calibration: ignored
    other = [rec(10, 0.5, digest="old"), rec(11, 0.5, node={**NODE, "cpu": "Xeon"}),
             rec(12, 0.5, node={**NODE, "cores": 64}), rec(5, 0.5)]
    assert H.corrections(other, digest="abc", kind=KIND, since=8) is None
    assert H.corrections(other + [rec(30, 2.0)], digest="abc", kind=KIND, since=8)["runs"] == 1
    # a run that fitted only the jobs leaves the source at 1; a digest of '' (no scenario) never matches
    assert H.corrections([rec(10, None, {"a": 0.7})], digest="abc", kind=KIND, since=0)["source"] == 1.0
    assert H.corrections([rec(10, 0.5, digest="")], digest="", kind=KIND, since=0) is None
    # start-ups: the newer weighs twice the older, arithmetically; a run without one leaves the others' alone
    runs = [{**rec(10), "startup": {"a": 1.0, "b": 2.0}}, {**rec(20), "startup": {"a": 1.6}}, rec(30)]
    got = H.corrections(runs, digest="abc", kind=KIND, since=0)
    assert got["startup"] == {"a": pytest.approx((2 * 1.6 + 1 * 1.0) / 3), "b": pytest.approx(2.0)}
    assert "start-up a 1.40 s, b 2.00 s" in H.describe(got)


def test_records_are_written_read_and_cleared(tmp_path):
    workdir = str(tmp_path / "work")
    assert H.read_history(workdir) == [] and H.clear_history(workdir) == 0
    p1 = H.write_record(workdir, {"time": 2.0, "source": 0.9, "jobs": {}, "node": NODE, "scenario": {"sha256": "x"}})
    (tmp_path / "work" / "history" / "junk.json").write_text("{not json")
    (tmp_path / "work" / "history" / "foreign.json").write_text(json.dumps({"version": 99, "time": 1}))
    got = H.read_history(workdir)
    assert [r["path"] for r in got] == [p1] and got[0]["source"] == 0.9
    assert H.clear_history(workdir) == 3 and H.read_history(workdir) == []
    node = H.node_identity()
    assert node["host"] and node["cores"] >= 1 and H.node_kind(node)[1] == node["cores"]


def test_the_plan_starts_from_the_history(tmp_path, shm_root, monkeypatch):
    spec = Spec.from_toml(write_spec(tmp_path, shm_root))
    order = list(spec.job_names)
    plain = plan_run(spec, order, {}, "plan").to_dict()
    slow = plan_run(spec, order, {}, "plan",
                    PlanInputs(history={"runs": 2, "source": 0.5, "jobs": {}, "latest": 1.0})).to_dict()
    assert "history" not in plain and slow["history"]["runs"] == 2
    assert slow["predicted"]["simultaneous"] > plain["predicted"]["simultaneous"] * 1.2  # a slower source
    # plan_history: none yet; a record made here after the calibration applies; off by the env var or the spec
    assert H.plan_history(spec, "plan", environ={}) is None
    H.write_record(spec.run.workdir, {"time": time.time() + 1, "source": 0.5, "jobs": {"a": 1.1},
                                      "node": H.node_identity(),
                                      "scenario": {"sha256": H.scenario_digest(spec.plan.scenario)}})
    got = H.plan_history(spec, "plan", environ={})
    assert got["runs"] == 1 and got["source"] == pytest.approx(0.5) and got["jobs"] == {"a": pytest.approx(1.1)}
    assert H.plan_history(spec, "plan", environ={"HPCSTAGGER_NO_HISTORY": "1"}) is None
    assert H.plan_history(spec, "simultaneous", environ={}) is None
    # a new calibration (the scenario file changes) starts a new history
    with open(spec.plan.scenario, "a") as f:
        f.write("\n# recalibrated\n")
    os.utime(spec.plan.scenario)
    assert H.plan_history(spec, "plan", environ={}) is None


def test_history_cli_shows_and_clears(tmp_path, shm_root):
    path = write_spec(tmp_path, shm_root)
    spec = Spec.from_toml(path)
    out = run_cli("history", path)
    assert out.returncode == 0 and "no runs recorded" in out.stdout
    H.write_record(spec.run.workdir, {"time": time.time() + 1, "date": "2026-11-24 07:00:00", "source": 0.75,
                                      "jobs": {"a": 1.25}, "node": H.node_identity(),
                                      "scenario": {"sha256": H.scenario_digest(spec.plan.scenario)}})
    out = run_cli("history", path)
    assert out.returncode == 0, out.stderr
    assert "x0.75" in out.stdout and "x1.25" in out.stdout and "current" in out.stdout
    assert "starts from 1 run(s): source x0.75, a x1.25" in out.stdout
    H.write_record(spec.run.workdir, {"time": time.time() + 2, "date": "2026-11-24 07:01:00", "source": 0.75,
                                      "jobs": {}, "startup": {"a": 1.234}, "node": H.node_identity(),
                                      "scenario": {"sha256": H.scenario_digest(spec.plan.scenario)}})
    out = run_cli("history", path)
    assert "A START-UP" in out.stdout and "1.23 s" in out.stdout and "start-up a 1.23 s" in out.stdout
    data = json.loads(run_cli("history", path, "--json").stdout)
    assert len(data["records"]) == 2 and data["next_plan"]["runs"] == 2
    out = run_cli("history", path, "--clear")
    assert out.returncode == 0 and "removed 2 record(s)" in out.stdout
    assert H.read_history(spec.run.workdir) == []


def test_the_watcher_fits_on_top_of_the_history_not_twice(tmp_path, shm_root):
    """A run planned from the history fits its source factor against the history-corrected curve,
    and records the product: a right history stays put instead of compounding run after run."""
    from types import SimpleNamespace

    from hpcstagger.colocated.watcher import _record_history, _steering
    from hpcstagger.model import Scenario

    spec = Spec.from_toml(write_spec(tmp_path, shm_root))
    order = list(spec.job_names)
    history = {"runs": 1, "source": 1.5, "jobs": {"a": 0.8}, "latest": 1.0}
    plan = plan_run(spec, order, {}, "plan", PlanInputs(history=history))
    plan = replace(plan, steer=plan.steer or {"interval": 1.0, "horizon": 10.0, "max_delay": None, "min_delay": 0.0})
    session = SimpleNamespace(spec=spec, plan=plan, jobs={n: [i] for i, n in enumerate(order)}, run_dir="")
    st = _steering(session)
    file_curve = Scenario.from_toml(spec.plan.scenario).storage.bandwidth
    assert st.bandwidth == pytest.approx([1.5 * b for b in file_curve])
    built = st.build(1.0, {})  # no fit yet: the plan's own scenario
    assert built.storage.bandwidth == pytest.approx([1.5 * b for b in file_curve])
    # a run whose fit agrees with the history records the history's factors again
    st.beta, st.alpha, st.source_seen = 1.0, {"a": 1.0}, {"readers": 1.0}
    _record_history(session, st)
    (rec,) = H.read_history(spec.run.workdir)
    assert rec["source"] == pytest.approx(1.5) and rec["jobs"] == {"a": pytest.approx(0.8)}


def _run_files(run_dir, job, *, t0, released, loop_start):
    """A job leader's status and progress files as a run leaves them."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"{job}.0.json"), "w") as f:
        json.dump({"job": job, "t0": t0, "timings": {"started_at": released}}, f)
    if loop_start is not None:
        with open(os.path.join(run_dir, f"{job}.progress.json"), "w") as f:
            json.dump({"job": job, "loop_start": loop_start, "history": []}, f)


def test_start_ups_are_read_from_the_run_and_the_plan_starts_from_them(tmp_path, shm_root):
    """Each job's start-up (release to its loop's first batch) comes from the run's files, also for a
    job whose loop began after the record was written; the next plan and the watcher use it."""
    from types import SimpleNamespace

    from hpcstagger.spec.records import startups
    from hpcstagger.colocated.watcher import _record_history, _steering

    spec = Spec.from_toml(write_spec(tmp_path, shm_root))
    a, b = spec.job_names
    run_dir = str(tmp_path / "run")
    _run_files(run_dir, a, t0=1000.0, released=0.0, loop_start=1000.8)
    _run_files(run_dir, b, t0=1000.0, released=2.0, loop_start=None)  # still setting up
    assert startups(run_dir, [a, b, "nobody"]) == {a: pytest.approx(0.8)}
    plan = plan_run(spec, [a, b], {}, "plan")
    plan = replace(plan, steer=plan.steer or {"interval": 1.0, "horizon": 10.0, "max_delay": None, "min_delay": 0.0})
    session = SimpleNamespace(spec=spec, plan=plan, jobs={a: [0], b: [1]}, run_dir=run_dir)
    st = _steering(session)
    st.beta, st.alpha, st.source_seen = 1.0, {a: 1.0}, {"readers": 1.0}
    _record_history(session, st)
    _run_files(run_dir, b, t0=1000.0, released=2.0, loop_start=1003.5)  # b's loop began afterwards
    (got,) = H.read_history(spec.run.workdir)
    assert got["startup"] == {a: pytest.approx(0.8), b: pytest.approx(1.5)} and got["run_jobs"] == [a, b]
    corr = H.plan_history(spec, "plan", environ={})
    assert corr["startup"] == {a: pytest.approx(0.8), b: pytest.approx(1.5)}
    # the plan's scenario and the watcher's take the learned start-ups; without a history, the file's
    learned = plan_run(spec, [a, b], {}, "plan", PlanInputs(history=corr))
    assert [j["startup"] for j in (learned.scenario or {})["job"]] == [pytest.approx(0.8), pytest.approx(1.5)]
    assert [j.get("startup", 0.0) for j in (plan.scenario or {})["job"]] != [pytest.approx(0.8), pytest.approx(1.5)]
    st2 = _steering(SimpleNamespace(spec=spec, plan=learned, jobs={a: [0], b: [1]}, run_dir=run_dir))
    assert [j.startup for j in st2.build(1.0, {}).jobs] == [pytest.approx(0.8), pytest.approx(1.5)]
    # the run directory gone: the record keeps what it had
    import shutil

    shutil.rmtree(run_dir)
    with open(got["path"]) as f:
        on_disk = json.load(f)
    assert on_disk["startup"] == {a: pytest.approx(0.8)}
    (again,) = H.read_history(spec.run.workdir)
    assert again["startup"] == {a: pytest.approx(0.8)}


def test_no_records_says_what_keeps_a_run_from_being_recorded(tmp_path, capsys):
    from hpcstagger.cli import main
    from hpcstagger.stagger.steering import WARMUP, WINDOW

    path = write_spec(tmp_path, str(tmp_path / "shm"))  # mode plan with a scenario
    assert main(["history", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no runs recorded") and len(out.strip().splitlines()) == 1
    assert f"before the watcher's fit window (about {WARMUP + WINDOW:g} s of training" in out
    assert "a shorter run records nothing" in out and "started every job together" in out
    assert "a job that waits" not in out  # the old reason, which held in the runs it failed to explain
    text = (tmp_path / "spec.toml").read_text()
    (tmp_path / "spec.toml").write_text(text.replace('mode = "plan"', 'mode = "plan"\nhistory = false'))
    assert main(["history", path]) == 0
    assert "[plan] history = false: its runs are not recorded" in capsys.readouterr().out
    (tmp_path / "spec.toml").write_text(text.replace('mode = "plan"', 'mode = "simultaneous"'))
    assert main(["history", path]) == 0
    assert "[plan] mode is 'simultaneous': only a run in mode plan records" in capsys.readouterr().out
