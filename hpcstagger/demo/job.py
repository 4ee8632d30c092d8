"""The training job of the demo: ``python -m hpcstagger.demo.job --model convnet`` on each rank.

It joins the co-located run (:func:`hpcstagger.init`), builds everything it needs while it waits
out its planned delay (model, optimiser, data loader, checkpoint buffers), then trains its epochs
with a PyTorch DataLoader over a CachedDataset (the shared cache), iterated as
``for images, labels in session.loader(loader):``, checkpointing asynchronously. ``hpcstagger
calibrate --spec`` runs this same command to measure the job (the loop stops itself early there).
Its status file records the samples it read, its cache hits, its checkpoints and its time per epoch.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib
from typing import Any
from collections.abc import Sequence
from hpcstagger.demo.models import build_model
from hpcstagger.checkpoint import AsyncCheckpointer
import hpcstagger

__all__ = ["Collate", "build", "train_step", "main"]


class Collate:
    """Sample bytes (a label byte, then a C x H x W image) to a batch: (images in [0, 1], labels).

    It runs in the DataLoader's worker processes, so it is a picklable class."""

    def __init__(self, shape: tuple[int, int, int]):
        self.shape = tuple(shape)

    def __call__(self, samples: list[Any]) -> tuple[Any, Any]:
        import numpy as np
        import torch

        rows = np.stack([np.frombuffer(s, dtype=np.uint8) for s in samples])
        images = torch.from_numpy(rows[:, 1:].reshape(len(rows), *self.shape).astype(np.float32) / 255.0)
        return images, torch.from_numpy(rows[:, 0].astype(np.int64))


def build(model_name: str, shape: tuple[int, int, int], *, lr: float = 0.05, seed: int = 0) -> tuple[Any, Any]:
    """(model, optimiser) of the demo model ``model_name`` for images of ``shape``."""
    import torch

    from hpcstagger.demo.data import CLASSES

    torch.manual_seed(seed)
    model = build_model(model_name, shape, CLASSES)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train_step(model: Any, opt: Any, images: Any, labels: Any) -> float:
    """One training step on a batch; the loss."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    opt.step()
    return float(loss.item())


def _loader(dataset: Any, shape: tuple[int, int, int], *, batch: int, workers: int, prefetch: int,
            seed: int) -> Any:
    """A PyTorch DataLoader as users write one: a fresh random order every epoch, ``workers`` worker
    processes (kept between epochs) with ``prefetch`` batches each in flight."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, generator=generator,
                                       collate_fn=Collate(shape), num_workers=workers,
                                       prefetch_factor=prefetch if workers else None,
                                       persistent_workers=workers > 0)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcstagger.demo.job", description=__doc__)
    p.add_argument("--model", required=True, help="convnet or mlp")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (default 1)")
    p.add_argument("--prefetch", type=int, default=2, help="batches each worker keeps in flight (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="training steps on synthetic data while waiting (default 3)")
    return p.parse_args(argv)


def _get_ready(session: Any, model: Any, opt: Any, shape: tuple[int, int, int], *, batch: int,
               warmup: int) -> tuple[Any, float]:
    """Ready what the first step needs: (the checkpointer or None, the seconds it took).

    That is the checkpointer (collective over the job's ranks) with its snapshot buffers allocated
    and touched, and ``warmup`` training steps on synthetic data. It runs before the job waits for
    its planned start: a job that starts at once pays for this after the plan; a delayed job has it
    done when its delay ends.
    """
    import torch

    t = time.perf_counter()
    ckpt = None
    spec = session.spec
    if spec.checkpoint.every > 0:
        ckpt = AsyncCheckpointer(**session.checkpoint_options(), comm=session.comm)
        ckpt.prepare({"model": model, "optimizer": opt})
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(batch, *shape, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    for _ in range(warmup):
        train_step(model, opt, images, labels)
    return ckpt, time.perf_counter() - t


def _train(session: Any, loader: Any, epochs: int, model: Any, opt: Any, ckpt: Any, *,
           every: int) -> tuple[int, int, int, list[float], list[float]]:
    """Train ``epochs`` epochs, saving a checkpoint every ``every`` steps.

    Returns (samples, steps, checkpoints saved, wall seconds per epoch, CPU seconds per epoch).
    """
    steps, samples, saves, epoch_times = 0, 0, 0, []
    cpu = []
    for epoch in range(epochs):
        t = time.perf_counter()
        c0 = time.process_time()
        for images, labels in session.loader(loader):  # the one hpcstagger call around the loader
            train_step(model, opt, images, labels)
            steps += 1
            samples += len(labels)
            if ckpt is not None and steps % every == 0:
                ckpt.save(steps, {"model": model, "optimizer": opt, "epoch": epoch, "step": steps})
                saves += 1
        epoch_times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c0)
        session.say(f"epoch {epoch + 1}/{epochs} took {epoch_times[-1]:.1f} s")
    return samples, steps, saves, epoch_times, cpu


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's job: join the run, get ready while waiting out the planned delay, train, report."""
    args = _parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from hpcstagger.cache import CachedDataset

    # Everything local to this job is built before joining the run: the plan's clock starts after.
    c, h, w = (int(v) for v in os.environ.get("HPCSTAGGER_DEMO_SHAPE", "3,64,64").split(","))
    shape = (c, h, w)
    model, opt = build(args.model, shape, lr=args.lr)
    session = hpcstagger.init(wait=False)
    job = session.spec.job(session.job)
    source = session.source()
    cache = session.cache()
    dataset = CachedDataset(source, cache) if cache is not None else source
    # its own order, the same in every run of this job (and in its calibration, which runs it alone)
    loader = _loader(dataset, shape, batch=args.batch, workers=args.workers, prefetch=args.prefetch,
                     seed=zlib.crc32(session.job.encode()))
    # While this job waits for its planned start, it readies what the first step needs.
    ckpt, ready_s = _get_ready(session, model, opt, shape, batch=args.batch, warmup=args.warmup)
    session.wait()
    session.start_backend()
    late = session.elapsed() - session.delay
    session.say(f"training {args.model}: {job.epochs} epoch(s) of {len(dataset)} samples "
                f"(ready {ready_s:.2f} s after the plan, started {late:.2f} s after its planned start)")
    samples, steps, saves, epoch_times, cpu = _train(session, loader, job.epochs, model, opt, ckpt,
                                                     every=session.spec.checkpoint.every)
    if ckpt is not None:
        ckpt.close()
    stats = cache.stats() if cache is not None else {}
    session.finish(samples=samples, steps=steps, checkpoints=saves, epoch_times=epoch_times, epoch_cpu=cpu,
                   ready_s=ready_s,
                   late_start_s=late, cache_hits=stats.get("hits"), cache_misses=stats.get("misses"))
    if hasattr(source, "close"):
        source.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
