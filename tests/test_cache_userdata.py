"""Users' datasets as they are, through the cache: torchvision's ImageFolder and DatasetFolder with
``cache.file_loader()``, whole files (``read_file``, ``open_file``), the index or the record in
CachedDataset's transform, and CachedDataset.__getitems__ with and without ``cache.get_many``."""

from __future__ import annotations

import support.torchvision_cpu  # noqa: F401  (before torchvision: see tests/support/torchvision_cpu.py)

import io
import logging
import os
import pickle
import tarfile
import textwrap

import pytest
import torch
from PIL import Image
from torchvision import datasets, transforms

from hpcstagger.cache import CachedDataset, DirectorySource, ShmCache
from hpcstagger.cache.sources import SampleRecord
from hpcstagger.cache import wholefile
from hpcstagger.errors import ConfigError
from support import cache_util
from support.docblocks import run_block

CLASSES = ("cat", "dog", "fish")
MODES = ("RGB", "RGBA", "L", "P")  # PNG modes; every class also gets two JPEGs


def _image(mode: str, seed: int, size: tuple[int, int] = (12, 9)) -> Image.Image:
    rgb = Image.frombytes("RGB", size, bytes((seed * 37 + k * 11) % 256 for k in range(size[0] * size[1] * 3)))
    return rgb.convert(mode) if mode != "P" else rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)


def make_image_tree(root) -> int:
    """``root/<class>/`` with PNGs in four modes and two JPEGs per class; returns the file count."""
    n = 0
    for c, name in enumerate(CLASSES):
        d = root / name
        d.mkdir(parents=True)
        for k, mode in enumerate(MODES):
            _image(mode, 10 * c + k).save(d / f"{k}.png")
            n += 1
        for k in range(2):
            _image("RGB", 100 + 10 * c + k).save(d / f"j{k}.jpg", quality=90)
            n += 1
    return n


@pytest.fixture
def image_root(tmp_path):
    root = tmp_path / "data" / "train"
    make_image_tree(root)
    return root


def _same_image(a: Image.Image, b: Image.Image) -> bool:
    return (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())


# ---- ImageFolder and DatasetFolder ----------------------------------------------------------------

def test_imagefolder_with_the_cache_loader_is_torchvision_s_own(shm_root, image_root):
    cache = ShmCache("images", 1 << 20)
    ref = datasets.ImageFolder(image_root)
    ds = datasets.ImageFolder(image_root, loader=cache.file_loader())
    n = len(ref)
    assert n == len(CLASSES) * (len(MODES) + 2) == len(ds)
    assert ds.classes == ref.classes == sorted(CLASSES)
    assert ds.class_to_idx == ref.class_to_idx
    assert ds.samples == ref.samples and ds.targets == ref.targets
    for epoch in range(2):
        for i in range(n):
            (img, y), (rimg, ry) = ds[i], ref[i]
            assert y == ry == ref.class_to_idx[os.path.basename(os.path.dirname(ref.samples[i][0]))]
            assert img.mode == "RGB" and _same_image(img, rimg), (epoch, ref.samples[i][0])
        s = cache.stats()
        assert (s["misses"], s["hits"], s["inserts"]) == (n, epoch * n, n), (epoch, s)
    files = [p for p, _ in ref.samples]
    assert s["insert_bytes"] == s["read_bytes"] == sum(os.path.getsize(p) for p in files)
    assert bytes(cache.read_file(files[0])) == open(files[0], "rb").read()


