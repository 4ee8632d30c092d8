"""Checkpoints on real MPI ranks. Run by scripts/run-tests under mpiexec -n 1, 2 and 4:

    mpiexec -n 4 python -m pytest --with-mpi -m mpi tests/test_ckpt_mpi.py
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import warnings

import pytest
import torch

from hpcstagger import config
from hpcstagger.checkpoint import AsyncCheckpointer, load, verify_checkpoint
from hpcstagger.checkpoint.writer import ShardWriter
from hpcstagger.comm import Comm
from hpcstagger.errors import CheckpointError, CheckpointWarning
from support.ckpt_util import plain, same

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]


@pytest.fixture
def world() -> Comm:
    c = Comm.world()
    assert c.is_mpi, "pytest --with-mpi should have initialised MPI"
    return c


@pytest.fixture
def shared_dir(world):
    """A fresh directory every rank sees; removed by rank 0 at the end."""
    d = tempfile.mkdtemp(prefix="hpcstagger-test-ckpt-") if world.rank == 0 else None
    d = world.bcast(d)
    yield d
    world.barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir(world):
    d = tempfile.mkdtemp(prefix="hpcstagger-test-ckpt-", dir="/dev/shm") if world.rank == 0 else None
    d = world.bcast(d)
    yield d
    world.barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def _state(step: int) -> dict:
    """A replicated state: equal on every rank, different for every step (one big, some small tensors)."""
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {"model": model, "emb": torch.randn(300, 1000, generator=g).bfloat16(), "step": step,
            "meta": {"epoch": step // 3, "seen": [step, step + 1]}}


def _sub(world, size):
    """A communicator of the first ``size`` ranks (None on the others)."""
    return world.split(0 if world.rank < size else None)


@pytest.mark.parametrize("nsave,nload", [("all", "one"), ("all", "half"), ("half", "all"), ("one", "all")])
def test_save_at_one_world_size_load_at_another(world, shared_dir, nsave, nload):
    sizes = {"all": world.size, "half": max(1, world.size // 2), "one": 1}
    sc = _sub(world, sizes[nsave])
    with config.override(ckpt_min_split_bytes=64 << 10):  # split the big tensors across shards
        if sc is not None:
            with AsyncCheckpointer(shared_dir, comm=sc, keep=2) as ck:
                for step in range(3):
                    ck.save(step, _state(step))
            sc.free()
    world.barrier()
    lc = _sub(world, sizes[nload])
    if lc is not None:
        got = load(shared_dir, comm=lc)
        same(plain(_state(2)), got)
        assert load(shared_dir, step=1, comm=lc)["step"] == 1
        lc.free()
    world.barrier()
    if world.rank == 0:
        names = sorted(os.listdir(os.path.join(shared_dir, "step-000000002")))
        n = sizes[nsave]
        assert names == ["manifest.json"] + [f"shard-{r:05d}-of-{n:05d}.h5" for r in range(n)]
        assert verify_checkpoint(os.path.join(shared_dir, "step-000000002")) == []
        assert sorted(os.listdir(shared_dir)) == ["step-000000001", "step-000000002"]


def test_shards_are_balanced(world, shared_dir):
    with config.override(ckpt_min_split_bytes=64 << 10):
        with AsyncCheckpointer(shared_dir, comm=world) as ck:
            ck.save(0, _state(0))
    if world.rank == 0:
        d = os.path.join(shared_dir, "step-000000000")
        sizes = [os.path.getsize(os.path.join(d, f"shard-{r:05d}-of-{world.size:05d}.h5")) for r in range(world.size)]
        total = sum(sizes)
        assert max(sizes) - min(sizes) <= 64 * 1024 + 16 * 1024, sizes  # one small tensor + HDF5 overhead
        assert total > 1_100_000


class FaultyWriter(ShardWriter):
    """Fails with a real OSError at a chosen step on a chosen rank (DCP's FaultyStorageWriter idea)."""

    def __init__(self, step: int, rank: int, where: str = "write"):
        self.fail_step, self.fail_rank, self.where = step, rank, where

    def write_shard(self, *, step, rank, **kw):
        if self.where == "write" and (step, rank) == (self.fail_step, self.fail_rank):
            raise OSError(errno.ENOSPC, "No space left on device", kw["path"])
        return super().write_shard(step=step, rank=rank, **kw)

    def copy_shard(self, *, step, rank, **kw):
        if self.where == "flush" and (step, rank) == (self.fail_step, self.fail_rank):
            raise OSError(errno.EIO, "Input/output error", kw["dst"])
        return super().copy_shard(step=step, rank=rank, **kw)


def test_a_failing_rank_fails_the_save_on_every_rank(world, shared_dir):
    bad = world.size - 1
    ck = AsyncCheckpointer(shared_dir, comm=world, writer=FaultyWriter(step=2, rank=bad))
    ck.save(1, _state(1))
    h = ck.save(2, _state(2))
    with pytest.raises(CheckpointError) as info:
        ck.wait()
    msg = str(info.value)
    assert f"failed on rank(s) {bad} of {world.size}" in msg
    assert os.path.join(shared_dir, "step-000000002", f"shard-{bad:05d}-of-{world.size:05d}.h5") in msg
    assert "No space left on device" in msg and "previous checkpoint is intact" in msg
    assert h.done()
    world.barrier()
    assert not os.path.exists(os.path.join(shared_dir, "step-000000002", "manifest.json"))
    same(plain(_state(1)), load(shared_dir, comm=world))
    ck.save(3, _state(3))  # the failure was reported; saving goes on
    ck.close()
    same(plain(_state(3)), load(shared_dir, comm=world))


def test_a_failing_flush_keeps_the_staged_checkpoint(world, shared_dir, shm_dir):
    ck = AsyncCheckpointer(shared_dir, comm=world, staging_dir=shm_dir, writer=FaultyWriter(1, 0, where="flush"))
    ck.save(0, _state(0))
    h = ck.save(1, _state(1))
    assert h.wait_staged() == os.path.join(shm_dir, "step-000000001")
    with pytest.raises(CheckpointError, match=r"(?s)rank\(s\) 0 of .*Input/output error"):
        h.wait()
    ck.close()
    same(plain(_state(1)), load([shm_dir, shared_dir], comm=world))  # newest on any level
    same(plain(_state(0)), load(shared_dir, comm=world))


def test_a_bad_state_on_one_rank_fails_on_every_rank(world, shared_dir):
    with AsyncCheckpointer(shared_dir, comm=world) as ck:
        bad = world.size - 1
        state = _state(0) | ({"oops": object()} if world.rank == bad else {"oops": 1})
        with pytest.raises(CheckpointError, match="'oops' is a object") as info:
            ck.save(0, state)
        if world.size > 1:
            assert f"failed on 1 of {world.size} rank(s): {bad}" in str(info.value)
        if world.size > 1:
            shape = (3,) if world.rank == 0 else (4,)
            with pytest.raises(CheckpointError, match="differ across ranks"):
                ck.save(1, {"x": torch.zeros(shape)})
        ck.save(2, _state(2))
    same(plain(_state(2)), load(shared_dir, comm=world))


def test_load_skips_a_checkpoint_one_rank_cannot_read(world, shared_dir):
    with AsyncCheckpointer(shared_dir, comm=world, keep=3) as ck:
        ck.save(0, _state(0))
        ck.save(1, _state(1))
    world.barrier()
    if world.rank == 0:  # damage the newest (shard 0 holds the first tensor): every rank must skip it
        os.unlink(os.path.join(shared_dir, "step-000000001", f"shard-00000-of-{world.size:05d}.h5"))
    world.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = load(shared_dir, comm=world)
    same(plain(_state(0)), got)
    texts = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(texts) == 1 and "step 1" in texts[0] and "shard-00000-of" in texts[0], texts
    assert world.allgather(texts) == [texts] * world.size  # every rank warns, and alike


def test_strict_load_raises_alike_on_every_rank(world, shared_dir):
    with AsyncCheckpointer(shared_dir, comm=world, keep=3) as ck:
        ck.save(0, _state(0))
        ck.save(1, _state(1))
    world.barrier()
    if world.rank == 0:  # cut the last shard: no rank may load step 1 now
        shard = os.path.join(shared_dir, "step-000000001", f"shard-{world.size - 1:05d}-of-{world.size:05d}.h5")
        os.truncate(shard, os.path.getsize(shard) // 2)
    world.barrier()
    with pytest.raises(CheckpointError) as info:
        load(shared_dir, comm=world, strict=True)
    msg = str(info.value)
    assert "step 1" in msg and f"shard-{world.size - 1:05d}" in msg and "\n" not in msg
    assert world.allgather(msg) == [msg] * world.size
    same(plain(_state(0)), load(shared_dir, step=0, comm=world, strict=True))


def test_ddp_gated_hook_and_one_process_group_per_job(world):
    import torch.distributed as dist

    from hpcstagger.checkpoint import ActivityGate
    from hpcstagger.integrations.torch_ddp import destroy_process_group, gated_allreduce_hook, init_process_group

    job = world.split(world.rank % 2)  # two co-located "jobs" (one when run on a single rank)
    init_process_group(job, timeout=60)
    try:
        t = torch.full((1,), float(world.rank))
        dist.all_reduce(t)
        assert t.item() == sum(r for r in range(world.size) if r % 2 == world.rank % 2)  # its own job only
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
        gate = ActivityGate()
        model.register_comm_hook(None, gated_allreduce_hook(gate))
        model(torch.randn(4, 8) * (job.rank + 1)).sum().backward()
        assert gate.entered >= 1 and gate.count == 0
        grads = job.allgather(model.module.weight.grad.clone())
        assert all(torch.equal(g, grads[0]) for g in grads)
    finally:
        destroy_process_group(job)
        job.free()
