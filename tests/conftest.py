"""Shared fixtures: the real single-node Slurm, and helpers for running the CLI and batch jobs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from local_slurm import LocalSlurm, missing_binaries  # noqa: E402

from hpcstagger.colocated._shm import remove_stale_mpich_segments, unheld_entries  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Property tests are derandomized (the same examples on every run, so a red run is reproducible)
# and keep no example database. Hypothesis's other caches go to a temporary directory removed at
# the end, not to .hypothesis/ in the checkout.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="hpcstagger-hypothesis-")
try:
    from hypothesis import settings as _hypothesis_settings
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # pragma: no cover - the test extra brings it
    pass
else:
    set_hypothesis_home_dir(_HYPOTHESIS_HOME)
    _hypothesis_settings.register_profile("hpcstagger", derandomize=True, database=None)
    _hypothesis_settings.load_profile("hpcstagger")


def pytest_unconfigure(config):
    shutil.rmtree(_HYPOTHESIS_HOME, ignore_errors=True)


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


# ---------------------------------------------------------------------------- ranks' reports
# A job script for co-located runs: every rank reports its job, rank and arguments in a file of its
# own (ranks/<array task or "run">/<job>.<rank>.txt beside the script). Tests read those files, not
# the launcher's stdout, where the ranks' lines can interleave.
RANK_PROBE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from hpcstagger import init
    s = init()
    line = f"{s.job} rank {s.rank}/{s.comm.size} argv={sys.argv[1:]}"
    print(line, flush=True)
    out = Path(__file__).resolve().parent / "ranks" / os.environ.get("SLURM_ARRAY_TASK_ID", "run")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{s.job}.{s.rank}.tmp").write_text(line)
    (out / f"{s.job}.{s.rank}.tmp").rename(out / f"{s.job}.{s.rank}.txt")
    time.sleep(0.3)
    s.finish()
""")


def rank_reports(script_dir: str | os.PathLike, task: str = "run") -> dict[str, str]:
    """What each rank of a RANK_PROBE run reported: {"<job>.<rank>": line}."""
    return {p.stem: p.read_text() for p in (Path(script_dir) / "ranks" / task).glob("*.txt")}


# ---------------------------------------------------------------------------- /dev/shm hygiene
_SESSION_START = time.time()


def new_shm_entries(since: float) -> list[Path]:
    """Entries of /dev/shm created after ``since`` that no live process holds."""
    return unheld_entries(since)


def pytest_sessionfinish(session, exitstatus):
    """Clean MPICH leftovers of aborted runs, then fail (under CI) if a test left /dev/shm files."""
    remove_stale_mpich_segments(_SESSION_START)
    rank = os.environ.get("PMI_RANK", "0")
    if rank != "0":
        return  # under mpiexec, rank 0 reports for all
    leftovers = [str(p) for p in new_shm_entries(_SESSION_START)]
    if leftovers:
        msg = f"tests left {len(leftovers)} entr(y/ies) in /dev/shm: {', '.join(sorted(leftovers)[:10])}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"{'ERROR' if in_ci() else 'WARNING'}: {msg}", red=True)
        if in_ci() and session.exitstatus == 0:
            session.exitstatus = 1


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


# What a batch step spanning the two local "nodes" exports before srun. Two faults of the PyPI
# MPICH wheel's default UCX netmod show there, both outside hpcstagger:
# - UCX's shared-memory transports trip over each other between two "nodes" on one host;
# - MPICH publishes its UCX address at start-up through PMI-1 "put" lines that, run-length
#   encoded, sometimes exceed the 1024 bytes a line that Slurm 22.05's pmi2 plugin reads, and the
#   step then dies in MPI_Init ("mpi/pmi2: value not properly terminated in client request").
#   How long a line is depends on the address bytes, so it fails now and then, not always.
# MPICH's OFI netmod over TCP has a short address and neither fault. See README, Troubleshooting.
MULTI_NODE_MPI_ENV = "export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp"


@pytest.fixture(scope="session")
def slurm_two_nodes(slurm_cluster):
    """A second local Slurm with two nodes on this host (heterogeneous jobs need two nodes)."""
    cluster = LocalSlurm(nodes=2, cpus=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()
