"""Cache administration helpers behind ``hpcstagger cache``: list caches, remove a damaged one."""

from __future__ import annotations

import os

from .. import config
from ..errors import CacheError
from . import _fs
from .store import ShmCache

__all__ = ["list_caches", "remove_broken"]


def list_caches(root: str | None = None) -> list[str]:
    """Names of the caches under ``root`` (default: the ``shm_root`` knob); [] if it does not exist."""
    root = os.path.abspath(root or config.get("shm_root"))
    if not os.path.lexists(root):
        return []
    fd = _fs.open_secure_dir(root, create=False, what="cache root")
    try:
        names = []
        for name in sorted(os.listdir(fd)):
            try:
                _fs.validate_name(name)
                os.stat(os.path.join(name, "ledger"), dir_fd=fd, follow_symlinks=False)
            except (CacheError, OSError):
                continue
            names.append(name)
        return names
    finally:
        os.close(fd)


def remove_broken(name: str, root: str | None = None) -> bool:
    """Remove cache directory ``name`` if it is safe to touch (ours, not a link) but not a usable cache.

    For ``hpcstagger cache clear`` on a cache whose creation died half way or whose files were
    damaged. Returns False (removing nothing) when the directory is missing, unsafe, or healthy.
    """
    root = os.path.abspath(root or config.get("shm_root"))
    try:
        _fs.validate_name(name)
        ShmCache(name, None, root=root).close()
        return False  # healthy
    except CacheError:
        pass
    try:
        root_fd = _fs.open_secure_dir(root, create=False, what="cache root")
    except CacheError:
        return False
    try:
        try:
            dir_fd = _fs.open_secure_subdir(root_fd, name, root, create=False, what="cache directory")
        except CacheError:
            return False
        try:
            for entry in os.listdir(dir_fd):
                os.unlink(entry, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        os.rmdir(name, dir_fd=root_fd)
        return True
    finally:
        os.close(root_fd)
