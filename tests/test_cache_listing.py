"""A directory dataset listed once per node and run, shared through the shm root, and file lists.

The processes here are real and separate (subprocesses, or forked ones), each with the test's
private shm root; a later process's silence on the dataset's tree is shown with strace and by
taking the tree away.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpcstagger.cache import DirectorySource
from hpcstagger.cache import _listing, _nodelisting
from hpcstagger.cache._nodelisting import LISTINGS, run_identity
from hpcstagger.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
STRACE = shutil.which("strace")
FORK = mp.get_context("fork")
RUN_VARS = ("HPCSTAGGER_RUN_DIR", "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID")

CHILD = r"""
import json, sys
from hpcstagger.cache import DirectorySource
kw = json.loads(sys.argv[2])
try:
    src = DirectorySource(sys.argv[1], **kw)
    out = {"root": src.root, "files": src.files, "keys": [src.key(i) for i in range(len(src))]}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out), flush=True)
if len(sys.argv) > 3:
    sys.stdin.readline()  # hold the listing until told to exit
"""


@pytest.fixture(autouse=True)
def _no_run_in_env(monkeypatch):
    """Tests name their runs themselves; the suite may run inside a Slurm job or torchrun."""
    for var in RUN_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    for fd in _nodelisting._held.values():  # what this process held open
        os.close(fd)
    _nodelisting._held.clear()


def make_tree(root: Path, folders: int = 4, per_folder: int = 5) -> Path:
    for d in range(folders):
        for f in range(per_folder):
            p = root / f"n{d:02d}" / f"{f:03d}.jpg"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x" * (d * per_folder + f + 1))
    return root


def child_env(shm_root: str, **run: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RUN_VARS}
    env.update(HPCSTAGGER_SHM_ROOT=shm_root, PYTHONPATH=str(REPO), **run)
    return env


def build_in_child(root: Path, shm_root: str, cwd: Path, *, strace_out: Path | None = None,
                   env: dict[str, str] | None = None, **kw) -> dict:
    """DirectorySource(root, **kw) in a new process; its files and keys, or its error."""
    argv = [sys.executable, "-c", CHILD, str(root), json.dumps(kw)]
    if strace_out is not None:
        argv = [STRACE, "-f", "-y", "-qq", "-e", "trace=%file,%%stat,getdents64", "-o", str(strace_out), *argv]
    cwd.mkdir(exist_ok=True)
    out = subprocess.run(argv, env=env or child_env(shm_root), cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def listings(shm_root: str) -> list[str]:
    d = Path(shm_root) / LISTINGS
    return sorted(os.listdir(d)) if d.exists() else []


def calls_under(trace: Path, root: Path) -> list[str]:
    """The traced system calls that name a path under ``root`` (or an fd open on one)."""
    marks = tuple(str(r) + end for r in {root, root.resolve()} for end in ("/", ">", '"'))
    return [line for line in trace.read_text().splitlines() if any(m in line for m in marks)]


# ---- the run identity -------------------------------------------------------------------------
def test_run_identity_rules():
    from hpcstagger.spec import runenv

    assert _nodelisting.RUN_DIR_ENV == runenv.RUN_DIR
    assert run_identity(environ={}) is None
    assert run_identity(environ={"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default is no identity
    assert run_identity(environ={"SLURM_JOB_ID": "7"}) is None  # a batch script or salloc shell: commands, not a run
    assert run_identity(environ={"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "4294967294"}) is None  # the batch step
    assert run_identity(environ={"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}) == "slurm:7.2"
    assert run_identity(environ={"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun:abc"
    both = run_identity(environ={"HPCSTAGGER_RUN_DIR": "/w/runs/r1", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})
    assert both == "hpcstagger:/w/runs/r1 slurm:7.0"  # a run directory reused by another job is another run
    assert run_identity("mine", environ={"SLURM_JOB_ID": "7"}) == "run:mine"


def test_without_a_run_identity_each_process_lists_alone(tmp_path, shm_root, caplog):
    make_tree(tmp_path / "data")
    with caplog.at_level(logging.DEBUG, logger="hpcstagger.cache._nodelisting"):
        src = DirectorySource(tmp_path / "data")
    assert len(src) == 20 and not os.path.exists(Path(shm_root) / LISTINGS)
    assert any("no run identity" in r.getMessage() for r in caplog.records)
    DirectorySource(tmp_path / "data", listing=False, run="r1")
    assert not os.path.exists(Path(shm_root) / LISTINGS)  # listing=False: never shared


# ---- shared between processes -----------------------------------------------------------------
def _can_trace() -> bool:
    """strace is there and may trace (a container can forbid ptrace)."""
    return STRACE is not None and subprocess.run([STRACE, "-qq", "-o", os.devnull, "true"],
                                                 capture_output=True, timeout=60).returncode == 0


def test_a_later_process_makes_no_metadata_call_on_the_tree(tmp_path, shm_root):
    """strace on both processes: the first opens, lists and stats under the root; the second,
    same run, nothing at all (not even a stat of the root)."""
    if not _can_trace():
        pytest.skip("needs strace and ptrace (the test below shows the same without them)")
    root = make_tree(tmp_path / "data")
    env = child_env(shm_root, SLURM_JOB_ID="41", SLURM_STEP_ID="0")
    first = build_in_child(root, shm_root, tmp_path / "cwd", strace_out=tmp_path / "first.trace", env=env)
    second = build_in_child(root, shm_root, tmp_path / "cwd", strace_out=tmp_path / "second.trace", env=env)
    assert second == first and len(first["files"]) == 20
    seen = calls_under(tmp_path / "first.trace", root)
    assert sum("getdents64" in c for c in seen) >= 5 and sum("stat" in c for c in seen) >= 20  # the probe sees
    assert calls_under(tmp_path / "second.trace", root) == []
    assert len(listings(shm_root)) == 1


def test_a_later_process_builds_the_source_with_the_tree_gone(tmp_path, shm_root):
    """The run's listing stands in for the tree; another run lists again (and finds nothing)."""
    root = make_tree(tmp_path / "data")
    run_a = child_env(shm_root, HPCSTAGGER_RUN_DIR=str(tmp_path / "runs" / "a"))
    first = build_in_child(root, shm_root, tmp_path / "cwd", env=run_a)
    os.rename(root, tmp_path / "away")
    assert build_in_child(root, shm_root, tmp_path / "cwd", env=run_a) == first
    other = build_in_child(root, shm_root, tmp_path / "cwd", env=child_env(shm_root, TORCHELASTIC_RUN_ID="t2"))
    assert other["error"] == "ConfigError" and "does not exist" in other["message"]


