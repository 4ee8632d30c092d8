"""One job's first epoch on the kernel-throttled ext4 of bench_userjobs.py: shuffled against file order.

    python benchmarks/userjobs/epoch1.py [--repeat 2] [--samples 3072] [--bps 6e6]   (root)

The dataset (samples of 3 KiB, as bench_userjobs.py makes it) lies on an ext4 image on a loop
device whose reads a cgroup v1 blkio throttle limits to ``--bps``. Each case runs one epoch of a
DataLoader over ``CachedDataset(HDF5Source)`` with train.py's decode and model (torch at 1
thread), from a cold page cache and an empty ShmCache, in a process of the throttled cgroup. It
prints, per case, the epoch's wall time, the bytes the loop device read and the main process's CPU
time, and writes them to benchmarks/out/epoch1.json.

The cases separate the first epoch's terms: reading alone (no model), the model with 0, 2 and 4
workers in a shuffled order, and the model with 2 workers in file order. Where reading and
computing overlap, the epoch takes the longer of the two; where they do not, their sum.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = [(0, "none", "shuffled"), (2, "none", "shuffled"), (0, "cnn", "shuffled"), (2, "cnn", "shuffled"),
         (4, "cnn", "shuffled"), (2, "cnn", "file order")]


def one_epoch(path: str, device: str, workers: int, model_name: str, order: str, cache_name: str) -> dict:
    """Child process, inside the throttled cgroup: one epoch; its figures."""
    import torch
    import torch.nn as nn

    sys.path.insert(0, str(HERE))
    from train import Decode, build

    from hpcstagger.cache import CachedDataset, HDF5Source, ShmCache

    torch.set_num_threads(1)
    source = HDF5Source(path, "samples")
    cache = ShmCache(cache_name, 2 * len(source) * len(bytes(source[0])))
    try:
        dataset = CachedDataset(source, cache, transform=Decode(32, flip=True))
        sampler = (torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
                   if order == "shuffled" else None)
        loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=workers)
        model = None if model_name == "none" else build(model_name, 32)
        opt = None if model is None else torch.optim.SGD(model.parameters(), lr=0.05)

        def sectors() -> int:
            with open(f"/sys/block/{device}/stat") as f:
                return int(f.read().split()[2])

        s0, t0, c0 = sectors(), time.perf_counter(), time.process_time()
        for images, labels in loader:
            if model is not None and opt is not None:
                opt.zero_grad()
                nn.functional.cross_entropy(model(images), labels).backward()
                opt.step()
        return {"workers": workers, "model": model_name, "order": order,
                "epoch_s": time.perf_counter() - t0, "device_bytes": (sectors() - s0) * 512,
                "main_cpu_s": time.process_time() - c0}
    finally:
        cache.destroy(force=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2, help="runs of every case (interleaved)")
    p.add_argument("--samples", type=int, default=3072, help="dataset samples of 3 KiB (default 3072, ~9.4 MB)")
    p.add_argument("--bps", type=float, default=6.0e6, help="the throttle, bytes/s (default 6e6)")
    p.add_argument("--out", default=str(HERE.parent / "out" / "epoch1.json"))
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        path, device, workers, model, order, name = args.child
        print(json.dumps(one_epoch(path, device, int(workers), model, order, name)), flush=True)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("epoch1.py needs root: it mounts a loop device and writes a blkio cgroup")
    sys.path.insert(0, str(HERE.parent))
    import bench_userjobs as bu

    from hpcstagger._io import drop_cached_pages

    rows = []
    with bu.workspace("epoch1", args.samples, False) as (root, data):
        with bu.real_fs(data, args.bps, root) as (path, cg):
            source = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path.parent)], capture_output=True,
                                    text=True, check=True).stdout.strip()
            device = os.path.basename(source)
            join = bu.cgroup_joiner(cg)

            for rep in range(args.repeat):
                for i, (workers, model, order) in enumerate(CASES):
                    drop_cached_pages(path)
                    argv = [sys.executable, __file__, "--child", str(path), device, str(workers), model, order,
                            f"epoch1-{os.getpid()}-{rep}-{i}"]
                    res = subprocess.run(argv, preexec_fn=join, capture_output=True, text=True, timeout=300,
                                         env=dict(os.environ, PYTHONPATH=str(HERE.parent.parent)))
                    if res.returncode != 0:
                        raise SystemExit(f"case {workers} workers, {model}, {order} failed: {res.stderr[-2000:]}")
                    row = dict(json.loads(res.stdout.strip().splitlines()[-1]), repeat=rep)
                    rows.append(row)
                    print(f"{workers} workers, model {model:4s}, {order:10s}: epoch {row['epoch_s']:.2f} s, "
                          f"device read {row['device_bytes'] / 1e6:.2f} MB, main CPU {row['main_cpu_s']:.2f} s",
                          flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "epoch1", "command": " ".join(sys.argv), "samples": args.samples, "bps": args.bps,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
