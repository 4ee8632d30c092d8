"""A synthetic, learnable, image-like dataset in one HDF5 file.

Each sample is one row of the ``samples`` dataset (uint8): a label byte, then a C x H x W image
whose colour and stripe orientation depend on the label, plus noise. The file is written in
chunks, so generating a few hundred MB needs little memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from hpcstagger._io import temp_path

__all__ = ["CLASSES", "make_dataset", "decode"]

CLASSES = 10


def _images(labels: np.ndarray, shape: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    c, h, w = shape
    yy, xx = np.mgrid[0:h, 0:w]
    out = np.empty((len(labels), c, h, w), dtype=np.uint8)
    for i, y in enumerate(labels):
        angle = np.pi * y / CLASSES
        stripes = np.sin((np.cos(angle) * xx + np.sin(angle) * yy) * (2 * np.pi / 8))
        base = 128 + 60 * stripes
        for ch in range(c):
            tint = 40 * np.cos(2 * np.pi * (y / CLASSES + ch / c))
            noise = rng.normal(0, 25, size=(h, w))
            out[i, ch] = np.clip(base + tint + noise, 0, 255)
    return out


def make_dataset(path: str, samples: int, shape: tuple[int, int, int] = (3, 64, 64), *, seed: int = 0,
                 progress: Callable[[int], None] | None = None) -> int:
    """Write ``samples`` labelled images to ``path`` (atomically); return the bytes per sample."""
    import h5py

    row = 1 + int(np.prod(shape))
    rng = np.random.default_rng(seed)
    tmp = temp_path(path)
    try:
        with h5py.File(tmp, "w") as f:
            ds = f.create_dataset("samples", shape=(samples, row), dtype=np.uint8, chunks=(1, row))
            ds.attrs["image_shape"] = shape
            ds.attrs["classes"] = CLASSES
            block = 256
            for start in range(0, samples, block):
                n = min(block, samples - start)
                labels = rng.integers(0, CLASSES, size=n)
                rows = np.empty((n, row), dtype=np.uint8)
                rows[:, 0] = labels
                rows[:, 1:] = _images(labels, shape, rng).reshape(n, -1)
                ds[start:start + n] = rows
                if progress:
                    progress(n)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return row


def decode(data: bytes | memoryview, shape: tuple[int, int, int]) -> tuple[np.ndarray, int]:
    """A sample's bytes as (float32 image scaled to [0, 1], label)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    image = arr[1:].reshape(shape).astype(np.float32) / 255.0
    return image, int(arr[0])
