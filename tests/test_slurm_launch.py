"""`hpcstagger slurm render|submit` on the real local Slurm: srun --multi-prog, mpiexec, sequential."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from support.cli import run_cli
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


def test_render_is_pure_and_golden(tmp_path):
    spec = _spec(tmp_path)
    out = run_cli("slurm", "render", str(spec))
    assert out.returncode == 0
    text = out.stdout
    assert "#SBATCH --ntasks=3" in text and "#SBATCH --job-name=sl" in text
    assert "0 bash $run_dir/job-a.sh\n1-2 bash $run_dir/job-b.sh" in text
    assert "exec python work.py 'two words'" in text
    assert text.rstrip().endswith('exit "$rc"')


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
