"""Checkpoint data written with O_DIRECT (hpcstagger.checkpoint._direct): real files on the real file
systems of this machine (ext4 under pytest's tmp_path, tmpfs in /dev/shm, and a ramfs, which refuses
O_DIRECT), the bytes checked exactly, and page-cache residency read with fincore."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import torch

from hpcstagger import config
from hpcstagger.checkpoint import AsyncCheckpointer, load
from hpcstagger.checkpoint import probe
from hpcstagger.checkpoint._direct import ALIGN, ALIGN_THRESHOLD, FileSink, aligned_buffer
from hpcstagger.checkpoint.snapshot import SnapshotBuffers
from hpcstagger.checkpoint.writer import copy_hashed
from support.ckpt_util import same

pytestmark = pytest.mark.timeout(120)


def _direct_ok(directory) -> bool:
    path = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


@pytest.fixture
def counted():
    probe.disable()
    probe.reset()
    probe.enable()
    yield probe
    probe.disable()
    probe.reset()


def _pattern(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _write(path, regions, *, direct=None, size=None):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if size:
            os.ftruncate(fd, size)
        with FileSink(fd, direct=direct) as sink:
            for data, off in regions:
                sink.write(data, off)
            os.fsync(fd)
            return sink.direct_bytes, sink.buffered_bytes
    finally:
        os.close(fd)


def test_aligned_middle_goes_direct_and_every_byte_lands(tmp_path):
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    mem = np.frombuffer(aligned_buffer(5 * ALIGN), dtype=np.uint8)
    mem[:] = _pattern(len(mem))
    # a region that starts 100 bytes before a page boundary in the file and in memory, and ends mid-page
    data = mem[ALIGN - 100:4 * ALIGN + 37]
    off = 3 * ALIGN - 100
    path = tmp_path / "f"
    direct, buffered = _write(path, [(data, off)])
    assert direct == 3 * ALIGN  # the whole pages in the middle
    assert buffered == 100 + 37  # the head and the tail
    got = path.read_bytes()
    assert got[off:off + len(data)] == data.tobytes()
    assert got[:off] == bytes(off)  # a hole reads as zeros


def test_memory_out_of_step_with_the_file_is_written_buffered(tmp_path):
    mem = np.frombuffer(aligned_buffer(4 * ALIGN), dtype=np.uint8)
    mem[:] = _pattern(len(mem), 2)
    data = mem[8:8 + 2 * ALIGN]  # page-aligned file offset, memory 8 bytes past a page
    direct, buffered = _write(tmp_path / "f", [(data, ALIGN)])
    assert (direct, buffered) == (0, 2 * ALIGN)
    assert (tmp_path / "f").read_bytes()[ALIGN:] == data.tobytes()


def test_knob_off_writes_everything_through_the_page_cache(tmp_path):
    mem = np.frombuffer(aligned_buffer(4 * ALIGN), dtype=np.uint8)
    mem[:] = _pattern(len(mem), 3)
    with config.override(ckpt_direct_io=False):
        direct, buffered = _write(tmp_path / "f", [(mem, 0)])
    assert (direct, buffered) == (0, 4 * ALIGN)
    assert (tmp_path / "f").read_bytes() == mem.tobytes()


@contextlib.contextmanager
def _ramfs():
    """A ramfs mounted on a fresh directory (it refuses O_DIRECT at open); skipped where mounting is
    not allowed (not root, or in a container without the capability)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a ramfs needs root")
    d = tempfile.mkdtemp(prefix="hpcstagger-test-ramfs-")
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", d], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a ramfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=True, timeout=30)
        os.rmdir(d)


def test_file_system_refusing_o_direct_falls_back_to_the_page_cache(tmp_path):
    with _ramfs() as d:
        assert not _direct_ok(d)
        mem = np.frombuffer(aligned_buffer(3 * ALIGN), dtype=np.uint8)
        mem[:] = _pattern(len(mem), 4)
        direct, buffered = _write(os.path.join(d, "f"), [(mem, 0)])
        assert (direct, buffered) == (0, 3 * ALIGN)
        with open(os.path.join(d, "f"), "rb") as f:
            assert f.read() == mem.tobytes()
        # and a whole checkpoint there saves and loads
        state = {"w": torch.arange(300_000, dtype=torch.float32), "step": 3}
        with AsyncCheckpointer(os.path.join(d, "ck"), gate=None) as ck:
            ck.save(3, state).wait(timeout=60)
        same(load(os.path.join(d, "ck"))["w"], state["w"])


