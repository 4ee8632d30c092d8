"""Train a small CNN with torch.distributed (DDP) as one job of a co-located hpcstagger run.

    python examples/make_dataset.py data.h5                       # a dataset to train on
    mpiexec -n 2 python examples/train_ddp.py --data data.h5      # this job alone, 2 ranks
    hpcstagger launch examples/colocated.toml                      # with the Horovod example beside it
    sbatch --ntasks=3 slurm/colocated.sbatch examples/colocated.toml

What hpcstagger does for it:
- hpcstagger.init() tells this job apart from the others in the MPI world, holds it back for its
  planned start delay, and starts torch.distributed (gloo) on this job's ranks only;
- CachedDataset reads every sample through the node's shared cache in /dev/shm: the first job to
  read a sample fills the cache, every other job on the node then hits it;
- AsyncCheckpointer takes a snapshot at each save and writes it in the background, one shard per
  rank, committed atomically; the script resumes from the newest checkpoint when restarted;
- `for batch in session.loader(loader):` is the loop as it is; when `hpcstagger calibrate --spec`
  runs this script it measures the loop there (and the job stops early), so the planner knows the
  job's real costs.

Inside a job spec the data, cache and checkpoint settings come from the spec; alone, from the
options below.
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
from hpcstagger.integrations.torch_ddp import destroy_process_group


def build_model(size: int, classes: int = 10) -> nn.Module:
    """A small convolutional network for 3 x size x size images."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (size // 4) ** 2, classes))


def collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample bytes (label byte, then the image) to a batch of images in [0, 1] and labels."""
    rows = np.stack([np.frombuffer(s, dtype=np.uint8) for s in samples])
    size = int(round(((rows.shape[1] - 1) / 3) ** 0.5))
    images = torch.from_numpy(rows[:, 1:].reshape(len(rows), 3, size, size).astype(np.float32) / 255)
    return images, torch.from_numpy(rows[:, 0].astype(np.int64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="HDF5 file with a 'samples' dataset (alone; a spec's [dataset] otherwise)")
    p.add_argument("--epochs", type=int, help="epochs (default: the spec's, or 2)")
    p.add_argument("--batch", type=int, default=32, help="batch size per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--cache-mb", type=int, default=256, help="shared cache size when alone (default 256 MB)")
    p.add_argument("--ckpt-dir", default="checkpoints/ddp", help="checkpoint directory when alone")
    p.add_argument("--ckpt-every", type=int, default=20, help="steps between checkpoints (0: epoch ends only)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (default 1)")
    args = p.parse_args()
    torch.set_num_threads(1)

    # Join the run: with HPCSTAGGER_SPEC set (hpcstagger launch, the Slurm scripts) this is one job of
    # several; under a plain `mpiexec -n N` every rank belongs to this one job.
    session = hpcstagger.init(wait=False, backend="ddp")
    comm, spec = session.comm, session.spec
    if spec is not None:
        source, cache = session.source(), session.cache()
        ckpt_opts = session.checkpoint_options()  # directory, staging level, keep, who flushes
        epochs = args.epochs or spec.job(session.job).epochs
        every = spec.checkpoint.every or args.ckpt_every
    else:
        if not args.data:
            raise SystemExit("train_ddp.py: give --data FILE.h5 (or run it from a job spec)")
        source = HDF5Source(args.data, "samples")
        cache = ShmCache("examples", args.cache_mb * 10**6) if args.cache_mb else None
        ckpt_opts = {"directory": args.ckpt_dir}
        epochs, every = args.epochs or 2, args.ckpt_every

    # Reads that go to the source mark a shared gate busy, so the checkpoint writer stays out of their way.
    reads = SharedActivityGate()
    dataset = CachedDataset(source, cache, source_read_hook=reads.source_read_hook()) if cache else source
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=comm.size, rank=comm.rank, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, collate_fn=collate,
                                         num_workers=args.workers, persistent_workers=args.workers > 0)
    size = int(round(((len(bytes(source[0])) - 1) / 3) ** 0.5))
    model = build_model(size)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # The checkpoint writer writes between training steps and while no sample is read from the source.
    steps = StepGate()
    steps.watch(model)
    steps.watch(opt)
    ckpt = AsyncCheckpointer(**ckpt_opts, comm=comm, gate=AnyGate(steps, reads))

    # Resume from the newest committed checkpoint, if any.
    start_epoch, step = 0, 0
    try:
        state = ckpt.load()
        hpcstagger.restore_checkpoint(state, model=model, optimizer=opt)
        start_epoch, step = state["epoch"] + 1, state["step"]
        session.say(f"resumed from step {step} (epoch {state['epoch']})")
    except CheckpointError:
        pass  # nothing to resume from

    session.wait()            # the planned start delay
    session.start_backend()   # torch.distributed (gloo) on this job's ranks
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    t0 = time.time()
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        for images, labels in session.loader(loader):  # as `loader`; `hpcstagger calibrate` measures it here
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp(images), labels)
            loss.backward()
            opt.step()
            step += 1
            if every and step % every == 0:
                ckpt.save(step, {"model": model, "optimizer": opt, "epoch": epoch - 1, "step": step})
        ckpt.save(step, {"model": model, "optimizer": opt, "epoch": epoch, "step": step})
        session.say(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, step {step}")
    ckpt.close()
    steps.close()
    session.finish(steps=step, seconds=time.time() - t0, loss=loss.item() if step else None)
    reads.close()
    destroy_process_group(comm)


if __name__ == "__main__":
    main()
