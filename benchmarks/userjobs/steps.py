"""The models of ``train.py`` as step factories, for ``hpcstagger calibrate SPEC --job NAME=MODULE:FUNCTION``:
each returns ``step(samples: list[bytes])``, one SGD step on a batch decoded from the samples. This is
the route a user takes for a job that calibration cannot measure from its own command."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from .train import build


def _factory(model_name: str) -> Callable[[list[bytes]], None]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.set_flush_denormal(True)  # as train.py does: a fitted model's denormal gradients would slow its steps
    state: dict[str, object] = {}

    def step(samples: list[bytes]) -> None:
        rows = [np.frombuffer(bytes(s), dtype=np.uint8) for s in samples]
        size = int(round(((len(rows[0]) - 1) / 3) ** 0.5))
        if "net" not in state:
            state["net"] = net = build(model_name, size)
            state["opt"] = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        net, opt = state["net"], state["opt"]
        images = torch.from_numpy(np.stack([r[1:].reshape(3, size, size) for r in rows]).astype(np.float32) / 255.0)
        labels = torch.tensor([int(r[0]) % 10 for r in rows])
        opt.zero_grad()  # type: ignore[attr-defined]
        loss = nn.functional.cross_entropy(net((images - 0.5) / 0.25), labels)  # type: ignore[operator]
        loss.backward()
        opt.step()  # type: ignore[attr-defined]

    return step


def cnn() -> Callable[[list[bytes]], None]:
    return _factory("cnn")


def mlp() -> Callable[[list[bytes]], None]:
    return _factory("mlp")
