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
from typing import Any
from collections.abc import Callable, Collection, Sequence

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
        return loss.item()

    return model, opt, step


class _Prefetcher:
    """One background thread reads the samples of an epoch in order, up to ``depth`` ahead.

    This is the loader the performance model assumes: one reader per job, fetching one sample at a
    time while the job computes. The thread spends its time in I/O (sleeping in the emulated source,
    or copying from the cache), so it hardly competes with the training for the interpreter.
    """

    def __init__(self, dataset: Any, depth: int):
        import queue
        import threading

        self.dataset, self.depth = dataset, depth
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._order: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hpcstagger-demo-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            order = self._order.get()
            if order is None:
                return
            try:
                for i in order:
                    self._q.put(bytes(self.dataset[int(i)]))
            except Exception as exc:  # handed to the training thread
                self._q.put(exc)

    def epoch(self, order: Collection[Any], batch: int) -> Any:
        """Yield lists of ``batch`` sample bytes, in ``order``."""
        self._order.put(order)
        out: list[bytes] = []
        for _ in range(len(order)):
            item = self._q.get()
            if isinstance(item, Exception):
                raise item
            out.append(item)
            if len(out) == batch:
                yield out
                out = []
        if out:
            yield out

    def close(self) -> None:
        self._order.put(None)
        self._thread.join(timeout=10)


