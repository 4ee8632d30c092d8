"""Shared fixtures: the real single-node Slurm, and helpers for running the CLI and batch jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from local_slurm import LocalSlurm, missing_binaries  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for running ``hpcstagger`` and ``mpiexec`` from this interpreter's venv."""
    env = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    env.pop("MPIR_CVAR_PMI_VERSION", None)
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m hpcstagger ARGS`` in a subprocess and capture its output."""
    return subprocess.run([sys.executable, "-m", "hpcstagger", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env(), cwd=cwd)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node Slurm; yields the LocalSlurm (``.env`` has SLURM_CONF and PATH).

    Skips only when the Slurm binaries are missing (or we are not root) and CI is not set;
    under CI=true the tests must run, so a missing Slurm fails them.
    """
    missing = missing_binaries()
    reason = None
    if missing:
        reason = (f"Slurm binaries missing ({', '.join(missing)}); install them with "
                  "'apt-get install slurmctld slurmd slurm-client munge' (.ci/run does)")
    elif os.geteuid() != 0:
        reason = "the local Slurm's slurmd must run as root"
    if reason:
        if in_ci():
            pytest.fail(f"CI is set but Slurm tests cannot run: {reason}")
        pytest.skip(reason)
    cluster = LocalSlurm().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def batch_job(slurm_cluster, tmp_path):
    """Submit a batch script body and wait for it; returns (job record, output text)."""
    from hpcstagger import slurm

    def submit(body: str, *sbatch_args: str, timeout: float = 120, name: str = "job"):
        workdir = tmp_path / name
        workdir.mkdir(exist_ok=True)
        workdir.chmod(0o777)
        script = workdir / f"{name}.sbatch"
        script.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
        out = workdir / "out.txt"
        job_id = slurm.submit(script, ["--chdir", str(workdir), "--output", str(out), "--job-name", name,
                                       *sbatch_args], env=slurm_cluster.env)
        record = slurm.wait_for_job(job_id, timeout, env=slurm_cluster.env)
        text = out.read_text() if out.exists() else ""
        return job_id, record, text

    return submit
