"""The closed loop in a real launch: two user-style jobs (a DataLoader over CachedDataset behind an
emulated slow source, ``session.loader``), the watcher fits the model, releases the waiting job,
and records the run; the next launch plans from that record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cli import cli_env, run_cli
from support.userjob import SCENARIO, write_run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

def _spec(tmp_path, shm_root):
    # a calibration whose jobs' reads got 0.9 of the curve: the watcher fits relative to that
    # and jobs that take 0.4 s to start: the plan's start spread is 0.25 x 0.4 s (plan_jitter)
    text = SCENARIO.replace("bandwidth = [2.0e5, 1.0e5]", "bandwidth = [2.0e5, 1.0e5]\nfit_baseline = 0.9")
    (tmp_path / "s.toml").write_text(text.replace("epochs = 2", "epochs = 2\nstartup = 0.4"))
    return write_run(tmp_path, shm_root, name="steered", plan='mode = "plan"\nscenario = "s.toml"\nmin_delay = 2.0')


def test_a_steered_launch_fits_releases_and_records(tmp_path, shm_root):
    spec = _spec(tmp_path, shm_root)
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm_root)  # the emulated source's state goes under the test's root
    out = run_cli("launch", spec, "--cold-cache", "--json", cwd=tmp_path, env=env, timeout=200)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    waited = [n for n, d in result["delays"].items() if d > 0]
    assert len(waited) == 1, result["delays"]
    late = waited[0]
    release = result["jobs"][late]["release"]
    assert release["at"] >= 2.0 - 1e-6 and release["reason"]  # min_delay held it back at least that long
    steer = result["steer"]
    assert steer["decisions"][0]["jobs"] == [late] and steer["failed"] is None
    assert steer["fits"], "the watcher never fitted the model"
    fit = [f for f in steer["fits"] if not f.get("after_release")][-1]  # the last fit that decided
    assert fit["seen"]["readers"] > 0 and 0.25 <= fit["source"] <= 4.0
    # both jobs load in their main process: their reads are not counted in flight, before the release
    # either (counting would cost their loops), and the source is fitted to the mean in flight
    assert fit["seen"]["baseline"] == 0.9 and fit["seen"]["estimator"] == "mean in flight"
    # release times are compared over the plan's start spread (plan_jitter x the mean start-up)
    assert fit["jitter"] == pytest.approx(0.25 * 0.4, rel=1e-6)
    # the run is in the spec's history, and the next plan starts from it
    hist = run_cli("history", spec, "--json", cwd=tmp_path, env=env)
    data = json.loads(hist.stdout)
    assert len(data["records"]) == 1 and data["next_plan"]["runs"] == 1
    assert data["records"][0]["source"] == pytest.approx(steer["fit"]["source"])
    # each job's start-up, the released one's too (its loop began after the record was written)
    starts = data["records"][0]["startup"]
    assert set(starts) == set(result["delays"]) and all(0 < v < 30 for v in starts.values()), starts
    progress = json.loads((Path(result["run_dir"]) / f"{late}.progress.json").read_text())
    status = json.loads((Path(result["run_dir"]) / f"{late}.0.json").read_text())
    released = status["timings"]["started_at"]  # when the job got its release (the watcher's "at", plus delivery)
    assert released == pytest.approx(release["at"], abs=0.5)
    assert starts[late] == pytest.approx(progress["loop_start"] - status["t0"] - released, abs=1e-3)
    assert data["next_plan"]["startup"] == pytest.approx(starts)
    again = run_cli("launch", spec, "--cold-cache", cwd=tmp_path, env=env, timeout=200)
    assert again.returncode == 0, again.stderr
    assert "from the history of 1 run(s)" in again.stderr
    quiet = run_cli("launch", spec, "--cold-cache", "--no-history", cwd=tmp_path, env=env, timeout=200)
    assert quiet.returncode == 0 and "from the history" not in quiet.stderr


def test_releases_that_come_before_any_evidence_are_still_learned_from(tmp_path, shm_root):
    # max_delay releases the waiting job long before either loop has begun: the watcher looks on
    # after the release, fits the run, and records it, so that the next plan can learn from it
    (tmp_path / "s.toml").write_text(SCENARIO)
    spec = write_run(tmp_path, shm_root, name="early", plan='mode = "plan"\nscenario = "s.toml"\nmax_delay = 0.3')
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm_root)
    out = run_cli("launch", spec, "--cold-cache", "--json", cwd=tmp_path, env=env, timeout=200)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    late = [n for n, d in result["delays"].items() if d > 0]
    assert len(late) == 1, result["delays"]
    release = result["jobs"][late[0]]["release"]
    assert release["at"] < 1.0 and "max_delay" in release["reason"], release
    steer = result["steer"]
    assert steer["failed"] is None and steer["fits"], steer
    fit = steer["fits"][-1]
    assert fit["after_release"] and fit["seen"]["readers"] > 0 and 0.25 <= fit["source"] <= 4.0
    # both jobs load in their main process: after the release too, the source is fitted to the mean in flight
    assert fit["seen"]["estimator"] == "mean in flight", fit["seen"]
    hist = json.loads(run_cli("history", spec, "--json", cwd=tmp_path, env=env).stdout)
    assert len(hist["records"]) == 1
    assert hist["records"][0]["source"] == pytest.approx(steer["fit"]["source"])


def test_the_job_released_last_is_fitted_on_its_whole_run_and_recorded(tmp_path, shm_root):
    # jobs of 12 epochs: the one that waits follows the other through the cache in its first epoch,
    # then runs on its own costs; its leader hosts the watcher, which fits it once more when it
    # has finished (the host's finish waits for that fit) and rewrites the run's record with it
    text = SCENARIO.replace("epochs = 2", "epochs = 12")
    (tmp_path / "s.toml").write_text(text)
    spec = Path(write_run(tmp_path, shm_root, name="late", plan='mode = "plan"\nscenario = "s.toml"'))
    spec.write_text(spec.read_text().replace("epochs = 2", "epochs = 12"))
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm_root)
    out = run_cli("launch", str(spec), "--cold-cache", "--json", cwd=tmp_path, env=env, timeout=200)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    late = [n for n, d in result["delays"].items() if d > 0]
    assert len(late) == 1, result["delays"]
    steer = result["steer"]
    assert steer["failed"] is None and steer["host"]["job"] == late[0], steer["host"]
    fitted = [f for f in steer["fits"] if late[0] in (f.get("late") or [])]
    assert fitted, steer["fits"]
    factor = fitted[-1]["jobs"][late[0]]
    assert 0.5 < factor < 2.0
    hist = json.loads(run_cli("history", str(spec), "--json", cwd=tmp_path, env=env).stdout)
    assert len(hist["records"]) == 1 and hist["records"][0]["jobs"][late[0]] == pytest.approx(factor)
    assert hist["next_plan"]["jobs"][late[0]] == pytest.approx(factor)
