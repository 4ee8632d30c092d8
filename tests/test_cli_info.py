"""`hpcstagger info`: one JSON object, the facts it reports, and one-line usage errors."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from support.cli import BIN, cli_env, run_cli


def _clean_env(**extra: str) -> dict[str, str]:
    env = cli_env(**extra)
    for k in list(env):
        if k.startswith("SLURM_") or k.startswith("PMI_"):
            del env[k]
    env.update(extra)
    return env


def test_info_json_is_one_object_with_the_facts():
    import numpy
    import torch

    out = run_cli("info", "--json", env=_clean_env())
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)  # fails unless stdout is exactly one JSON document
    assert isinstance(info, dict)
    v = info["versions"]
    assert v["torch"]["version"] == torch.__version__
    assert v["numpy"]["version"] == numpy.__version__
    assert v["h5py"]["installed"] and v["h5py"]["hdf5"]
    assert v["mpi4py"]["library"].startswith("MPICH")
    assert v["mpi4py"]["initialized"] is False  # not an MPI launch: MPI stays uninitialised
    assert "installed" in v["horovod"]
    assert info["launchers"]["mpiexec"]["path"] == str(BIN / "mpiexec")
    assert info["slurm_job"] is None
    assert info["mpi_launch"]["launched"] is False
    assert info["system"]["cpu_count"] == os.cpu_count()
    st = os.statvfs("/dev/shm")
    assert info["shm"]["size_bytes"] == st.f_blocks * st.f_frsize
    assert 0 < info["shm"]["available_bytes"] <= info["shm"]["size_bytes"]
    assert info["gpus"]["count"] == torch.cuda.device_count()
    assert any(k["env"] == "HPCSTAGGER_COLLECTIVE_TIMEOUT" for k in info["knobs"])


def test_info_reports_the_slurm_job_from_its_environment():
    env = _clean_env(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="c[1-2]", SLURM_NTASKS="4", SLURM_JOB_NAME="t")
    info = json.loads(run_cli("info", "--json", env=env).stdout)
    assert info["slurm_job"]["job_id"] == 77
    assert info["slurm_job"]["nodes"] == ["c1", "c2"]
    assert info["slurm_job"]["ntasks"] == 4


def test_info_text_report():
    out = run_cli("info", env=_clean_env())
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip() and " " in line)
    assert lines["hpcstagger"].strip() == __import__("hpcstagger").__version__
    assert "not inside a Slurm job" in out.stdout
    assert "/dev/shm" in out.stdout and "free of" in out.stdout


@pytest.mark.parametrize("args, needle", [
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
    (["nosuch"], "invalid choice: 'nosuch'"),
])
def test_usage_errors_exit_2_with_one_line(args, needle):
    out = run_cli(*args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stdout == ""


def test_no_command_prints_help_and_exits_2():
    out = run_cli()
    assert out.returncode == 2 and "info" in out.stderr


def test_console_script_and_version():
    out = subprocess.run([str(BIN / "hpcstagger"), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("hpcstagger ")


@pytest.mark.timeout(120)
def test_info_under_mpiexec_reports_each_rank():
    out = subprocess.run([str(BIN / "mpiexec"), "-n", "2", str(BIN / "hpcstagger"), "info", "--json"],
                         capture_output=True, text=True, timeout=100, env=_clean_env())
    assert out.returncode == 0, out.stderr
    infos = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert len(infos) == 2
    assert sorted(i["versions"]["mpi4py"]["world_rank"] for i in infos) == [0, 1]
    assert all(i["versions"]["mpi4py"]["world_size"] == 2 for i in infos)
    assert all(i["mpi_launch"]["launched"] for i in infos)
    assert [i["versions"]["mpi4py"]["world_rank"] for i in infos] == [0, 1]  # rank 0 prints, in order


@pytest.mark.timeout(120)
def test_info_text_under_mpiexec_prints_each_rank_once():
    out = subprocess.run([str(BIN / "mpiexec"), "-n", "3", str(BIN / "hpcstagger"), "info"],
                         capture_output=True, text=True, timeout=100, env=_clean_env())
    assert out.returncode == 0, out.stderr
    ranks = [line.split("rank", 1)[1].strip() for line in out.stdout.splitlines() if line.startswith("mpi launch")]
    assert ranks == ["0 of 3", "1 of 3", "2 of 3"], out.stdout