def test_snapshot_buffer_puts_large_pieces_on_page_boundaries():
    from hpcstagger.checkpoint.sharding import plan_shards
    from hpcstagger.checkpoint.state import flatten

    state = {"a": torch.zeros(3, dtype=torch.float32), "b": torch.ones(ALIGN_THRESHOLD // 4 + 5),
             "c": torch.zeros(7, dtype=torch.uint8), "d": torch.full((ALIGN_THRESHOLD,), 2.0)}
    _, leaves = flatten(state)
    plan = plan_shards([leaf.spec for leaf in leaves], 1)
    by_key = {leaf.spec.key: leaf for leaf in leaves}
    entries = [(p, by_key[p.key]) for p in plan.for_shard(0)]
    buf = SnapshotBuffers()
    buf.ensure(entries)
    views = buf.copy(entries)
    for (p, leaf), v in zip(entries, views, strict=True):
        address = v.__array_interface__["data"][0]
        assert address % 64 == 0
        if len(v) >= ALIGN_THRESHOLD:
            assert address % ALIGN == 0, p.key
        assert v.tobytes() == leaf.raw.numpy()[:len(v)].tobytes()
    buf.release()


def _fincore_pages(path: str) -> int | None:
    exe = shutil.which("fincore")
    if exe is None:
        return None
    out = subprocess.run([exe, "--bytes", "--noheadings", "--output", "PAGES", path], capture_output=True,
                         text=True, timeout=30)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.split() else None


def test_a_save_writes_its_tensors_around_the_page_cache(tmp_path, counted):
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    g = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(3_000_000, generator=g), "odd": torch.randn(123_457, generator=g),
             "tiny": torch.randn(3, generator=g), "step": 7}
    nbytes = 4 * (3_000_000 + 123_457 + 3)
    with AsyncCheckpointer(tmp_path / "ck", gate=None) as ck:
        path = ck.save(7, state).wait(timeout=60)
    t = probe.totals()
    assert t["pwrite_direct"]["bytes"] >= nbytes - 3 * ALIGN  # all but the small tensor and two tails
    assert t["pwrite"]["bytes"] < 3 * ALIGN
    shard = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".h5"))
    pages = _fincore_pages(shard)
    if pages is not None:  # written directly: next to none of the 12 MB is in the page cache (before load)
        assert pages * 4096 < nbytes // 10, pages
    loaded = load(tmp_path / "ck")
    for k in ("big", "odd", "tiny"):
        same(loaded[k], state[k], k)


@pytest.mark.parametrize("direct", [True, False])
def test_direct_writes_go_in_large_spans_and_hashing_in_chunks(tmp_path, counted, direct):
    """Direct writes of ckpt_write_bytes (the device gets each whole), buffered ones of a chunk (a
    copy on the writer's CPU); the hash, and a look at the gate, goes by chunks either way."""
    if direct and not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    g = torch.Generator().manual_seed(9)
    state = {"big": torch.randn(1_000_000, generator=g), "step": 1}     # 4 MB in one piece
    chunk, span = 256 << 10, 1 << 20
    with config.override(ckpt_chunk_bytes=chunk, ckpt_write_bytes=span, ckpt_direct_io=direct):
        with AsyncCheckpointer(tmp_path / "ck", gate=None) as ck:
            h = ck.save(1, state)
            path = h.wait(timeout=60)
    t = probe.totals()
    pieces = -(-4_000_000 // chunk)
    if direct:
        assert t["pwrite_direct"]["calls"] == -(-4_000_000 // span) == 4    # not 16 writes of a chunk
        assert t.get("pwrite", {}).get("bytes", 0) < ALIGN                  # the last partial page
    else:
        assert "pwrite_direct" not in t and t["pwrite"]["calls"] >= pieces
    assert t["hash"]["calls"] >= 2 * pieces      # the piece's checksum and the file's, chunk by chunk
    assert h.stats["chunks"] >= 2 * pieces       # a look at the gate before each chunk hashed
    same(load(tmp_path / "ck")["big"], state["big"], "big")
    assert os.listdir(path)


def test_copy_between_levels_goes_direct_and_checks_out(tmp_path):
    src = os.path.join("/dev/shm", f"hpcstagger-test-direct-{os.getpid()}")
    data = _pattern(3 * (1 << 20) + 999, 6)
    try:
        with open(src, "wb") as f:
            f.write(data.tobytes())
        dst = tmp_path / "copy"
        with open(src, "rb", buffering=0) as fin:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                with probe_on() as p:
                    size, digest = copy_hashed(fin.fileno(), fd, 1 << 20)
                    t = p.totals()
            finally:
                os.close(fd)
    finally:
        os.unlink(src)
    import xxhash

    assert size == len(data) and digest == xxhash.xxh3_64(data.tobytes()).hexdigest()
    assert dst.read_bytes() == data.tobytes()
    if _direct_ok(tmp_path):
        assert t["pwrite_direct"]["bytes"] == 3 * (1 << 20) + (999 // ALIGN) * ALIGN


@contextlib.contextmanager
def probe_on():
    probe.reset()
    probe.enable()
    try:
        yield probe
    finally:
        probe.disable()
        probe.reset()
