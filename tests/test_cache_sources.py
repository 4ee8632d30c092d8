"""DirectorySource, HDF5Source (lazy per-process open) and the ThrottledSource emulator."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest

from hpcstagger.cache import DirectorySource, HDF5Source, Source, ThrottledSource
from hpcstagger.cache.throttle import remove_if_idle
from hpcstagger.errors import CacheError, ConfigError
from support import cache_util

FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")


@pytest.fixture
def files(tmp_path):
    root = tmp_path / "data"
    for rel, size in [("b/2.bin", 300), ("a.bin", 100), ("b/1.bin", 200), ("c/d/e.txt", 50)]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(bytes([len(rel)]) * size)
    return root


def test_directory_source_sorted_keys_and_pattern(files):
    src = DirectorySource(files)
    assert isinstance(src, Source)
    assert src.files == ["a.bin", "b/1.bin", "b/2.bin", "c/d/e.txt"]
    assert [len(src[i]) for i in range(len(src))] == [100, 200, 300, 50]
    assert src[-1] == (files / "c/d/e.txt").read_bytes()
    assert src.key(1).startswith("file:" + os.path.realpath(files / "b/1.bin") + "@")
    assert len({src.key(i) for i in range(len(src))}) == 4
    with pytest.raises(IndexError):
        src[4]
    assert DirectorySource(files, "b/*.bin").files == ["b/1.bin", "b/2.bin"]
    clone = pickle.loads(pickle.dumps(src))
    assert clone[2] == src[2] and clone.key(2) == src.key(2)
    with pytest.raises(ConfigError, match="no files match"):
        DirectorySource(files, "*.nothing")
    with pytest.raises(ConfigError, match="not a directory"):
        DirectorySource(files / "a.bin")


def _h5_rows(path: str) -> list[bytes]:
    src = HDF5Source(path, "x")
    return [src[i] for i in range(len(src))]


def _h5_child(src: HDF5Source, q) -> None:
    q.put([src[i] for i in range(len(src))])


def test_hdf5_source_opens_lazily_in_each_process(tmp_path):
    import h5py
    import numpy as np

    path = str(tmp_path / "d.h5")
    data = np.arange(20 * 7, dtype=np.float32).reshape(20, 7)
    with h5py.File(path, "w") as f:
        f["x"] = data
        f["grp/y"] = np.zeros(3)
        f["scalar"] = 1.0
    src = HDF5Source(path, "x")
    assert src._file is None  # nothing open until the first read
    assert len(src) == 20 and src[3] == data[3].tobytes() and src[-1] == data[19].tobytes()
    assert src._file is not None
    assert src.key(3).startswith(f"h5:{os.path.realpath(path)}:x:3@")
    # the parent's handle is open; a forked child opens its own and reads the same rows
    q = FORK.Queue()
    p = FORK.Process(target=_h5_child, args=(src, q))
    p.start()
    rows = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0 and rows == [r.tobytes() for r in data]
    assert src[5] == data[5].tobytes()  # and the parent's handle still works
    # pickled (spawn) copies hold no handle
    clone = pickle.loads(pickle.dumps(src))
    assert clone._file is None and clone[7] == data[7].tobytes()
    with SPAWN.Pool(1) as pool:
        assert pool.apply(_h5_rows, (path,)) == [r.tobytes() for r in data]
    src.close()
    assert HDF5Source(path, "grp/y")[1] == bytes(8)
    with pytest.raises(ConfigError, match="no dataset 'nope'"):
        HDF5Source(path, "nope")
    with pytest.raises(ConfigError, match="scalar"):
        HDF5Source(path, "scalar")
    with pytest.raises(ConfigError, match="does not exist"):
        HDF5Source(str(tmp_path / "missing.h5"), "x")
    with pytest.raises(ConfigError, match="is a directory"):
        HDF5Source(str(tmp_path), "x")
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(ConfigError, match="cannot open .* as HDF5"):
        HDF5Source(str(tmp_path / "junk.h5"), "x")


# ---- ThrottledSource --------------------------------------------------------------------------

RATE = 1_000_000  # bytes/s; the sources below hold 400 KB, so one reader alone takes ~0.4 s


@pytest.fixture
def slow_files(tmp_path):
    root = tmp_path / "slow"
    root.mkdir()
    for i in range(8):
        (root / f"{i}.bin").write_bytes(os.urandom(50_000))
    return DirectorySource(root)


def _epoch_to_queue(src: ThrottledSource, barrier, seed: int, q) -> None:
    q.put(cache_util.read_epoch(src, barrier, seed))


def _concurrently(*sources: ThrottledSource) -> list[float]:
    """Each source read for one epoch by its own process, all starting together; wall times."""
    barrier, q = FORK.Barrier(len(sources)), FORK.Queue()
    procs = [FORK.Process(target=_epoch_to_queue, args=(s, barrier, i, q)) for i, s in enumerate(sources)]
    for p in procs:
        p.start()
    times = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return times


def _pair(src: ThrottledSource) -> list[float]:
    return _concurrently(src, src)


@pytest.mark.timeout(120)
def test_throttle_shares_bandwidth_between_processes(shm_root, slow_files):
    src = ThrottledSource(slow_files, RATE, shared_name="fs")
    assert src[0] == slow_files[0] and src.key(3) == slow_files.key(3) and len(src) == 8
    alone = cache_util.read_epoch(src)
    assert 0.3 < alone < 1.5, alone  # 400 KB at 1 MB/s
    pair = _pair(src)
    # two readers at once each get about half: the pair takes clearly longer than one alone
    assert min(pair) > 1.5 * alone, (alone, pair)
    other = ThrottledSource(slow_files, RATE, shared_name="other-fs")  # another budget
    both = _concurrently(src, other)
    assert max(both) < 1.4 * alone, (alone, both)
    src.unlink()
    other.unlink()
    assert os.listdir(shm_root) == []  # the shared state is gone


class _SlowInner:
    """A source whose own read takes 3 ms (as an HDF5 read does on a busy node) before the throttle paces it."""

    def __len__(self) -> int:
        return 100_000

    def key(self, i: int) -> int:
        return i

    def __getitem__(self, i: int) -> bytes:
        time.sleep(0.003)
        return bytes(3000)


def _read_n(src: ThrottledSource, barrier, start: int, q) -> None:
    barrier.wait(30)
    t0 = time.monotonic()
    for i in range(start, start + 60):
        src[i]
    q.put((t0, time.monotonic()))


@pytest.mark.timeout(120)
def test_throttle_counts_a_reader_while_its_inner_read_runs(shm_root):
    """Four readers whose inner reads take 3 ms of each 4 ms read get the aggregate rate between
    them, no more: a reader counts from the start of its read, not only while it is paced."""
    src = ThrottledSource(_SlowInner(), 3_000_000, shared_name="inner")
    barrier, q = FORK.Barrier(4), FORK.Queue()
    procs = [FORK.Process(target=_read_n, args=(src, barrier, 1000 * r, q)) for r in range(4)]
    for p in procs:
        p.start()
    spans = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    aggregate = 4 * 60 * 3000 / (max(b for _, b in spans) - min(a for a, _ in spans))
    # 3 MB/s shared by 4: 4 ms a read. Counting a reader only while paced gave 3.7 MB/s here.
    assert 2.4e6 < aggregate < 3.3e6, aggregate
    src.unlink()


@pytest.mark.timeout(120)
def test_throttle_degradation_list(shm_root, slow_files):
    assert ThrottledSource(slow_files, [4, 6, 3], shared_name="x").per_reader_rate(1) == 4
    rates = ThrottledSource(slow_files, [4, 6, 3], shared_name="x")
    assert [rates.per_reader_rate(k) for k in (1, 2, 3, 4)] == [4, 3, 1, 0.75]
    # aggregate doubles with a second reader: each still gets the full single-reader rate
    scaling = ThrottledSource(slow_files, [RATE, 2 * RATE], shared_name="scaling")
    alone = cache_util.read_epoch(scaling)
    pair = _pair(scaling)
    assert max(pair) < 1.4 * alone, (alone, pair)
    # aggregate halves with a second reader: each gets a quarter
    collapsing = ThrottledSource(slow_files, [RATE, RATE / 2], shared_name="collapsing")
    pair = _pair(collapsing)
    assert min(pair) > 2.5 * alone, (alone, pair)
    scaling.unlink()
    collapsing.unlink()
    for bad in (0, -1, [], [1, 0], "fast", [True]):
        with pytest.raises(ConfigError, match="bytes_per_second"):
            ThrottledSource(slow_files, bad, shared_name="x")
    with pytest.raises(ConfigError, match="latency"):
        ThrottledSource(slow_files, 1, shared_name="x", latency=-1)
    with pytest.raises(CacheError, match="invalid throttle shared_name"):
        ThrottledSource(slow_files, 1, shared_name="../x")


def _read_one_big(src: ThrottledSource, started) -> None:
    started.set()
    src[0]


@pytest.mark.timeout(120)
def test_throttle_forgets_a_reader_killed_mid_read(shm_root, tmp_path):
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "0.bin").write_bytes(bytes(5_000_000))  # 5 s alone at 1 MB/s
    big = ThrottledSource(DirectorySource(tmp_path / "big"), RATE, shared_name="fs")
    started = FORK.Event()
    proc = FORK.Process(target=_read_one_big, args=(big, started))
    proc.start()
    assert started.wait(30)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    (tmp_path / "small").mkdir()
    for i in range(4):
        (tmp_path / "small" / f"{i}").write_bytes(bytes(100_000))
    small = ThrottledSource(DirectorySource(tmp_path / "small"), RATE, shared_name="fs")
    took = cache_util.read_epoch(small)  # 0.4 s alone; ~0.8 s if the dead reader still counted
    assert took < 0.65, took
    small.unlink()


def test_throttle_latency_and_pickling(shm_root, slow_files):
    src = ThrottledSource(slow_files, 1e12, shared_name="lat", latency=0.05)
    t = time.monotonic()
    for i in range(4):
        src[i]
    assert time.monotonic() - t >= 0.19
    clone = pickle.loads(pickle.dumps(src))
    assert clone._st is None and clone.bandwidth == (1e12,) and clone[1] == slow_files[1]
    clone.close()
    src.close()  # the last one out removes the state file
    assert not os.path.exists(os.path.join(shm_root, ".throttle", "lat"))


def _attach_and_wait(src: ThrottledSource, attached, leave) -> None:
    src[0]  # attaches this process to the shared reader table
    attached.set()
    leave.wait(30)
    os._exit(0)  # as a DataLoader worker ends: without detaching


@pytest.mark.timeout(120)
def test_remove_if_idle_keeps_a_table_in_use_and_removes_an_abandoned_one(shm_root, slow_files):
    path = os.path.join(shm_root, ".throttle", "left")
    assert remove_if_idle("left") is False  # nothing there
    src = ThrottledSource(slow_files, 1e12, shared_name="left")
    attached, leave = FORK.Event(), FORK.Event()
    proc = FORK.Process(target=_attach_and_wait, args=(src, attached, leave))
    proc.start()
    assert attached.wait(30)
    assert remove_if_idle("left") is False and os.path.exists(path)  # a live reader holds it
    leave.set()
    proc.join(30)
    assert proc.exitcode == 0 and os.path.exists(path)  # it left without detaching: the table stays
    assert remove_if_idle("left") is True and not os.path.exists(path)
    with pytest.raises(CacheError):
        remove_if_idle("../left")
