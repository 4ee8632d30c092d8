"""An MPI job over a partitioned cache, run by the tests under mpiexec or srun.

    python partitioned_job.py OUT_DIR ROOT [--epochs N] [--samples K] [--kill RANK:EPOCH] [--stop RANK:EPOCH]
                              [--corrupt]

Every rank reads its share of K deterministic samples (``cache_util.sample``) per epoch, in an
order reshuffled every epoch as a DistributedSampler would, through a ``CachedDataset`` over a
``PartitionedCache`` of capacity 1/nodes of the dataset (a little more). It compares every sample
with the source's bytes and writes ``OUT_DIR/<rank>.json``: per epoch the source reads, the wrong
samples and the seconds, then the cache's counters and the dead nodes. ``--kill R:E`` makes rank R
SIGKILL itself half way through epoch E; ``--stop R:E`` makes it SIGSTOP itself there instead (a hung
node), after writing its pid to ``OUT_DIR/stopped.pid`` for the test to kill. ``--corrupt`` flips
one payload byte of every entry in node 1's arena after the first epoch (every rank then checks that
no wrong byte came back).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.cache_util import sample


class CountingSource:
    """K deterministic samples; counts the reads that reach it (the emulated shared file system)."""

    def __init__(self, n: int, size: int):
        self.n, self.size, self.reads = n, size, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        self.reads += 1
        return sample(i, self.size, self.size)

    def key(self, i: int) -> str:
        return f"sample-{i}"


def corrupt_arena(root: str, name: str) -> int:
    """Flip the last byte of every entry's payload in the cache's current arena; returns how many."""
    from hpcstagger.cache import ShmCache

    cache = ShmCache(name, None, root=root)
    index, _, gen = cache.regions()
    path = os.path.join(root, name, f"arena.{gen}")
    flipped = 0
    fd = os.open(path, os.O_RDWR)
    try:
        for i in range(len(index) // 32):
            hi, lo, off, meta = (int.from_bytes(index[i * 32 + j:i * 32 + j + 8], "little") for j in (0, 8, 16, 24))
            if (hi or lo) and meta >> 56 == 1:
                at = off + 64 + (meta & ((1 << 56) - 1)) - 1
                b = os.pread(fd, 1, at)
                os.pwrite(fd, bytes([b[0] ^ 0xFF]), at)
                flipped += 1
    finally:
        os.close(fd)
    cache.close()
    return flipped


def _alive(pid: int) -> bool:
    """Whether process ``pid`` on this host still runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("root")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--size", type=int, default=20_000)
    ap.add_argument("--kill", default="")
    ap.add_argument("--stop", default="")
    ap.add_argument("--corrupt", action="store_true")
    args = ap.parse_args()
    from hpcstagger.cache import CachedDataset, PartitionedCache
    from hpcstagger.cache.nodes import discover
    from hpcstagger.comm import Comm

    comm = Comm.world()
    pids = comm.allgather(os.getpid())  # the ranks share this host in every test
    source = CountingSource(args.samples, args.size)
    layout_nodes = discover(comm).count
    capacity = int(args.samples * args.size / layout_nodes * 1.3)
    cache = PartitionedCache("part", capacity, comm, root=args.root, max_entries=4 * args.samples)
    data = CachedDataset(source, cache)
    fault = args.kill or args.stop
    kill_rank, kill_epoch = (int(x) for x in fault.split(":")) if fault else (-1, -1)
    report: dict = {"rank": comm.rank, "node": cache.layout.node, "nodes": layout_nodes, "root": cache.root,
                    "epochs": []}
    for epoch in range(args.epochs):
        order = list(range(args.samples))
        random.Random(epoch).shuffle(order)
        mine = order[comm.rank::comm.size]
        before, wrong, t = source.reads, 0, time.perf_counter()
        for j, i in enumerate(mine):
            if comm.rank == kill_rank and epoch == kill_epoch and j == len(mine) // 2:
                if args.stop:
                    Path(args.out, "stopped.pid").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP if args.stop else signal.SIGKILL)
            wrong += data[i] != sample(i, args.size, args.size)
        report["epochs"].append({"source_reads": source.reads - before, "wrong": wrong, "reads": len(mine),
                                 "seconds": time.perf_counter() - t})
        if kill_rank < 0:
            comm.barrier()  # every insert is sent before the next epoch starts...
            for _ in range(50):
                cache.progress()  # ...and taken in
                time.sleep(0.002)
            comm.barrier()
        if args.corrupt and epoch == 0:
            if cache.layout.node == 1 and comm.rank == cache.layout.local_ranks()[0]:
                report["flipped"] = corrupt_arena(cache.root, "part")
            comm.barrier()
    report["stats"] = {k: v for k, v in cache.stats().items() if isinstance(v, (int, float, list))}
    report["dead_nodes"] = sorted(cache.dead_nodes)
    out = Path(args.out, f"{comm.rank}.json")
    out.with_suffix(".tmp").write_text(json.dumps(report))
    out.with_suffix(".tmp").rename(out)
    if kill_rank >= 0:
        # A launcher may end the others soon after a rank dies (Hydra's proxy does at its next event,
        # such as a rank's exit: docs/partitioned.md). So every rank lingers, bounded, until each
        # other rank but the victim has reported or ended.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                r == kill_rank or Path(args.out, f"{r}.json").exists() or not _alive(pid)
                for r, pid in enumerate(pids)):
            time.sleep(0.05)
    t = time.monotonic()
    # Where close() ever hangs, the stacks say where (a test's failure message shows the file).
    stacks = open(Path(args.out, f"{comm.rank}.stack"), "w")
    faulthandler.dump_traceback_later(30, file=stacks)
    cache.close()
    faulthandler.cancel_dump_traceback_later()
    stacks.close()
    Path(args.out, f"{comm.rank}.closed").write_text(f"{time.monotonic() - t:.3f}")


if __name__ == "__main__":
    main()
