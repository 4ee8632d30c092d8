"""The training run of the crash-consistency test, run in processes forked from a forkserver.

Deterministic CPU training of a small MLP with Adam and dropout (so the RNG state matters) that
saves every ``save_every`` steps. The same function is the uninterrupted reference run, the run
killed at a random moment, and the resumed run, which loads the newest checkpoint and trains on.
Results go to a JSON file: digests of the state at every save (reference), of the state loaded
(resume), and of the final state.
"""

from __future__ import annotations

import json
import os

import h5py  # noqa: F401  (imported once in the forkserver, not in every child)
import torch
import torch._dynamo  # what Adam's first step would import (1-2 s)
import xxhash

import hpcstagger.checkpoint.checkpointer  # likewise
import hpcstagger.checkpoint.load  # noqa: F401  (likewise: preloaded in the forkserver)
from hpcstagger.checkpoint import AsyncCheckpointer, load, restore
from hpcstagger.errors import CheckpointError


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def digest(state) -> str:
    """xxh3 over every tensor's bytes and every plain value, in key order: equal iff bit-identical."""
    h = xxhash.xxh3_64()

    def walk(obj, path=""):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        else:
            h.update(f"{path}={obj!r};".encode())

    walk(state)
    return h.hexdigest()


def _state(model, opt, step):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}


def run(directory: str, out: str, *, steps: int, save_every: int, resume: bool, record: bool,
        progress=None) -> None:
    torch.set_num_threads(1)
    model, opt = model_and_optimizer()
    result: dict = {"saves": {}}
    start = 0
    if resume:
        try:
            state = load(directory)
        except CheckpointError:
            state = None
        result["loaded_step"] = None if state is None else state["step"]
        if state is not None:
            result["loaded_digest"] = digest(state)
            restore(state, model=model, optimizer=opt)
            torch.set_rng_state(state["rng"])
            start = state["step"] + 1
    ck = AsyncCheckpointer(directory, keep=3)
    for step in range(start, steps):
        if progress is not None:
            progress.value = step  # the test kills this process once it reaches a chosen step
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step % save_every == 0:
            if record:
                result["saves"][step] = digest(_state(model, opt, step))
            ck.save(step, {"model": model, "optimizer": opt, "step": step, "rng": torch.get_rng_state()})
    ck.close()
    result["final"] = digest(model.state_dict())
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out)
