"""The checkpointer's CUDA path on a real GPU: pinned snapshot buffers, copies ordered on the current
stream, CUDA generator states, and restoring at another device.

Every test is marked ``gpu`` and skips, with the reason, where ``torch.cuda.is_available()`` is False
(CI has no GPU). Run them on a GPU machine with
``python -m pytest -p no:cacheprovider -m gpu tests/test_ckpt_cuda.py``.
"""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any

import numpy as np
import pytest
import torch

from hpcstagger.checkpoint import AsyncCheckpointer, load, restore
from hpcstagger.checkpoint import ActivityGate, capture_rng, restore_rng
from support.ckpt_util import same

# the module (``hpcstagger.checkpoint.load`` the attribute is the function of the same name)
load_module = importlib.import_module("hpcstagger.checkpoint.load")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"),
    pytest.mark.timeout(180),
]

DEV = "cuda:0"


def _cuda_model(seed: int = 0, width: int = 256) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 8)).to(DEV)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0) -> None:
    for s in range(first, first + steps):
        g = torch.Generator(device=DEV).manual_seed(100 + s)
        x = torch.randn(32, 64, device=DEV, generator=g)
        y = torch.randn(32, 8, device=DEV, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _trained(seed: int = 0, width: int = 256, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _cuda_model(seed, width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, steps)
    return model, opt


def _to(obj: Any, device: str) -> Any:
    """A copy of a (nested) state with every tensor on ``device`` (for comparisons)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=True)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to(v, device) for v in obj)
    return obj


def _devices(obj: Any) -> set[str]:
    if isinstance(obj, torch.Tensor):
        return {obj.device.type}
    if isinstance(obj, dict):
        return set().union(*(_devices(v) for v in obj.values())) if obj else set()
    if isinstance(obj, (list, tuple)):
        return set().union(*(_devices(v) for v in obj)) if obj else set()
    return set()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_model_and_optimizer_round_trip_bit_for_bit_through_a_pinned_buffer(tmp_path):
    model, opt = _trained()
    extra = {"bf16": torch.randn(33, 7, device=DEV).bfloat16(),
             "transposed": torch.randn(48, 20, device=DEV).t(),  # not contiguous: copied before the snapshot
             "scalar": torch.tensor(3.5, device=DEV), "empty": torch.empty(0, 4, device=DEV),
             "host": torch.arange(10), "np": np.arange(6.0)}
    want = _to({"model": model.state_dict(), "optimizer": opt.state_dict(), **extra}, "cpu")
    with AsyncCheckpointer(tmp_path) as ck:
        h = ck.save(3, {"model": model, "optimizer": opt, **extra})
        assert ck._buffers.pinned and ck._buffers._buf.is_pinned()
        h.wait()
    got = load(tmp_path)  # map_location=None: every tensor back on the device it was saved from
    assert got["model"]["0.weight"].device == torch.device(DEV)
    assert got["bf16"].device == torch.device(DEV) and got["host"].device.type == "cpu"
    assert got["transposed"].shape == (20, 48)
    same(want, _to(got, "cpu"))
    m2 = _cuda_model(seed=7)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
    restore(got, model=m2, optimizer=o2)
    same(_to(model.state_dict(), "cpu"), _to(m2.state_dict(), "cpu"))
    # training on from the restored copy matches training on from the original, bit for bit
    _train(model, opt, 2, first=3)
    _train(m2, o2, 2, first=3)
    same(_to(model.state_dict(), "cpu"), _to(m2.state_dict(), "cpu"))


def test_snapshot_is_complete_when_save_returns(tmp_path):
    """Kernels queued before save() are in the snapshot; kernels queued after it are not."""
    a = torch.randn(4096, 4096, device=DEV)
    x = torch.zeros(4096, 4096, device=DEV)
    torch.cuda.synchronize()
    gate = ActivityGate()
    with AsyncCheckpointer(tmp_path, gate=gate) as ck:
        for _ in range(8):  # queued, not finished, when save() starts copying
            x.add_(a @ a, alpha=1e-3)
        with gate.active():  # hold the writer back while the training changes the tensors
            h = ck.save(0, {"x": x})
            before = x.cpu()  # (synchronises: the value the snapshot must hold)
            for _ in range(8):
                x.add_(a @ a, alpha=1.0)
            x.mul_(-1.0)
            torch.cuda.synchronize()
        h.wait()
    got = load(tmp_path, map_location="cpu")["x"]
    assert torch.equal(got, before) and not torch.equal(got, x.cpu())


def test_save_on_a_side_stream_is_ordered_after_its_kernels(tmp_path):
    """Values produced on a non-default stream that is current during save() are copied after they exist."""
    a = torch.randn(4096, 4096, device=DEV)
    x = torch.zeros(4096, 4096, device=DEV)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with AsyncCheckpointer(tmp_path) as ck, torch.cuda.stream(side):
        for _ in range(8):
            x.add_(a @ a, alpha=1e-3)
        h = ck.save(0, {"x": x})
        want = x.cpu()
        h.wait()
    torch.cuda.synchronize()
    assert torch.equal(load(tmp_path, map_location="cpu")["x"], want)


def test_cuda_rng_state_round_trip(tmp_path):
    torch.cuda.manual_seed_all(1234)
    torch.randn(1, device=DEV)  # the CUDA generators are initialised from here on
    state = capture_rng()
    assert "cuda" in state and len(state["cuda"]) == torch.cuda.device_count()
    expect = torch.randn(1000, device=DEV)
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save(0, {"rng": state})
    for where in (None, "cpu", DEV):  # the generator states come back wherever they were loaded
        torch.cuda.manual_seed_all(999)
        got = load(tmp_path, map_location=where)["rng"]
        restore_rng(got)
        assert torch.equal(torch.randn(1000, device=DEV), expect), where


def test_gpu_saved_checkpoint_loads_on_the_cpu(tmp_path, monkeypatch, caplog):
    model, opt = _trained()
    want = _to({"model": model.state_dict(), "optimizer": opt.state_dict()}, "cpu")
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save(1, {"model": model, "optimizer": opt})
    manifest = json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
    assert DEV in {t["device"] for t in manifest["tensors"].values()}
    for where in ("cpu", {DEV: "cpu"}, lambda t, saved: t):
        got = load(tmp_path, map_location=where)
        assert _devices(got) == {"cpu"}, where
        same(want, got)
    # a process without the saved device: the tensors come to the CPU, with one warning
    real = load_module._device_available
    monkeypatch.setattr(load_module, "_device_available", lambda name: not name.startswith("cuda") and real(name))
    with caplog.at_level(logging.WARNING, logger="hpcstagger.checkpoint.load"):
        got = load(tmp_path)
    assert _devices(got) == {"cpu"}
    assert sum("loaded on the CPU" in r.getMessage() for r in caplog.records) == 1
    same(want, got)
    # ... and the CPU copy restores into a CPU model and optimizer
    m_cpu = _cuda_model(seed=3).cpu()
    o_cpu = torch.optim.Adam(m_cpu.parameters(), lr=1e-3)
    restore(got, model=m_cpu, optimizer=o_cpu)
    same(want["model"], m_cpu.state_dict())


def test_cpu_saved_checkpoint_loads_on_the_gpu(tmp_path):
    model = _cuda_model().cpu()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train_cpu(model, opt)
    opt_state = _to(opt.state_dict(), "cpu")
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save(2, {"model": model, "optimizer": opt})
        assert not ck._buffers.pinned  # no CUDA source: plain host memory
    for where in (DEV, "cuda", torch.device(DEV), {"cpu": DEV}):
        got = load(tmp_path, map_location=where)
        assert _devices(got) == {"cuda"}, where
        same({"model": _to(model.state_dict(), "cpu"), "optimizer": opt_state}, _to(got, "cpu"))
    m2 = _cuda_model(seed=9)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
    restore(load(tmp_path, map_location=DEV), model=m2, optimizer=o2)
    same(_to(model.state_dict(), "cpu"), _to(m2.state_dict(), "cpu"))
    assert all(p.device == torch.device(DEV) for p in m2.parameters())
    _train(m2, o2, 1)  # the restored optimizer steps on the GPU


def _train_cpu(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _torch_pinned_bytes() -> int | None:
    """Bytes held by torch's own pinned-memory allocator (None where this torch does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else stats().get("allocated_bytes.current")


def test_a_layout_change_unpins_the_old_buffer_and_the_buffer_fits(tmp_path):
    """The snapshot buffer is page-locked memory of the snapshot's size, not a block of torch's pinned
    allocator (rounded up to a power of two, and kept pinned in its cache once freed)."""
    model = _cuda_model(width=1024)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt}
    held = _torch_pinned_bytes()
    with AsyncCheckpointer(tmp_path, keep=5) as ck:
        ck.save(0, state)  # Adam has no state yet: the model alone
        old = ck._buffers._buf  # (keeps the old buffer's memory mapped, to look at it below)
        assert old.is_pinned() and old.data_ptr() % 4096 == 0
        _train(model, opt, 1)
        ck.save(1, state)  # with Adam's moments: another layout, a new buffer three times the size
        new = ck._buffers._buf
        assert ck._buffers.allocations == 2 and new.is_pinned() and not old.is_pinned()
        assert new.numel() < 1.01 * 3 * sum(p.numel() * 4 for p in model.parameters()) + 64 * 16
        assert _torch_pinned_bytes() == held  # nothing of torch's pinned allocator, so nothing cached there
        ck.wait()
    assert not new.is_pinned()  # close() unpins it
    same(_to(opt.state_dict(), "cpu"), load(tmp_path, map_location="cpu")["optimizer"])


def test_buffers_are_reused_and_memory_does_not_grow_over_many_saves(tmp_path):
    model, opt = _trained(width=1024)  # about 13 MB of parameters and Adam moments
    state = {"model": model, "optimizer": opt}
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
    with AsyncCheckpointer(tmp_path, keep=2) as ck:
        for step in range(3):  # warm up: the buffer, h5py, the allocators' caches
            _train(model, opt, 1, first=step)
            ck.save(step, state)
        ck.drain()
        rss0 = _rss_bytes()
        pinned0 = _torch_pinned_bytes()
        for step in range(3, 28):
            _train(model, opt, 1, first=step)
            ck.save(step, state)
        ck.drain()
        growth = _rss_bytes() - rss0
        pinned1 = _torch_pinned_bytes()
        assert ck._buffers.allocations == 1 and ck._buffers.pinned
        assert nbytes <= ck._buffers.nbytes < nbytes * 1.01
    # a snapshot leaked per save would add 25 x 13 MB; allow under one snapshot of noise
    assert growth < nbytes, f"RSS grew by {growth / 1e6:.1f} MB over 25 saves of {nbytes / 1e6:.1f} MB"
    assert pinned0 == pinned1, f"pinned host memory went from {pinned0} to {pinned1} bytes"
    same(_to(opt.state_dict(), "cpu"), load(tmp_path, map_location="cpu")["optimizer"])


def test_a_refused_host_register_falls_back_to_torchs_pinned_allocator(tmp_path, monkeypatch, caplog):
    real = torch.cuda.cudart()

    class _Refusing:
        """cudart whose cudaHostRegister fails (as where the platform does not support it)."""

        def cudaHostRegister(self, ptr, size, flags):
            return 1  # cudaErrorInvalidValue

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Refusing())
    x = torch.randn(1000, device=DEV)
    with caplog.at_level(logging.WARNING, logger="hpcstagger.checkpoint.snapshot"):
        with AsyncCheckpointer(tmp_path) as ck:
            ck.save(0, {"x": x})
            assert ck._buffers.pinned and ck._buffers._buf.is_pinned() and ck._buffers._unpin is None
    assert any("cudaHostRegister" in r.getMessage() for r in caplog.records)
    assert torch.equal(load(tmp_path, map_location="cpu")["x"], x.cpu())
    torch.zeros(1, device=DEV)  # no CUDA error left behind for the next kernel launch
