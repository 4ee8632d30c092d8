#!/usr/bin/env python3
"""Stale samples after a dataset changes, the cost of keying samples by their identity, and the
cost of listing a large directory. All measurements come from one run.

(a) Stale samples: for each kind of change to a dataset (files rewritten in place, replaced by
    rename, grown, shrunk, the directory regenerated, HDF5 files regenerated or written in place,
    mtimes restored afterwards, ...), a first job reads every sample through a ``CachedDataset``
    and fills the shared cache; the data is changed; a new job with the same cache name then reads
    every sample through a DataLoader with workers. A sample is stale when it differs from the
    bytes on disk. Each job is its own process (``--inproc`` runs them in this process, faster).
(b) The hit path through ``CachedDataset`` (key, lookup, verified view, bytes): a
    ``DirectorySource`` keyed by path and identity against the same source keyed by path alone
    (what the key was before identities), over the same samples in the same order, interleaved.
(c) Listing a directory of ``--files`` files (100 folders): ``DirectorySource`` (scandir, one stat
    per file, identities) against ``pathlib.Path.glob`` with ``is_file()``, the listing before
    identities, and against ``os.walk`` with no stat at all (the floor), page cache warm.

Usage: python benchmarks/bench_stale.py [--parts abc] [--inproc] [--path-keys] [--files N] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

N_FILES = 48       # samples per dataset in (a)
SIZE = 3000        # bytes per sample in (a)
TICK = 0.05        # seconds between a read and a change: more than any local file system's timestamp tick


# ---------------------------------------------------------------- (a) the datasets and their changes
def _payload(tag: str, i: int, size: int = SIZE) -> bytes:
    seed = hashlib.sha256(f"{tag}:{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def make_dir(root: Path, tag: str = "v1") -> None:
    for i in range(N_FILES):
        p = root / f"c{i % 4}" / f"{i:03d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_payload(tag, i))


def make_h5(path: Path, tag: str = "v1", rows: int = N_FILES, dtype: str = "uint8") -> None:
    import h5py
    import numpy as np

    data = np.stack([np.frombuffer(_payload(tag, i), dtype=np.uint8) for i in range(rows)]).view(dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, maxshape=(None,) + data.shape[1:])


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.bin"))


def _in_place(p: Path, data: bytes) -> None:
    with open(p, "r+b") as f:
        f.write(data)


def _rename_over(p: Path, data: bytes) -> None:
    tmp = p.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, p)


def _keep_mtime(p: Path, change: Callable[[], None]) -> None:
    st = os.stat(p)
    change()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def _h5_rows_in_place(path: Path, rows: range, keep_mtime: bool = False) -> None:
    import h5py
    import numpy as np

    st = os.stat(path)
    with h5py.File(path, "r+") as f:
        for i in rows:
            f["x"][i] = np.frombuffer(_payload("v2", i), dtype=np.uint8)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _regen_dir(root: Path) -> None:
    shutil.rmtree(root)
    make_dir(root, "v2")


def _rewrite_all(root: Path) -> None:
    for i, p in enumerate(_files(root)):
        _in_place(p, _payload("v2", i))


def _grow(root: Path) -> None:
    with open(_files(root)[3], "ab") as f:
        f.write(b"tail")


def _h5_grow(path: Path) -> None:
    import h5py
    import numpy as np

    with h5py.File(path, "r+") as f:
        f["x"].resize(N_FILES + 4, axis=0)
        f["x"][0] = np.frombuffer(_payload("v2", 0), dtype=np.uint8)


def _h5_rename_over(path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    make_h5(tmp, "v2")
    os.replace(tmp, path)


# Each case: (name, kind, change(dataset path)). Directory cases change files under the root; HDF5
# cases change the file. Every change keeps the sample count and size unless it says otherwise.
CASES: list[tuple[str, str, Callable[[Path], None]]] = [
    ("dir: one file rewritten in place", "dir", lambda r: _in_place(_files(r)[5], _payload("v2", 5))),
    ("dir: every file rewritten in place", "dir", _rewrite_all),
    ("dir: file replaced by rename", "dir", lambda r: _rename_over(_files(r)[7], _payload("v2", 7))),
    ("dir: file grown", "dir", _grow),
    ("dir: file shrunk", "dir", lambda r: os.truncate(_files(r)[4], SIZE // 2)),
    ("dir: whole directory regenerated", "dir", _regen_dir),
    ("dir: rewritten in place, mtime restored", "dir",
     lambda r: _keep_mtime(_files(r)[9], lambda: _in_place(_files(r)[9], _payload("v2", 9)))),
    ("dir: replaced by rename, mtime restored", "dir",
     lambda r: _keep_mtime(_files(r)[2], lambda: _rename_over(_files(r)[2], _payload("v2", 2)))),
    ("hdf5: regenerated, same shape", "h5", lambda p: make_h5(p, "v2")),
    ("hdf5: rows rewritten in place", "h5", lambda p: _h5_rows_in_place(p, range(0, N_FILES, 3))),
    ("hdf5: rows rewritten, mtime restored", "h5", lambda p: _h5_rows_in_place(p, range(1, 9), keep_mtime=True)),
    ("hdf5: replaced by rename", "h5", _h5_rename_over),
    ("hdf5: grown (rows appended, row 0 changed)", "h5", _h5_grow),
]

def path_keys() -> None:
    """Key samples as sources did before identities (the path, the dataset and row), to show what
    this benchmark sees when a cache serves stale data (``--path-keys``)."""
    from hpcstagger.cache import sources

    sources.DirectorySource.key = lambda self, i: "file:" + self.path(i)  # type: ignore[method-assign]
    sources.HDF5Source.key = lambda self, i: f"h5:{self.path}:{self.dataset}:{i}"  # type: ignore[method-assign]


_JOB = r"""
import hashlib, json, os, sys
import torch.utils.data
from hpcstagger.cache import CachedDataset, DirectorySource, HDF5Source, ShmCache
if os.environ.get("BENCH_STALE_PATH_KEYS"):
    sys.path.insert(0, os.environ["BENCH_STALE_PATH_KEYS"])
    import bench_stale
    bench_stale.path_keys()
