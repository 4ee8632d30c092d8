"""`hpcstagger launch`: MPMD runs in every mode, the result table, and failures named by job."""

from __future__ import annotations

import json
import textwrap

import pytest

from hpcstagger.errors import ConfigError
from hpcstagger.colocated.launch import mpmd_command, parse_delays
from hpcstagger.spec.jobspec import Spec

from support.cli import cli_env, run_cli
from support.model_scenarios import small_toml

pytestmark = pytest.mark.timeout(180)

WORK = textwrap.dedent("""
    import os, time
    from hpcstagger import init
    s = init()
    if os.environ.get("FAIL_JOB") == s.job and s.rank == s.comm.size - 1:
        raise ValueError("loss is NaN at step 7")
    time.sleep(float(os.environ.get("WORK_" + s.job, "0.5")))
    s.finish(steps=3)
""")


def _spec(tmp_path, mode="simultaneous", extra=""):
    (tmp_path / "work.py").write_text(WORK)
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "lt"
        timeout = 120
        [plan]
        mode = "{mode}"
        {extra}
        [[job]]
        name = "a"
        command = "python work.py"
        env = {{ WORK_a = "0.5" }}
        [[job]]
        name = "b"
        command = "python work.py"
        ranks = 2
        env = {{ WORK_b = "1.0" }}
    """))
    return path


def _scenario(initial: float = 0.0) -> str:
    """A calibrated scenario for the spec's jobs a and b (the cache ``initial``-full at the start)."""
    return small_toml({"a": 0.0005, "b": 0.001}, initial=initial)


