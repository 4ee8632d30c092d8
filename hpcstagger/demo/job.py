"""The training job of the demo: ``python -m hpcstagger.demo.job --model convnet`` on each rank.

It joins the co-located run (:func:`hpcstagger.init`), builds everything it needs while it waits
out its planned delay (model, optimiser, data loader, checkpoint buffers), then trains its epochs
reading the dataset through the shared cache, checkpointing asynchronously. Its status file
records the samples it read, its cache hits, its checkpoints and its time per epoch.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, Sequence

__all__ = ["make_step", "main"]


def _collate(shape: tuple[int, int, int]) -> Callable[[list[Any]], tuple[Any, Any]]:
    import numpy as np
    import torch

    def collate(samples: list[Any]) -> tuple[Any, Any]:
        rows = np.stack([np.frombuffer(s, dtype=np.uint8) for s in samples])
        images = torch.from_numpy(rows[:, 1:].reshape(len(rows), *shape).astype(np.float32) / 255.0)
        return images, torch.from_numpy(rows[:, 0].astype(np.int64))

    return collate


def make_step(model_name: str, shape: tuple[int, int, int], *, lr: float = 0.05,
              seed: int = 0) -> tuple[Any, Any, Callable[[list[bytes]], float]]:
    """(model, optimiser, step): ``step(samples)`` decodes a batch of sample bytes and trains on it.

    The same step serves calibration (``hpcstagger.model.calibrate`` times it on samples in memory)
    and training, so the measured seconds per sample are those the job will see.
    """
    import torch

    from .data import CLASSES
    from .models import build_model

    torch.manual_seed(seed)
    model = build_model(model_name, shape, CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    collate = _collate(shape)

    def step(samples: list[bytes]) -> float:
        x, y = collate(samples)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss)

    return model, opt, step


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcstagger.demo.job", description=__doc__)
    p.add_argument("--model", required=True, help="convnet or mlp")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--prefetch", type=int, default=4, help="batches the loader reads ahead (default 4)")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import hpcstagger
    from hpcstagger.cache import CachedDataset

    session = hpcstagger.init(wait=False)
    spec = session.spec
    assert spec is not None
    job = spec.job(session.job)
    source = session.source()
    shape = tuple(int(v) for v in os.environ.get("HPCSTAGGER_DEMO_SHAPE", "3,64,64").split(","))
    model, opt, step = make_step(args.model, shape, lr=args.lr)  # type: ignore[arg-type]
    cache = session.cache()
    dataset = CachedDataset(source, cache) if cache is not None else source
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=1,
                                         collate_fn=list, prefetch_factor=args.prefetch,
                                         persistent_workers=True, drop_last=False)
    ckpt = None
    every = spec.checkpoint.every
    if every > 0:
        from hpcstagger.checkpoint import AsyncCheckpointer

        directory, staging = session.checkpoint_dir()
        ckpt = AsyncCheckpointer(directory, comm=session.comm, keep=spec.checkpoint.keep, staging_dir=staging)
        ckpt.prepare({"model": model, "optimizer": opt})
    ready = session.elapsed()
    session.wait()
    session.start_backend()
    session.say(f"training {args.model}: {job.epochs} epoch(s) of {len(dataset)} samples")
    steps, samples, saves, epoch_times = 0, 0, 0, []
    for epoch in range(job.epochs):
        t = time.perf_counter()
        for batch in loader:
            step(batch)
            steps += 1
            samples += len(batch)
            if ckpt is not None and steps % every == 0:
                ckpt.save(steps, {"model": model, "optimizer": opt, "epoch": epoch, "step": steps})
                saves += 1
        epoch_times.append(time.perf_counter() - t)
        session.say(f"epoch {epoch + 1}/{job.epochs} took {epoch_times[-1]:.1f} s")
    if ckpt is not None:
        ckpt.close()
    stats = cache.stats() if cache is not None else {}
    session.finish(samples=samples, steps=steps, checkpoints=saves, epoch_times=epoch_times,
                   ready_before_start=ready, cache_hits=stats.get("hits"), cache_misses=stats.get("misses"))
    del loader
    if hasattr(source, "close"):
        source.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
