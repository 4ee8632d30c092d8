"""Durable writes and checksums."""

from __future__ import annotations

import os

import pytest

from hpcstagger._io import atomic_write, atomic_write_json, checksum, checksum_stream, read_json


def test_checksum_is_stable_and_sensitive():
    import numpy as np

    data = bytes(range(256)) * 100
    assert checksum(data) == checksum(memoryview(data)) == checksum(np.frombuffer(data, np.uint8))
    assert len(checksum(data)) == 16
    flipped = bytearray(data)
    flipped[1234] ^= 1
    assert checksum(bytes(flipped)) != checksum(data)
    assert checksum_stream([data[:1000], data[1000:]]) == checksum(data)


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "f.json"
    atomic_write_json(p, {"a": 1})
    atomic_write_json(p, {"a": 2})
    assert read_json(p) == {"a": 2}
    assert os.listdir(tmp_path) == ["f.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path):
    p = tmp_path / "f.bin"
    atomic_write(p, b"old")

    def explode(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(p, explode)
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_atomic_write_json_rejects_nan(tmp_path):
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"x": float("nan")})
    assert not list(tmp_path.iterdir())
