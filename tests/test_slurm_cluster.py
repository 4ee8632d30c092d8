"""Tests on the real single-node Slurm started by the slurm_cluster fixture."""

from __future__ import annotations

import json
import socket

import pytest

from hpcstagger import slurm
from hpcstagger.errors import LaunchError
from support import local_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]


def test_info_json_under_sbatch_reports_its_job(batch_job, slurm_cluster):
    job_id, record, text = batch_job("hpcstagger info --json\n", "-n", "2", name="info")
    assert record["JobState"] == "COMPLETED", text
    info = json.loads(text)
    assert info["slurm_job"]["job_id"] == job_id
    assert info["slurm_job"]["job_name"] == "info"
    assert info["slurm_job"]["nodes"] == [slurm_cluster.node]
    assert info["slurm_job"]["ntasks"] == 2
    assert info["launchers"]["sbatch"]["path"]


def test_mpi_ranks_inside_a_batch_job_with_srun_and_mpiexec(batch_job):
    # Rank 0 prints for all: output of several ranks through one launcher can interleave mid-line.
    probe = ("python -c \"from hpcstagger.comm import Comm; c = Comm.world(); r = c.allgather(c.rank); "
             "c.rank == 0 and print('{}', c.size, r)\"")
    body = f"srun --mpi=pmi2 -n 2 {probe.format('srun')}\nmpiexec -n 2 {probe.format('mpiexec')}\n"
    _, record, text = batch_job(body, "-n", "2", name="mpi")
    assert record["JobState"] == "COMPLETED", text
    lines = sorted(line for line in text.splitlines() if line.startswith(("srun", "mpiexec")))
    assert lines == ["mpiexec 2 [0, 1]", "srun 2 [0, 1]"], text


def test_failing_job_is_reported_failed_with_its_exit_code(batch_job):
    _, record, _ = batch_job("echo about to fail\nexit 3\n", name="fail")
    assert record["JobState"] == "FAILED"
    assert record["ExitCode"] == "3:0"


def test_oversized_job_is_refused_not_left_pending(slurm_cluster, tmp_path):
    script = tmp_path / "big.sbatch"
    script.write_text("#!/bin/bash\ntrue\n")
    with pytest.raises(LaunchError, match="More processors requested than permitted"):
        slurm.submit(script, ["-n", "1000"], env=slurm_cluster.env)


def test_wait_for_unknown_job_raises(slurm_cluster):
    with pytest.raises(LaunchError, match="does not know job 987654"):
        slurm.wait_for_job(987654, 5, env=slurm_cluster.env)


def test_a_cluster_whose_port_was_taken_meanwhile_starts_on_fresh_ports(slurm_cluster, monkeypatch):
    """Ports are picked free, not held: another cluster (a parallel test) may bind one first. The
    first start here gives slurmd a port that a socket holds; slurmd fails to bind it, and the start
    is retried on fresh ports (``slurm_cluster`` only for its conditions: Slurm installed, root)."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, not listening: a bind fails, a connection is refused
    taken = held.getsockname()[1]
    real = local_slurm._free_port
    handed: list[int] = []

    def first_taken() -> int:  # the first config's slurmd ports (its 2nd and 3rd) are the held one
        port = taken if len(handed) in (1, 2) else real()
        handed.append(port)
        return port

    monkeypatch.setattr(local_slurm, "_free_port", first_taken)
    cluster = local_slurm.LocalSlurm()
    try:
        cluster.start()
        assert handed[1:3] == [taken] * 2 and len(handed) == 6 and taken not in handed[3:]
        conf = (cluster.dir / "slurm.conf").read_text()
        assert f"Port={taken}" not in conf
    finally:
        cluster.stop()
        held.close()
