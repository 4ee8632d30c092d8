"""The slurm/*.sbatch templates, submitted to the real local Slurm as a user would."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
TEMPLATES = REPO / "slurm"

WORK = textwrap.dedent("""
    import sys, time
    from hpcstagger.coordinator import init
    s = init()
    print(f"{s.job} rank {s.rank}/{s.comm.size} argv={sys.argv[1:]}", flush=True)
    time.sleep(0.3)
    s.finish()
""")


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


def test_colocated_template(slurm_cluster, batch_job, tmp_path):
    spec = _spec(tmp_path, a_args="'two words'")
    body = (TEMPLATES / "colocated.sbatch").read_text().split("\n", 1)[1]
    _, record, text = batch_job(body, "--ntasks=3", name="colocated", script_args=(str(spec),))
    assert record["JobState"] == "COMPLETED", text
    assert "a rank 0/1 argv=['two words']" in text and "b rank 1/2" in text
    assert "mode fixed: delays a +0.0s, b +1.0s" in text and "waiting 1.0 s (planned start)" in text
    assert "mode fixed, makespan" in text  # the final table


def test_colocated_template_without_a_spec_fails_clearly(slurm_cluster, batch_job):
    body = (TEMPLATES / "colocated.sbatch").read_text().split("\n", 1)[1]
    _, record, text = batch_job(body, name="nospec")
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0"
    assert "give the job spec" in text


def test_hetjob_template(slurm_two_nodes, batch_job_on, tmp_path):
    spec = _spec(tmp_path)
    body = (TEMPLATES / "hetjob.sbatch").read_text().split("\n", 1)[1]
    # The two local "nodes" share one host, where MPICH's UCX shared-memory transport between
    # "nodes" fails; real separate nodes talk TCP or a fabric anyway.
    body = body.replace("set -euo pipefail", "set -euo pipefail\nexport UCX_TLS=tcp", 1)
    _, record, text = batch_job_on(slurm_two_nodes, body, name="het", script_args=(str(spec),))
    assert record["JobState"] == "COMPLETED", text
    assert "a rank 0/1" in text and "b rank 1/2" in text and "waiting 1.0 s (planned start)" in text
    assert "b    2      1.0" in text


def test_sweep_array_template(slurm_cluster, batch_job, tmp_path):
    spec = _spec(tmp_path, name="sweep-@TASK@", a_args="--lr @A@", b_args="--lr @B@")
    template = spec.rename(tmp_path / "sweep.toml.in")
    body = (TEMPLATES / "sweep-array.sbatch").read_text().split("\n", 1)[1]
    body = body.replace("#SBATCH --ntasks=2", "#SBATCH --ntasks=3")
    # after the #SBATCH block: sbatch stops reading directives at the first command
    body = body.replace("set -euo pipefail", "set -euo pipefail\nexport VALUES='1 2 3 4'", 1)
    job_id, record, _ = batch_job(body, "--array=0-1", "--output",
                                  str(tmp_path / "task-%a.out"), name="sweep", script_args=(str(template),))
    assert record["JobState"] == "COMPLETED"
    t0, t1 = (tmp_path / "task-0.out").read_text(), (tmp_path / "task-1.out").read_text()
    assert "a rank 0/1 argv=['--lr', '1']" in t0 and "b rank 0/2 argv=['--lr', '2']" in t0
    assert "a rank 0/1 argv=['--lr', '3']" in t1 and "b rank 1/2 argv=['--lr', '4']" in t1
    assert (tmp_path / "hpcstagger-runs" / "sweep-0").is_dir() and (tmp_path / "hpcstagger-runs" / "sweep-1").is_dir()
