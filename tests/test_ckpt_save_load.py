"""AsyncCheckpointer and load in one process: real HDF5 files, real threads, real /dev/shm staging."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import h5py
import numpy as np
import pytest
import torch

from hpcstagger.checkpoint import AsyncCheckpointer, load, restore
from hpcstagger import comm as comm_module
from hpcstagger import config
from hpcstagger.checkpoint import ActivityGate, SaveHandle, capture_rng, restore_rng
from hpcstagger.checkpoint.load import read_checkpoint
from hpcstagger.checkpoint.writer import ShardWriter
from hpcstagger.checkpoint.catalog import scan
from hpcstagger.checkpoint.protocol import agree
from hpcstagger.checkpoint.sharding import layout_signature, plan_shards
from hpcstagger.checkpoint.snapshot import SnapshotBuffers
from hpcstagger.checkpoint.state import flatten
from hpcstagger.comm import Comm
from hpcstagger.errors import CheckpointError, CheckpointWarning, CollectiveError, ConfigError
from support.ckpt_util import FakeClock, make_model, plain, same, train_step, trained
from support.cli import in_ci

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="hpcstagger-test-ckpt-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _state(model, opt, step, **extra):
    return {"model": model, "optimizer": opt, "step": step, "rng": capture_rng(), **extra}


def test_round_trip_bit_for_bit_and_restore(tmp_path):
    model, opt = trained()
    extra = {"bf16": torch.randn(7, 3).bfloat16(), "np": np.arange(5.0), "sched": {"epoch": 2, "lr": [0.1, 0.01]}}
    state = _state(model, opt, 3, **extra)
    with AsyncCheckpointer(tmp_path) as ck:
        h = ck.save(3, state)
        assert h.wait() == str(tmp_path / "step-000000003")
        assert set(h.timings) >= {"blocking_s", "staged_s", "durable_s"}
    got = load(tmp_path)
    same(plain(state), got)
    m2 = make_model(seed=5)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    rest = restore(got, model=m2, optimizer=o2)
    assert set(rest) == {"step", "rng", "bf16", "np", "sched"}
    same(model.state_dict(), m2.state_dict())
    same(opt.state_dict(), o2.state_dict())
    # Training on from the restored copy matches training on from the original, bit for bit.
    restore_rng(got["rng"])
    train_step(m2, o2, 3)
    restore_rng(state["rng"])
    train_step(model, opt, 3)
    same(model.state_dict(), m2.state_dict())


def test_snapshot_is_taken_at_save_time(tmp_path):
    model, opt = trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with AsyncCheckpointer(tmp_path) as ck:
        gate = ActivityGate()
        ck.gate = gate
        with gate.active():  # hold the writer back while the training changes the weights
            h = ck.save(1, {"model": model})
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        h.wait()
    same(before, load(tmp_path)["model"])


def test_files_are_plain_hdf5_and_manifest_json(tmp_path):
    model, opt = trained()
    bf = torch.randn(4, 2).bfloat16()
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save(5, {"model": model, "bf": bf})
    step_dir = tmp_path / "step-000000005"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["world_size"] == 1
    assert {"torch", "h5py", "hdf5", "numpy", "hpcstagger", "python"} <= set(manifest["versions"])
    shard = step_dir / manifest["shards"][0]["file"]
    with h5py.File(shard, "r") as f:
        w = f["model/0.weight"]
        assert np.array_equal(w[()], model.state_dict()["0.weight"].numpy())
        assert w.attrs["dtype"] == "float32" and list(w.attrs["shape"]) == [64, 16]
        assert len(w.attrs["checksum"]) == 16
        raw = f["bf"]
        assert raw.dtype == np.uint16 and raw.attrs["dtype"] == "bfloat16"
        assert torch.equal(torch.from_numpy(raw[()].astype(np.int16)).view(torch.bfloat16), bf)
    if shutil.which("h5dump") is None:
        if in_ci():
            pytest.fail("h5dump is missing under CI (apt-get install hdf5-tools)")
        pytest.skip("h5dump not installed (apt-get install hdf5-tools)")
    out = subprocess.run(["h5dump", "-d", "/model/3.bias", str(shard)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "H5T_IEEE_F32LE" in out.stdout and '"float32"' in out.stdout


def test_retention_keeps_the_last_committed(tmp_path):
    model, opt = trained()
    with AsyncCheckpointer(tmp_path, keep=2) as ck:
        for step in range(5):
            ck.save(step, _state(model, opt, step))
        ck.drain()  # durable, and the retention after it done
        assert ck.idle()
        assert sorted(os.listdir(tmp_path)) == ["step-000000003", "step-000000004"]
    assert sorted(os.listdir(tmp_path)) == ["step-000000003", "step-000000004"]
    assert load(tmp_path)["step"] == 4
    assert load(tmp_path, step=3)["step"] == 3
    with pytest.raises(CheckpointError, match="no committed checkpoint of step 1"):
        load(tmp_path, step=1)


def test_load_skips_incomplete_and_damaged_checkpoints(tmp_path):
    model, opt = trained()
    with AsyncCheckpointer(tmp_path, keep=5) as ck:
        for step in range(3):
            ck.save(step, _state(model, opt, step))
    # Step 2 loses its manifest (as if the save never committed): not even a candidate.
    os.unlink(tmp_path / "step-000000002" / "manifest.json")
    # Step 1 has a flipped byte inside a tensor.
    shard = tmp_path / "step-000000001" / "shard-00000-of-00001.h5"
    with h5py.File(shard, "r") as f:
        off = f["model/0.weight"].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.warns(CheckpointWarning, match="skipped the damaged checkpoint of step 1 .*fails its checksum"):
        got = load(tmp_path)
    assert got["step"] == 0
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load(tmp_path, step=1)
    shutil.rmtree(tmp_path / "step-000000000")
    with pytest.raises(CheckpointError, match="every committed one is damaged"):
        load(tmp_path)


def test_load_of_empty_directory_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="no committed checkpoint in"):
        load(tmp_path)


def test_saving_a_step_again_replaces_it(tmp_path):
    model, opt = trained()
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save(1, {"v": torch.zeros(3)})
        ck.save(2, {"v": torch.ones(3)})
        ck.save(1, {"v": torch.full((3,), 7.0)})  # e.g. after resuming from an older checkpoint
    assert torch.equal(load(tmp_path, step=1)["v"], torch.full((3,), 7.0))
    assert torch.equal(load(tmp_path)["v"], torch.ones(3))


def test_layout_changes_reallocate_and_empty_optimizer_state(tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with AsyncCheckpointer(tmp_path, keep=5) as ck:
        ck.save(0, {"model": model, "optimizer": opt})  # Adam has no state yet
        train_step(model, opt, 0)
        ck.prepare({"model": model, "optimizer": opt})
        ck.save(1, {"model": model, "optimizer": opt})
        assert ck._buffers.allocations == 2
        ck.save(2, {"model": model, "optimizer": opt})
        assert ck._buffers.allocations == 2  # reused
    assert load(tmp_path, step=0)["optimizer"]["state"] == {}
    same(opt.state_dict(), load(tmp_path)["optimizer"])


class _FailingWriter(ShardWriter):
    """Fails with a real OSError (disk full) when writing the chosen step."""

    def __init__(self, fail_step: int):
        self.fail_step = fail_step

    def write_shard(self, *, step, rank, nshards, path, items, pacer):
        if step == self.fail_step:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super().write_shard(step=step, rank=rank, nshards=nshards, path=path, items=items, pacer=pacer)


def test_background_error_raised_once_on_next_save_and_previous_intact(tmp_path):
    model, opt = trained()
    ck = AsyncCheckpointer(tmp_path, writer=_FailingWriter(fail_step=2))
    ck.save(1, _state(model, opt, 1))
    ck.save(2, _state(model, opt, 2))
    with pytest.raises(CheckpointError) as info:
        ck.save(3, _state(model, opt, 3))
    msg = str(info.value)
    assert "step 2" in msg and "rank 0" in msg and "No space left on device" in msg
    assert str(tmp_path / "step-000000002" / "shard-00000-of-00001.h5") in msg
    assert "previous checkpoint is intact" in msg
    assert load(tmp_path)["step"] == 1
    h = ck.save(3, _state(model, opt, 3))  # the error was raised once; saving works again
    assert h.wait().endswith("step-000000003")
    ck.save(2, _state(model, opt, 2))
    with pytest.raises(CheckpointError, match="No space left"):
        ck.wait()
    ck.wait()  # already reported
    ck.close()
    assert load(tmp_path)["step"] == 3
    assert not [n for n in os.listdir(tmp_path / "step-000000002") if n.endswith(".h5")] if \
        (tmp_path / "step-000000002").exists() else True


def test_handle_wait_raises_the_error_and_close_too(tmp_path):
    ck = AsyncCheckpointer(tmp_path, writer=_FailingWriter(fail_step=0))
    h = ck.save(0, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match="No space left"):
        h.wait()
    ck.close()  # already reported through the handle
    ck2 = AsyncCheckpointer(tmp_path, writer=_FailingWriter(fail_step=0))
    ck2.save(0, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match="No space left"):
        ck2.close()
    with pytest.raises(CheckpointError, match="closed"):
        ck2.save(1, {"x": torch.ones(2)})


class _HurryRecorder:
    def __init__(self):
        self.hurried = 0

    def hurry(self):
        self.hurried += 1


def test_save_handle_lifecycle_of_a_committed_save():
    pacer = _HurryRecorder()
    h = SaveHandle(4, "/ckpt/step-4", "/shm/step-4", pacer=pacer)
    assert not h.done() and h.error is None and "in flight" in repr(h)
    assert h.join(timeout=0.01) is False and pacer.hurried == 1  # a waiter hurries the writer
    with pytest.raises(CheckpointError, match="not staged after"):
        h.wait_staged(timeout=0.01)
    h.mark_staged()
    assert h.wait_staged(timeout=0) == "/shm/step-4" and not h.done()
    with pytest.raises(CheckpointError, match="not finished after"):
        h.wait(timeout=0)
    h.finish()
    assert h.done() and h.join() is True and h.wait() == "/ckpt/step-4" and "done" in repr(h)
    h.raise_unreported()  # nothing to raise
    hurried = pacer.hurried
    h.join()
    assert pacer.hurried == hurried  # finished: nobody to hurry


def test_save_handle_failure_is_raised_once_by_raise_unreported():
    err = CheckpointError("writing shard: disk full")
    h = SaveHandle(5, "/ckpt/step-5", None)
    h.fail(err)
    waiter_saw = []
    t = threading.Thread(target=lambda: (h.join(), waiter_saw.append(h.error)))
    t.start()
    time.sleep(0.02)
    assert t.is_alive() and not h.done()  # fail() alone releases nobody
    h.finish()
    t.join(10)
    assert waiter_saw == [err] and h.error is err and "failed" in repr(h)
    with pytest.raises(CheckpointError, match="disk full"):
        h.raise_unreported()
    h.raise_unreported()  # once only
    with pytest.raises(CheckpointError, match="disk full"):
        h.wait()  # the handle itself always says so

    h = SaveHandle(6, "/ckpt/step-6", "/shm/step-6")
    h.fail(err)
    h.finish()  # failed before staging: wait_staged raises, and that counts as reported
    with pytest.raises(CheckpointError, match="disk full"):
        h.wait_staged(timeout=0)
    h.raise_unreported()


def test_save_handle_failure_after_staging():
    h = SaveHandle(7, "/ckpt/step-7", "/shm/step-7")
    h.mark_staged()
    h.fail(CheckpointError("flushing: disk full"))
    h.finish()
    assert h.wait_staged() == "/shm/step-7"  # the staged checkpoint stands
    with pytest.raises(CheckpointError, match="flushing"):
        h.raise_unreported()


def test_snapshot_buffers_touch_zeroes_the_whole_buffer():
    _, leaves = flatten({"x": torch.full((1000,), -1, dtype=torch.int32)})  # every byte 0xff
    plan = plan_shards([leaf.spec for leaf in leaves], 1)
    entries = [(p, leaves[0]) for p in plan.for_shard(0)]
    b = SnapshotBuffers()
    b.touch()  # nothing allocated yet: nothing to do
    b.ensure(entries)
    (view,) = b.copy(entries)
    assert view.all() and b.nbytes >= 4000
    b.touch()
    assert not view.any()


class _FakeRequest:
    def __init__(self, ready_after, on_ready):
        self.tests, self.ready_after, self.on_ready = 0, ready_after, on_ready

    def Test(self):
        self.tests += 1
        if self.ready_after is not None and self.tests >= self.ready_after:
            self.on_ready()
            return True
        return False


class _FakeMpiComm:
    """Rank 0 of two whose non-blocking all-gather completes on the ``ready_after``-th Test (or never);
    the other rank sends the same record."""

    def __init__(self, ready_after):
        self.ready_after = ready_after
        self.request = None

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Iallgather(self, send, recv):
        def fill():
            recv[:] = send

        self.request = _FakeRequest(self.ready_after, fill)
        return self.request


def test_snapshot_agreement_spins_then_sleeps(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(comm_module, "time", clock)  # the pauses of the polled wait
    yields = []
    monkeypatch.setattr(comm_module.os, "sched_yield", lambda: yields.append(1))
    sig = layout_signature([leaf.spec for leaf in flatten({"x": torch.ones(3)})[1]])
    raw = _FakeMpiComm(ready_after=205)
    assert agree(Comm(raw), None, sig) == [(None, sig), (None, sig)]
    assert raw.request.tests == 205
    assert len(yields) == 199 and clock.slept == [0.0002] * 5  # bare yields first: latency matters here


def test_snapshot_agreement_timeout_breaks_the_communicator():
    raw = _FakeMpiComm(ready_after=None)
    c = Comm(raw)
    start = time.monotonic()
    with config.override(collective_timeout=0.05), \
            pytest.raises(CollectiveError, match=r"not every rank reached save\(\) within 0.05 s"):
        agree(c, None, "0" * 32)
    assert 0.05 <= time.monotonic() - start < 5
    assert c.broken == "checkpoint snapshot agreement timed out" and c.abandoned is raw.request
    with pytest.raises(CollectiveError, match="unusable after an earlier failure"):
        c.barrier()


def test_bad_state_raises_at_save_without_writing(tmp_path):
    with AsyncCheckpointer(tmp_path) as ck:
        with pytest.raises(CheckpointError, match="'bad' is a object"):
            ck.save(0, {"bad": object()})
        ck.save(1, {"ok": 1})
    assert [e.step for e in scan([str(tmp_path)])] == [1]


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="keep"):
        AsyncCheckpointer(tmp_path, keep=0)
    with pytest.raises(ConfigError, match="staging_dir must differ"):
        AsyncCheckpointer(tmp_path, staging_dir=tmp_path)


def test_staging_level_commits_first_then_flushes(tmp_path, shm_dir):
    model, opt = trained()
    with config.override(ckpt_staging_keep=1):
        with AsyncCheckpointer(tmp_path, staging_dir=shm_dir, keep=3) as ck:
            for step in range(3):
                h = ck.save(step, _state(model, opt, step))
                assert h.wait_staged() == os.path.join(shm_dir, f"step-{step:09d}")
                assert h.wait() == str(tmp_path / f"step-{step:09d}")
            assert h.timings["staged_s"] <= h.timings["durable_s"]
            assert ck.load()["step"] == 2
    assert sorted(os.listdir(shm_dir)) == ["step-000000002"]
    assert sorted(os.listdir(tmp_path)) == [f"step-{s:09d}" for s in range(3)]
    for d in (shm_dir, str(tmp_path)):
        same(plain(_state(model, opt, 2)) | {"rng": load(d)["rng"]}, load(d))
    # The newest complete checkpoint on any level wins.
    shutil.rmtree(tmp_path / "step-000000002")
    assert load([shm_dir, str(tmp_path)])["step"] == 2
    shutil.rmtree(os.path.join(shm_dir, "step-000000002"))
    assert load([shm_dir, str(tmp_path)])["step"] == 1


class _FailingFlush(ShardWriter):
    def copy_shard(self, **kw):
        raise OSError(errno.EACCES, "Permission denied", kw["dst"])


def test_failed_flush_keeps_the_staged_checkpoint_loadable(tmp_path, shm_dir):
    ck = AsyncCheckpointer(tmp_path, staging_dir=shm_dir, writer=_FailingFlush())
    h = ck.save(4, {"x": torch.arange(3)})
    assert h.wait_staged() == os.path.join(shm_dir, "step-000000004")
    with pytest.raises(CheckpointError, match="Permission denied"):
        h.wait()
    ck.close()
    assert torch.equal(load([shm_dir, str(tmp_path)])["x"], torch.arange(3))
    with pytest.raises(CheckpointError):
        load(tmp_path)


def test_map_location(tmp_path):
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save(0, {"t": torch.arange(4.0), "n": np.ones(2)})
    got = load(tmp_path, map_location="cpu")
    assert got["t"].device.type == "cpu"
    seen = []
    got = load(tmp_path, map_location=lambda t, dev: seen.append(dev) or t * 2)
    assert seen == ["cpu"] and torch.equal(got["t"], torch.arange(4.0) * 2)
    assert isinstance(got["n"], np.ndarray)  # numpy arrays stay on the host
    got = load(tmp_path, map_location={"cuda:0": "cpu"})
    assert torch.equal(got["t"], torch.arange(4.0))
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="no loadable"):
            load(tmp_path, map_location="cuda:0")


def test_read_checkpoint_names_a_wrong_directory(tmp_path):
    with pytest.raises(CheckpointError, match="named step-N"):
        read_checkpoint(str(tmp_path))


def test_gate_defers_the_writer_but_never_forever(tmp_path):
    gate = ActivityGate()
    with config.override(ckpt_chunk_bytes=4096, ckpt_gate_max_wait=0.01):
        with AsyncCheckpointer(tmp_path, gate=gate) as ck:
            gate.enter()  # training busy for the whole save: each chunk waits its bounded turn
            h = ck.save(0, {"x": torch.zeros(20_000)})
            while not h.done():
                time.sleep(0.01)  # h.wait() would hurry the writer past the gate
            gate.exit()
            h.wait()
            assert h.stats["gate_waits"] >= 20 and h.stats["chunks"] >= 20
            gate.enter()
            with config.override(ckpt_gate_max_wait=600.0):
                h = ck.save(1, {"x": torch.zeros(20_000)})
                assert h.wait(timeout=60)  # waiting on it stops the deferring at once
            gate.exit()
    assert load(tmp_path)["x"].shape == (20_000,)


def test_unclosed_checkpointer_finishes_its_save_at_exit(tmp_path):
    code = f"""
import torch
from hpcstagger import AsyncCheckpointer
ck = AsyncCheckpointer({str(tmp_path)!r})
ck.save(9, {{"x": torch.arange(1_000_000)}})
"""
    import sys

    from support.cli import REPO, cli_env

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=cli_env(),
                         cwd=str(REPO))  # this checkout's hpcstagger
    assert out.returncode == 0, out.stderr
    assert torch.equal(load(tmp_path)["x"], torch.arange(1_000_000))
