"""Real Horovod training with gated asynchronous checkpoints; run by test_ckpt_horovod.py as

    mpiexec -n N python tests/support/ckpt_hvd_job.py DIR NJOBS

The world is split into NJOBS co-located jobs, each with its own Horovod (``hvd.init(comm=...)``) and
its own checkpoint directory DIR/jobJ. Each job trains a small MLP on rank-dependent data (so the
all-reduce matters), saves sharded checkpoints over its ranks with the Horovod gate, checks that
the replicas agree, loads the last checkpoint, and checks that a model and optimizer restored from
it train on bit for bit like the originals. Rank 0 of each job writes DIR/report-jobJ.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from hpcstagger.checkpoint import AsyncCheckpointer, load, restore
from hpcstagger.checkpoint import ActivityGate
from hpcstagger.comm import Comm
from hpcstagger.integrations import horovod as hh


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))


def _train(model, opt, step, rank):
    g = torch.Generator().manual_seed(step * 100 + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def main(directory: str, njobs: int) -> None:
    torch.set_num_threads(1)
    world = Comm.world()
    job_id = world.rank % njobs
    job = world.split(job_id)
    hvd = hh.init(job)
    assert (hvd.size(), hvd.rank()) == (job.size, job.rank), (hvd.size(), hvd.rank(), job.size, job.rank)

    model = _model()
    gate = ActivityGate()
    opt = hh.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), gate=gate,
                                  named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    d = os.path.join(directory, f"job{job_id}")
    ck = AsyncCheckpointer(d, comm=job, gate=gate, keep=2)
    handles = []
    for step in range(12):
        _train(model, opt, step, job.rank)
        if step % 4 == 3:
            handles.append(ck.save(step, {"model": model, "optimizer": opt, "step": step}))
    ck.wait()
    assert gate.entered >= 12 and gate.count == 0, (gate.entered, gate.count)
    weights = job.allgather([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for w in weights for a, b in zip(w, weights[0], strict=True)), "replicas differ"

    state = load(d, comm=job)
    assert state["step"] == 11
    model2 = _model()
    opt2 = hh.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=1e-2), gate=gate,
                                   named_parameters=[("resumed." + n, p) for n, p in model2.named_parameters()])
    restore(state, model=model2, optimizer=opt2)
    for step in range(12, 15):
        _train(model, opt, step, job.rank)
        _train(model2, opt2, step, job.rank)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    ck.close()
    hvd.shutdown()
    if job.rank == 0:  # a file per job: two jobs' rank 0 printing could interleave on the launcher's stdout
        report = json.dumps({"job": job_id, "size": job.size, "resumed_equal": same, "gate_entered": gate.entered,
                             "chunks": sum(h.stats.get("chunks", 0) for h in handles),
                             "steps": sorted(os.listdir(d))})
        path = os.path.join(directory, f"report-job{job_id}.json")
        with open(path + ".tmp", "w") as f:
            f.write(report)
        os.replace(path + ".tmp", path)
    job.free()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
