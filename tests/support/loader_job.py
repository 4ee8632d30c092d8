"""A consumer of a shared loader pipeline, run as its own process by tests/test_loader.py.

``python loader_job.py SPEC.json``. SPEC holds the SharedLoader's arguments and what to do: how many
epochs, how long to sleep per batch, a gate file to wait for before attaching, whether to use CUDA
before building the loader (``cuda_first``) and to change each batch in place after checking it
(``inplace``). The job rewrites its own JSON file (``out``, atomically) after attaching and after
every batch, so the test can follow it while it runs: per batch the epoch, the sample indices, the
tensor's device and whether every tensor matched its index.
A LoaderError ends the job with exit status 0 and is recorded (message, and when it was caught);
anything else is a traceback on stderr and exit status 1.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import Dataset

from hpcstagger._io import atomic_write_json
from hpcstagger.errors import LoaderError
from hpcstagger.loader import SharedLoader

WIDTH = 4


class Numbered(Dataset):
    """Sample ``i`` is (``1000 * i + [0, 1, 2, 3]`` as float64, ``i``); ``fail_at`` raises."""

    def __init__(self, n: int, fail_at: int = -1):
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"sample {i} is corrupt (planted by the test)")
        return expected(i), i


def expected(i):
    """The tensor of sample ``i`` (or of each sample of a tensor of indices)."""
    if isinstance(i, torch.Tensor):
        return 1000.0 * i.to(torch.float64)[:, None] + torch.arange(WIDTH, dtype=torch.float64, device=i.device)
    return 1000.0 * i + torch.arange(WIDTH, dtype=torch.float64)


def _gate(path: str | None) -> None:
    deadline = time.monotonic() + 60
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {path} never opened")
        time.sleep(0.01)


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    out = spec["out"]
    record: dict = {"pid": os.getpid(), "batches": [], "error": None, "done": False}
    if spec.get("cuda_first"):  # CUDA in use before the loader starts its producer (which forks)
        torch.ones(1, device="cuda").sum().item()
    loader = SharedLoader(Numbered(spec["n"], spec.get("fail_at", -1)), spec["batch_size"], name=spec["name"],
                          root=spec["root"], **spec.get("loader", {}))
    record["len"] = len(loader)
    atomic_write_json(out, record, durable=False)  # built: torch is imported and the gate is next
    _gate(spec.get("gate"))
    sleep = spec.get("sleep", 0.0)
    try:
        loader.attach()
        record.update(producer_pid=loader.producer_pid, first=loader.stats()["first_batch"])
        atomic_write_json(out, record, durable=False)
        for epoch in range(spec["epochs"]):
            for x, i in loader:
                record["batches"].append({"e": epoch, "i": i.tolist(), "ok": torch.equal(x, expected(i)),
                                          "t": time.time(), "dev": str(x.device)})
                if spec.get("inplace"):  # private batches: no other consumer may see this
                    x.mul_(-1.0)
                record["stats"] = loader.stats()
                atomic_write_json(out, record, durable=False)
                time.sleep(sleep)
        record["done"] = True
    except LoaderError as exc:
        record["error"] = {"message": str(exc), "at": time.time()}
    record["stats"] = loader.stats()
    record["finished_at"] = time.time()
    loader.close()
    atomic_write_json(out, record, durable=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
