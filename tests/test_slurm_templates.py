"""The slurm/*.sbatch templates, submitted to the real local Slurm as a user would."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from support.cli import REPO
from support.local_slurm import MULTI_NODE_MPI_ENV
from support.ranks import RANK_PROBE, rank_reports

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
TEMPLATES = REPO / "slurm"

WORK = RANK_PROBE
# What the templates read from the environment, and the generic names they once read: a test
# scrubs them from the submitting environment (the cluster's, taken when it started) so that
# nothing of its caller's leaks into the job, then sets what it means to set.
TEMPLATE_VARS = ("HPCSTAGGER_SPEC", "HPCSTAGGER_PLAN_MODE", "HPCSTAGGER_LAUNCHER", "HPCSTAGGER_VENV",
                 "HPCSTAGGER_SCENARIO", "HPCSTAGGER_CALIBRATE_BUDGET", "HPCSTAGGER_STEP_JOBS",
                 "HPCSTAGGER_TEMPLATE", "HPCSTAGGER_VALUES", "HPCSTAGGER_RUN_DIR", "HPCSTAGGER_SHM_ROOT")
GENERIC_VARS = ("SPEC", "OUT", "BUDGET", "JOBS", "VENV", "MODE", "LAUNCHER", "TEMPLATE", "VALUES", "DIR")


def _scrub(monkeypatch, cluster) -> None:
    for name in TEMPLATE_VARS + GENERIC_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delitem(cluster.env, name, raising=False)


def _spec(tmp_path: Path, name="tpl", a_args="", b_args="", mode="fixed") -> Path:
    (tmp_path / "work.py").write_text(WORK)
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "{name}"
        [plan]
        mode = "{mode}"
        delays = {{ b = 1.0 }}
        [[job]]
        name = "a"
        command = "python work.py {a_args}"
        [[job]]
        name = "b"
        command = "python work.py {b_args}"
        ranks = 2
    """))
    return path


def test_every_template_documents_its_sbatch_lines_and_variables():
    for path in TEMPLATES.glob("*.sbatch"):
        text = path.read_text()
        assert text.startswith("#!/bin/bash\n# hpcstagger:"), path
        assert "# Use:" in text and "# #SBATCH lines" in text and "# Variables" in text, path
        assert "#SBATCH --time=" in text and "#SBATCH --output=" in text, path