def test_a_second_process_and_dataloader_workers_hit(shm_root, image_root, tmp_path):
    cache = ShmCache("images2", 1 << 20)
    tf = transforms.PILToTensor()
    ref = datasets.ImageFolder(image_root, transform=tf)
    ds = datasets.ImageFolder(image_root, loader=cache.file_loader(), transform=tf)
    n = len(ref)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork")
    images, labels = zip(*loader, strict=True)
    ref_images, ref_labels = zip(*torch.utils.data.DataLoader(ref, batch_size=3), strict=True)
    assert torch.equal(torch.cat(images), torch.cat(ref_images))
    assert torch.equal(torch.cat(labels), torch.cat(ref_labels))
    assert (cache.stats()["misses"], cache.stats()["hits"]) == (n, 0)
    # another process on the node, attaching by name: every read is a hit
    out = run_block(textwrap.dedent(f"""
        from torchvision import datasets
        from hpcstagger.cache import ShmCache
        cache = ShmCache("images2", None)
        ds = datasets.ImageFolder({str(image_root)!r}, loader=cache.file_loader())
        labels = [ds[i][1] for i in range(len(ds))]
        s = cache.stats()
        print(len(labels), s["misses"], s["hits"])
    """), tmp_path, shm_root)
    assert out.split() == [str(n), str(n), str(n)]


def byte_sum(data) -> int:
    return sum(bytes(data))


def test_datasetfolder_with_a_custom_extension_and_decode(shm_root, tmp_path):
    root = tmp_path / "sigs"
    expected = {}
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for k in range(4):
            data = cache_util.sample(10 * ord(c) + k, 100, 3000)
            (root / c / f"{k}.sig").write_bytes(data)
            expected[str(root / c / f"{k}.sig")] = data
        (root / c / "notes.txt").write_text("not a sample")
    cache = ShmCache("sigs", 1 << 20)
    ds = datasets.DatasetFolder(root, loader=cache.file_loader(decode=byte_sum), extensions=(".sig",))
    ref = datasets.DatasetFolder(root, loader=lambda p: sum(open(p, "rb").read()), extensions=(".sig",))
    assert len(ds) == 8 and ds.class_to_idx == ref.class_to_idx == {"a": 0, "b": 1}
    assert [ds[i] for i in range(8)] == [ref[i] for i in range(8)]
    raw = datasets.DatasetFolder(root, loader=cache.file_loader(decode=None), extensions=(".sig",))
    for i in range(8):
        view, y = raw[i]
        assert isinstance(view, memoryview) and view.readonly
        assert bytes(view) == expected[raw.samples[i][0]] and y == raw.targets[i]
    s = cache.stats()
    assert (s["misses"], s["hits"]) == (8, 8)  # the raw pass hit what the decoded pass cached


def test_the_loader_pickles_and_rejects_bad_arguments(shm_root, image_root):
    cache = ShmCache("pk", 1 << 20)
    loader = cache.file_loader(listed_root=image_root)
    path = str(image_root / "cat" / "0.png")
    back = pickle.loads(pickle.dumps(loader))
    assert _same_image(back(path), loader(path))
    assert back.listed_root == os.path.realpath(image_root)
    with pytest.raises(ConfigError, match="decode must be a callable"):
        cache.file_loader(decode="rgb")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="is not a directory"):
        cache.file_loader(listed_root=image_root / "nothing-here")
    with pytest.raises(FileNotFoundError):
        loader(str(image_root / "cat" / "missing.png"))


def test_the_partitioned_cache_has_the_same_loader(shm_root, image_root):
    from hpcstagger.cache import PartitionedCache

    cache = PartitionedCache("part", 1 << 20)  # one process: the whole partition is this node
    try:
        ref = datasets.ImageFolder(image_root)
        ds = datasets.ImageFolder(image_root, loader=cache.file_loader())
        for _ in range(2):
            assert all(_same_image(ds[i][0], ref[i][0]) for i in range(len(ref)))
        s = cache.stats()
        assert (s["local_hits"], s["entries"]) == (len(ref), len(ref))
        path = ref.samples[0][0]
        assert bytes(cache.read_file(path)) == open(path, "rb").read()
    finally:
        cache.close()


def test_a_file_shares_its_entry_with_directory_source(shm_root, image_root):
    cache = ShmCache("shared", 1 << 20)
    source = DirectorySource(image_root)
    ds = CachedDataset(source, cache)
    assert [wholefile.file_key(source.path(i)) for i in range(len(source))] == [source.key(i)
                                                                               for i in range(len(source))]
    filled = [ds[i] for i in range(len(source))]
    raw = cache.file_loader(decode=None)
    assert [bytes(raw(source.path(i))) for i in range(len(source))] == filled
    s = cache.stats()
    assert (s["misses"], s["hits"]) == (len(source), len(source))