def test_simultaneous_fixed_and_sequential_runs(tmp_path):
    spec = _spec(tmp_path)
    out = run_cli("launch", str(spec), "--json", cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr
    sim = json.loads(out.stdout)
    assert sim["mode"] == "simultaneous" and sim["jobs"]["b"]["state"] == "done"
    assert 1.0 <= sim["makespan"] < 3.5 and sim["jobs"]["b"]["metrics"] == {"steps": 3}

    fixed = json.loads(run_cli("launch", str(spec), "--delays", "b=1.5", "--json", cwd=tmp_path).stdout)
    assert fixed["mode"] == "fixed" and fixed["delays"] == {"a": 0.0, "b": 1.5}
    assert fixed["jobs"]["b"]["start"] >= 1.5 and 2.5 <= fixed["makespan"] < 5.0

    seq = json.loads(run_cli("launch", str(spec), "--mode", "sequential", "--json", cwd=tmp_path).stdout)
    a, b = seq["jobs"]["a"], seq["jobs"]["b"]
    assert b["start"] >= a["finish"] and a["finish"] + 1.0 <= seq["makespan"] < a["finish"] + 3.0

    text = run_cli("launch", str(spec), cwd=tmp_path)
    assert text.returncode == 0
    assert "mode simultaneous, makespan" in text.stdout and "JOB  RANKS  DELAY  START  FINISH  STATE" in text.stdout


def test_a_failing_job_is_named_and_stops_the_run(tmp_path):
    spec = _spec(tmp_path)
    (tmp_path / "spec.toml").write_text(spec.read_text().replace('WORK_b = "1.0"', 'WORK_b = "60", FAIL_JOB = "b"'))
    out = run_cli("launch", str(spec), cwd=tmp_path, timeout=100)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert "job 'b' (2 rank(s)) failed: rank 1: ValueError: loss is NaN at step 7" in last
    assert "job 'a' (1 rank(s)) did not finish: stopped when job 'b' failed" in last


def test_timeout_stops_the_run(tmp_path):
    spec = _spec(tmp_path)
    (tmp_path / "spec.toml").write_text(spec.read_text().replace('WORK_b = "1.0"', 'WORK_b = "60"'))
    out = run_cli("launch", str(spec), "--timeout", "5", cwd=tmp_path, timeout=60)
    assert out.returncode == 1
    assert "exceeded its timeout of 5 s" in out.stderr
    assert "job 'b' (2 rank(s)) did not finish: stopped by the run's timeout" in out.stderr


def test_dry_run_and_bad_input(tmp_path):
    spec = _spec(tmp_path)
    out = run_cli("launch", str(spec), "--dry-run")
    assert out.returncode == 0
    assert " -n 1 env HPCSTAGGER_JOB=a WORK_a=0.5 " in out.stdout and " : -n 2 env HPCSTAGGER_JOB=b " in out.stdout
    out = run_cli("launch", str(spec), "--delays", "b=soon")
    assert out.returncode == 1 and "cannot read 'b=soon'" in out.stderr
    out = run_cli("launch", str(spec), "--delays", "z=1")
    assert out.returncode == 1 and "no job named 'z'" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[[job]]\nname = "a"\ncommand = "x"\nranks = -1\n')
    out = run_cli("launch", str(bad))
    assert out.returncode == 1 and "job[0].ranks must be an integer >= 1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_mpmd_command_is_pure(tmp_path):
    spec = Spec.from_toml(_spec(tmp_path))
    argv = mpmd_command(spec, mpiexec="mpiexec", python="/py")
    assert argv == ["mpiexec", "-n", "1", "env", "HPCSTAGGER_JOB=a", "WORK_a=0.5", "/py", "work.py", ":",
                    "-n", "2", "env", "HPCSTAGGER_JOB=b", "WORK_b=1.0", "/py", "work.py"]
    assert mpmd_command(spec, mpiexec="m", python="/py", jobs=["b"])[:3] == ["m", "-n", "2"]
    assert parse_delays("a=0, b=12.5") == {"a": 0.0, "b": 12.5}
    with pytest.raises(ConfigError):
        parse_delays("a=-1")


@pytest.mark.parametrize("env, job", [
    ({"HPCSTAGGER_JOB": "b"}, "b"), ({"SLURM_PROCID": "0"}, "a"), ({"SLURM_PROCID": "2"}, "b"),
    ({"PMI_RANK": "1"}, "b"),
    ({"SLURM_PROCID": "1", "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1",
      "SLURM_NTASKS_HET_GROUP_1": "2"}, "b"),
])
def test_exec_job_picks_the_rank_s_job(tmp_path, env, job):
    from hpcstagger.colocated.launch import exec_job

    spec = Spec.from_toml(_spec(tmp_path))
    argv, out_env, cwd = exec_job(spec, env)
    assert argv == ["python", "work.py"] and cwd == str(tmp_path)
    assert out_env["HPCSTAGGER_JOB"] == job and out_env[f"WORK_{job}"] == spec.job(job).env[f"WORK_{job}"]
    assert out_env["HPCSTAGGER_SPEC"] == spec.path


def test_exec_job_errors(tmp_path):
    from hpcstagger.colocated.launch import exec_job

    spec = Spec.from_toml(_spec(tmp_path))
    with pytest.raises(ConfigError, match="cannot tell this rank's job"):
        exec_job(spec, {})
    with pytest.raises(ConfigError, match="rank 3 is beyond the spec's 3 rank"):
        exec_job(spec, {"SLURM_PROCID": "3"})


def test_the_plan_line_says_why_a_plan_starts_together_and_sequential_runs_say_sequential(tmp_path, monkeypatch):
    """A plan of all zeros says why in each job's plan line; a sequential run's one-job launches say
    mode sequential (not simultaneous) in their lines and status files."""
    monkeypatch.delenv("HPCSTAGGER_PLAN_MIN_GAIN", raising=False)
    (tmp_path / "s.toml").write_text(_scenario(initial=1.0))
    spec = _spec(tmp_path, mode="plan", extra='scenario = "s.toml"')
    out = run_cli("launch", str(spec), cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "] mode plan: delays a +0.0s, b +0.0s;" in ln]
    assert len(lines) == 2, out.stderr  # each job's leader
    assert all("a simultaneous start: the model predicts that no stagger shortens the makespan" in ln
               for ln in lines), lines

    seq = run_cli("launch", str(spec), "--mode", "sequential", "--json", cwd=tmp_path, timeout=150)
    assert seq.returncode == 0, seq.stderr
    announced = [ln for ln in seq.stderr.splitlines() if "] mode " in ln]
    assert [ln.split("] ", 1)[1].split(";")[0] for ln in announced] == [
        "mode sequential: delays a +0.0s", "mode sequential: delays b +0.0s"]
    run_dir = json.loads(seq.stdout)["run_dir"]
    assert json.loads((tmp_path / run_dir / "b" / "b.0.json").read_text())["mode"] == "sequential"


def test_a_job_killed_with_sigkill_is_named_as_the_likely_oom_kill():
    """mpiexec reports a rank the kernel's OOM killer took as exit status 9: the line says so and
    names what to shrink, where a bare status left the user to guess."""
    from hpcstagger.colocated.launch import JobResult, RunResult

    run = RunResult(mode="simultaneous", returncode=9, run_dir="r", delays={"a": 0.0}, makespan=None,
                    jobs={"a": JobResult("a", 1, "started"), "b": JobResult("b", 2, "done")})
    (line,) = run.failures()
    assert line.startswith("job 'a' (1 rank(s)) did not finish: killed with SIGKILL while started (exit status 9)")
    assert "out-of-memory killer" in line and "[cache] capacity" in line
    other = RunResult(mode="simultaneous", returncode=3, run_dir="r", delays={}, makespan=None,
                      jobs={"a": JobResult("a", 1, "started")})
    assert other.failures() == ["job 'a' (1 rank(s)) did not finish: stopped while started (exit status 3)"]


def test_the_launcher_plans_ahead_and_rank_0_takes_its_plan_only_for_the_same_request(tmp_path):
    """hpcstagger launch starts world rank 0's planning while the ranks start: the plan file is in
    the run directory, and every rank's plan says it was planned ahead. A job that reports a
    calibration of its own changes the request, and rank 0 plans itself; the knob off plans as before."""
    (tmp_path / "s.toml").write_text(_scenario())
    spec = _spec(tmp_path, mode="plan", extra='scenario = "s.toml"')
    work = (tmp_path / "work.py").read_text()
    (tmp_path / "work.py").write_text(work.replace(
        "s = init()", "s = init(calibration={'sample_time': 0.002} if os.environ.get('CALIBRATED') else None)"))

    def run(**env):
        out = run_cli("launch", str(spec), "--json", cwd=tmp_path, timeout=150, env={**cli_env(), **env})
        assert out.returncode == 0, out.stderr
        run_dir = tmp_path / json.loads(out.stdout)["run_dir"]
        plans = [json.loads((run_dir / f).read_text())["plan"] for f in ("a.0.json", "b.0.json")]  # the leaders
        said = [ln for ln in out.stderr.splitlines() if "] mode plan: delays" in ln]
        return run_dir, plans, said

    run_dir, plans, said = run()
    assert (run_dir / "plan-ahead.json").exists()
    assert all(p.get("planned_ahead") is True for p in plans), plans
    assert len(said) == 2 and all("planned ahead while the ranks started" in ln for ln in said), said
    ahead = json.loads((run_dir / "plan-ahead.json").read_text())
    assert ahead["plan"]["delays"] == plans[0]["delays"]

    _, plans, said = run(CALIBRATED="1")  # rank 0's request names the jobs' calibrations
    assert not any(p.get("planned_ahead") for p in plans)
    assert plans[0]["calibrations"]["a"] == {"sample_time": 0.002}
    assert not any("planned ahead" in ln for ln in said)

    run_dir, plans, _ = run(HPCSTAGGER_PLAN_AHEAD="0")
    assert not (run_dir / "plan-ahead.json").exists() and not any(p.get("planned_ahead") for p in plans)
