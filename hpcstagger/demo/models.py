"""Two small models for the demo jobs: a convolutional net and a multilayer perceptron."""

from __future__ import annotations

from typing import Any
from hpcstagger.errors import ConfigError

__all__ = ["MODELS", "build_model"]

MODELS = ("convnet", "mlp")


def build_model(name: str, shape: tuple[int, int, int], classes: int) -> Any:
    """A fresh ``name`` model for images of ``shape`` (C, H, W); raises ConfigError for an unknown name."""
    import torch.nn as nn

    c, h, w = shape
    if name == "convnet":
        return nn.Sequential(
            nn.Conv2d(c, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 16, classes))
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                             nn.Linear(64, classes))
    raise ConfigError(f"unknown demo model {name!r}; choose one of {', '.join(MODELS)}")