# ---- a changed file is never served stale ---------------------------------------------------------

def _replace(path, data):
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a new inode (the old one is still linked while the new is made)


def _rewrite_same_size_mtime_forward(path, data):
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _grow(path, data):
    with open(path, "ab") as f:
        f.write(b"more")


@pytest.mark.parametrize("change", [_replace, _rewrite_same_size_mtime_forward, _grow],
                         ids=["replaced", "rewritten-in-place", "grown"])
def test_a_changed_file_is_read_fresh(shm_root, tmp_path, change):
    path = tmp_path / "f.bin"
    old, new = cache_util.sample(1, 2000, 2000), cache_util.sample(2, 2000, 2000)
    path.write_bytes(old)
    cache = ShmCache("changed", 1 << 20)
    raw = cache.file_loader(decode=None)
    assert bytes(raw(str(path))) == old and bytes(raw(str(path))) == old  # a miss, then a hit
    assert (cache.stats()["misses"], cache.stats()["hits"]) == (1, 1)
    change(path, new)
    now = path.read_bytes()
    assert now != old
    assert bytes(raw(str(path))) == now
    assert bytes(cache.read_file(path)) == now  # the new version was cached under its own identity
    s = cache.stats()
    assert (s["misses"], s["hits"], s["inserts"]) == (2, 2, 2)


def test_listed_identities_spare_the_stat_and_read_changes_as_they_are(shm_root, image_root, monkeypatch, caplog):
    cache = ShmCache("listed", 1 << 20)
    paths = sorted(str(p) for p in image_root.rglob("*.*"))
    plain, listed = cache.file_loader(decode=None), cache.file_loader(decode=None, listed_root=image_root)
    for p in paths:
        plain(p)  # fill
    stats = []
    real_stat = os.stat

    def counting_stat(path, *a, **kw):
        stats.append(path)
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(os, "stat", counting_stat)
    assert [bytes(plain(p)) for p in paths] == [bytes(listed(p)) for p in paths]
    assert len(stats) == len(paths)  # one stat per hit without a listing, none with it
    monkeypatch.undo()
    assert cache.stats()["misses"] == len(paths)
    # a file not yet cached that changed after the listing: read as it is now, logged once
    fresh = ShmCache("listed2", 1 << 20)
    loader = fresh.file_loader(decode=None, listed_root=image_root)
    target = image_root / "dog" / "0.png"
    _replace(target, b"new bytes")
    monkeypatch.setattr(wholefile, "_changes_logged", set())
    with caplog.at_level(logging.WARNING, logger="hpcstagger.cache.wholefile"):
        assert bytes(loader(str(target))) == b"new bytes"
        assert bytes(loader(str(target))) == b"new bytes"
    assert len([r for r in caplog.records if "changed after" in r.message]) == 1
    # it was cached under the identity it was read at: a loader that stats each file hits it
    before = fresh.stats()["hits"]
    assert bytes(fresh.file_loader(decode=None)(str(target))) == b"new bytes"
    assert fresh.stats()["hits"] == before + 1


# ---- whole files ----------------------------------------------------------------------------------

def test_open_file_gives_tarfile_the_shard_once(shm_root, tmp_path):
    shard = tmp_path / "shard.tar"
    members = {f"s{k:02d}.bin": cache_util.sample(k, 500, 5000) for k in range(6)}
    with tarfile.open(shard, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cache = ShmCache("tar", 1 << 20)
    for mode in ("r", "r|"):  # random access and stream
        with tarfile.open(fileobj=cache.open_file(shard), mode=mode) as tar:
            got = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}
        assert got == members
    s = cache.stats()
    assert (s["misses"], s["hits"], s["read_bytes"]) == (1, 1, os.path.getsize(shard))


