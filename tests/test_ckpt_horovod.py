"""Real Horovod (built by scripts/install-horovod) training with gated checkpoints, under mpiexec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import REPO, cli_env, in_ci

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

JOB = Path(__file__).parent / "support" / "ckpt_hvd_job.py"


def _need_horovod():
    out = subprocess.run([sys.executable, "-c", "import horovod.torch as h; assert h.mpi_built()"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        reason = (f"Horovod with MPI is not installed ({out.stderr.strip().splitlines()[-1:]}); "
                  "run scripts/install-horovod")
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.mark.parametrize("ranks,jobs", [(2, 1), (4, 2)], ids=["2-ranks-1-job", "4-ranks-2-colocated-jobs"])
def test_horovod_training_with_gated_checkpoints(tmp_path, ranks, jobs):
    _need_horovod()
    # This checkout's hpcstagger for the ranks, whatever is installed in the environment.
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = cli_env(OMP_NUM_THREADS="1", HOROVOD_CYCLE_TIME="1", PYTHONPATH=path)
    out = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(JOB), str(tmp_path), str(jobs)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("report-job*.json")), key=lambda r: r["job"])
    assert [r["job"] for r in results] == list(range(jobs)), out.stdout
    for r in results:
        assert r["size"] == ranks // jobs
        assert r["resumed_equal"], r
        assert r["gate_entered"] >= 12 and r["chunks"] >= 3
        assert r["steps"] == ["step-000000007", "step-000000011"]
        manifest = json.loads((tmp_path / f"job{r['job']}" / "step-000000011" / "manifest.json").read_text())
        assert manifest["world_size"] == ranks // jobs
