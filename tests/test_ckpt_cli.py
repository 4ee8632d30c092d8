"""`hpcstagger ckpt ls / verify / export` on real checkpoints, in subprocesses."""

from __future__ import annotations

import json
import os

import h5py
import pytest
import torch

from hpcstagger import AsyncCheckpointer
from support.ckpt_util import plain, same, trained
from support.cli import run_cli

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three committed checkpoints (steps 0-2)."""
    d = tmp_path_factory.mktemp("ckpts")
    model, opt = trained(width=256)
    with AsyncCheckpointer(d, keep=5) as ck:
        for step in range(3):
            ck.save(step, {"model": model, "optimizer": opt, "step": step, "bf": torch.ones(3).bfloat16()})
    return d, plain({"model": model, "optimizer": opt, "step": 2, "bf": torch.ones(3).bfloat16()})


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_ls_lists_newest_first(saved, tmp_path):
    d, _ = saved
    out = run_cli("ckpt", "ls", str(d))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["step", "status"]
    assert [ln.split()[0] for ln in lines[1:]] == ["2", "1", "0"]
    assert all(ln.split()[1] == "committed" for ln in lines[1:])
    out = run_cli("ckpt", "ls", "--json", str(d))
    doc = json.loads(out.stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [2, 1, 0]
    assert doc["checkpoints"][0]["world_size"] == 1 and doc["checkpoints"][0]["bytes"] > 0


def test_verify_passes_a_sound_directory(saved):
    d, _ = saved
    out = run_cli("ckpt", "verify", str(d))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 of 3 checkpoint(s) sound" in out.stdout
    out = run_cli("ckpt", "verify", "--step", "1", "--json", str(d))
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ok"] and [c["step"] for c in doc["checkpoints"]] == [1]
    out = run_cli("ckpt", "verify", str(d / "step-000000000"))  # one step directory
    assert out.returncode == 0 and "1 of 1 checkpoint(s) sound" in out.stdout


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_verify_catches_a_flipped_byte_in_tensor_data(saved, tmp_path):
    d = _copy(saved[0], tmp_path / "c")
    shard = d / "step-000000001" / "shard-00000-of-00001.h5"
    with h5py.File(shard, "r") as f:
        off = f["model/0.weight"].id.get_offset()
    _flip(shard, off + 100)
    out = run_cli("ckpt", "verify", str(d))
    assert out.returncode == 1
    assert "step 1: PROBLEM" in out.stdout and "whole-file checksum mismatch" in out.stdout
    assert "step 0: ok" in out.stdout and "step 2: ok" in out.stdout
    # Without the whole-file check, the piece checksum names the damaged tensor.
    from hpcstagger.checkpoint.load import read_checkpoint
    from hpcstagger.errors import CheckpointError

    with pytest.raises(CheckpointError, match="dataset /model/0.weight fails its checksum"):
        read_checkpoint(str(d / "step-000000001"))


def test_verify_catches_a_flipped_byte_outside_the_data(saved, tmp_path):
    d = _copy(saved[0], tmp_path / "c")
    shard = d / "step-000000002" / "shard-00000-of-00001.h5"
    _flip(shard, 200)  # in HDF5's own structures, not in any tensor
    out = run_cli("ckpt", "verify", "--step", "2", str(d))
    assert out.returncode == 1 and "step 2: PROBLEM" in out.stdout, out.stdout


def test_verify_catches_a_missing_shard_and_a_missing_manifest(saved, tmp_path):
    d = _copy(saved[0], tmp_path / "c")
    os.unlink(d / "step-000000002" / "shard-00000-of-00001.h5")
    os.unlink(d / "step-000000001" / "manifest.json")
    out = run_cli("ckpt", "verify", str(d))
    assert out.returncode == 1
    assert "shard-00000-of-00001.h5 is missing" in out.stdout
    assert "step 1: PROBLEM" in out.stdout and "manifest.json is missing" in out.stdout
    assert "1 of 3 checkpoint(s) sound; problems in step(s) 2, 1" in out.stdout
    out = run_cli("ckpt", "ls", str(d))
    assert "incomplete" in out.stdout


def test_verify_catches_a_damaged_manifest(saved, tmp_path):
    d = _copy(saved[0], tmp_path / "c")
    m = d / "step-000000000" / "manifest.json"
    m.write_text(m.read_text().replace('"step": 0', '"step": 7'))
    out = run_cli("ckpt", "verify", "--step", "0", str(d))
    assert out.returncode == 1 and "manifest checksum mismatch" in out.stdout


def test_verify_errors_are_one_line(tmp_path):
    out = run_cli("ckpt", "verify", str(tmp_path / "nope"))
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "does not exist" in out.stderr
    out = run_cli("ckpt", "verify", str(tmp_path))
    assert out.returncode == 1 and "no checkpoints in" in out.stderr
    out = run_cli("ckpt", "verify", "--step", "x", str(tmp_path))
    assert out.returncode == 2


def test_export_writes_a_plain_torch_file(saved, tmp_path):
    d, expected = saved
    out = run_cli("ckpt", "export", str(d), "--step", "2", "--out", str(tmp_path / "s.pt"))
    assert out.returncode == 0, out.stderr
    got = torch.load(tmp_path / "s.pt", weights_only=True)
    same(expected, got)
    out = run_cli("ckpt", "export", str(d), "--step", "9", "--out", str(tmp_path / "t.pt"))
    assert out.returncode == 1 and "no committed checkpoint of step 9" in out.stderr
    assert not (tmp_path / "t.pt").exists()
