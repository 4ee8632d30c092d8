"""`hpcstagger slurm render|submit` on the real local Slurm: srun --multi-prog, mpiexec, sequential."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from support.cli import run_cli
from support.loader_util import gone
from support.local_slurm import MULTI_NODE_MPI_ENV
from support.ranks import RANK_PROBE, rank_reports

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

WORK = RANK_PROBE


def _spec(tmp_path, launcher="srun", mode="fixed"):
    (tmp_path / "work.py").write_text(WORK)
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "sl"
        [plan]
        mode = "{mode}"
        delays = {{ b = 1.0 }}
        [slurm]
        launcher = "{launcher}"
        time = "00:10:00"
        [[job]]
        name = "a"
        command = "python work.py 'two words'"
        [[job]]
        name = "b"
        command = "python work.py"
        ranks = 2
    """))
    return path


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_submit_runs_every_job_with_its_delay(slurm_cluster, tmp_path, launcher):
    spec = _spec(tmp_path, launcher)
    out = run_cli("slurm", "submit", str(spec), "--wait", "--timeout", "180", env=slurm_cluster.env, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)
    assert f"job {job_id} COMPLETED" in out.stdout
    log = (tmp_path / f"sl-{job_id}.out").read_text()
    assert rank_reports(tmp_path) == {"a.0": "a rank 0/1 argv=['two words']", "b.0": "b rank 0/2 argv=[]",
                                     "b.1": "b rank 1/2 argv=[]"}  # quoted arguments survive the launcher
    assert "mode fixed: delays a +0.0s, b +1.0s" in log and "waiting 1.0 s (planned start)" in log
    status = json.loads(run_cli("status", str(spec), "--json").stdout)
    assert status["run_dir"].endswith(f"slurm-{job_id}")
    assert all(j["state"] == "done" for j in status["jobs"].values())
    assert status["jobs"]["b"]["start"] >= 1.0
    assert (Path(status["run_dir"]) / "batch.exit").read_text() == "0\n"  # the script's last act