kind, path, root, out = sys.argv[1:5]
source = DirectorySource(path) if kind == "dir" else HDF5Source(path, "x")
cache = ShmCache("stale-bench", 64 << 20, root=root)
ds = CachedDataset(source, cache, transform=lambda b: hashlib.sha256(bytes(b)).hexdigest())
loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
digests = [d for batch in loader for d in batch]
json.dump({"digests": digests, "keys": [source.key(i) for i in range(len(source))]}, open(out, "w"))
"""


def _job(kind: str, path: Path, root: str, out: Path, inproc: bool) -> list[str]:
    """One job reading every sample through the cache: the sha256 of each sample it got."""
    if not inproc:
        subprocess.run([sys.executable, "-c", _JOB, kind, str(path), root, str(out)], check=True, timeout=300)
        return json.loads(out.read_text())["digests"]
    import torch.utils.data

    from hpcstagger.cache import CachedDataset, DirectorySource, HDF5Source, ShmCache

    source = DirectorySource(path) if kind == "dir" else HDF5Source(str(path), "x")
    cache = ShmCache("stale-bench", 64 << 20, root=root)
    try:
        ds = CachedDataset(source, cache, transform=lambda b: hashlib.sha256(bytes(b)).hexdigest())
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
        return [d for batch in loader for d in batch]
    finally:
        cache.close()


def _truth(kind: str, path: Path) -> list[str]:
    """The sha256 of every sample as it is on disk now, read without any cache."""
    if kind == "dir":
        files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda q: q.relative_to(path).as_posix())
        return [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    import h5py

    with h5py.File(path, "r") as f:
        return [hashlib.sha256(row.tobytes()).hexdigest() for row in f["x"][:]]


def _differ(got: list[str], truth: list[str]) -> int:
    """Samples that differ, a missing or extra one counting as differing."""
    return sum(1 for a, b in zip(got, truth, strict=False) if a != b) + abs(len(got) - len(truth))


def run_case(name: str, kind: str, change: Callable[[Path], None], work: Path, inproc: bool) -> dict[str, Any]:
    """One case in ``work`` (emptied first) with its own cache root: a job, the change, a new job."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = tempfile.mkdtemp(prefix="hpcs-stale-", dir="/dev/shm")
    try:
        path = work / "data"
        if kind == "dir":
            make_dir(path)
        else:
            path = work / "data.h5"
            make_h5(path)
        first = _job(kind, path, root, work / "first.json", inproc)
        time.sleep(TICK)
        change(path)
        second = _job(kind, path, root, work / "second.json", inproc)
        truth = _truth(kind, path)
        stale = _differ(second, truth)
        changed = _differ(first, truth)
        return {"case": name, "samples": len(truth), "changed": changed, "stale": stale}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def part_a(inproc: bool) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcs-stale-") as tmp:
        for name, kind, change in CASES:
            rows.append(run_case(name, kind, change, Path(tmp) / "case", inproc))
            r = rows[-1]
            print(f"  {r['case']:<46} samples {r['samples']:>3}  changed {r['changed']:>3}  stale {r['stale']:>3}",
                  flush=True)
    return rows


