"""session.finish's metrics: the README's `loss=loss.item()` and a tensor as it is both record a
number without torch's warning; a metric a status file cannot hold is one clear error."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from hpcstagger.colocated.progress import plain_metrics
from hpcstagger.errors import ConfigError


def test_tensors_and_numpy_values_become_numbers_without_a_warning():
    w = torch.nn.Parameter(torch.ones(3))
    loss = (w * 2).sum()  # requires grad, as a training loss does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = plain_metrics({"loss": loss, "item": loss.item(), "acc": np.float32(0.5), "hist": np.arange(3),
                             "steps": 7, "name": "cnn", "per_epoch": [1.5, 2.0]})
    assert out == {"loss": 6.0, "item": 6.0, "acc": 0.5, "hist": [0, 1, 2], "steps": 7, "name": "cnn",
                   "per_epoch": [1.5, 2.0]}
    json.dumps(out)


def test_a_metric_a_status_file_cannot_hold_is_named():
    with pytest.raises(ConfigError, match="metric 'model' is a Linear"):
        plain_metrics({"model": torch.nn.Linear(2, 2)})