def test_another_run_lists_again_and_removes_the_earlier_runs_listing(tmp_path, shm_root):
    root = make_tree(tmp_path / "data")
    first = build_in_child(root, shm_root, tmp_path / "cwd", run="r1")
    (root / "n01" / "002.jpg").write_bytes(b"changed, longer than before")
    same_run = build_in_child(root, shm_root, tmp_path / "cwd", run="r1")
    assert same_run == first  # the run keeps what it listed
    (before,) = listings(shm_root)
    later = build_in_child(root, shm_root, tmp_path / "cwd", run="r2")
    changed = [i for i, (a, b) in enumerate(zip(first["keys"], later["keys"], strict=True)) if a != b]
    assert changed == [first["files"].index("n01/002.jpg")]
    (after,) = listings(shm_root)  # r1's listing is gone: no live process holds it
    assert after != before and after.split("-")[0] == before.split("-")[0]


def test_a_listing_in_use_is_not_removed_by_another_run(tmp_path, shm_root):
    from hpcstagger.colocated.leftovers import clean, find

    root = make_tree(tmp_path / "data")
    (tmp_path / "cwd").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", CHILD, str(root), json.dumps({"run": "r1"}), "hold"],
                              env=child_env(shm_root), cwd=tmp_path / "cwd", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and "files" in json.loads(holder.stdout.readline())
        build_in_child(root, shm_root, tmp_path / "cwd", run="r2")
        assert len(listings(shm_root)) == 2  # r1's is held by a live process
        items = {i.path: i for i in find(shm_root, gate_dir=str(tmp_path))}
        held = [i for i in items.values() if i.users]
        assert [i.kind for i in items.values()] == ["dataset listing"] * 2
        assert len(held) == 1 and held[0].users[0][0] == holder.pid
        assert [i.path for i in clean(shm_root, unused_only=True, gate_dir=str(tmp_path))] == \
            [i.path for i in items.values() if not i.users]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    build_in_child(root, shm_root, tmp_path / "cwd", run="r3")
    assert len(listings(shm_root)) == 1  # r1's went once its holder was gone
    assert clean(shm_root, gate_dir=str(tmp_path)) and not os.path.exists(shm_root)  # clean knows the folder


def _build_counted(root: str, count_dir: str, barrier) -> None:
    real = _listing.list_files

    def counted(*a):
        open(os.path.join(count_dir, str(os.getpid())), "w").close()
        return real(*a)

    _listing.list_files = counted
    barrier.wait()
    assert len(DirectorySource(root, run="r1")) == 20


