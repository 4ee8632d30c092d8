"""Durable file writes and checksums shared by the cache, checkpoints and calibration files,
dropping a file from the kernel's page cache, and whole-line writes to stderr.

Every durable write goes: temp file in the same directory, write, flush, fsync, rename over the
target, fsync the directory. A reader therefore sees the old file or the new one, never a part.
Checksums are xxh3-64 (about 12 GB/s here, against 3 GB/s for zlib's CRC-32), written as 16 hex
digits so JSON and HDF5 attributes hold them exactly.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any, BinaryIO
from collections.abc import Callable

__all__ = ["CHECKSUM_ALGORITHM", "checksum", "fsync_dir", "atomic_write", "atomic_write_json", "read_json",
           "json_safe", "drop_cached_pages", "say_line"]

CHECKSUM_ALGORITHM = "xxh3_64"


def checksum(data: Any) -> str:
    """xxh3-64 of a bytes-like object (bytes, memoryview, contiguous numpy array) as 16 hex digits."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def checksum_stream(chunks: Any) -> str:
    """xxh3-64 of the concatenation of an iterable of bytes-like chunks."""
    import xxhash

    h = xxhash.xxh3_64()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename or unlink inside it is durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str | os.PathLike[str]) -> str:
    """A unique temporary name beside ``path`` (same directory, hence same file system)."""
    path = os.fspath(path)
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], None], *,
                 mode: int = 0o644, durable: bool = True) -> None:
    """Write ``data`` (bytes, or a function that writes to the open file) to ``path`` atomically.

    With ``durable`` (the default) the file and its directory are fsynced before and after the
    rename. On any error the temporary file is removed and the old ``path`` is left as it was.
    """
    path = os.fspath(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, durable: bool = True) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (see :func:`atomic_write`)."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    atomic_write(path, text.encode(), durable=durable)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Load a JSON file."""
    with open(path, "rb") as f:
        return json.loads(f.read())


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats (nan, inf) replaced by None, so that it is valid JSON."""
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def drop_cached_pages(path: str | os.PathLike[str]) -> int:
    """Ask the kernel to drop ``path``'s pages from its page cache (``posix_fadvise(DONTNEED)``;
    no privileges needed, dirty or mapped pages stay). Returns the file's size in bytes.

    Raises OSError when the file cannot be opened or advised, AttributeError where the platform
    has no ``posix_fadvise``.
    """
    advise = os.posix_fadvise
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return size
    finally:
        os.close(fd)


def say_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in one call and flush.

    ``print`` writes the text and the newline separately; under ``PYTHONUNBUFFERED`` (or ``python -u``)
    those are two system calls, so lines from several ranks sharing one pipe can run together. One write
    of up to PIPE_BUF (4096) bytes to a pipe is atomic.
    """
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