def test_view_file_reads_seeks_and_copies_nothing():
    data = bytes(range(256)) * 4
    f = wholefile.ViewFile(memoryview(data), name="x")
    assert f.read(3) == data[:3] and f.tell() == 3
    assert f.seek(-2, io.SEEK_END) == len(data) - 2 and f.read() == data[-2:] and f.read(5) == b""
    f.seek(10)
    buf = bytearray(4)
    assert f.readinto(buf) == 4 and bytes(buf) == data[10:14]
    assert f.getbuffer().readonly and f.getbuffer().obj is data
    with pytest.raises(ValueError):
        f.seek(-1)
    assert io.BufferedReader(wholefile.ViewFile(data)).read() == data


def test_a_file_larger_than_the_cache_is_read_every_time_and_logged_once(shm_root, tmp_path, monkeypatch, caplog):
    big = tmp_path / "big.bin"
    big.write_bytes(cache_util.sample(3, 5000, 5000))
    cache = ShmCache("small", 4096)
    monkeypatch.setattr(wholefile, "_refusals_logged", set())
    with caplog.at_level(logging.INFO, logger="hpcstagger.cache.wholefile"):
        for _ in range(3):
            assert bytes(cache.read_file(big)) == big.read_bytes()
    s = cache.stats()
    assert (s["misses"], s["hits"], s["inserts"], s["read_bytes"]) == (3, 0, 0, 3 * 5000)
    logged = [r.message for r in caplog.records if "over its capacity" in r.message]
    assert len(logged) == 1 and "big.bin" in logged[0], caplog.text


# ---- CachedDataset: the index or the record in the transform --------------------------------------

@pytest.fixture
def class_dir(tmp_path):
    root = tmp_path / "samples"
    for c, name in enumerate(("ant", "bee", "cow")):
        (root / name).mkdir(parents=True)
        for k in range(3):
            (root / name / f"{k}.bin").write_bytes(cache_util.sample(10 * c + k, 100, 2000))
    return root


def with_path_label(data, record):
    assert record.path.endswith(".bin") and record.key.startswith("file:")
    return bytes(data), os.path.basename(os.path.dirname(record.path))


def with_index(data, i):
    return bytes(data), i


class Meter:
    def __init__(self):
        self.samples = []

    def sample(self, hit, nbytes, get_s, read_s, insert_s, transform_s, read_cpu_s=0.0):
        self.samples.append((hit, nbytes))


