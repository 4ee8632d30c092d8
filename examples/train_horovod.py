"""Train a small MLP with Horovod as one job of a co-located hpcstagger run.

    python examples/make_dataset.py data.h5                          # a dataset to train on
    mpiexec -n 2 python examples/train_horovod.py --data data.h5     # this job alone, 2 ranks
    hpcstagger launch examples/colocated.toml                         # with the DDP example beside it

Horovod must be built with MPI (scripts/install-horovod). hpcstagger.init() starts it with
hvd.init(comm=<this job's communicator>), so each co-located job has its own Horovod; the rest is
as in train_ddp.py: the shared /dev/shm cache, asynchronous sharded checkpoints, resume, and the
loop written `for batch in session.loader(loader):` for `hpcstagger calibrate --spec` to measure.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn as nn

import hpcstagger
from hpcstagger.cache import CachedDataset, HDF5Source, ShmCache
from hpcstagger.checkpoint import AnyGate, AsyncCheckpointer, SharedActivityGate, StepGate
from hpcstagger.errors import CheckpointError
from hpcstagger.integrations import horovod as hh


def build_model(pixels: int, classes: int = 10) -> nn.Module:
    """A small multilayer perceptron on flattened images of ``pixels`` values."""
    return nn.Sequential(nn.Flatten(), nn.Linear(pixels, 128), nn.ReLU(), nn.Linear(128, classes))


def collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample bytes (label byte, then the image) to a batch of flattened images in [0, 1] and labels."""
    rows = np.stack([np.frombuffer(s, dtype=np.uint8) for s in samples])
    return (torch.from_numpy(rows[:, 1:].astype(np.float32) / 255),
            torch.from_numpy(rows[:, 0].astype(np.int64)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="HDF5 file with a 'samples' dataset (alone; a spec's [dataset] otherwise)")
    p.add_argument("--epochs", type=int, help="epochs (default: the spec's, or 2)")
    p.add_argument("--batch", type=int, default=32, help="batch size per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--cache-mb", type=int, default=256, help="shared cache size when alone (default 256 MB)")
    p.add_argument("--ckpt-dir", default="checkpoints/horovod", help="checkpoint directory when alone")
    p.add_argument("--ckpt-every", type=int, default=20, help="steps between checkpoints (0: epoch ends only)")
    args = p.parse_args()
    torch.set_num_threads(1)

    session = hpcstagger.init(wait=False, backend="horovod")
    comm, spec = session.comm, session.spec
    if spec is not None:
        source, cache = session.source(), session.cache()
        ckpt_opts = session.checkpoint_options()  # directory, staging level, keep, who flushes
        epochs = args.epochs or spec.job(session.job).epochs
        every = spec.checkpoint.every or args.ckpt_every
    else:
        if not args.data:
            raise SystemExit("train_horovod.py: give --data FILE.h5 (or run it from a job spec)")
        source = HDF5Source(args.data, "samples")
        cache = ShmCache("examples", args.cache_mb * 10**6) if args.cache_mb else None
        ckpt_opts = {"directory": args.ckpt_dir}
        epochs, every = args.epochs or 2, args.ckpt_every

    reads = SharedActivityGate()
    dataset = CachedDataset(source, cache, source_read_hook=reads.source_read_hook()) if cache else source
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=comm.size, rank=comm.rank, seed=2)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, collate_fn=collate)
    model = build_model(len(bytes(source[0])) - 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    steps = StepGate()
    steps.watch(model)
    steps.watch(opt)
    ckpt = AsyncCheckpointer(**ckpt_opts, comm=comm, gate=AnyGate(steps, reads))
    start_epoch, step = 0, 0
    try:
        state = ckpt.load()
        hpcstagger.restore_checkpoint(state, model=model, optimizer=opt)
        start_epoch, step = state["epoch"] + 1, state["step"]
        session.say(f"resumed from step {step} (epoch {state['epoch']})")
    except CheckpointError:
        pass

    session.wait()            # the planned start delay
    session.start_backend()   # hvd.init(comm=<this job's communicator>)
    hvd = hh.hvd_module()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    dist_opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    t0 = time.time()
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        for images, labels in session.loader(loader):  # as `loader`; `hpcstagger calibrate` measures it here
            dist_opt.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            dist_opt.step()
            step += 1
            if every and step % every == 0:
                ckpt.save(step, {"model": model, "optimizer": opt, "epoch": epoch - 1, "step": step})
        ckpt.save(step, {"model": model, "optimizer": opt, "epoch": epoch, "step": step})
        session.say(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, step {step}")
    ckpt.close()
    steps.close()
    session.finish(steps=step, seconds=time.time() - t0, loss=loss.item() if step else None)
    reads.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
