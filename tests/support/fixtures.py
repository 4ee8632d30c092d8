"""The suite's shared fixtures, a pytest plugin (``pytest_plugins`` in tests/conftest.py): the real
single-node and two-node Slurm, batch jobs on them, a private /dev/shm root for the cache, and
shared-loader consumer processes."""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
import time

import pytest

from hpcstagger import config

from .cli import in_ci
from .local_slurm import LocalSlurm, missing_binaries
from .shm import remove_stale_mpich_segments


# ------------------------------------------------------------------------------------------ Slurm
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


@pytest.fixture(scope="session")
def slurm_two_nodes(slurm_cluster):
    """A second local Slurm with two nodes on this host (heterogeneous jobs need two nodes).

    Steps that span both nodes need ``local_slurm.MULTI_NODE_MPI_ENV`` in the batch script."""
    cluster = LocalSlurm(nodes=2, cpus=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def batch_job(batch_job_on, slurm_cluster):
    """Submit a batch script body to the local Slurm and wait; returns (job id, record, output)."""

    def submit(body: str, *sbatch_args: str, timeout: float = 120, name: str = "job",
               script_args: tuple[str, ...] = ()):
        return batch_job_on(slurm_cluster, body, *sbatch_args, timeout=timeout, name=name,
                            script_args=script_args)

    return submit


@pytest.fixture
def batch_job_on(tmp_path):
    """Submit a batch script body to a given LocalSlurm and wait; returns (job id, record, output)."""
    from hpcstagger import slurm

    def submit(cluster, body: str, *sbatch_args: str, timeout: float = 120, name: str = "job",
               script_args: tuple[str, ...] = ()):
        workdir = tmp_path / name
        workdir.mkdir(exist_ok=True)
        workdir.chmod(0o777)
        script = workdir / f"{name}.sbatch"
        script.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
        out = workdir / "out.txt"
        submitted = time.time()
        job_id = slurm.submit(script, ["--chdir", str(workdir), "--output", str(out), "--job-name", name,
                                       *sbatch_args], env=cluster.env, script_args=script_args)
        record = slurm.wait_for_job(job_id, timeout, env=cluster.env)
        remove_stale_mpich_segments(submitted)  # a failed or killed step skips MPICH's cleanup
        text = out.read_text() if out.exists() else ""
        return job_id, record, text

    return submit


# ------------------------------------------------------------------------------------------ cache
@pytest.fixture
def shm_root():
    """A fresh 0700 directory in /dev/shm, set as the shm root; removed afterwards."""
    root = tempfile.mkdtemp(prefix="hpcs-test-", dir="/dev/shm")
    try:
        with config.override(shm_root=root, throttle_dir=""):
            yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------- shared loader
@pytest.fixture
def jobs(shm_root, tmp_path):
    """Shared-loader consumer processes (support/loader_util.Jobs) under ``shm_root``; whatever a
    failed test left running is killed."""
    from .loader_util import Jobs

    j = Jobs(tmp_path, shm_root)
    try:
        yield j
    finally:
        j.cleanup()
