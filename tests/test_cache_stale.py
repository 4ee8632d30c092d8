"""A changed dataset is never served stale: sources key samples by the identity of the file's
version, and listing a directory matches pathlib's glob rules."""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import sys
import time
from pathlib import Path

import pytest

from hpcstagger.cache import CachedDataset, DirectorySource, HDF5Source, ShmCache
from hpcstagger.cache._listing import glob_regex, list_files

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_stale.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_stale", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_stale", mod)
    spec.loader.exec_module(mod)
    return mod


B = _bench()


@pytest.mark.parametrize("name,kind,change", B.CASES, ids=[c[0] for c in B.CASES])
def test_a_new_job_after_a_change_reads_the_new_bytes(name, kind, change, tmp_path):
    """A job fills the cache, the data changes, a new job with the same cache name (DataLoader with
    workers) reads every sample: none differs from the disk, and the change did change samples."""
    r = B.run_case(name, kind, change, tmp_path / "case", inproc=True)
    assert r["changed"] > 0, r  # the change is real, so the check below can fail
    assert r["stale"] == 0, r


def test_new_jobs_in_their_own_processes(tmp_path):
    """The same, each job its own process as users run them: the file rewritten in place."""
    name, kind, change = B.CASES[1]
    r = B.run_case(name, kind, change, tmp_path / "case", inproc=False)
    assert r["changed"] == r["samples"] and r["stale"] == 0, r


def test_unchanged_data_still_hits(tmp_path, shm_root):
    """Identities are stable: an unchanged dataset, listed again, hits every sample."""
    B.make_dir(tmp_path / "d")
    B.make_h5(tmp_path / "d.h5")
    cache = ShmCache("stable", 8 << 20)
    try:
        for make in (lambda: DirectorySource(tmp_path / "d"), lambda: HDF5Source(tmp_path / "d.h5", "x")):
            first = make()
            assert [first.key(i) for i in range(len(first))] == [make().key(i) for i in range(len(first))]
            ds = CachedDataset(first, cache)
            for i in range(len(ds)):
                ds[i]
            before = cache.stats()["hits"]
            again = CachedDataset(make(), cache)
            assert [again[i] for i in range(len(again))] == [first[i] for i in range(len(first))]
            assert cache.stats()["hits"] - before == len(first)
    finally:
        cache.close()


def test_hdf5_identity_covers_shape_and_dtype(tmp_path):
    import h5py
    import numpy as np

    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((4, 8), dtype=np.uint8)
        f["y"] = np.zeros((4, 8), dtype=np.uint8)
    a = HDF5Source(path, "x")
    assert a.key(0) != HDF5Source(path, "y").key(0)  # another dataset of the same file
    st = os.stat(path)
    with h5py.File(path, "r+") as f:  # same bytes, another dtype
        del f["x"]
        f["x"] = np.zeros((4, 8), dtype=np.int8)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert HDF5Source(path, "x").key(0) != a.key(0)


def test_a_file_changed_under_a_running_source_is_read_new_and_logged(tmp_path, caplog):
    B.make_dir(tmp_path / "d")
    src = DirectorySource(tmp_path / "d")
    time.sleep(B.TICK)
    (tmp_path / "d" / src.files[2]).write_bytes(b"new")
    with caplog.at_level(logging.WARNING, logger="hpcstagger.cache.sources"):
        assert src[2] == b"new"
        src[2]
    assert sum("changed after the dataset was listed" in r.getMessage() for r in caplog.records) == 1


def test_pickled_source_keeps_its_listing_and_identities(tmp_path):
    B.make_dir(tmp_path / "d")
    src = DirectorySource(tmp_path / "d")
    clone = pickle.loads(pickle.dumps(src))
    assert clone.files == src.files and list(clone.tokens) == list(src.tokens)
    assert [clone.key(i) for i in range(len(src))] == [src.key(i) for i in range(len(src))]