def test_concurrent_processes_of_a_node_list_once(tmp_path, shm_root):
    make_tree(tmp_path / "data")
    (tmp_path / "counts").mkdir()
    barrier = FORK.Barrier(4)
    procs = [FORK.Process(target=_build_counted, args=(str(tmp_path / "data"), str(tmp_path / "counts"), barrier))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert len(os.listdir(tmp_path / "counts")) == 1
    assert os.listdir(shm_root) == [LISTINGS] and [f.endswith(".listing") for f in listings(shm_root)] == [True]
    assert stat.S_IMODE(os.stat(Path(shm_root) / LISTINGS).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(Path(shm_root) / LISTINGS / listings(shm_root)[0]).st_mode) == 0o600


# ---- what a listing is of ---------------------------------------------------------------------
def test_a_listing_of_other_data_is_not_used(tmp_path, shm_root):
    root = make_tree(tmp_path / "data")
    all_files = DirectorySource(root, run="r1")
    (root / "n00" / "000.jpg").unlink()  # a listing made from here on shows it gone
    assert len(DirectorySource(root, run="r1")) == 20  # the run's listing
    assert len(DirectorySource(root, "n0[0-1]/*.jpg", run="r1")) == 9  # another pattern
    shutil.copytree(root, tmp_path / "copy")
    assert len(DirectorySource(tmp_path / "copy", run="r1")) == 19  # another root
    lst = tmp_path / "list.txt"
    lst.write_text("n01/000.jpg\n")
    assert DirectorySource(root, files=lst, run="r1").files == ["n01/000.jpg"]
    lst.write_text("n01/001.jpg\nn01/000.jpg\n")  # the list changed within the run
    assert DirectorySource(root, files=lst, run="r1").files == ["n01/001.jpg", "n01/000.jpg"]
    assert DirectorySource(root, files=["n02/000.jpg"], run="r1").files == ["n02/000.jpg"]
    assert all_files.files[0] == "n00/000.jpg"
    names = listings(shm_root)  # one per root and selection (each version of the list is one)
    assert len(names) == 6 and all(n.endswith(".listing") for n in names)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "other root", "junk", "empty", "group-writable",
                                    "symlink", "foreign"])
def test_a_damaged_or_foreign_listing_is_not_used(tmp_path, shm_root, damage):
    if damage == "foreign" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    root = make_tree(tmp_path / "data")
    DirectorySource(root, run="r1")
    (root / "n00" / "000.jpg").unlink()
    (name,) = listings(shm_root)
    path = Path(shm_root) / LISTINGS / name
    raw = path.read_bytes()
    if damage == "symlink":
        decoy = tmp_path / "decoy.listing"
        decoy.write_bytes(raw)
        path.unlink()
        path.symlink_to(decoy)
    else:
        bad = {"truncated": raw[:-5], "flipped": raw[:-1] + bytes([raw[-1] ^ 1]), "junk": b"junk\n",
               "empty": b"", "other root": raw.replace(str(root).encode(), str(tmp_path / "elsewhere").encode())}
        path.write_bytes(bad.get(damage, raw))
        if damage == "group-writable":
            os.chmod(path, 0o660)
        if damage == "foreign":
            os.chown(path, 65534, 65534)
    assert len(DirectorySource(root, run="r1")) == 19  # listed again, not read
    assert os.lstat(path).st_uid == os.geteuid() and stat.S_ISREG(os.lstat(path).st_mode)  # replaced
    (root / "n00" / "001.jpg").unlink()
    assert len(DirectorySource(root, run="r1")) == 19  # and the new one is used


def test_a_run_listing_file_and_the_node_listing_together(tmp_path, shm_root):
    """listing=PATH with a run: the node's first process lists and writes both; a node that has
    the listing publishes a missing PATH; a node without it reads PATH instead of listing."""
    root = make_tree(tmp_path / "data")
    path = tmp_path / "run" / "dataset-r1.listing"
    path.parent.mkdir()
    first = DirectorySource(root, listing=str(path), run="r1")
    assert path.exists() and len(listings(shm_root)) == 1
    (root / "n00" / "000.jpg").unlink()
    path.unlink()
    assert DirectorySource(root, listing=str(path), run="r1").files == first.files  # from the node
    assert path.exists()  # published again
    shutil.rmtree(Path(shm_root) / LISTINGS)
    assert DirectorySource(root, listing=str(path), run="r1").files == first.files  # from the file
    assert len(DirectorySource(root, listing=str(path))) == 20  # no run: the file alone, as before


