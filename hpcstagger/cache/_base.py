"""What a node cache and the partitioned cache share over their own ``get`` and ``put``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from hpcstagger.cache import wholefile

__all__ = ["LoadThrough"]


class LoadThrough:
    """``get_or_load`` over a cache's own ``get`` and ``put`` (:class:`ShmCache`, and the
    partitioned cache, whose ``put`` stores at the sample's owner node)."""

    def get(self, key: str | int) -> memoryview | None:
        raise NotImplementedError

    def put(self, key: str | int, data: Any) -> bool:
        raise NotImplementedError

    def get_many(self, keys: Iterable[str | int]) -> list[memoryview | None]:
        """``[self.get(k) for k in keys]``: the samples of a batch of keys, in order, None for a miss.

        Caches with a faster batched lookup (:class:`ShmCache`) override it; the results and the
        counted lookups are the same as those of the single gets.
        """
        get = self.get
        return [get(k) for k in keys]

    def get_or_load(self, key: str | int, loader: Callable[[], Any]) -> Any:
        """The cached sample for ``key``, or ``loader()``'s bytes-like result, inserted if the policy allows
        (through :meth:`read_through`: a ShmCache waits for a sample another process is loading).

        The caller always gets its bytes: a refused insert (full cache, full /dev/shm) only means
        the next reader loads it again.
        """
        view = self.get(key)
        if view is not None:
            return view
        return self.read_through(key, loader)[0]

    def read_through(self, key: str | int, read: Callable[[], Any], *,
                     insert: bool = True) -> tuple[Any, bool, bool]:
        """A miss of ``key``: ``(read(), cached, True)``, inserted unless ``insert`` is False
        (``cached``: :meth:`put`'s answer). :class:`ShmCache` reads it once for the node."""
        data = read()
        return data, self.put(key, data) if insert else False, True

    def file_loader(self, decode: Callable[[memoryview], Any] | None = wholefile.pil_rgb, *,
                    listed_root: str | os.PathLike[str] | None = None) -> wholefile.FileLoader:
        """A picklable ``loader(path)`` for torchvision's ``ImageFolder`` and ``DatasetFolder``: the file
        read through this cache, then ``decode(view)``.

        ``decode`` defaults to torchvision's default loader (a PIL Image in RGB); ``None`` gives the
        bytes (a read-only memoryview); any callable on bytes decodes them. The file is keyed by its
        real path and its identity (inode, size, mtime, ctime), so a changed file is never served
        stale. A hit costs one ``stat`` of the file; a miss also opens, reads and ``fstat``s it and
        inserts it. ``listed_root`` takes the identities of the files under that directory from one
        listing instead, made once per node and run as ``DirectorySource`` makes it: a hit then
        costs no system call, and a file changed afterwards is served as it was listed (as
        ``DirectorySource`` does). Raises ConfigError for a bad ``decode`` or ``listed_root``.
        """
        return wholefile.FileLoader(self, decode, listed_root=listed_root)

    def read_file(self, path: str | os.PathLike[str]) -> memoryview:
        """The whole file ``path`` through this cache, as a read-only memoryview: one ``stat`` and a
        lookup on a hit; a miss reads the file and inserts it. A file the cache cannot hold (larger
        than its capacity, or a full cache) is read from the file every time. Raises OSError as
        ``open`` would."""
        return wholefile.read_file(self, path)

    def open_file(self, path: str | os.PathLike[str]) -> wholefile.ViewFile:
        """:meth:`read_file` as a read-only, seekable binary file (for ``tarfile.open(fileobj=...)``);
        it copies nothing. Raises OSError as ``open`` would."""
        return wholefile.open_file(self, path)
