"""A training job written the way PyTorch users write them, for the planner benchmark (benchmarks/bench_userjobs.py).

Nothing here is shaped to fit the model: a DataLoader with worker processes and batches, a
DistributedSampler, DDP or Horovod, SGD, a seeded initialisation, and no timing code. The only hpcstagger calls are the
ones a user makes: ``hpcstagger.init()``, ``CachedDataset`` and ``session.finish()``, plus the
one wrapper ``session.loader(loader)`` that lets ``hpcstagger calibrate --spec`` measure the job
(``--no-wrapper`` leaves it out). ``steps.py`` beside it gives the same models as step factories.

    python benchmarks/userjobs/train.py --model cnn --batch 64 --workers 2   (from a job spec)
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn as nn

import hpcstagger
from hpcstagger.cache import CachedDataset


def build(name: str, size: int, classes: int = 10) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, 128), nn.ReLU(), nn.Linear(128, classes))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * (size // 4) ** 2, classes))
    if name == "wide":
        return nn.Sequential(nn.Conv2d(3, 48, 3, padding=1), nn.ReLU(), nn.Conv2d(48, 48, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(48 * (size // 2) ** 2, classes))
    raise SystemExit(f"unknown model {name!r}: mlp, cnn or wide")


class Decode:
    """Sample bytes (a label byte, then a 3 x size x size uint8 image) to a normalised tensor."""

    def __init__(self, size: int, flip: bool):
        self.size, self.flip = size, flip

    def __call__(self, data: bytes) -> tuple[torch.Tensor, int]:
        row = np.frombuffer(data, dtype=np.uint8)
        image = torch.from_numpy(row[1:].reshape(3, self.size, self.size).astype(np.float32) / 255.0)
        if self.flip and row[0] % 2:
            image = image.flip(2)  # a cheap augmentation
        return (image - 0.5) / 0.25, int(row[0]) % 10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", help="mlp, cnn or wide")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0,
                   help="the seed of the model's initial weights and of the sampler (DistributedSampler's default: 0)")
    p.add_argument("--no-wrapper", action="store_true",
                   help="iterate the DataLoader itself, without session.loader (as many users first write it)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    # These models fit the synthetic dataset within an epoch; from then on the loss is near zero and
    # some gradients are denormal floats, which made the cnn's steps 2 to 3.5 times slower on an Intel
    # Xeon, in runs whose initial weights led there and not in others. Flushing them to zero keeps a
    # job's step cost the same from run to run, as it is on data a model does not fit at once.
    torch.set_flush_denormal(True)

    session = hpcstagger.init()  # joins the co-located run, waits out the planned delay, starts DDP/Horovod
    comm, spec = session.comm, session.spec
    assert spec is not None, "run this from a job spec (hpcstagger launch / sweep / calibrate --spec)"
    source = session.source()
    size = int(round(((len(bytes(source[0])) - 1) / 3) ** 0.5))
    dataset = CachedDataset(source, session.cache(), transform=Decode(size, flip=True))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=comm.size, rank=comm.rank, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                                         persistent_workers=args.workers > 0)
    model = build(args.model, size)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if session.backend == "ddp":
        net: nn.Module = nn.parallel.DistributedDataParallel(model)
    elif session.backend == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        net = model
    else:
        net = model
    epochs = spec.job(session.job).epochs
    steps = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in (loader if args.no_wrapper else session.loader(loader)):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(images), labels)
            loss.backward()
            opt.step()
            steps += 1
    session.finish(steps=steps)


if __name__ == "__main__":
    main()
