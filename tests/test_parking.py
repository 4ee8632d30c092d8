"""A job a guarded plan holds at its first batch: it sets itself up during the hold, waits when its
loop asks ``session.loader`` for the first batch, and its loop begins at its release."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcstagger.colocated.parking import at_first_batch, parks, wait_or_park
from support.cli import cli_env, run_cli
from support.userjob import SCENARIO, write_run


class _Session(SimpleNamespace):
    def __init__(self, park=("b",), job="b", delay=2.0):
        super().__init__(job=job, delays={job: delay}, calibrating="", timings={}, parked=None, waits=[], said=[],
                         plan=SimpleNamespace(steer={"park": list(park)}))
        self.clock = 0.0

    @property
    def delay(self):
        return self.delays[self.job]

    def elapsed(self):
        return self.clock

    def say(self, text):
        self.said.append(text)

    def wait(self, idle):
        self.waits.append((self.clock, list(idle)))


def test_a_parked_job_waits_once_when_its_loop_first_asks_for_a_batch():
    session = _Session()
    assert parks(session)
    wait_or_park(session, ["idle"])
    assert session.waits == [] and session.parked == ["idle"] and "held at its first batch" in session.said[0]
    loader = [1, 2, 3]
    held = at_first_batch(session, loader)
    assert len(held) == 3 and session.waits == []  # nothing waits before the loop begins
    session.clock = 1.25  # its set-up took this long
    assert list(held) == [1, 2, 3]
    assert session.waits == [(1.25, ["idle"])] and session.timings["parked_setup"] == 1.25
    assert session.parked is None
    assert list(at_first_batch(session, loader)) == [1, 2, 3] and len(session.waits) == 1  # the next epoch: no wait
    assert at_first_batch(session, loader) is loader


@pytest.mark.parametrize("session", [_Session(park=()), _Session(job="a", park=("b",)), _Session(delay=0.0)],
                         ids=["not parked", "another job", "no delay"])
def test_a_job_the_plan_does_not_park_waits_in_init(session):
    assert not parks(session)
    wait_or_park(session, ["idle"])
    assert session.waits == [(0.0, ["idle"])] and session.parked is None


SETUP_S = 1.5  # the job's set-up after hpcstagger.init (a model, an optimizer): a sleep here


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_guarded_short_stagger_sets_the_held_job_up_during_its_hold(tmp_path, shm_root):
    # a scenario whose plan starts b a little before the first evidence (a's start-up, the watcher's
    # warm-up and one re-fit): the guard holds b at its first batch, its loop due at its delay plus
    # its start-up, which comes after that evidence
    text = SCENARIO.replace("epochs = 2", f"epochs = 2\nstartup = {SETUP_S}")
    text = text.replace('name = "b"\nsample_time = 0.0003', 'name = "b"\nsample_time = 0.001')
    (tmp_path / "s.toml").write_text(text)
    spec = write_run(tmp_path, shm_root, name="parked", plan='mode = "plan"\nscenario = "s.toml"')
    job = tmp_path / "job.py"
    job.write_text(job.read_text().replace("session = hpcstagger.init()\n",
                                           f"session = hpcstagger.init()\ntime.sleep({SETUP_S})\n"))
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm_root, HPCSTAGGER_PLAN_JITTER="0.25")
    out = run_cli("launch", spec, "--cold-cache", "--json", cwd=tmp_path, env=env, timeout=200)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    steer = result["steer"]
    run_dir = Path(result["run_dir"])
    plan = json.loads((run_dir / "b.0.json").read_text())["plan"] or json.loads(
        (run_dir / "a.0.json").read_text())["plan"]
    assert plan["steer"]["park"] == ["b"], plan["steer"]
    assert "b's loop up to +" in plan["steer"]["guard"], plan["steer"]["guard"]
    assert "held at its first batch until released" in out.stderr
    status = json.loads((run_dir / "b.0.json").read_text())
    progress = json.loads((run_dir / "b.progress.json").read_text())
    setup, released = status["timings"]["parked_setup"], status["timings"]["started_at"]
    assert SETUP_S <= setup < released, status["timings"]  # set up before its release, not after
    begun = progress["loop_start"] - status["t0"]
    assert released <= begun < released + 0.5  # its loop began at its release
    assert steer["failed"] is None and steer["decisions"][0]["jobs"] == ["b"]
    # the run's history counts b's set-up in its start-up, as for a job that waited before it
    hist = json.loads(run_cli("history", spec, "--json", cwd=tmp_path, env=env).stdout)
    starts = hist["records"][0]["startup"]
    assert starts["b"] == pytest.approx(setup + begun - released, abs=0.01) and starts["b"] >= SETUP_S
    assert starts["a"] >= SETUP_S


def test_the_watcher_plans_a_parked_job_with_no_start_up_left_and_the_history_counts_its_set_up(tmp_path, shm_root):
    from dataclasses import replace

    from hpcstagger.colocated.watcher import _steering
    from hpcstagger.spec.jobspec import Spec
    from hpcstagger.spec.records import startups
    from hpcstagger.stagger.delays import plan_run
    from hpcstagger.stagger.runplan import PlanInputs
    from support.spec_util import write_spec

    spec = Spec.from_toml(write_spec(tmp_path, shm_root))
    a, b = spec.job_names
    base = plan_run(spec, [a, b], {}, "plan", PlanInputs(history={"runs": 1, "startup": {a: 0.7, b: 0.9}}))
    steer = {"interval": 1.0, "horizon": 10.0, "max_delay": None, "min_delay": 0.0, "groups": [[a], [b]]}
    for park, want in (([], [0.7, 0.9]), ([b], [0.7, 0.0])):
        plan = replace(base, steer={**steer, **({"park": park} if park else {})})
        st = _steering(SimpleNamespace(spec=spec, plan=plan, jobs={a: [0], b: [1]}, run_dir=""))
        assert [j.startup for j in st.build(1.0, {}).jobs] == [pytest.approx(w) for w in want]
    # b set itself up for 1.2 s, was released at +3.0 s and began its loop 0.1 s later
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for job, timings, loop in ((a, {"started_at": 0.0}, 1000.8), (b, {"started_at": 3.0, "parked_setup": 1.2}, 1003.1)):
        (run_dir / f"{job}.0.json").write_text(json.dumps({"job": job, "t0": 1000.0, "timings": timings}))
        (run_dir / f"{job}.progress.json").write_text(json.dumps({"job": job, "loop_start": loop, "history": []}))
    assert startups(str(run_dir), [a, b]) == {a: pytest.approx(0.8), b: pytest.approx(1.3)}
