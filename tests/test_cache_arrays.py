"""NumPy .npy files and HDF5 datasets as sources (one array, or several as one pack), the pack
format and its checks, and staleness: a changed file is never served from the cache."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import struct
import time

import numpy as np
import pytest

from hpcstagger.cache import CachedDataset, DirectorySource, ShmCache
from hpcstagger.cache.arrays import (PACK_ALIGN, HDF5ArraysSource, NpySource, decode_npy, unpack_arrays,
                                     pack_arrays)
from hpcstagger.errors import CacheError, ConfigError

N = 12
TICK = 0.05  # seconds between writes: more than a local file system's timestamp tick


def _images(n: int = N, tag: int = 0) -> np.ndarray:
    return (np.arange(n * 2 * 3, dtype=np.float32).reshape(n, 2, 3) + 1000 * tag)


def _labels(n: int = N, tag: int = 0) -> np.ndarray:
    return np.arange(n, dtype=np.int64) * 7 + tag


@pytest.fixture
def npy(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    np.save(d / "images.npy", _images())
    np.save(d / "labels.npy", _labels())
    return d


@pytest.fixture
def h5(tmp_path):
    import h5py

    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f["images"] = _images()
        f["labels"] = _labels()
        f["grp/masks"] = np.arange(N * 4, dtype=np.uint8).reshape(N, 4) % 2 == 1
    return path


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# ---- NpySource ---------------------------------------------------------------------------------
def test_npy_one_array_gives_raw_rows_and_decodes_them(npy):
    src = NpySource(npy / "images.npy")
    images = _images()
    assert not src.packed and len(src) == N and src.names == ("images",)
    assert [src[i] for i in range(N)] == [r.tobytes() for r in images]
    assert src[-1] == images[-1].tobytes()
    with pytest.raises(IndexError):
        src[N]
    row = src.decode(src[5])
    assert row.dtype == np.float32 and row.shape == (2, 3) and np.array_equal(row, images[5])
    assert not row.flags.writeable  # a view of the bytes, not a copy
    assert src.key(5).startswith(f"npy:{os.path.realpath(npy / 'images.npy')}:5@")
    assert len({src.key(i) for i in range(N)}) == N
    with pytest.raises(CacheError, match="has 24 bytes, not 23"):
        src.decode(src[5][:-1])
    labels = NpySource(str(npy / "labels.npy"))
    assert labels.decode(labels[3]).shape == () and int(labels.decode(labels[3])) == 21


def test_npy_several_files_form_one_record_per_row(npy):
    images, labels = _images(), _labels()
    by_stem = NpySource([npy / "images.npy", npy / "labels.npy"])
    named = NpySource({"x": npy / "images.npy", "y": str(npy / "labels.npy")})
    assert by_stem.packed and by_stem.names == ("images", "labels") and named.names == ("x", "y")
    for i in range(N):
        rec = by_stem.decode(by_stem[i])
        assert list(rec) == ["images", "labels"]
        assert np.array_equal(rec["images"], images[i]) and int(rec["labels"]) == labels[i]
        assert unpack_arrays(by_stem[i]).keys() == rec.keys()
        assert by_stem[i] == pack_arrays({"images": images[i], "labels": labels[i]})
        xy = named.decode(named[i])
        assert np.array_equal(xy["x"], images[i]) and xy["y"] == labels[i]
    # another naming is another pack: other bytes, other keys
    assert by_stem.key(0) != named.key(0) and by_stem.key(0) != NpySource(npy / "images.npy").key(0)
    with pytest.raises(ConfigError, match="distinct names"):
        NpySource([npy / "images.npy", npy / "images.npy"])


def test_npy_refusals_name_the_fix(npy, tmp_path):
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match="never unpickles"):
        NpySource(tmp_path / "objects.npy")
    np.savez(tmp_path / "arch.npz", images=_images())
    with pytest.raises(ConfigError, match=r"\.npz.*np\.save"):
        NpySource(tmp_path / "arch.npz")
    (tmp_path / "text.npy").write_bytes(b"not an array at all")
    with pytest.raises(ConfigError, match="not a .npy file"):
        NpySource(tmp_path / "text.npy")
    np.save(tmp_path / "fortran.npy", np.asfortranarray(_images()[:, :, 0]))
    with pytest.raises(ConfigError, match="Fortran order.*ascontiguousarray"):
        NpySource(tmp_path / "fortran.npy")
    np.save(tmp_path / "scalar.npy", np.float32(1))
    with pytest.raises(ConfigError, match="scalar"):
        NpySource(tmp_path / "scalar.npy")
    np.save(tmp_path / "short.npy", _labels(N - 1))
    with pytest.raises(ConfigError, match=rf"differ in length .*labels.npy: {N}.*short.npy: {N - 1}"):
        NpySource([npy / "labels.npy", tmp_path / "short.npy"])
    with pytest.raises(ConfigError, match="does not exist"):
        NpySource([npy / "images.npy", tmp_path / "missing.npy"])
    with pytest.raises(ConfigError, match="is a directory"):
        NpySource(npy)
    with pytest.raises(ConfigError, match="no files"):
        NpySource([])
    raw = (npy / "images.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[:-10])
    with pytest.raises(ConfigError, match="truncated"):
        NpySource(tmp_path / "cut.npy")


def test_npy_source_pickles_without_files_and_forks_with_them(npy):
    src = NpySource([npy / "images.npy", npy / "labels.npy"])
    first = src[2]
    assert src._fds  # opened on the first read
    clone = pickle.loads(pickle.dumps(src))
    assert clone._fds == [] and clone[2] == first and clone.key(2) == src.key(2)
    clone.close()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_rows_to_queue, args=(src, q))
    p.start()
    rows = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0 and rows == [src[i] for i in range(N)]
    assert src[3] == rows[3]  # the parent's descriptors still work after the child closed its copies
    src.close()
    assert src._fds == [] and src[4] == rows[4]  # and reopen


def _rows_to_queue(src, q) -> None:
    q.put([src[i] for i in range(len(src))])
    src.close()


def test_a_directory_of_npy_files_one_sample_each(shm_root, tmp_path):
    root = tmp_path / "samples"
    root.mkdir()
    arrays = [np.arange(i + 1, dtype=np.int16) * i for i in range(4)]
    arrays.append(np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)))  # Fortran order is fine here
    arrays.append(np.array(["a", "bcd"]))
    for i, a in enumerate(arrays):
        np.save(root / f"{i}.npy", a)
    (root / "skip.txt").write_text("not matched")
    src = DirectorySource(root, "*.npy")
    cache = ShmCache("npy-files", 1 << 20)
    try:
        ds = CachedDataset(src, cache, transform=decode_npy)
        for _ in range(2):  # a miss, then a hit
            got = [ds[i] for i in range(len(ds))]
            for a, b in zip(arrays, got, strict=True):
                assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
                assert not b.flags.writeable and b.flags.aligned
        assert cache.stats()["hits"] == len(arrays)
    finally:
        cache.close()
    raw = (root / "1.npy").read_bytes()
    for bad in (raw[:-1], raw + b"\0", raw[:60], raw[:5], b"", b"junk" * 20):
        with pytest.raises(CacheError):
            decode_npy(bad)
    np.save(tmp_path / "objects.npy", np.array([None, 1], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match="never unpickles"):
        decode_npy((tmp_path / "objects.npy").read_bytes())
    np.savez(tmp_path / "arch.npz", a=arrays[0])
    with pytest.raises(CacheError, match=r"\.npz"):
        decode_npy((tmp_path / "arch.npz").read_bytes())


# ---- HDF5ArraysSource --------------------------------------------------------------------------
def test_hdf5_records_of_several_datasets(h5, npy):
    import h5py

    src = HDF5ArraysSource(h5, ["images", "labels", "grp/masks"])
    with h5py.File(h5, "r") as f:
        masks = f["grp/masks"][()]
    assert len(src) == N and src.names == ("images", "labels", "grp/masks")
    assert src._file is None  # nothing open until the first read
    for i in range(N):
        rec = src.decode(src[i])
        assert np.array_equal(rec["images"], _images()[i]) and rec["labels"] == _labels()[i]
        assert rec["grp/masks"].dtype == np.bool_ and np.array_equal(rec["grp/masks"], masks[i])
    # the same arrays from .npy files make the same pack bytes (the layout depends on the arrays only)
    assert HDF5ArraysSource(h5, ["images", "labels"])[4] == NpySource([npy / "images.npy", npy / "labels.npy"])[4]
    renamed = HDF5ArraysSource(h5, {"x": "images", "y": "labels"})
    assert list(renamed.decode(renamed[0])) == ["x", "y"] and renamed.key(0) != src.key(0)
    assert src.key(3).startswith(f"h5rec:{os.path.realpath(h5)}:images,labels,grp/masks:3@")
    clone = pickle.loads(pickle.dumps(src))
    assert clone._file is None and clone[7] == src[7] and clone.key(7) == src.key(7)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_rows_to_queue, args=(src, q))
    p.start()
    rows = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0 and rows == [src[i] for i in range(N)]
    src.close()
    clone.close()


def test_hdf5_records_refusals(h5, tmp_path):
    import h5py

    with h5py.File(h5, "a") as f:
        f["short"] = np.zeros(N - 2)
        f["scalar"] = 1.0
        f["strings"] = np.array(["a", "bc"] * (N // 2), dtype=h5py.string_dtype())
        f["compound"] = np.zeros(N, dtype=[("a", "<i4"), ("b", "<f8")])
    with pytest.raises(ConfigError, match=rf"differ in length \(images: {N}, short: {N - 2}\)"):
        HDF5ArraysSource(h5, ["images", "short"])
    with pytest.raises(ConfigError, match="no dataset 'nope' .*top-level names: compound, grp, images"):
        HDF5ArraysSource(h5, ["images", "nope"])
    with pytest.raises(ConfigError, match="scalar"):
        HDF5ArraysSource(h5, ["scalar"])
    with pytest.raises(ConfigError, match="Python objects"):
        HDF5ArraysSource(h5, ["images", "strings"])
    with pytest.raises(ConfigError, match="structured"):
        HDF5ArraysSource(h5, ["compound"])
    with pytest.raises(ConfigError, match="HDF5Source"):
        HDF5ArraysSource(h5, "images")
    with pytest.raises(ConfigError, match="no datasets"):
        HDF5ArraysSource(h5, [])
    with pytest.raises(ConfigError, match="does not exist"):
        HDF5ArraysSource(tmp_path / "missing.h5", ["images"])
    with pytest.raises(ConfigError, match="is a directory"):
        HDF5ArraysSource(tmp_path, ["images"])
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(ConfigError, match="cannot open .* as HDF5"):
        HDF5ArraysSource(tmp_path / "junk.h5", ["images"])


# ---- the pack ----------------------------------------------------------------------------------
KINDS = {
    "f4": np.arange(6, dtype=np.float32).reshape(2, 3),
    "be": np.arange(5, dtype=">i2"),
    "bool": np.array([True, False, True]),
    "u": np.array(["ab", "héllo"]),
    "s": np.array([b"x", b"yz"]),
    "dt": np.array(["2024-01-02T03:04"], dtype="datetime64[ns]"),
    "c16": np.array([1 + 2j]),
    "zero": np.zeros((0, 3), dtype=np.uint8),
    "scalar": np.array(3.5),
    "long": np.arange(1000, dtype=np.float64),
}


def test_record_round_trip_aligned_views():
    rec = pack_arrays(KINDS)
    buf = np.zeros(len(rec) + PACK_ALIGN, dtype=np.uint8)  # a 64-byte aligned copy, as the cache holds it
    start = -_address(buf) % PACK_ALIGN
    buf[start:start + len(rec)] = np.frombuffer(rec, np.uint8)
    view = memoryview(buf[start:start + len(rec)]).toreadonly()
    out = unpack_arrays(view)
    assert list(out) == list(KINDS)
    base = _address(buf) + start
    for name, a in KINDS.items():
        got = out[name]
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a), name
        assert not got.flags.writeable and got.flags.aligned, name
        if got.nbytes:
            assert (_address(got) - base) % PACK_ALIGN == 0 and _address(got) % PACK_ALIGN == 0, name
            assert np.shares_memory(got, buf), name  # a view, not a copy
    with pytest.raises(ConfigError, match="Python objects"):
        pack_arrays({"o": np.array([None])})
    with pytest.raises(ConfigError, match="structured"):
        pack_arrays({"s": np.zeros(2, dtype=[("a", "<i4")])})
    with pytest.raises(ConfigError, match="at least one"):
        pack_arrays({})
    with pytest.raises(ConfigError, match="1 to 255"):
        pack_arrays({"": np.zeros(1)})


def _in_bounds(out: dict[str, np.ndarray], data: bytes) -> bool:
    lo = _address(np.frombuffer(data, np.uint8))
    return all(a.nbytes == 0 or lo <= _address(a) and _address(a) + a.nbytes <= lo + len(data) for a in out.values())


def test_truncated_or_damaged_records_are_refused_never_read_out_of_bounds():
    rec = pack_arrays({"images": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "labels": np.arange(2)})
    assert unpack_arrays(rec)["labels"].tolist() == [0, 1]
    for n in range(len(rec)):  # every truncation
        with pytest.raises(CacheError, match="not a valid pack"):
            unpack_arrays(rec[:n])
    with pytest.raises(CacheError, match="truncated or padded"):
        unpack_arrays(rec + b"\0")
    start = struct.unpack_from("<I", rec, 8)[0]
    refused = 0
    for pos in range(start):  # every header byte, set to a few values: refused, or views within the pack
        for value in (0x00, 0x01, 0x3F, 0x80, 0xFF):
            if rec[pos] == value:
                continue
            bad = rec[:pos] + bytes([value]) + rec[pos + 1:]
            try:
                out = unpack_arrays(bad)
            except CacheError:
                refused += 1
                continue
            assert _in_bounds(out, bad), (pos, value)
    assert refused > start  # most damage is caught, not decoded as something else
    # targeted damage: each a clear refusal
    first = 20  # the first entry: offset u64, ndim u8, name_len u8, dtype_len u8, shape, name, dtype
    cases = {
        "magic": (0, b"XXXX"),
        "version": (4, b"\x02"),
        "offset past the end": (first, struct.pack("<Q", len(rec))),
        "misaligned offset": (first, struct.pack("<Q", start + 8)),
        "huge shape": (first + 11, struct.pack("<Q", 2**62)),
        "object dtype": (rec.index(b"<f4"), b"|O8"),
    }
    for what, (pos, patch) in cases.items():
        bad = rec[:pos] + patch + rec[pos + len(patch):]
        with pytest.raises(CacheError, match="not a valid pack"):
            unpack_arrays(bad)
            pytest.fail(what)
    with pytest.raises(CacheError, match="not a valid pack"):
        unpack_arrays(_images()[0].tobytes())  # a raw row is not a pack


# ---- through the cache and a DataLoader ----------------------------------------------------------
def test_hits_are_aligned_read_only_views_of_the_cache(shm_root, npy, h5):
    cache = ShmCache("arrays", 1 << 20)
    try:
        for src in (NpySource([npy / "images.npy", npy / "labels.npy"]), HDF5ArraysSource(h5, ["images", "labels"])):
            ds = CachedDataset(src, cache, transform=src.decode)
            misses = [ds[i] for i in range(N)]
            before = cache.stats()["hits"]
            hits = [ds[i] for i in range(N)]
            assert cache.stats()["hits"] - before == N
            for i in range(N):
                assert bytes(cache.get(src.key(i))) == src[i]
                for rec in (misses[i], hits[i]):
                    assert np.array_equal(rec["images"], _images()[i]) and rec["labels"] == _labels()[i]
                    assert not rec["images"].flags.writeable and rec["images"].flags.aligned
                assert _address(hits[i]["images"]) % PACK_ALIGN == 0
    finally:
        cache.close()


def collate_arrays(batch):
    """Stack a batch of decoded packs into tensors: one copy (np.stack), then zero-copy from_numpy."""
    import torch

    return {k: torch.from_numpy(np.stack([rec[k] for rec in batch])) for k in batch[0]}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_records_through_the_cache(shm_root, npy, h5, context):
    import warnings

    import torch

    cache = ShmCache(f"dl-{context}", 1 << 20)
    sources = [NpySource([npy / "images.npy", npy / "labels.npy"]), HDF5ArraysSource(h5, ["images", "labels"])]
    for src in sources:
        src[0]  # open in the parent: the workers must not use the parent's HDF5 handle
    dataset = torch.utils.data.ConcatDataset([CachedDataset(s, cache, transform=s.decode) for s in sources])
    loader = torch.utils.data.DataLoader(dataset, batch_size=5, num_workers=2, multiprocessing_context=context,
                                         collate_fn=collate_arrays, persistent_workers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about non-writable arrays or buffers
        for _ in range(2):
            batches = list(loader)
            images = torch.cat([b["images"] for b in batches])
            labels = torch.cat([b["labels"] for b in batches])
            assert torch.equal(images, torch.from_numpy(np.concatenate([_images(), _images()])))
            assert torch.equal(labels, torch.from_numpy(np.concatenate([_labels(), _labels()])))
    s = cache.stats()
    assert (s["misses"], s["hits"], s["entries"]) == (2 * N, 2 * N, 2 * N)
    for src in sources:
        assert all(bytes(cache.get(src.key(i))) == src[i] for i in range(N))
    cache.close()


# ---- a changed file is never served stale ------------------------------------------------------
def _rewrite_in_place_keep_mtime(path, data: bytes) -> None:
    st = os.stat(path)
    time.sleep(TICK)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _fill(src, cache) -> list:
    ds = CachedDataset(src, cache)
    return [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("how", ["rename", "in place, mtime kept"])
def test_a_new_source_after_a_change_reads_the_new_rows(shm_root, npy, how):
    cache = ShmCache("stale-npy", 1 << 20)
    try:
        files = [npy / "images.npy", npy / "labels.npy"]
        old = NpySource(files)
        first = _fill(old, cache)
        assert _fill(NpySource(files), cache) == first and cache.stats()["hits"] == N  # unchanged: hits
        new_labels = _labels(tag=1)
        if how == "rename":
            time.sleep(TICK)
            np.save(npy / "tmp.npy", new_labels)
            os.replace(npy / "tmp.npy", npy / "labels.npy")
        else:
            _rewrite_in_place_keep_mtime(npy / "labels.npy", open_npy_bytes(new_labels))
        again = NpySource(files)
        got = [again.decode(b) for b in _fill(again, cache)]
        assert [int(r["labels"]) for r in got] == new_labels.tolist()  # every sample changed, none stale
        assert all(np.array_equal(r["images"], _images()[i]) for i, r in enumerate(got))
        assert all(old.key(i) in cache for i in range(N))  # the old version is still cached, unused
    finally:
        cache.close()


def open_npy_bytes(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_a_new_hdf5_record_source_after_an_in_place_change_reads_the_new_rows(shm_root, h5):
    import h5py

    cache = ShmCache("stale-h5", 1 << 20)
    try:
        old = HDF5ArraysSource(h5, ["images", "labels"])
        _fill(old, cache)
        old.close()  # HDF5 refuses to open a file for writing that this process holds open
        st = os.stat(h5)
        time.sleep(TICK)
        with h5py.File(h5, "r+") as f:
            f["labels"][...] = _labels(tag=1)
        os.utime(h5, ns=(st.st_atime_ns, st.st_mtime_ns))
        again = HDF5ArraysSource(h5, ["images", "labels"])
        got = [int(again.decode(b)["labels"]) for b in _fill(again, cache)]
        assert got == _labels(tag=1).tolist() and all(old.key(i) in cache for i in range(N))
    finally:
        cache.close()


def test_a_file_changed_under_a_built_source(npy, caplog):
    src = NpySource(npy / "labels.npy")
    clone = pickle.loads(pickle.dumps(src))  # as a spawned worker gets it: opens the file on first read
    _rewrite_in_place_keep_mtime(npy / "labels.npy", open_npy_bytes(_labels(tag=5)))
    with caplog.at_level(logging.WARNING, logger="hpcstagger.cache.arrays"):
        assert int(clone.decode(clone[2])) == _labels(tag=5)[2]  # read as it is now, and logged
    assert any("changed after this source was built" in r.getMessage() for r in caplog.records)
    clone.close()
    # another dtype: refused, not misread
    np.save(npy / "labels.npy", _labels().astype(np.int32))
    clone = pickle.loads(pickle.dumps(src))
    with pytest.raises(ConfigError, match="changed after this source was built.*build the source again"):
        clone[0]
    # shrunk under an open source: an error, never a crash (a memory map would take SIGBUS here)
    np.save(npy / "images.npy", _images())
    images = NpySource(npy / "images.npy")
    images[0]
    os.truncate(npy / "images.npy", 200)
    with pytest.raises(ConfigError, match="shorter than when this source was built"):
        images[N - 1]
    images.close()
