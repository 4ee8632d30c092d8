"""Read WebDataset tar shards through the node's cache: python examples/webdataset_shards.py SHARD_DIR

A webdataset pipeline (shards split over DataLoader workers, a shuffle buffer) whose shards are
opened through a ShmCache: each shard is read from the file system once per node while the cache
holds it; later epochs, and every other process or job on the node that names the same cache, read
it from /dev/shm. Per epoch it prints the samples read, a digest of their bytes (the same for any
order), the shards read from the file system (the cache's misses) and those read from the cache.
``--make N`` first writes N small shards of synthetic samples into SHARD_DIR.
"""

import argparse
import glob
import hashlib
import os

import torch
import webdataset as wds

from hpcstagger.cache import ShmCache, shard_samples


def make_shards(directory: str, shards: int, per_shard: int = 16) -> None:
    """Write ``shards`` tar shards of ``per_shard`` samples (``.bin`` bytes and a ``.cls`` label)."""
    os.makedirs(directory, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(os.path.join(directory, f"train-{s:04d}.tar")) as sink:
            for k in range(per_shard):
                seed = hashlib.sha256(f"{s}-{k}".encode()).digest()
                sink.write({"__key__": f"s{s:04d}-{k:04d}", "bin": seed * (8 + k), "cls": str(k % 10).encode()})


def digest(samples: list[dict]) -> str:
    """A digest of the samples' keys and bytes, in key order."""
    h = hashlib.sha256()
    for sample in sorted(samples, key=lambda x: x["__key__"]):
        for field in sorted(f for f in sample if not f.startswith("__")):
            h.update(f"{sample['__key__']}.{field}".encode() + bytes(sample[field]))
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shard_dir", help="directory of .tar shards")
    p.add_argument("--epochs", type=int, default=2, help="epochs to read (default 2)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--cache", default="shards", help="the node cache's name (default shards)")
    p.add_argument("--capacity-mb", type=int, default=256, help="its capacity in MiB when created (default 256)")
    p.add_argument("--shuffle", type=int, default=100, help="shuffle buffer, in samples (default 100)")
    p.add_argument("--make", type=int, default=0, metavar="N", help="first write N small shards into shard_dir")
    args = p.parse_args()
    if args.make:
        make_shards(args.shard_dir, args.make)
    urls = sorted(glob.glob(os.path.join(args.shard_dir, "*.tar")))
    if not urls:
        raise SystemExit(f"no .tar shards in {args.shard_dir} (write some with --make N)")
    cache = ShmCache(args.cache, args.capacity_mb << 20)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        shard_samples(cache),  # in place of wds.tarfile_to_samples(): each shard opened through the cache
        wds.shuffle(args.shuffle),
    )
    loader = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=args.workers,
                                         persistent_workers=args.workers > 0)
    for epoch in range(args.epochs):
        before = cache.stats()
        samples = list(loader)
        after = cache.stats()
        distinct = len({s["__key__"] for s in samples})
        print(f"epoch {epoch}: {len(samples)} samples ({distinct} distinct), digest {digest(samples)}, "
              f"shards from the file system {after['misses'] - before['misses']}, "
              f"from the cache {after['hits'] - before['hits']}")


if __name__ == "__main__":
    main()
