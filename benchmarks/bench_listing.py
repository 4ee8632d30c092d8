#!/usr/bin/env python3
"""Listing a large directory dataset once per node: the first process against the later ones.

For each size (``--sizes``, default 10,000, 100,000 and 1,000,000 files of 16 bytes, ``--per-folder``
files per folder as in ImageNet's layout) a tree is written to a temporary directory on a local
disk (``--dir``, default the system's temporary directory; never /dev/shm) and, page cache warm:

- **first**: a new process builds ``DirectorySource(root)`` as a rank of a launched run does
  (``HPCSTAGGER_RUN_DIR`` set, a private shm root): it lists the tree with identities and writes
  the node's listing. The construction time is measured in the process (``seconds``), and the
  process's whole life from the outside (``wall``, with interpreter start and imports).
- **later**: ``--procs`` - 1 processes of the same run, started together after the first ended,
  build the same source from the node's listing; each one's construction time and wall time.
- **calls**: with ``strace -f -c -e trace=%%stat,getdents64,openat`` (``%%stat``: every call of the
  stat family; strace's ``%stat`` leaves out ``newfstatat`` and ``statx``) the system calls of a first
  process (of a new run) and of a later one, against a process that only imports hpcstagger (the
  floor every process pays); and with ``strace -f -y`` the later process's calls that name a path
  under the tree (its metadata calls on the tree: 0 is the target).
- **baselines**: ``os.walk`` over the tree (no stat at all: the floor of any listing) and
  ``pathlib.Path.glob("**/*")`` with ``is_file()`` (one stat per entry, no identities), in this
  process.

With ``--cold`` (root only) a first process of another run also lists the tree after the
kernel's dentry and inode caches are dropped (``/proc/sys/vm/drop_caches`` 2), as on a node that
has not seen the tree, and ``os.walk`` is timed after the same drop.

Targets it checks (construction times): 1,000,000 files listed with identities in at most 10 s
by the first process; every later process done in at most 1 s with no metadata call on the tree.
The trees and the shm root are removed afterwards, also after Ctrl-C (``--keep`` keeps the trees).

Usage: python benchmarks/bench_listing.py [--sizes 10000,100000,1000000] [--per-folder 1000] [--procs 4]
       [--dir DIR] [--keep] [--no-strace] [--cold] [--json benchmarks/out/bench_listing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STRACE = shutil.which("strace") or "/usr/bin/strace"
FIRST_TARGET_S, FIRST_TARGET_FILES, LATER_TARGET_S = 10.0, 1_000_000, 1.0
STAT_CALLS = {"stat", "lstat", "fstat", "newfstatat", "statx", "fstatat64", "stat64", "lstat64", "fstat64"}
RUN_VARS = ("HPCSTAGGER_RUN_DIR", "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "HPCSTAGGER_SHM_ROOT")

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from hpcstagger.cache import DirectorySource
t1 = time.perf_counter()
if sys.argv[1] != "-":
    src = DirectorySource(sys.argv[1])
    n = len(src)
else:
    n = 0
print(json.dumps({"seconds": time.perf_counter() - t1, "import_seconds": t1 - t0, "files": n}), flush=True)
"""


