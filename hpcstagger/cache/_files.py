"""Creating and opening the files of one cache, in its directory (see :mod:`hpcstagger.cache._ledger`).

Every file is opened relative to the cache directory's descriptor with ``O_NOFOLLOW``, created
mode 0600. A new cache's ``ledger`` is written in full to ``ledger.tmp`` and renamed into place,
so a ledger either does not exist or is complete; its ``index.1`` and ``arena.1`` are created first.
The caller holds the cache directory's ``flock`` (creation and first attach are serialised).
"""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Callable

from hpcstagger.errors import CacheError
from hpcstagger.cache import _fs
from hpcstagger.cache._layout import (HEADER_BYTES, H_ARENA_BYTES, H_CAPACITY, H_CREATED, H_GEN, H_INDEX_SLOTS, H_MAGIC,
                      H_MAX_ENTRIES, H_NSLOTS, H_POLICY, H_VERSION, LEDGER_BYTES, MAGIC, NSLOTS, SLOT,
                      VERSION, sizes_for)

FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def exists(name: str, dir_fd: int) -> bool:
    """Whether ``name`` exists in the directory ``dir_fd`` (a symlink counts: it is not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def open_file(dir_fd: int, path: str, cache: str, name: str) -> int:
    """Open the existing file ``name`` of cache ``cache`` (directory ``path``) read-write."""
    file_path = os.path.join(path, name)
    try:
        return os.open(name, os.O_RDWR | FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CacheError(f"cache {path} lost its {name}; remove the cache with "
                         f"'hpcstagger cache clear {cache}'") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _fs.symlink_error(file_path, "cache file") from None
        raise CacheError(f"cannot open cache file {file_path}: {exc.strerror}") from None


def create_cache(dir_fd: int, path: str, root: str, capacity: int, policy_code: int, max_entries: int,
                 stores: bool) -> None:
    """Create a cache's files in the directory ``dir_fd`` (``path``, under ``root``): the first
    generation's index and arena (if it ``stores``), then the ledger with its header filled in."""
    for leftover in os.listdir(dir_fd):  # a creation that died half way
        os.unlink(leftover, dir_fd=dir_fd)
    slots, arena = sizes_for(capacity, max_entries, stores)
    if stores:
        create_file(dir_fd, path, root, "index.1", slots * SLOT.size, allocate=True)
        create_file(dir_fd, path, root, "arena.1", arena, allocate=False)
    header = [0] * (HEADER_BYTES // 8)
    header[H_MAGIC], header[H_VERSION], header[H_CAPACITY] = MAGIC, VERSION, capacity
    header[H_POLICY], header[H_MAX_ENTRIES], header[H_INDEX_SLOTS] = policy_code, max_entries, slots
    header[H_ARENA_BYTES], header[H_GEN], header[H_CREATED] = arena, 1, int(time.time())
    header[H_NSLOTS] = NSLOTS
    data = struct.pack(f"<{len(header)}Q", *header) + bytes(LEDGER_BYTES - HEADER_BYTES)
    _new_file(dir_fd, "ledger.tmp", lambda fd: _write_all(fd, data),
              lambda why: f"cannot create cache {path}: {why}; free space in {root} (df -h {root})")
    os.rename("ledger.tmp", "ledger", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def create_file(dir_fd: int, path: str, root: str, name: str, size: int, *, allocate: bool) -> None:
    """Create ``name`` of ``size`` bytes. Files read through a mapping at arbitrary places (the
    index) are allocated now: on tmpfs a read fault in a hole allocates a page, and on a full
    /dev/shm that is a SIGBUS. The arena stays sparse: only regions written by pwrite are read."""

    def fill(fd: int) -> None:
        if allocate and size:
            os.posix_fallocate(fd, 0, size)
        os.ftruncate(fd, size)

    _new_file(dir_fd, name, fill,
              lambda why: f"cannot create {path}/{name} ({size} bytes): {why}; free space in {root} "
                          f"(df -h {root}) or use a smaller capacity or max_entries")


def _new_file(dir_fd: int, name: str, fill: Callable[[int], None], failure: Callable[[str | None], str]) -> None:
    """Create ``name`` (mode 0600, no symlink followed) and ``fill`` it; if that fails with an OSError,
    remove it and raise CacheError(``failure(the OS's reason)``)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        fill(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)
        raise CacheError(failure(exc.strerror)) from None
    os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