def test_sequential_batch_script_runs_jobs_one_after_another(slurm_cluster, tmp_path):
    spec = _spec(tmp_path, mode="sequential")
    out = run_cli("slurm", "submit", str(spec), "--wait", "--timeout", "180", env=slurm_cluster.env, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    status = json.loads(run_cli("status", str(spec), "--json").stdout)
    a, b = status["jobs"]["a"], status["jobs"]["b"]
    assert a["state"] == b["state"] == "done" and b["start"] >= a["finish"]
    # each job's own launch is labelled sequential in its ranks' status files
    modes = {json.loads(p.read_text())["mode"] for p in Path(status["run_dir"]).glob("*/*.json")
             if p.name[:2] in ("a.", "b.")}
    assert modes == {"sequential"}, modes


@pytest.mark.parametrize("how, state", [("raise RuntimeError('boom')", "failed"), ("sys.exit('boom')", "exited")])
def test_failed_batch_job_exits_nonzero_and_names_the_job(slurm_cluster, tmp_path, how, state):
    spec = _spec(tmp_path)
    (tmp_path / "work.py").write_text(WORK.replace("time.sleep(0.3)", f"time.sleep(0.3)\nif s.job == 'b': {how}"))
    out = run_cli("slurm", "submit", str(spec), "--wait", "--timeout", "180", env=slurm_cluster.env, timeout=200)
    assert out.returncode == 1
    assert "ended FAILED" in out.stderr
    assert re.search(rf"b\s+2\s+1\.0\s+1\.\d\s+-\s+{state}", out.stdout), out.stdout
    run_dir = Path(json.loads(run_cli("status", str(spec), "--json").stdout)["run_dir"])
    assert (run_dir / "batch.exit").read_text().strip() not in ("", "0")  # the step's code, written last


def test_render_is_pure_and_golden(tmp_path):
    spec = _spec(tmp_path)
    out = run_cli("slurm", "render", str(spec))
    assert out.returncode == 0
    text = out.stdout
    assert "#SBATCH --ntasks=3" in text and "#SBATCH --job-name=sl" in text
    assert "0 bash $run_dir/job-a.sh\n1-2 bash $run_dir/job-b.sh" in text
    assert "exec python work.py 'two words'" in text
    assert text.rstrip().endswith('exit "$rc"')
    # what the run leaves is cleaned after the step, before the job ends
    assert text.index("--multi-prog") < text.index("hpcstagger clean --after-run") < text.index('exit "$rc"')
    assert text.rstrip().splitlines()[-2] == 'echo "$rc" > "$run_dir/batch.exit"'  # submit --wait's end marker


def test_heterogeneous_job_with_hpcstagger_exec(slurm_two_nodes, batch_job_on, tmp_path):
    spec = _spec(tmp_path, mode="fixed")
    body = f"""\
        #SBATCH --ntasks=1
        #SBATCH hetjob
        #SBATCH --ntasks=2
        export HPCSTAGGER_RUN_DIR=$PWD/status
        {MULTI_NODE_MPI_ENV}
        srun --mpi=pmi2 --kill-on-bad-exit=1 --het-group=0,1 hpcstagger exec {spec}
        hpcstagger status {spec} $HPCSTAGGER_RUN_DIR
    """
    _, record, text = batch_job_on(slurm_two_nodes, body, name="het")
    assert record["JobState"] == "COMPLETED", text
    assert rank_reports(tmp_path) == {"a.0": "a rank 0/1 argv=['two words']", "b.0": "b rank 0/2 argv=[]",
                                     "b.1": "b rank 1/2 argv=[]"}, text
    assert "waiting 1.0 s (planned start)" in text
    assert "b    2      1.0" in text  # the status table printed by the batch script


def test_launch_with_srun_inside_an_allocation(slurm_cluster, batch_job_on, tmp_path):
    spec = _spec(tmp_path, mode="fixed")
    _, record, text = batch_job_on(slurm_cluster, f"hpcstagger launch {spec} --launcher srun\n",
                                   "--ntasks=3", name="srunlaunch")
    assert record["JobState"] == "COMPLETED", text
    assert "mode fixed, makespan" in text
    assert rank_reports(tmp_path) == {"a.0": "a rank 0/1 argv=['two words']", "b.0": "b rank 0/2 argv=[]",
                                     "b.1": "b rank 1/2 argv=[]"}, text


SHARED_JOB = """
import sys, torch
from hpcstagger.loader import SharedLoader

class Data:
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i

loader = SharedLoader(Data(), 4, name="p", num_workers=1)
n = sum(1 for _ in loader)
with open(sys.argv[1], "w") as f:
    f.write(f"{n} {loader.producer_pid}")
loader.close()
"""


def test_a_batch_job_ends_its_idle_shared_loader_producer(slurm_cluster, shm_root, tmp_path):
    """The producer would linger 30 s past its last consumer, and the job's end (proctrack/cgroup on
    a real cluster) would kill it there with its files still in /dev/shm; the batch script stops it."""
    (tmp_path / "job.py").write_text(SHARED_JOB)
    spec = tmp_path / "spec.toml"
    spec.write_text(textwrap.dedent("""
        [run]
        name = "ld"
        [plan]
        mode = "simultaneous"
        [slurm]
        time = "00:10:00"
        [[job]]
        name = "a"
        command = "python job.py out.txt"
    """))
    env = {**slurm_cluster.env, "HPCSTAGGER_SHM_ROOT": shm_root, "HPCSTAGGER_LOADER_LINGER": "30"}
    out = run_cli("slurm", "submit", str(spec), "--wait", "--timeout", "180", env=env, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    batches, pid = (int(x) for x in (tmp_path / "out.txt").read_text().split())
    assert batches == 8 and pid > 0
    assert gone(pid), f"the producer pid {pid} still runs after the job"
    loader_dir = Path(shm_root) / ".loader"
    assert not loader_dir.exists() or list(loader_dir.iterdir()) == []


def test_a_batch_job_plans_while_its_ranks_start(slurm_cluster, tmp_path):
    """The rendered script starts world rank 0's planning with ``hpcstagger slurm prepare`` before
    its srun step, as ``hpcstagger launch`` does before its ranks: rank 0 takes that plan, and with
    the knob off it plans itself."""
    from support.model_scenarios import small_toml

    (tmp_path / "work.py").write_text(WORK)
    (tmp_path / "s.toml").write_text(small_toml({"a": 0.0005, "b": 0.001}))
    spec = tmp_path / "spec.toml"
    spec.write_text(textwrap.dedent("""
        [run]
        name = "pa"
        [plan]
        mode = "plan"
        scenario = "s.toml"
        [slurm]
        time = "00:10:00"
        [[job]]
        name = "a"
        command = "python work.py"
        [[job]]
        name = "b"
        command = "python work.py"
    """))

    def run(**env):
        out = run_cli("slurm", "submit", str(spec), "--wait", "--timeout", "180", env={**slurm_cluster.env, **env},
                      timeout=200)
        assert out.returncode == 0, out.stdout + out.stderr
        run_dir = Path(json.loads(run_cli("status", str(spec), "--json").stdout)["run_dir"])
        plans = [json.loads((run_dir / f).read_text())["plan"] for f in ("a.0.json", "b.0.json")]
        return run_dir, plans

    run_dir, plans = run()
    ahead = json.loads((run_dir / "plan-ahead.json").read_text())
    assert all(p.get("planned_ahead") is True for p in plans), plans
    assert ahead["plan"]["delays"] == plans[0]["delays"]
    run_dir, plans = run(HPCSTAGGER_PLAN_AHEAD="0")
    assert not (run_dir / "plan-ahead.json").exists() and not any(p.get("planned_ahead") for p in plans)
