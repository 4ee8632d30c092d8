"""`hpcstagger demo`, end to end on a small dataset (the full demo is the README's main command)."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest

from support.cli import cli_env, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_demo_runs_plans_and_reports(tmp_path):
    root = tempfile.mkdtemp(prefix="hpcs-demo-", dir="/dev/shm")
    try:
        out = run_cli("demo", "--workdir", str(tmp_path / "demo"), "--samples", "800", "--epochs", "2",
                      "--calibrate-budget", "6", env=cli_env(HPCSTAGGER_SHM_ROOT=root), timeout=380)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["RUN", "DELAYS", "PREDICTED", "MEASURED", "ERROR"]
    assert [ln.split()[0] for ln in lines[1:4]] == ["plan", "simultaneous", "sequential"]
    result = json.loads((tmp_path / "demo" / "demo.json").read_text())
    runs = {r["mode"]: r for r in result["runs"]}
    for r in runs.values():
        assert r["measured"] > 0 and r["predicted"] > 0
        assert all(j["metrics"]["samples"] == 1600 for j in r["jobs"].values())  # 2 epochs of 800
        assert all(j["metrics"]["checkpoints"] >= 1 for j in r["jobs"].values())
    seq = runs["sequential"]["jobs"]
    assert seq["mlp"]["start"] >= seq["convnet"]["finish"]
    assert (tmp_path / "demo" / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "scenario" in result and result["plan"]["delays"]
