"""The runnable examples of docs/cache.md's "Bring your own dataset" (ImageFolder, DatasetFolder, the
record in the transform, webdataset shards), run as they stand on data prepared here, with their
printed output checked."""

from __future__ import annotations

import io
import re
import tarfile

import pytest

from support.docblocks import REPO, named_blocks, run_block, runnable_blocks

DOC = REPO / "docs" / "cache.md"
NAMES = ("imagefolder", "datasetfolder", "transform-index", "webdataset")
example = pytest.mark.timeout(240)  # each runs its block in a fresh interpreter (torch, DataLoader workers)


@pytest.fixture(scope="module")
def blocks() -> dict[str, str]:
    return runnable_blocks(DOC)


def test_every_example_is_in_the_docs():
    named_blocks(DOC, NAMES)


@pytest.mark.slow
@example
def test_imagefolder_example(blocks, tmp_path, shm_root):
    from PIL import Image

    n = 0
    for c, name in enumerate(("cat", "dog", "fish")):
        (tmp_path / "data" / "train" / name).mkdir(parents=True)
        for k, (mode, ext) in enumerate((("RGB", "png"), ("L", "png"), ("RGBA", "png"), ("RGB", "jpg"))):
            pixels = bytes((c * 50 + k * 20 + j) % 256 for j in range(20 * 12 * 3))
            path = tmp_path / "data" / "train" / name / f"{k}.{ext}"
            Image.frombytes("RGB", (20, 12), pixels).convert(mode).save(path)
            n += 1
    out = run_block(blocks["imagefolder"], tmp_path, shm_root)
    assert out.splitlines() == [
        f"epoch 0: {n} samples, hits 0, misses {n}",  # the first epoch reads every file once
        f"epoch 1: {n} samples, hits {n}, misses {n}",  # the second reads none
        "classes {'cat': 0, 'dog': 1, 'fish': 2}",
    ], out


@pytest.mark.slow
@example
def test_datasetfolder_example(blocks, tmp_path, shm_root):
    import numpy as np

    for c, name in enumerate(("high", "low")):
        d = tmp_path / "data" / "signals" / name
        d.mkdir(parents=True)
        for k in range(5):
            (d / f"{k}.sig").write_bytes((np.arange(32, dtype=np.int16) * (c + 1) + k).tobytes())
        (d / "README.txt").write_text("not a sample")
    out = run_block(blocks["datasetfolder"], tmp_path, shm_root)
    assert out.splitlines() == [
        "epoch 0: 10 samples, misses 10",
        "epoch 1: 10 samples, misses 10",
        "classes {'high': 0, 'low': 1}",
    ], out


@pytest.mark.slow
@example
def test_transform_index_example(blocks, tmp_path, shm_root):
    for name, count in (("ant", 3), ("bee", 5), ("cow", 4)):
        d = tmp_path / "data" / "samples" / name
        d.mkdir(parents=True)
        for k in range(count):
            (d / f"{k}.bin").write_bytes(bytes(range(k, k + 40)))
    out = run_block(blocks["transform-index"], tmp_path, shm_root)
    assert out.splitlines() == ["12 samples, per class [3, 5, 4]", "indices [0, 1, 2]"], out


@pytest.mark.slow
@example
def test_webdataset_example(blocks, tmp_path, shm_root):
    d = tmp_path / "data" / "shards"
    d.mkdir(parents=True)
    for s in range(4):
        with tarfile.open(d / f"train-{s:02d}.tar", "w") as tar:
            for k in range(6):
                for ext, data in (("cls", b"%d" % (k % 2)), ("txt", b"sample %d of shard %d" % (k, s))):
                    info = tarfile.TarInfo(f"s{s}-{k}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    out = run_block(blocks["webdataset"], tmp_path, shm_root)
    rows = [re.fullmatch(r"epoch (\d): (\d+) samples, (\d+) distinct, shards read from files (\d+)", line)
            for line in out.splitlines()]
    assert all(rows) and [m.groups() for m in rows if m] == [("0", "24", "24", "4"), ("1", "24", "24", "4")], out
