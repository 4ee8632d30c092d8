"""A small torch training job written the usual way, for the calibration tests (run as a script).

    python calib_job.py [--workers W] [--batch B] [--epochs E] [--forever] [--out DIR] [--count FILE]
        [--no-loader] [--step-sleep S] [--slow-first-start FILE]

It joins the run (``hpcstagger.init``), reads the spec's dataset through ``CachedDataset`` over the
spec's cache, shards it with a DistributedSampler, loads it with a DataLoader (W workers, batches
of B), trains a small MLP (DDP when the spec's backend is ddp) and iterates its loader as
``for x, y in session.loader(loader):``, the one hpcstagger call around the loader. With
``--forever`` it trains until stopped; with ``--out`` each rank writes ``after-loop.<rank>`` when
its loop ends (a calibration's early exit never gets there). With ``--count`` each rank appends a
line to FILE as it starts (how often the job was launched). With ``--no-loader`` it iterates its
DataLoader directly, never through ``session.loader``, as a job not yet adapted would. With
``--step-sleep S`` each step takes S seconds longer (a slower job, for a test that acts while it runs).
With ``--slow-first-start FILE`` its start-up takes 2 s longer when FILE does not exist yet, and
FILE is made then: a start slowed once, as on a node whose speed varies.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import hpcstagger
from hpcstagger.cache import CachedDataset


class Decode:
    """Sample bytes (label byte, then pixels) to (float tensor, label); picklable for workers."""

    def __call__(self, data):
        arr = np.frombuffer(data, dtype=np.uint8)
        return torch.from_numpy(arr[1:].astype(np.float32) / 255.0), int(arr[0]) % 10


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--forever", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--count", default="")
    p.add_argument("--no-loader", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-first-start", default="")
    args = p.parse_args()
    if args.count:
        with open(args.count, "a") as f:
            f.write(f"{os.getpid()}\n")
    torch.set_num_threads(1)
    session = hpcstagger.init(wait=False)
    cache = session.cache()
    dataset = CachedDataset(session.source(), cache, transform=Decode()) if cache else None
    assert dataset is not None, "the calibration test's spec has a cache"
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=session.comm.size, rank=session.rank, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                                         persistent_workers=args.workers > 0)
    pixels = len(dataset.source[0]) - 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(pixels, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session.wait()
    session.start_backend()
    if args.slow_first_start and session.rank == 0 and not os.path.exists(args.slow_first_start):
        with open(args.slow_first_start, "w") as f:
            f.write("slowed\n")
        time.sleep(2.0)
    net = torch.nn.parallel.DistributedDataParallel(model) if session.backend == "ddp" else model
    epochs = 10**9 if args.forever else (args.epochs or session.spec.job(session.job).epochs)
    steps = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in (loader if args.no_loader else session.loader(loader)):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            steps += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
    if args.out:
        with open(os.path.join(args.out, f"after-loop.{session.rank}"), "w") as f:
            f.write(str(steps))
    session.finish(steps=steps)


if __name__ == "__main__":
    main()