def test_missing_paths_are_named(tmp_path):
    from hpcstagger.errors import ConfigError

    with pytest.raises(ConfigError, match="does not exist"):
        DirectorySource(tmp_path / "dataa")
    (tmp_path / "f.bin").write_bytes(b"1")
    with pytest.raises(ConfigError, match="not a directory"):
        DirectorySource(tmp_path / "f.bin")


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "t"
    for rel in ["a.jpg", "b.png", ".hidden.jpg", "x/1.jpg", "x/2.JPG", "x/y/3.jpg", "x/y/z/4.jpg", "w[1]/5.jpg",
                "q/r/6.txt", "x/y/a.jpg"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
    (root / "emptydir").mkdir()
    (root / "x" / "link.jpg").symlink_to(root / "a.jpg")
    (root / "x" / "dangling.jpg").symlink_to(root / "nope")
    (root / "dirlink").symlink_to(root / "x", target_is_directory=True)
    return root


PATTERNS = ["**/*", "*", "*.jpg", "**/*.jpg", "x/*.jpg", "x/**/*.jpg", "*/y/*.jpg", "**/y/*", "x/?.jpg",
            "x/[12].*", "x/[!1].jpg", "w[[]1]/*", "**/*.txt", "q/**", "nothing/*", "**/a.jpg", "x/y/**/*.jpg"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_listing_matches_pathlib_glob(tree, pattern):
    """The listing is what Path.glob gives, filtered to regular files (symlinked directories aside:
    this tree's link to x is skipped by both for ** and listed by pathlib for */y/*)."""
    want = sorted(p.relative_to(tree).as_posix() for p in tree.glob(pattern) if p.is_file()
                  and not p.relative_to(tree).as_posix().startswith("dirlink/"))
    files, tokens = list_files(str(tree), pattern)
    assert files == want
    assert len(tokens) == len(files)


def test_glob_regex_rules():
    rx = glob_regex("**/*.jpg")
    assert rx.fullmatch("a.jpg") and rx.fullmatch("x/y/a.jpg") and not rx.fullmatch("a.jpgx")
    assert not glob_regex("*.jpg").fullmatch("x/a.jpg")
    assert glob_regex("a[!b]c").fullmatch("axc") and not glob_regex("a[!b]c").fullmatch("abc")
    assert glob_regex("a[c").fullmatch("a[c")


def test_glob_segments_match_as_fnmatch_does():
    """Within one name, a pattern matches exactly what fnmatch (pathlib's matcher) matches."""
    import fnmatch
    import random

    rng = random.Random(7)
    for _ in range(3000):
        pat = "".join(rng.choice("ab*?[]!^-\\&") for _ in range(rng.randint(1, 6)))
        name = "".join(rng.choice("ab^-[]!\\&") for _ in range(rng.randint(0, 4)))
        if pat == "**":  # a whole segment of ** is the recursive wildcard (tested above), not a name
            continue
        assert bool(glob_regex(pat).fullmatch(name)) == fnmatch.fnmatchcase(name, pat), (pat, name)


def test_a_refused_insert_is_logged_once(tmp_path, shm_root, caplog, monkeypatch):
    from hpcstagger.cache import dataset as dataset_mod

    monkeypatch.setattr(dataset_mod, "_refusal_logged", False)
    B.make_dir(tmp_path / "d")
    cache = ShmCache("small", 4 * B.SIZE)  # room for 4 of the 48 samples
    try:
        ds = CachedDataset(DirectorySource(tmp_path / "d"), cache)
        with caplog.at_level(logging.INFO, logger="hpcstagger.cache.dataset"):
            got = [ds[i] for i in range(len(ds))]
        assert got == [DirectorySource(tmp_path / "d")[i] for i in range(len(ds))]
        assert cache.stats()["entries"] == 4
        msgs = [r.getMessage() for r in caplog.records if "refused an insert" in r.getMessage()]
        assert len(msgs) == 1 and "hpcstagger cache clear small" in msgs[0]
    finally:
        cache.close()


# ---- one listing per run, shared through a file ------------------------------------------------
def test_listing_file_round_trip_and_rejections(tmp_path):
    from array import array

    from hpcstagger.cache._listing import read_listing, write_listing

    names = ["a.jpg", "sub/b c.jpg", "line\nbreak.jpg", "bytes-\udcff.jpg", "ü.jpg"]
    tokens = array("Q", [1, 2**64 - 1, 3, 0, 42])
    path = str(tmp_path / "dataset-1.listing")
    write_listing(path, "/data", "**/*", names, tokens)
    files, toks = read_listing(path, "/data", "**/*")
    assert files == names and list(toks) == list(tokens)
    assert read_listing(path, "/other", "**/*") is None and read_listing(path, "/data", "*.jpg") is None
    raw = open(path, "rb").read()
    for bad in (raw[:-3], raw[:-8] + b"\1" * 8, b"junk", b"", raw.replace(b"hpcstagger-listing", b"x")):
        open(path, "wb").write(bad)
        assert read_listing(path, "/data", "**/*") is None
    assert read_listing(str(tmp_path / "missing"), "/data", "**/*") is None
    write_listing(path, "/data", "**/*", [], array("Q"))
    assert read_listing(path, "/data", "**/*") == ([], array("Q"))


def test_a_source_built_with_a_run_listing_reads_it_instead_of_listing(tmp_path):
    B.make_dir(tmp_path / "d")
    run = tmp_path / "run"
    run.mkdir()
    (run / "dataset-old.listing").write_bytes(b"an earlier run's")
    listing = str(run / "dataset-new.listing")
    first = DirectorySource(tmp_path / "d", listing=listing)
    assert sorted(os.listdir(run)) == ["dataset-new.listing"]  # written, the earlier run's removed
    os.unlink(tmp_path / "d" / first.files[0])  # a later process of the run does not list again
    second = DirectorySource(tmp_path / "d", listing=listing)
    assert second.files == first.files and [second.key(i) for i in range(3)] == [first.key(i) for i in range(3)]
    fresh = DirectorySource(tmp_path / "d")  # without the run's listing: the directory as it is
    assert len(fresh) == len(first) - 1


def _list_counted(root: str, listing: str, count_dir: str, barrier) -> None:
    from hpcstagger.cache import _listing

    real = _listing.list_files

    def counted(*a):
        open(os.path.join(count_dir, str(os.getpid())), "w").close()
        return real(*a)

    _listing.list_files = counted
    barrier.wait()
    src = DirectorySource(root, listing=listing)
    assert len(src) == B.N_FILES


def test_concurrent_processes_of_a_run_list_once(tmp_path):
    import multiprocessing as mp

    B.make_dir(tmp_path / "d")
    (tmp_path / "counts").mkdir()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_list_counted, args=(str(tmp_path / "d"), str(tmp_path / "dataset-x.listing"),
                                                     str(tmp_path / "counts"), barrier)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert len(os.listdir(tmp_path / "counts")) == 1


SOURCE_JOB = """
import json, os
from hpcstagger import init
s = init()
src = s.source()
out = os.path.join(os.environ["OUT_DIR"], f"{s.job}.{s.rank}.json")
json.dump({"n": len(src), "keys": [src.key(i) for i in range(len(src))], "run_dir": s.run_dir}, open(out, "w"))
s.finish()
"""


@pytest.mark.timeout(180)
def test_a_launched_run_lists_its_directory_dataset_once(tmp_path, shm_root):
    """hpcstagger launch: every job's session.source() has the same listing, made once and kept
    in the run's directory."""
    import json
    import textwrap

    from support.cli import cli_env, run_cli

    B.make_dir(tmp_path / "data")
    (tmp_path / "job.py").write_text(SOURCE_JOB)
    (tmp_path / "out").mkdir()
    spec = tmp_path / "spec.toml"
    spec.write_text(textwrap.dedent(f"""
        [run]
        name = "listing"
        timeout = 120
        [dataset]
        path = "data"
        [cache]
        capacity = 1048576
        root = "{shm_root}"
        [plan]
        mode = "simultaneous"
        [[job]]
        name = "a"
        command = "python job.py"
        ranks = 2
        [[job]]
        name = "b"
        command = "python job.py"
    """))
    out = run_cli("launch", str(spec), env=cli_env(OUT_DIR=str(tmp_path / "out")), cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").iterdir())]
    assert len(rows) == 3 and all(r["n"] == B.N_FILES and r["keys"] == rows[0]["keys"] for r in rows)
    run_dir = rows[0]["run_dir"]
    assert [f for f in os.listdir(run_dir) if f.endswith(".listing")] and \
        len([f for f in os.listdir(run_dir) if f.startswith("dataset-")]) == 1