def test_every_template_reads_only_hpcstagger_variables():
    """A template reads its arguments, SLURM_* and HPCSTAGGER_* variables, and its own locals: a
    generic name (OUT, SPEC, DIR) would take whatever the submitting shell happens to hold."""
    import re

    for path in TEMPLATES.glob("*.sbatch"):
        body = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        assigned = set(re.findall(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", body, re.M))
        assigned |= set(re.findall(r"read -r -a ([a-z_]+)", body)) | {"job"}
        read = set(re.findall(r"\$\{?#?([A-Za-z_][A-Za-z0-9_]*)", body))
        foreign = sorted(n for n in read - assigned if not n.startswith(("HPCSTAGGER_", "SLURM_")))
        assert foreign == [], f"{path.name} reads {foreign} from the environment: name it HPCSTAGGER_*"
        generic = sorted(n for n in assigned if n.isupper() and not n.startswith(("HPCSTAGGER_", "SLURM_", "MPIR_")))
        assert generic == [], f"{path.name} assigns generic names {generic}"
        documented = path.read_text().split("# Variables", 1)[1].split("#SBATCH", 1)[0]
        for name in sorted(n for n in read if n.startswith("HPCSTAGGER_") and n != "HPCSTAGGER_RUN_DIR"):
            assert name in documented, f"{path.name} reads {name} without documenting it in its header"


def test_colocated_template(slurm_cluster, batch_job, tmp_path, monkeypatch):
    _scrub(monkeypatch, slurm_cluster)
    spec = _spec(tmp_path, a_args="'two words'")
    body = (TEMPLATES / "colocated.sbatch").read_text().split("\n", 1)[1]
    _, record, text = batch_job(body, "--ntasks=3", name="colocated", script_args=(str(spec),))
    assert record["JobState"] == "COMPLETED", text
    assert rank_reports(tmp_path) == {"a.0": "a rank 0/1 argv=['two words']", "b.0": "b rank 0/2 argv=[]",
                                      "b.1": "b rank 1/2 argv=[]"}, text
    assert "mode fixed: delays a +0.0s, b +1.0s" in text and "waiting 1.0 s (planned start)" in text
    assert "mode fixed, makespan" in text  # the final table


def test_colocated_template_without_a_spec_fails_clearly(slurm_cluster, batch_job, monkeypatch):
    _scrub(monkeypatch, slurm_cluster)
    monkeypatch.setitem(slurm_cluster.env, "SPEC", "/not/read.toml")   # a generic name is never read
    body = (TEMPLATES / "colocated.sbatch").read_text().split("\n", 1)[1]
    _, record, text = batch_job(body, name="nospec")
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0"
    assert "give the job spec" in text


def test_hetjob_template(slurm_two_nodes, batch_job_on, tmp_path, monkeypatch):
    _scrub(monkeypatch, slurm_two_nodes)
    spec = _spec(tmp_path)
    body = (TEMPLATES / "hetjob.sbatch").read_text().split("\n", 1)[1]
    body = body.replace("set -euo pipefail", "set -euo pipefail\n" + MULTI_NODE_MPI_ENV, 1)
    job_id, record, text = batch_job_on(slurm_two_nodes, body, name="het", script_args=(str(spec),))
    assert record["JobState"] == "COMPLETED", text
    assert sorted(rank_reports(tmp_path)) == ["a.0", "b.0", "b.1"], text
    assert "waiting 1.0 s (planned start)" in text
    assert "b    2      1.0" in text
    # the ranks' status files go under the spec's workdir (not the submit directory), where
    # `hpcstagger status SPEC` finds the newest run
    run_dir = tmp_path / "hpcstagger-runs" / "tpl" / "runs" / f"slurm-{job_id}"
    assert sorted(p.name for p in run_dir.glob("*.json")) == ["a.0.json", "b.0.json", "b.1.json"]
    assert f"run {run_dir}" in text


def test_sweep_array_template(slurm_cluster, batch_job, tmp_path, monkeypatch):
    _scrub(monkeypatch, slurm_cluster)
    spec = _spec(tmp_path, name="sweep-@TASK@", a_args="--lr @A@", b_args="--lr @B@")
    template = spec.rename(tmp_path / "sweep.toml.in")
    body = (TEMPLATES / "sweep-array.sbatch").read_text().split("\n", 1)[1]
    body = body.replace("#SBATCH --ntasks=2", "#SBATCH --ntasks=3")
    # after the #SBATCH block: sbatch stops reading directives at the first command
    body = body.replace("set -euo pipefail", "set -euo pipefail\nexport HPCSTAGGER_VALUES='1 2 3 4'", 1)
    job_id, record, _ = batch_job(body, "--array=0-1", "--output",
                                  str(tmp_path / "task-%a.out"), name="sweep", script_args=(str(template),))
    assert record["JobState"] == "COMPLETED"
    assert rank_reports(tmp_path, "0") == {"a.0": "a rank 0/1 argv=['--lr', '1']",
                                           "b.0": "b rank 0/2 argv=['--lr', '2']",
                                           "b.1": "b rank 1/2 argv=['--lr', '2']"}
    assert rank_reports(tmp_path, "1") == {"a.0": "a rank 0/1 argv=['--lr', '3']",
                                           "b.0": "b rank 0/2 argv=['--lr', '4']",
                                           "b.1": "b rank 1/2 argv=['--lr', '4']"}
    assert (tmp_path / "hpcstagger-runs" / "sweep-0").is_dir() and (tmp_path / "hpcstagger-runs" / "sweep-1").is_dir()


@pytest.fixture
def examples_dir(tmp_path):
    import shutil
    import subprocess
    import sys
    import tempfile

    for f in ("make_dataset.py", "train_ddp.py", "train_horovod.py", "colocated.toml"):
        shutil.copy(REPO / "examples" / f, tmp_path / f)
    subprocess.run([sys.executable, "make_dataset.py", "data.h5", "--samples", "256"], cwd=tmp_path, check=True,
                   timeout=60, capture_output=True)
    root = tempfile.mkdtemp(prefix="hpcs-slurm-examples-", dir="/dev/shm")
    yield tmp_path, root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_colocated_template_trains_the_examples(slurm_cluster, batch_job, examples_dir, monkeypatch):
    """The full path a user takes: the examples' spec through colocated.sbatch on Slurm, DDP and
    Horovod jobs in one allocation, the planned delays in the log, and checkpoints that verify."""
    from support.cli import cli_env, run_cli
    import subprocess
    import sys

    cwd, root = examples_dir
    if subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True).returncode:
        pytest.skip("Horovod is not installed; scripts/install-horovod builds it")
    _scrub(monkeypatch, slurm_cluster)
    spec = cwd / "colocated.toml"
    spec.write_text(spec.read_text().replace('mode = "simultaneous"', 'mode = "fixed"\ndelays = { mlp = 1.0 }'))
    body = (TEMPLATES / "colocated.sbatch").read_text().split("\n", 1)[1]
    body = body.replace("set -euo pipefail", f"set -euo pipefail\nexport HPCSTAGGER_SHM_ROOT={root}", 1)
    _, record, text = batch_job(body, "--ntasks=3", name="examples", timeout=240, script_args=(str(spec),))
    assert record["JobState"] == "COMPLETED", text
    assert "mode fixed: delays cnn +0.0s, mlp +1.0s" in text and "waiting 1.0 s (planned start)" in text
    assert "epoch 2/2" in text and "mode fixed, makespan" in text
    for job in ("cnn", "mlp"):
        out = run_cli("ckpt", "verify", str(cwd / "hpcstagger-runs" / "examples" / "checkpoints" / job),
                      env=cli_env(HPCSTAGGER_SHM_ROOT=root))
        assert out.returncode == 0 and "sound" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_calibrate_template_writes_a_scenario_and_prints_the_plan(slurm_cluster, batch_job, examples_dir,
                                                                  monkeypatch):
    import subprocess
    import sys

    from hpcstagger.model import Scenario

    cwd, root = examples_dir
    # every source level is measured twice on fresh samples: 1024 samples of 3 KB give each
    # measurement with 2 readers a window of a few tenths of a second behind the emulated 2 MB/s
    subprocess.run([sys.executable, "make_dataset.py", "data.h5", "--samples", "1024"], cwd=cwd, check=True,
                   timeout=60, capture_output=True)
    spec = cwd / "thr.toml"
    spec.write_text(textwrap.dedent("""
        [run]
        name = "thr"
        [dataset]
        path = "data.h5"
        name = "samples"
        throttle = [4e6, 2e6]
        [cache]
        capacity = "1MB"
        [[job]]
        name = "cnn"
        command = "python train_ddp.py"
        [[job]]
        name = "mlp"
        command = "python train_horovod.py"
        epochs = 3
    """))
    if subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True).returncode:
        pytest.skip("Horovod is not installed; scripts/install-horovod builds it")
    body = (TEMPLATES / "calibrate.sbatch").read_text().split("\n", 1)[1]
    _scrub(monkeypatch, slurm_cluster)
    # a caller's generic OUT naming a directory once became the output path: it is never read now
    monkeypatch.setitem(slurm_cluster.env, "OUT", str(cwd))
    body = body.replace("set -euo pipefail",
                        f"set -euo pipefail\nexport HPCSTAGGER_SHM_ROOT={root} HPCSTAGGER_CALIBRATE_BUDGET=20", 1)
    _, record, text = batch_job(body, name="calibrate", timeout=240, script_args=(str(spec),))
    assert record["JobState"] == "COMPLETED", text
    sc = Scenario.from_toml(cwd / "scenario.toml")
    assert 2.5e6 < sc.storage.bandwidth[0] < 4.4e6 and sc.storage.bandwidth[1] < sc.storage.bandwidth[0]
    assert [j.name for j in sc.jobs] == ["cnn", "mlp"] and sc.jobs[1].epochs == 3
    # each job measured from its own command in the allocation: the DDP example's DataLoader has a
    # worker, the Horovod example's loads in its main process
    assert (sc.jobs[0].workers, sc.jobs[0].batch, sc.jobs[1].workers) == (1, 32, 0)
    assert "calibrate: job cnn:" in text and "calibrate: job mlp:" in text
    assert "predicted makespan" in text and "simultaneous" in text