@pytest.mark.parametrize("measured", [False, True], ids=["plain", "measured"])
def test_the_transform_gets_the_index_or_the_record(shm_root, class_dir, measured):
    source = DirectorySource(class_dir, "*/*.bin")
    cache = ShmCache("rec", 1 << 20)
    by_record = CachedDataset(source, cache, with_path_label, with_record=True)
    by_index = CachedDataset(source, cache, with_index, with_index=True)
    meter = Meter()
    if measured:
        by_record.meter = by_index.meter = meter
    for i in range(len(source)):
        assert by_record[i] == (source[i], ("ant", "bee", "cow")[i // 3])
        assert by_index[i] == (source[i], i)
    if measured:
        assert meter.samples == [(False, len(source[i])) if d is by_record else (True, len(source[i]))
                                 for i in range(len(source)) for d in (by_record, by_index)]
    loader = torch.utils.data.DataLoader(by_record, batch_size=3)
    assert [list(labels) for _, labels in loader] == [["ant"] * 3, ["bee"] * 3, ["cow"] * 3]


class RecordSource:
    """A source with a record of its own (taken over ``path``)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return b"x" * (i + 1)

    def key(self, i):
        return f"rec-{i}"

    def path(self, i):
        raise AssertionError("record() is preferred over path()")

    def record(self, i):
        return {"label": i % 2}


def test_record_is_preferred_and_bad_combinations_are_refused(shm_root, class_dir):
    cache = ShmCache("rec2", 1 << 20)
    ds = CachedDataset(RecordSource(4), cache, lambda d, r: (len(d), r["label"]), with_record=True)
    assert [ds[i] for i in range(4)] == [(1, 0), (2, 1), (3, 0), (4, 1)]
    source = DirectorySource(class_dir)
    with pytest.raises(ConfigError, match="exclude each other"):
        CachedDataset(source, cache, with_index, with_index=True, with_record=True)
    with pytest.raises(ConfigError, match="needs a transform"):
        CachedDataset(source, cache, with_index=True)

    class Bare:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return b""

        def key(self, i):
            return i

    bare = CachedDataset(Bare(), cache, lambda d, r: r, with_record=True)
    assert bare[0] == SampleRecord(0, None, 0)  # no file behind it: the record has its index and key


# ---- CachedDataset.__getitems__ -------------------------------------------------------------------

class PlainCache:
    """A cache with get and put only (no get_many), over a ShmCache."""

    def __init__(self, cache):
        self.cache = cache
        self.gets = 0

    def get(self, key):
        self.gets += 1
        return self.cache.get(key)

    def put(self, key, data):
        return self.cache.put(key, data)

    def count_read(self, nbytes, seconds):
        self.cache.count_read(nbytes, seconds)


class BatchCache(PlainCache):
    """The same with get_many, recording each batch of keys."""

    def __init__(self, cache):
        super().__init__(cache)
        self.batches = []

    def get_many(self, keys):
        self.batches.append(list(keys))
        return [self.cache.get(k) for k in keys]


@pytest.mark.parametrize("wrapper", [PlainCache, BatchCache], ids=["get", "get_many"])
def test_getitems_gives_what_getitem_gives(shm_root, class_dir, wrapper):
    source = DirectorySource(class_dir)
    shm = ShmCache("items", 1 << 20)
    cache = wrapper(shm)
    ds = CachedDataset(source, cache, with_index, with_index=True)
    n = len(source)
    expected = [(source[i], i) for i in range(n)]
    for epoch in range(2):
        loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=list)
        assert [item for batch in loader for item in batch] == expected
        s = shm.stats()
        assert (s["misses"], s["hits"], s["inserts"]) == (n, epoch * n, n)
    if wrapper is BatchCache:
        assert cache.batches == 2 * [[source.key(i) for i in range(k, min(k + 4, n))] for k in range(0, n, 4)]
        assert cache.gets == 0
    else:
        assert cache.gets == 2 * n
    assert ds.__getitems__([5, 0, 5]) == [expected[5], expected[0], expected[5]]
    ds.meter = Meter()  # measured: item by item, each told to the meter
    assert ds.__getitems__([1, 2]) == [expected[1], expected[2]]
    assert ds.meter.samples == [(True, len(source[1])), (True, len(source[2]))]
    plain = CachedDataset(source, cache)  # without a transform: bytes, as __getitem__ gives
    assert plain.__getitems__([0, 1]) == [source[0], source[1]] == [plain[0], plain[1]]


def test_getitems_refuses_a_get_many_of_the_wrong_length(shm_root, class_dir):
    class Short(PlainCache):
        def get_many(self, keys):
            return [None]

    ds = CachedDataset(DirectorySource(class_dir), Short(ShmCache("short", 1 << 20)))
    with pytest.raises(TypeError, match="one .* per key"):
        ds.__getitems__([0, 1])


def test_the_torchvision_shim_defines_operators_only_where_torchvision_cannot_load_its_own(tmp_path):
    # Defining torchvision::nms where torchvision's own library loads (a CUDA torch) made its later
    # registration of the same operator abort the process: the shim loads the library first.
    import importlib
    import shutil

    from support.torchvision_cpu import _operators_load

    shared = next((m.__file__ for m in map(importlib.import_module, ("_json", "math", "_ctypes"))
                   if getattr(m, "__file__", "").endswith(".so")), None)
    if shared is None:
        pytest.skip("this Python has no extension module built as a shared object to stand in for a library")
    (tmp_path / "loads").mkdir()
    shutil.copy(shared, tmp_path / "loads" / "_C.so")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "_C.so").write_bytes(b"not a shared object")
    assert _operators_load([str(tmp_path / "loads")]) is True
    assert _operators_load([str(tmp_path / "broken")]) is False
    assert _operators_load([str(tmp_path / "nothing")]) is False
    assert str(tmp_path / "loads" / "_C.so") in torch.ops.loaded_libraries