# ---- file lists -------------------------------------------------------------------------------
def test_a_file_list_in_its_order(tmp_path, shm_root):
    root = make_tree(tmp_path / "data")
    lst = tmp_path / "train.txt"
    lst.write_text(f"# training split\n\nn03/004.jpg\n  n00/001.jpg  \n{root}/n02/000.jpg\n./n01/003.jpg\n")
    src = DirectorySource(root, files=lst)
    assert src.files == ["n03/004.jpg", "n00/001.jpg", "n02/000.jpg", "n01/003.jpg"]
    assert src[0] == (root / "n03" / "004.jpg").read_bytes() and src.pattern is None
    glob = DirectorySource(root)
    assert src.key(1) == glob.key(glob.files.index("n00/001.jpg"))  # the same file, the same cache key
    seq = DirectorySource(root, files=[Path("n03/004.jpg"), str(root / "n00" / "001.jpg")])
    assert seq.files == ["n03/004.jpg", "n00/001.jpg"] and seq.key(0) == src.key(0)
    assert "files=" in repr(seq)
    shared = build_in_child(root, shm_root, tmp_path / "cwd", files=str(lst), run="r1")
    os.rename(root, tmp_path / "away")  # a later process of the run reads the list's listing
    assert build_in_child(root, shm_root, tmp_path / "cwd", files=str(lst), run="r1") == shared
    assert shared["files"] == src.files


@pytest.mark.parametrize("lines,match,item", [
    (["n00/000.jpg", "../outside.jpg"], "line 2 of .*not under the root", "item 2 of files"),
    (["/etc/hostname"], "line 1 of .*not under the root", "item 1 of files"),
    (["n00/000.jpg", "n00/missing.jpg"], "line 2 of .*missing.jpg does not exist", "item 2 of files"),
    (["n00"], "line 1 of .*is a directory", "item 1 of files"),
    (["n00/000.jpg", "# dup", "./n00/000.jpg"], r"line 3 of .*listed twice \(first at line 1", "item 2 of files"),
    (["."], "line 1 of .*not under the root", "item 1 of files"),
    (["# nothing"], "no files listed in .*list.txt", "no files listed in files"),
])
def test_file_list_errors_name_the_line_and_the_fix(tmp_path, shm_root, lines, match, item):
    root = make_tree(tmp_path / "data")
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(lines) + "\n")
    for run in (None, "r1"):
        with pytest.raises(ConfigError, match=match):
            DirectorySource(root, files=lst, run=run)
    with pytest.raises(ConfigError, match=item):
        DirectorySource(root, files=[ln for ln in lines if not ln.startswith("#")])
    assert all(n.endswith(".listing") for n in listings(shm_root))  # no lock file left behind


def test_file_list_argument_errors(tmp_path):
    root = make_tree(tmp_path / "data")
    with pytest.raises(ConfigError, match="not both"):
        DirectorySource(root, "**/*.jpg", files=["n00/000.jpg"])
    with pytest.raises(ConfigError, match="the file list .*nope.txt does not exist"):
        DirectorySource(root, files=tmp_path / "nope.txt")
    with pytest.raises(ConfigError, match="sequence of paths"):
        DirectorySource(root, files=42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="holds b'n00/000.jpg'; give each path as a str"):
        DirectorySource(root, files=[b"n00/000.jpg"])  # type: ignore[list-item]
    os.mkfifo(root / "n00" / "pipe")
    with pytest.raises(ConfigError, match="item 1 of files: .*not a regular file"):
        DirectorySource(root, files=["n00/pipe"])


def test_no_files_left_beyond_the_listings(tmp_path, shm_root):
    """The folder holds listings only (no lock, no temporary file); a listing this process still
    holds stays when another run lists, and goes once let go of."""
    root = make_tree(tmp_path / "data")
    DirectorySource(root, run="r1")
    DirectorySource(root, run="r2")
    assert os.listdir(shm_root) == [LISTINGS]
    assert len(listings(shm_root)) == 2 and all(n.endswith(".listing") for n in listings(shm_root))
    for fd in _nodelisting._held.values():  # as if this process had exited
        os.close(fd)
    _nodelisting._held.clear()
    DirectorySource(root, run="r3")
    assert len(listings(shm_root)) == 1


def test_the_benchmark_reads_strace_summaries():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_listing", REPO / "benchmarks" / "bench_listing.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 55.34    0.001181           4       256        40 newfstatat
 22.35    0.000477          23        20           getdents64
 22.31    0.000476           6        69        17 openat
------ ----------- ----------- --------- --------- ----------------
100.00    0.002134           6       345        57 total
"""
    assert bench.parse_strace_summary(table) == {"newfstatat": 256, "getdents64": 20, "openat": 69}


def test_a_launch_removes_its_listings_when_its_ranks_are_gone(tmp_path, shm_root):
    """What hpcstagger launch calls after the run: unheld listings go, then the empty folders."""
    from hpcstagger.colocated.leftovers import remove_unused

    root = make_tree(tmp_path / "data")
    build_in_child(root, shm_root, tmp_path / "cwd", run="r1")
    (name,) = listings(shm_root)
    removed = remove_unused({"HPCSTAGGER_SHM_ROOT": shm_root}, gate_dir=str(tmp_path), keep_root=False)
    assert os.path.join(shm_root, LISTINGS, name) in removed and not os.path.exists(shm_root)