def test_slurm_run_dir_command(tmp_path):
    """No cluster needed: the command only names (and creates) a directory."""
    from support.cli import cli_env, run_cli

    spec = _spec(tmp_path)
    out = run_cli("slurm", "run-dir", str(spec), "--job-id", "42")
    expected = tmp_path / "hpcstagger-runs" / "tpl" / "runs" / "slurm-42"
    assert out.returncode == 0 and out.stdout.strip() == str(expected) and expected.is_dir(), out
    out = run_cli("slurm", "run-dir", str(spec), env=cli_env(SLURM_JOB_ID="7"))
    assert out.returncode == 0 and out.stdout.strip().endswith("runs/slurm-7"), out
    env = cli_env()
    env.pop("SLURM_JOB_ID", None)
    out = run_cli("slurm", "run-dir", str(spec), env=env)
    assert out.returncode == 1 and "no job id" in out.stderr and "--job-id" in out.stderr, out
    for bad in ("../x", "abc", "12a"):
        out = run_cli("slurm", "run-dir", str(spec), "--job-id", bad)
        assert out.returncode == 1 and "is not a Slurm job id" in out.stderr, out
    assert run_cli("slurm", "run-dir", str(spec), "--job-id", "42_3").stdout.strip().endswith("slurm-42_3")
