"""One trial of a hyper-parameter sweep, written the way PyTorch users write it, for the end-to-end
benchmark (benchmarks/bench_sweep_e2e.py).

The data is a torchvision ImageFolder of JPEG files, decoded by PIL in DataLoader worker
processes, with a random resized crop and a flip; the model a small CNN; SGD whose learning rate
is the swept parameter; a checkpoint of model and optimizer every ``--ckpt-every`` steps.

    python trial.py --data DIR --lr 0.05 --mode plain --ckpt torch      # what users run today
    python trial.py --data DIR --lr 0.05 --mode plain --ckpt dcp        # ... with DCP async_save
    python trial.py --lr 0.05 --mode hpcstagger --ckpt async            # from a job spec (hpcstagger launch)
    python trial.py --data DIR --lr 0.05 --device cuda:0                  # the model on a GPU

``--device cuda:N`` trains on that GPU: the plain DataLoader pins its batches and each batch is copied
to the device, as users write it; in hpcstagger mode ``session.data_loader(..., device=...)`` delivers
the batches there. Trials that share a GPU are separate processes, each with its own CUDA context.

``--mode plain`` imports nothing of hpcstagger. ``--mode hpcstagger`` is the same script with the
documented lines changed: ``hpcstagger.init()``, ImageFolder's ``loader`` reading through the node's
cache (``session.cache().file_loader()``; no cache when the spec's capacity is 0),
``session.data_loader`` for the DataLoader (a shared loader where the spec says so),
``session.loader(...)`` around the loop, ``AsyncCheckpointer`` for ``--ckpt async`` and
``session.finish()``. ``--report FILE`` writes what the trial measured of itself (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import sys
from pathlib import Path

import torch
import torch.nn as nn

T_START = time.time()

try:
    from torchvision import datasets, transforms
except RuntimeError:
    # PyPI's x86_64 torchvision wheels are CUDA builds whose operator library does not load beside
    # the CPU torch; the tests' shim defines the two operators' schemas so that the pure-Python
    # parts (datasets, transforms) import (tests/support/torchvision_cpu.py)
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
    import torchvision_cpu  # noqa: F401

    from torchvision import datasets, transforms
T_IMPORTED = time.time()  # the imports both modes share end here: later times compare plain and hpcstagger


def build_model(classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, classes))


def augment() -> transforms.Compose:
    return transforms.Compose([transforms.RandomResizedCrop(32, scale=(0.5, 1.0), antialias=True),
                               transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                               transforms.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])


class TorchSave:
    """What most scripts do: ``torch.save`` of the state, over the last one, blocking."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "checkpoint.pt")

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, self.path)

    def close(self) -> None:
        pass


class DcpAsync:
    """torch.distributed.checkpoint.async_save, one directory per step; a save waits for the last
    one to finish first (the pattern DCP's documentation shows)."""

    def __init__(self, directory: str):
        import torch.distributed.checkpoint as dcp

        self.dcp, self.directory, self.pending = dcp, directory, None

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if self.pending is not None:
            self.pending.result()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        self.pending = self.dcp.async_save(state, checkpoint_id=os.path.join(self.directory, f"step-{step}"),
                                           no_dist=True)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()


class Async:
    """hpcstagger's AsyncCheckpointer: a snapshot now, written in the background."""

    def __init__(self, options: dict):
        from hpcstagger import AsyncCheckpointer

        self.ck = AsyncCheckpointer(**options)

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.ck.save(step, {"model": model, "optimizer": opt, "step": step})

    def close(self) -> None:
        self.ck.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="the ImageFolder root (plain mode; a spec's [dataset] path otherwise)")
    p.add_argument("--mode", choices=("plain", "hpcstagger"), default="plain")
    p.add_argument("--lr", type=float, default=0.05, help="the swept parameter")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt", choices=("torch", "dcp", "async", "none"), default="torch")
    p.add_argument("--ckpt-dir", default="checkpoints", help="where checkpoints go (plain mode; the spec's otherwise)")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the model trains: cpu (default) or cuda:N")
    p.add_argument("--report", help="write this trial's times, CPU seconds and peak RSS here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"

    session, import_s = None, 0.0
    if args.mode == "hpcstagger":
        t = time.time()
        import hpcstagger

        import_s = time.time() - t  # what importing hpcstagger took

        session = hpcstagger.init()  # which trial this is, the planned start, the cache and loader of the spec
        assert session.spec is not None, "--mode hpcstagger runs from a job spec (hpcstagger launch)"
        cache = session.cache()
        root = session.spec.dataset.path
        folder = datasets.ImageFolder(root, transform=augment(),
                                      **({"loader": cache.file_loader()} if cache is not None else {}))
        loader = session.data_loader(folder, args.batch, shuffle=True, num_workers=args.workers,
                                     persistent_workers=args.workers > 0, **({"device": args.device} if on_gpu else {}))
        batches = session.loader(loader)
    else:
        folder = datasets.ImageFolder(args.data, transform=augment())
        loader = torch.utils.data.DataLoader(folder, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                             persistent_workers=args.workers > 0, pin_memory=on_gpu)
        batches = loader
    model = build_model(len(folder.classes)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.ckpt == "async":
        saver = Async(session.checkpoint_options() if session is not None else {"directory": args.ckpt_dir})
    elif args.ckpt == "dcp":
        saver = DcpAsync(args.ckpt_dir)
    elif args.ckpt == "torch":
        saver = TorchSave(args.ckpt_dir)
    t_loop, step, loss = time.time(), 0, torch.zeros(())
    for _ in range(args.epochs):
        for images, labels in batches:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            opt.step()
            step += 1
            if args.ckpt != "none" and step % args.ckpt_every == 0:
                saver.save(step, model, opt)
    if on_gpu:
        torch.cuda.synchronize(device)
    if args.ckpt != "none":
        saver.close()
    del loader, batches  # the DataLoader's workers end here, so their CPU time is counted below
    t_end = time.time()
    if session is not None:
        session.finish(loss=loss.item())
    if args.report:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        report = {"start": T_START, "imported": T_IMPORTED, "loop": t_loop, "end": t_end, "steps": step,
                  "loss": loss.item(), "lr": args.lr, "device": str(device),
                  "hpcstagger_imported": "hpcstagger" in sys.modules,
                  "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "maxrss_bytes": me.ru_maxrss * 1024, "children_maxrss_bytes": kids.ru_maxrss * 1024}
        if session is not None:  # when hpcstagger.init returned (its t0) and what each of its steps took
            report.update(t0=session.t0, import_s=import_s, init_timings=dict(session.timings))
        with open(args.report + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(args.report + ".tmp", args.report)


if __name__ == "__main__":
    main()
