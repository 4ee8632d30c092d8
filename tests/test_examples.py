"""The examples, run as a user would: alone under mpiexec (with resume), and co-located."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile

import pytest

from support.cli import BIN, REPO, cli_env, in_ci, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
EXAMPLES = REPO / "examples"


def _has_horovod() -> bool:
    out = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True, timeout=60)
    return out.returncode == 0


@pytest.fixture
def workdir(tmp_path):
    """The examples and a small dataset in a fresh directory, with a private cache root."""
    for f in ("make_dataset.py", "train_ddp.py", "train_horovod.py", "colocated.toml"):
        shutil.copy(EXAMPLES / f, tmp_path / f)
    subprocess.run([sys.executable, "make_dataset.py", "data.h5", "--samples", "384"], cwd=tmp_path, check=True,
                   timeout=60, capture_output=True)
    root = tempfile.mkdtemp(prefix="hpcs-examples-", dir="/dev/shm")
    yield tmp_path, cli_env(HPCSTAGGER_SHM_ROOT=root)
    shutil.rmtree(root, ignore_errors=True)


def _mpiexec(n, script, args, cwd, env):
    return subprocess.run([str(BIN / "mpiexec"), "-n", str(n), sys.executable, script, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def _verify(path, env):
    out = run_cli("ckpt", "verify", str(path), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("script", ["train_ddp.py", "train_horovod.py"])
def test_example_alone_trains_checkpoints_and_resumes(workdir, script):
    cwd, env = workdir
    if script == "train_horovod.py" and not _has_horovod():
        if in_ci():
            pytest.fail("CI must have Horovod (scripts/install-horovod)")
        pytest.skip("Horovod is not installed; scripts/install-horovod builds it")
    ckpt = cwd / "ckpt"
    out = _mpiexec(2, script, ["--data", "data.h5", "--epochs", "1", "--ckpt-dir", str(ckpt)], cwd, env)
    assert out.returncode == 0, out.stderr
    assert "epoch 1/1" in out.stderr and "step 6" in out.stderr  # 384 samples / 2 ranks / 32
    assert "sound" in _verify(ckpt, env)
    out = _mpiexec(2, script, ["--data", "data.h5", "--epochs", "2", "--ckpt-dir", str(ckpt)], cwd, env)
    assert out.returncode == 0, out.stderr
    assert "resumed from step 6 (epoch 0)" in out.stderr and "epoch 2/2" in out.stderr and "step 12" in out.stderr
    listing = run_cli("ckpt", "ls", str(ckpt), env=env).stdout
    assert " 12  committed       2" in listing


def test_examples_co_located(workdir):
    cwd, env = workdir
    if not _has_horovod():
        if in_ci():
            pytest.fail("CI must have Horovod (scripts/install-horovod)")
        pytest.skip("Horovod is not installed; scripts/install-horovod builds it")
    spec = cwd / "colocated.toml"
    spec.write_text(spec.read_text().replace('mode = "simultaneous"', 'mode = "fixed"\ndelays = { mlp = 1.0 }'))
    out = run_cli("launch", str(spec), "--json", env=env, cwd=cwd, timeout=280)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {n: j["state"] for n, j in result["jobs"].items()} == {"cnn": "done", "mlp": "done"}
    assert result["jobs"]["mlp"]["start"] >= 1.0
    assert "waiting 1.0 s (planned start)" in out.stderr
    for job in ("cnn", "mlp"):
        assert "sound" in _verify(cwd / "hpcstagger-runs" / "examples" / "checkpoints" / job, env)
    stats = json.loads(run_cli("cache", "stats", "examples", "--json", env=env).stdout)
    assert stats["hits"] > 0 and stats["inserts"] == 384  # one job's reads fed the other
