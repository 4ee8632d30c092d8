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


def small_toml(jobs: dict[str, float], *, initial: float | None = None) -> str:
    """A calibrated scenario file's text for a spec's jobs: 200 samples of 1,000 bytes from a source
    of 1.0 MB/s alone and 1.5 MB/s with 2 readers, a cache of the whole dataset (``initial``-full at
    the start, when given), and ``jobs`` as name -> seconds per sample."""
    lines = ["[dataset]", "samples = 200", "sample_bytes = 1000", "[storage]", "bandwidth = [1.0e6, 1.5e6]",
             "[cache]", "capacity = 2.0e5"] + ([f"initial = {initial}"] if initial is not None else [])
    for name, t in jobs.items():
        lines += ["[[job]]", f'name = "{name}"', f"sample_time = {t}"]
    return "\n".join(lines) + "\n"
