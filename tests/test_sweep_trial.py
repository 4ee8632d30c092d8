"""The end-to-end sweep's trial (benchmarks/sweep/trial.py) as both of its users run it: plain
PyTorch (its own DataLoader, torch.save or DCP async_save), and the same script with hpcstagger's
documented lines under ``hpcstagger launch``: ImageFolder through the node's cache, one shared
loader for every trial, AsyncCheckpointer. A tiny JPEG tree, real processes, real checkpoints."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.cli import cli_env, run_cli

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sweep_e2e.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sweep_e2e", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_sweep_e2e", mod)
    spec.loader.exec_module(mod)
    return mod


B = _bench()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep") / "images"
    n = B.make_images(root, 0.4, px=48, classes=3)
    return root, n


def _args(**kw) -> argparse.Namespace:
    base = {"epochs": 2, "batch": 8, "workers": 1, "ckpt_every": 3, "device": "cpu"}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("row", ["plain", "dcp"])
def test_a_plain_trial_trains_and_checkpoints_as_users_write_it(tmp_path, images, row):
    root, n = images
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.json"
    argv = B.trial_args(row, 0.05, ckpt, report, _args()) + ["--data", str(root)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=cli_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(report.read_text())
    steps = 2 * math.ceil(n / 8)
    assert r["steps"] == steps and math.isfinite(r["loss"]) and r["cpu_s"] > 0
    assert r["end"] > r["loop"] > r["imported"] > r["start"]
    last = steps // 3 * 3
    if row == "plain":
        state = torch.load(ckpt / "checkpoint.pt", weights_only=True)
        assert state["step"] == last and set(state) == {"model", "optimizer", "step"}
    else:
        assert (ckpt / f"step-{last}" / ".metadata").exists(), sorted(p.name for p in ckpt.iterdir())
    assert r["hpcstagger_imported"] is False  # plain PyTorch: the script never imports hpcstagger
    assert r["device"] == "cpu" and "t0" not in r  # no hpcstagger.init, so no start of its own to report


def test_hpcstagger_trials_share_the_cache_a_loader_and_checkpoint_asynchronously(tmp_path, images, shm_root):
    from hpcstagger.checkpoint import verify_checkpoint

    root, n = images
    work = tmp_path / "work"
    (work / "reports").mkdir(parents=True)
    spec = work / "spec.toml"
    B.write_spec(spec, "hpcstagger", root, work, Path(shm_root), 8 << 20, None, _args())
    text = spec.read_text()
    assert "share = true" in text and "--ckpt async" in text and 'mode = "simultaneous"' in text
    proc = run_cli("launch", str(spec), "--no-history", timeout=280,
                   env=cli_env(HPCSTAGGER_SHM_ROOT=shm_root), cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = 2 * math.ceil(n / 8)
    for lr in B.LRS:
        r = json.loads((work / "reports" / f"lr{lr}.json").read_text())
        assert r["steps"] == steps and math.isfinite(r["loss"]) and r["hpcstagger_imported"], (lr, r)
        # when hpcstagger.init returned, after the script started, and what its steps took
        assert r["start"] < r["t0"] < r["loop"] and r["import_s"] >= 0 and r["init_timings"]["init"] > 0, r
        assert r["init_timings"]["world"] > 0 and r["init_timings"]["spec"] >= 0, r  # MPI's start-up, timed apart
        ckpt = work / "ckpt" / f"lr{lr}"
        committed = sorted(p for p in ckpt.iterdir() if p.name.startswith("step-"))
        assert committed, f"no checkpoint committed for lr {lr}: {sorted(ckpt.iterdir())}"
        assert verify_checkpoint(str(committed[-1])) == []
    # one shared loader prepared the batches: the trials read the same samples, so their losses
    # differ only by their learning rates (and every trial saw every step)
    assert len({json.loads((work / "reports" / f"lr{lr}.json").read_text())["steps"] for lr in B.LRS}) == 1
