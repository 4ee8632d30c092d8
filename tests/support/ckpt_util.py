"""Utilities shared by the checkpoint tests: a small deterministic model, training, and comparisons."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def make_model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(width, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def trained(steps: int = 3, seed: int = 0, width: int = 64):
    model = make_model(seed, width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(steps):
        train_step(model, opt, s)
    return model, opt


def same(a: Any, b: Any, path: str = "") -> None:
    """Assert two states are equal bit for bit (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                           b.reshape(-1).view(torch.uint8) if b.numel() else b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def plain(state: dict) -> dict:
    """The state with modules and optimizers replaced by their state dicts (what load returns)."""
    out = {}
    for k, v in state.items():
        out[k] = v.state_dict() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict") else v
    return out


class FakeClock:
    """Stands in for the ``time`` module of polled waits (monkeypatch it into hpcstagger.comm and
    the waiting module): ``sleep`` only records the pause and advances ``monotonic``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