# ---------------------------------------------------------------- (b) the hit path
def part_b(reps: int = 7, n: int = 2000) -> dict[str, Any]:
    from hpcstagger.cache import CachedDataset, DirectorySource, ShmCache

    class PathKeyed(DirectorySource):
        """The same source keyed by its path alone, as keys were before identities."""

        def key(self, i: int) -> str:
            return "file:" + self.path(i)

    with tempfile.TemporaryDirectory(prefix="hpcs-hit-") as tmp:
        for i in range(n):
            p = Path(tmp) / f"d{i % 20:02d}" / f"{i:05d}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(os.urandom(4096))
        root = tempfile.mkdtemp(prefix="hpcs-hit-", dir="/dev/shm")
        try:
            cache = ShmCache("hit", 64 << 20, root=root)
            sets = {"identity key": CachedDataset(DirectorySource(tmp), cache),
                    "path key": CachedDataset(PathKeyed(tmp), cache)}
            for ds in sets.values():
                for i in range(n):
                    ds[i]  # fill
            times: dict[str, list[float]] = {k: [] for k in sets}
            for _ in range(reps):
                for k, ds in sets.items():
                    t = time.perf_counter()
                    for i in range(n):
                        ds[i]
                    times[k].append((time.perf_counter() - t) / n * 1e6)
            cache.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"us_per_hit": med, "ratio": med["identity key"] / med["path key"], "samples": n, "bytes": 4096,
            "reps": reps, "all_us": times}


# ---------------------------------------------------------------- (c) listing
def part_c(nfiles: int, reps: int = 3) -> dict[str, Any]:
    from hpcstagger.cache import DirectorySource

    per = max(1, nfiles // 100)
    with tempfile.TemporaryDirectory(prefix="hpcs-list-", dir=os.environ.get("TMPDIR")) as tmp:
        for d in range(100):
            folder = Path(tmp) / f"c{d:03d}"
            folder.mkdir()
            for f in range(per):
                (folder / f"{f:05d}.jpg").write_bytes(b"x" * 64)

        def glob_is_file() -> int:
            base = Path(tmp)
            return len(sorted(p.relative_to(base).as_posix() for p in base.glob("**/*.jpg") if p.is_file()))

        def walk() -> int:
            return sum(len(f) for _, _, f in os.walk(tmp))

        ways: dict[str, Callable[[], int]] = {"DirectorySource": lambda: len(DirectorySource(tmp, "**/*.jpg")),
                                              "pathlib glob + is_file": glob_is_file, "os.walk, no stat": walk}
        times: dict[str, list[float]] = {k: [] for k in ways}
        counts = {}
        for _ in range(reps):
            for k, f in ways.items():
                t = time.perf_counter()
                counts[k] = f()
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"files": 100 * per, "seconds": med, "counts": counts, "reps": reps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--parts", default="abc", help="which parts to run (default: abc)")
    ap.add_argument("--inproc", action="store_true", help="(a): run both jobs in this process")
    ap.add_argument("--path-keys", action="store_true",
                    help="(a): key samples by path alone, as before identities (the cache then serves stale data)")
    ap.add_argument("--files", type=int, default=100_000, help="(c): files to list (default 100000)")
    ap.add_argument("--json", default=str(HERE / "out" / "bench_stale.json"), help="where to write the results")
    args = ap.parse_args()
    out: dict[str, Any] = {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    if args.path_keys:
        path_keys()
        os.environ["BENCH_STALE_PATH_KEYS"] = str(HERE)
    if "a" in args.parts:
        print("(a) stale samples after a change, new job with the same cache name"
              + (", samples keyed by path alone" if args.path_keys else ""))
        out["a"] = part_a(args.inproc)
        print(f"  total stale: {sum(r['stale'] for r in out['a'])} of {sum(r['samples'] for r in out['a'])} samples "
              f"({sum(r['changed'] for r in out['a'])} changed on disk)")
    if "b" in args.parts:
        b = out["b"] = part_b()
        print(f"(b) hit through CachedDataset, 4 KB: identity key {b['us_per_hit']['identity key']:.2f} us, "
              f"path key {b['us_per_hit']['path key']:.2f} us (ratio {b['ratio']:.3f})")
    if "c" in args.parts:
        c = out["c"] = part_c(args.files)
        print(f"(c) listing {c['files']} files: " + ", ".join(f"{k} {v:.2f} s" for k, v in c["seconds"].items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
