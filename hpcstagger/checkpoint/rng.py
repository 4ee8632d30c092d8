"""Capture and restore the random number generators a training run depends on."""

from __future__ import annotations

from typing import Any

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """The states of Python's, numpy's legacy and torch's (CPU and every CUDA device's) generators.

    The result can go into a checkpoint state as it is; :func:`restore_rng` puts it back.
    """
    import random

    import numpy as np
    import torch

    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # untested here: no GPU
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(states: dict[str, Any]) -> None:
    """Put back generator states taken by :func:`capture_rng` (and loaded from a checkpoint)."""
    import random

    import numpy as np
    import torch

    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        np.random.set_state(tuple(states["numpy"]))
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])
