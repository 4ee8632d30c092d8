"""The runnable examples of docs/cache.md for NumPy arrays and HDF5 packs, run as they stand on
data prepared here, with their printed output checked."""

from __future__ import annotations

import numpy as np
import pytest

from support.docblocks import REPO, named_blocks, run_block, runnable_blocks

DOC = REPO / "docs" / "cache.md"
NAMES = ("numpy", "hdf5-arrays")


@pytest.fixture(scope="module")
def blocks() -> dict[str, str]:
    return runnable_blocks(DOC)


def test_every_example_is_in_the_docs():
    named_blocks(DOC, NAMES)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_numpy_example(blocks, tmp_path, shm_root):
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "images.npy", np.arange(10 * 3 * 4, dtype=np.float32).reshape(10, 3, 4))
    np.save(tmp_path / "data" / "labels.npy", np.arange(10, dtype=np.int64) * 10)
    # as it stands, but with warnings as errors: no tensor over memory that is not writable
    code = "import warnings\nwarnings.simplefilter('error')\n" + blocks["numpy"]
    out = run_block(code, tmp_path, shm_root)
    assert out.splitlines() == [
        "epoch 0: images (2, 3, 4) torch.float32, labels [80, 90]",
        "epoch 1: images (2, 3, 4) torch.float32, labels [80, 90]",
        "hit rate 0.50",  # the first epoch filled the cache, the second read it
    ], out


@pytest.mark.timeout(240)
def test_hdf5_records_example(blocks, tmp_path, shm_root):
    import h5py

    (tmp_path / "data").mkdir()
    with h5py.File(tmp_path / "data" / "train.h5", "w") as f:
        f["images"] = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2)
        f["labels"] = np.arange(6, dtype=np.int32) + 100
        f["masks"] = np.arange(6 * 3).reshape(6, 3) % 2 == 0
        f["unused"] = np.zeros(2)
    out = run_block(blocks["hdf5-arrays"], tmp_path, shm_root)
    assert out.splitlines() == [
        "images (2, 2) uint8 read-only",
        "labels () int32 read-only",
        "masks (3,) bool read-only",
        "label 103 mask [False, True, False] hits 1",
    ], out
