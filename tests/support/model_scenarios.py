"""Small model scenarios for the model tests: samples of 128 KiB, one per millisecond alone."""

from __future__ import annotations

import math

from hpcstagger.model import Scenario

S = 131072.0
B = 1.31072e8  # bytes/s: one sample per millisecond alone


def scenario(n=2000, jobs=((0.002, 1),), bandwidth=(B,), capacity=0.0, policy="minio", hit_bw=math.inf,
             prefetch=2) -> Scenario:
    """``n`` samples; ``jobs`` as (seconds per sample, epochs); ``capacity`` as a fraction of the
    dataset; ``hit_bw`` infinite for hits that cost nothing."""
    cache = {"capacity": capacity * n * S, "policy": policy}
    if math.isfinite(hit_bw):
        cache["hit_bandwidth"] = hit_bw
    return Scenario.from_dict({
        "dataset": {"samples": n, "sample_bytes": S}, "storage": {"bandwidth": list(bandwidth)},
        "cache": cache, "loader": {"prefetch": prefetch},
        "job": [{"name": f"j{i}", "sample_time": t, "epochs": e} for i, (t, e) in enumerate(jobs)]})
