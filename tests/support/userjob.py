"""Two user-style jobs for real launches: a DataLoader over a CachedDataset behind an emulated slow
source (200 kB/s alone, 100 kB/s for two readers), iterated through ``session.loader``."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

JOB = textwrap.dedent("""
    import time
    import torch
    import hpcstagger
    from hpcstagger.cache import CachedDataset

    session = hpcstagger.init()
    data = CachedDataset(session.source(), session.cache(), transform=lambda b: len(bytes(b)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=WORKERS)
    total = 0
    for epoch in range(session.spec.job(session.job).epochs):
        for batch in session.loader(loader):
            total += int(batch.sum())
            time.sleep(0.002)
    session.finish(total=total)
""")

SAMPLES, SAMPLE_BYTES = 300, 2000

SCENARIO = textwrap.dedent("""
    [dataset]
    samples = 300
    sample_bytes = 2000
    [storage]
    bandwidth = [2.0e5, 1.0e5]
    [cache]
    capacity = 7.0e5
    [[job]]
    name = "a"
    sample_time = 0.0003
    workers = 0
    batch = 8
    epochs = 2
    [[job]]
    name = "b"
    sample_time = 0.0003
    workers = 0
    batch = 8
    epochs = 2
""")


def write_run(tmp_path: Path, shm_root: str, *, name: str, plan: str, workers: int = 0) -> str:
    """The dataset (``SAMPLES`` files), ``job.py`` and a spec of two such jobs ``a`` and ``b`` with the
    ``[plan]`` lines ``plan``, in ``tmp_path``; returns the spec's path."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(SAMPLES):
        (data / f"{i:04d}.bin").write_bytes(os.urandom(SAMPLE_BYTES))
    (tmp_path / "job.py").write_text(JOB.replace("WORKERS", str(workers)))
    spec = tmp_path / "spec.toml"
    lines = ["[run]", f'name = "{name}"', "timeout = 180", "[dataset]", 'path = "data"', "throttle = [2.0e5, 1.0e5]",
             "[cache]", "capacity = 700000", f'root = "{shm_root}"', "[plan]", *plan.strip().splitlines()]
    for job in ("a", "b"):
        lines += ["[[job]]", f'name = "{job}"', 'command = "python job.py"', "epochs = 2"]
    spec.write_text("\n".join(lines) + "\n")
    return str(spec)