class _MemorySource:
    """Samples held in memory, as a map-style source (for timing the loop without any I/O)."""

    def __init__(self, samples: list[bytes]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> bytes:
        return self.samples[i]

    def key(self, i: int) -> str:
        return f"calibration-{i}"


def measure_sample_time(step: Callable[[list[bytes]], float], shape: tuple[int, int, int], *, batch: int,
                        prefetch: int, seconds: float = 3.0) -> float:
    """Seconds per sample of this job's training loop, in its steady state, with every sample a hit.

    The loop is the real one (the prefetching loader thread reading a CachedDataset over a warm
    ShmCache, and the training step), on synthetic samples in a private cache, so no source I/O is
    involved; jobs calibrating at the same time share the CPU as they will in the run. A fresh
    process can train more slowly for its first second or so, which the first, I/O-bound epoch hides
    in the real run; so only the second half of the ``seconds`` counts.
    """
    import numpy as np

    from ..cache import CachedDataset, ShmCache

    rng = np.random.default_rng(2)
    # enough distinct samples (about 9 MB at the demo's size) that they do not all stay in the
    # CPU's caches, as the real dataset does not
    count = max(4 * batch, (9 << 20) // (1 + int(np.prod(shape))))
    rows = rng.integers(0, 255, size=(count, 1 + int(np.prod(shape))), dtype=np.uint8)
    rows[:, 0] %= 10
    source = _MemorySource([r.tobytes() for r in rows])
    cache = ShmCache(f"hpcstagger-calibrate-{os.getpid()}", rows.nbytes * 2)
    try:
        dataset = CachedDataset(source, cache)
        for i in range(len(source)):
            dataset[i]  # warm the cache: every read below is a hit
        loader = _Prefetcher(dataset, prefetch)
        order = list(range(len(source)))
        marks: list[tuple[float, int]] = []
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in loader.epoch(order, batch):
                step(b)
                done += len(b)
                marks.append((time.perf_counter(), done))
        loader.close()
    finally:
        cache.destroy(force=True)
    half = t0 + seconds / 2
    first = next(m for m in marks if m[0] >= half)
    return (marks[-1][0] - first[0]) / max(1, marks[-1][1] - first[1])


def measure_miss_overhead(spec: Any, step: Callable[[list[bytes]], float], *, batch: int, prefetch: int,
                          seconds: float = 1.5) -> float:
    """Seconds each read that goes to the source costs this job beyond the source's own time.

    The loader reads real samples through a private ThrottledSource at the spec's one-reader
    bandwidth (private, so jobs calibrating at once do not share it) into an empty private cache,
    while the training thread trains: the time per sample, less ``bytes / bandwidth``, is what the
    cache insert, the loader's own work and its wait for the interpreter add to each miss.
    """
    import numpy as np

    from ..cache import CachedDataset, HDF5Source, ShmCache, ThrottledSource

    ds = spec.dataset
    if not ds.throttle or ds.format != "hdf5":
        return 0.0
    name = f"hpcstagger-calibrate-miss-{os.getpid()}"
    source = ThrottledSource(HDF5Source(ds.path, ds.name), [ds.throttle[0]], shared_name=name)
    cache = ShmCache(name, 1 << 30)
    try:
        dataset = CachedDataset(source, cache)
        order = np.random.default_rng(3).permutation(len(dataset))
        loader = _Prefetcher(dataset, prefetch)
        marks: list[tuple[float, int, int]] = []
        done, nbytes, t0 = 0, 0, time.perf_counter()
        for b in loader.epoch(order, batch):
            step(b)
            done += len(b)
            nbytes += sum(len(x) for x in b)
            marks.append((time.perf_counter(), done, nbytes))
            if marks[-1][0] - t0 >= seconds:
                break
        loader.close()
    finally:
        cache.destroy(force=True)
        source.unlink()
    if len(marks) < 4:
        return 0.0  # too few samples to tell
    # the second half of what was measured (the dataset may run out before ``seconds``)
    first = next(m for m in marks if m[0] >= (t0 + marks[-1][0]) / 2)
    last = marks[-1]
    count = max(1, last[1] - first[1])
    per_sample = (last[0] - first[0]) / count
    return max(0.0, per_sample - (last[2] - first[2]) / count / ds.throttle[0])


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcstagger.demo.job", description=__doc__)
    p.add_argument("--model", required=True, help="convnet or mlp")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--prefetch", type=int, default=64,
                   help="samples the loader reads ahead (default 64: two batches; the scenario's [loader] prefetch)")
    p.add_argument("--warmup", type=int, default=3, help="training steps on synthetic data while waiting (default 3)")
    return p.parse_args(argv)


def _get_ready(session: Any, spec: Any, model: Any, opt: Any, step: Callable[[list[bytes]], float],
               shape: tuple[int, int, int], *, batch: int, warmup: int) -> tuple[Any, float]:
    """Ready what the first step needs: (the checkpointer or None, the seconds it took).

    That is the checkpointer (collective over the job's ranks) with its snapshot buffers allocated
    and touched, and ``warmup`` training steps on synthetic data. It runs before the job waits for
    its planned start: a job that starts at once pays for this after the plan; a delayed job has it
    done when its delay ends.
    """
    import numpy as np

    t = time.perf_counter()
    ckpt = None
    if spec.checkpoint.every > 0:
        from hpcstagger.checkpoint import AsyncCheckpointer

        directory, staging = session.checkpoint_dir()
        ckpt = AsyncCheckpointer(directory, comm=session.comm, keep=spec.checkpoint.keep, staging_dir=staging)
        ckpt.prepare({"model": model, "optimizer": opt})
    fake = np.random.default_rng(1).integers(0, 255, size=(batch, 1 + int(np.prod(shape))), dtype=np.uint8)
    fake[:, 0] %= 10
    for _ in range(warmup):
        step([row.tobytes() for row in fake])
    return ckpt, time.perf_counter() - t


def _train(session: Any, dataset: Any, epochs: int, model: Any, opt: Any, step: Callable[[list[bytes]], float],
           ckpt: Any, *, every: int, batch: int,
           prefetch: int) -> tuple[int, int, int, list[float], list[float]]:
    """Train ``epochs`` epochs in a random order each, saving a checkpoint every ``every`` steps.

    Returns (samples, steps, checkpoints saved, wall seconds per epoch, CPU seconds per epoch).
    """
    import numpy as np

    loader = _Prefetcher(dataset, prefetch)
    rng = np.random.default_rng(1000 + session.job_index)
    steps, samples, saves, epoch_times = 0, 0, 0, []
    cpu = []
    for epoch in range(epochs):
        t = time.perf_counter()
        c0 = time.process_time()
        for b in loader.epoch(rng.permutation(len(dataset)), batch):
            step(b)
            steps += 1
            samples += len(b)
            if ckpt is not None and steps % every == 0:
                ckpt.save(steps, {"model": model, "optimizer": opt, "epoch": epoch, "step": steps})
                saves += 1
        epoch_times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c0)
        session.say(f"epoch {epoch + 1}/{epochs} took {epoch_times[-1]:.1f} s")
    loader.close()
    return samples, steps, saves, epoch_times, cpu


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's job: join the run, get ready while waiting out the planned delay, train, report."""
    args = _parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import hpcstagger
    from hpcstagger.cache import CachedDataset
    from hpcstagger.colocated.spec import Spec

    # Everything local to this job is built before joining the run: the plan's clock starts after.
    spec = Spec.from_toml(os.environ["HPCSTAGGER_SPEC"])
    c, h, w = (int(v) for v in os.environ.get("HPCSTAGGER_DEMO_SHAPE", "3,64,64").split(","))
    shape = (c, h, w)
    model, opt, step = make_step(args.model, shape, lr=args.lr)

    def calibration() -> dict[str, float]:
        return {"sample_time": measure_sample_time(step, shape, batch=args.batch, prefetch=args.prefetch),
                "miss_overhead": measure_miss_overhead(spec, step, batch=args.batch, prefetch=args.prefetch)}

    session = hpcstagger.init(spec, wait=False, calibration=calibration)
    job = spec.job(session.job)
    source = session.source()
    cache = session.cache()
    dataset = CachedDataset(source, cache) if cache is not None else source
    # While this job waits for its planned start, it readies what the first step needs.
    ckpt, ready_s = _get_ready(session, spec, model, opt, step, shape,
                               batch=args.batch, warmup=args.warmup)
    session.wait()
    session.start_backend()
    late = session.elapsed() - session.delay
    session.say(f"training {args.model}: {job.epochs} epoch(s) of {len(dataset)} samples "
                f"(ready {ready_s:.2f} s after the plan, started {late:.2f} s after its planned start)")
    samples, steps, saves, epoch_times, cpu = _train(session, dataset, job.epochs, model, opt, step, ckpt,
                                                     every=spec.checkpoint.every, batch=args.batch,
                                                     prefetch=args.prefetch)
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