def make_tree(root: Path, files: int, per_folder: int) -> float:
    """Write ``files`` files of 16 bytes, ``per_folder`` per folder; return the seconds it took."""
    t = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for d in range((files + per_folder - 1) // per_folder):
        folder = root / f"n{d:05d}"
        folder.mkdir(parents=True)
        for f in range(d * per_folder, min(files, (d + 1) * per_folder)):
            fd = os.open(folder / f"{f:08d}.JPEG", flags, 0o644)
            os.write(fd, f.to_bytes(16, "little"))
            os.close(fd)
    return time.perf_counter() - t


def child_env(shm_root: str, run_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RUN_VARS}
    env.update(HPCSTAGGER_SHM_ROOT=shm_root, HPCSTAGGER_RUN_DIR=run_dir, PYTHONPATH=str(REPO))
    return env


def child(root: str, env: dict[str, str], cwd: str, strace: list[str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-c", CHILD, root]
    return subprocess.Popen([*(strace or []), *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, started: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"a listing process failed ({proc.returncode}): {err.strip()[-2000:]}")
    row = json.loads(out.strip().splitlines()[-1])
    row["wall"] = time.perf_counter() - started
    return row


def run_one(root: str, env: dict[str, str], cwd: str) -> dict[str, Any]:
    t = time.perf_counter()
    return finish(child(root, env, cwd), t)


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls per system call from the summary table of ``strace -c`` (pure, for tests)."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        # "% time  seconds  usecs/call  calls  [errors]  syscall"; the total line ends with "total"
        if len(parts) >= 5 and re.fullmatch(r"[\d.]+", parts[0]) and parts[-1] != "total":
            try:
                calls[parts[-1]] = calls.get(parts[-1], 0) + int(parts[3])
            except ValueError:
                continue
    return calls


def counted(root: str, env: dict[str, str], cwd: str, trace: Path) -> dict[str, int]:
    """strace -c of one process: stat-family, getdents64 and openat calls."""
    proc = child(root, env, cwd, [STRACE, "-f", "-c", "-e", "trace=%%stat,getdents64,openat", "-o", str(trace)])
    finish(proc, time.perf_counter())
    calls = parse_strace_summary(trace.read_text())
    return {"stat": sum(v for k, v in calls.items() if k in STAT_CALLS),
            "getdents64": calls.get("getdents64", 0), "openat": calls.get("openat", 0)}


def calls_on_tree(root: str, env: dict[str, str], cwd: str, trace: Path) -> int:
    """The calls of one process that name a path under ``root`` (or an fd open on one)."""
    proc = child(root, env, cwd, [STRACE, "-f", "-y", "-qq", "-e", "trace=%file,%%stat,getdents64", "-o", str(trace)])
    finish(proc, time.perf_counter())
    marks = tuple(r + end for r in {root, os.path.realpath(root)} for end in ("/", ">", '"'))
    with open(trace, errors="replace") as f:
        return sum(1 for line in f if any(m in line for m in marks))


def drop_metadata_caches() -> None:
    """Write back, then drop the kernel's dentry and inode caches (``drop_caches`` 2; root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")


def baselines(root: Path) -> dict[str, float]:
    t = time.perf_counter()
    n_walk = sum(len(files) for _, _, files in os.walk(root))
    walk = time.perf_counter() - t
    t = time.perf_counter()
    n_glob = sum(1 for p in root.glob("**/*") if p.is_file())
    glob = time.perf_counter() - t
    assert n_walk == n_glob
    return {"os.walk": walk, "pathlib glob + is_file": glob}


def measure(size: int, args: argparse.Namespace, work: Path, shm_root: str) -> dict[str, Any]:
    root = work / f"tree-{size}"
    cwd = str(work)
    print(f"{size} files: writing the tree ...", flush=True)
    made = make_tree(root, size, args.per_folder)
    env = child_env(shm_root, str(work / f"run-{size}-a"))
    first = run_one(str(root), env, cwd)
    t = time.perf_counter()
    procs = [child(str(root), env, cwd) for _ in range(args.procs - 1)]
    later = [finish(p, t) for p in procs]
    assert first["files"] == size and all(r["files"] == size for r in later), (first, later)
    row: dict[str, Any] = {"files": size, "per_folder": args.per_folder, "write_seconds": made,
                           "first": first, "later": later}
    if args.cold:  # a node that has not seen the tree: its dentries and inodes are read from the disk
        drop_metadata_caches()
        row["first_cold"] = run_one(str(root), child_env(shm_root, str(work / f"run-{size}-cold")), cwd)
        drop_metadata_caches()
        t = time.perf_counter()
        sum(len(files) for _, _, files in os.walk(root))
        row["os.walk_cold"] = time.perf_counter() - t
    if args.strace:
        env_b = child_env(shm_root, str(work / f"run-{size}-b"))
        floor_env = child_env(shm_root, str(work / "run-floor"))
        row["calls"] = {"import only": counted("-", floor_env, cwd, work / "floor.strace"),
                        "first": counted(str(root), env_b, cwd, work / "first.strace"),
                        "later": counted(str(root), env_b, cwd, work / "later.strace")}
        row["later_calls_on_tree"] = calls_on_tree(str(root), env_b, cwd, work / "later-paths.strace")
        for name in ("floor.strace", "first.strace", "later.strace", "later-paths.strace"):
            (work / name).unlink(missing_ok=True)
    row["baselines"] = baselines(root)
    row["targets"] = {
        "first <= 10 s at 1,000,000 files": None if size < FIRST_TARGET_FILES else first["seconds"] <= FIRST_TARGET_S,
        "later <= 1 s": all(r["seconds"] <= LATER_TARGET_S for r in later),
        "later: 0 calls on the tree": None if not args.strace else row["later_calls_on_tree"] == 0,
    }
    if not args.keep:
        shutil.rmtree(root)
    return row


def report(row: dict[str, Any]) -> None:
    later = row["later"]
    print(f"  first process: {row['first']['seconds']:.4f} s to build (wall {row['first']['wall']:.2f} s)")
    print(f"  later {len(later)} processes, together: " + ", ".join(f"{r['seconds']:.4f} s" for r in later)
          + f" (wall up to {max((r['wall'] for r in later), default=0):.2f} s)")
    if "calls" in row:
        for who, c in row["calls"].items():
            print(f"  calls, {who}: stat {c['stat']}, getdents64 {c['getdents64']}, openat {c['openat']}")
        print(f"  later process, calls naming a path under the tree: {row['later_calls_on_tree']}")
    if "first_cold" in row:
        print(f"  first process, dentry and inode caches dropped: {row['first_cold']['seconds']:.4f} s to build "
              f"(wall {row['first_cold']['wall']:.2f} s); os.walk after the same drop {row['os.walk_cold']:.3f} s")
    print("  baselines: " + ", ".join(f"{k} {v:.3f} s" for k, v in row["baselines"].items()))
    print("  targets: " + ", ".join(f"{k}: {'-' if v is None else 'met' if v else 'MISSED'}"
                                    for k, v in row["targets"].items()))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the finally below removes the trees


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="files per tree, comma-separated")
    ap.add_argument("--per-folder", type=int, default=1000, help="files per folder (default 1000)")
    ap.add_argument("--procs", type=int, default=4, help="processes per run: the first and N-1 later (default 4)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the trees go (a local disk, not /dev/shm)")
    ap.add_argument("--keep", action="store_true", help="keep the trees (their folder is printed)")
    ap.add_argument("--no-strace", dest="strace", action="store_false", help="skip the system-call counts")
    ap.add_argument("--cold", action="store_true", help="also time a first process after the kernel's dentry and "
                    "inode caches are dropped, as on a node that has not seen the tree (root only)")
    ap.add_argument("--json", default=str(HERE / "out" / "bench_listing.json"), help="where to write the results")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if os.path.realpath(args.dir).startswith("/dev/shm"):
        ap.error("--dir must be on a disk: the point is a file system's metadata calls, not tmpfs's")
    if args.cold and os.geteuid() != 0:
        ap.error("--cold drops the kernel's dentry and inode caches, which needs root; leave it out")
    if args.strace and not os.path.exists(STRACE):
        ap.error(f"{STRACE} not found: install strace, or pass --no-strace")
    signal.signal(signal.SIGTERM, _interrupt)
    out: dict[str, Any] = {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "dir": os.path.realpath(args.dir), "procs": args.procs, "sizes": []}
    work = Path(tempfile.mkdtemp(prefix="bench-listing-", dir=args.dir))
    shm_root = tempfile.mkdtemp(prefix="bench-listing-", dir="/dev/shm")
    try:
        for size in sizes:
            row = measure(size, args, work, shm_root)
            report(row)
            out["sizes"].append(row)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        if args.keep:
            print(f"kept the trees in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
