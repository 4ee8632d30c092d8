"""Whole files through the cache: users' datasets as they are.

- :class:`FileLoader` (``cache.file_loader()``): the ``loader`` of torchvision's ``ImageFolder`` and
  ``DatasetFolder``, reading each file through the cache and decoding it.
- :func:`read_file` and :func:`open_file` (``cache.read_file(path)``, ``cache.open_file(path)``): a
  whole file's bytes, or a read-only binary file over them, for ``tarfile`` and tar shards.
- :class:`ShardOpener` and :func:`shard_samples`: stages of a ``webdataset`` pipeline that open each
  shard through the cache; :func:`cached_webdataset`: ``webdataset.WebDataset`` with that opener.

A file is cached under ``file:<real path>@<identity>``, the identity being
:func:`~hpcstagger.cache._listing.stat_token` of the version read (inode, size, mtime, ctime), as
:class:`~hpcstagger.cache.DirectorySource` keys its samples. The key of a lookup is computed from the
file's identity *now*: a lookup costs one ``stat`` of the file (or none with ``listed_root``), and a
changed file is a miss, read from the file, never the old bytes. A miss opens the file, ``fstat``s it,
reads it whole and ``fstat``s it again: it is inserted under the identity it was read at, and only
when that identity held over the whole read. A file the cache refuses (larger than its capacity, or
a full cache) is read from its file every time, correctly; that is logged once per process.

Nothing here imports PIL, torch or webdataset until a function needs it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, cast
from urllib.parse import urlparse

from hpcstagger.errors import ConfigError, DependencyError
from hpcstagger.cache._listing import Selection, stat_token
from hpcstagger.cache._nodelisting import dataset_listing

__all__ = ["FileLoader", "ViewFile", "ShardOpener", "pil_rgb", "read_file", "open_file", "file_key",
           "shard_samples", "cached_webdataset"]

log = logging.getLogger(__name__)

_real_dirs: dict[str, str] = {}  # per process: a directory, absolute as given -> its real path
_refusals_logged: set[str] = set()  # per process: the reasons already logged (see _refused)
_changes_logged: set[str] = set()  # per process: listed roots whose change was logged


class ByteCache(Protocol):
    """What the functions here need of a cache: :class:`~hpcstagger.cache.ShmCache` and
    :class:`~hpcstagger.cache.PartitionedCache` have it."""

    def get(self, key: str | int) -> memoryview | None: ...

    def put(self, key: str | int, data: Any) -> bool: ...


# ---- keys and reads -------------------------------------------------------------------------------

def _key_path(path: str | os.PathLike[str]) -> str:
    """``path`` with its directory resolved to a real path (once per directory and process): the
    file's name as keyed. A symbolic link to a file is keyed by the link's name and its target's
    identity, so two links to one file only duplicate an entry, never mix two files."""
    head, base = os.path.split(os.path.abspath(os.fspath(path)))
    real = _real_dirs.get(head)
    if real is None:
        real = _real_dirs[head] = os.path.realpath(head)
    return os.path.join(real, base)


def file_key(path: str | os.PathLike[str], token: int | None = None) -> str:
    """The cache key of the file ``path`` at identity ``token`` (default: its identity now, one
    ``stat``). The same key :class:`~hpcstagger.cache.DirectorySource` gives a regular file it lists.
    Raises OSError if the file cannot be stat'ed."""
    if token is None:
        token = stat_token(os.stat(path))
    return f"file:{_key_path(path)}@{token:016x}"


def _read_whole(path: str) -> tuple[bytes, int, int]:
    """The content of ``path`` and its identity before and after the read (one open, two fstats)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        size = st.st_size
        chunks: list[bytes] = []
        got = 0
        while True:  # one read for most files; more for files over 2 GiB or short reads
            more = os.read(fd, max(size - got, 1 << 20))
            if not more:
                break
            chunks.append(more)
            got += len(more)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return data, stat_token(st), stat_token(os.fstat(fd))
    finally:
        os.close(fd)


def _through(cache: ByteCache, path: str, kpath: str, token: int | None, listed_root: str = "") -> memoryview:
    """The whole file ``path`` through ``cache``: a hit under its identity ``token`` (its identity
    now when None: one stat), else a read of the file, inserted under the identity it was read at."""
    if token is None:
        token = stat_token(os.stat(path))
    key = f"file:{kpath}@{token:016x}"
    view = cache.get(key)
    if view is not None:
        return view
    through = getattr(cache, "read_through", None)
    if through is None:
        return _read_in(cache, path, kpath, token, listed_root)
    # a file another process is reading already is waited for, not read again; the read inserts
    # under the identity it read the file at, which the waiters find when it is the one they looked up
    got, _, _ = through(key, functools.partial(_read_in, cache, path, kpath, token, listed_root), insert=False)
    return memoryview(got)


def _read_in(cache: ByteCache, path: str, kpath: str, token: int, listed_root: str) -> memoryview:
    """A read of the whole file ``path`` (looked up under identity ``token``), inserted under the
    identity it was read at, and counted as a source read."""
    t0 = time.perf_counter()
    reading = getattr(cache, "reading", None)
    with reading() if reading is not None else contextlib.nullcontext():
        data, before, after = _read_whole(path)
    if before != token and listed_root and listed_root not in _changes_logged:
        _changes_logged.add(listed_root)
        log.warning("%s changed after %s was listed: read as it is now; build a new file_loader, or restart "
                    "the job, to cache it under its new identity (further changes are not logged)", path, listed_root)
    if before == after and not cache.put(f"file:{kpath}@{before:016x}", data):
        _refused(cache, path, len(data))
    count_read = getattr(cache, "count_read", None)
    if count_read is not None:
        count_read(len(data), time.perf_counter() - t0)
    return memoryview(data)


def _refused(cache: Any, path: str, nbytes: int) -> None:
    """Log once per process and reason that a file was not cached, and what that costs."""
    policy = getattr(cache, "policy", None)
    if policy is not None and not getattr(policy, "stores", True):
        return  # a pass-through cache refuses everything by design
    capacity = getattr(cache, "capacity_bytes", None)
    reason = "too-large" if isinstance(capacity, int) and nbytes > capacity else "full"
    if reason in _refusals_logged:
        return
    _refusals_logged.add(reason)
    name = getattr(cache, "name", "?")
    if reason == "too-large":
        log.info("cache %s cannot hold %s (%d bytes, over its capacity of %d bytes): files larger than the cache "
                 "are read from their source every time; create the cache with a larger capacity_bytes to "
                 "cache them", name, path, nbytes, capacity)
    else:
        log.info("cache %s refused %s (%d bytes): the cache, or /dev/shm, is full, so the files it does not hold "
                 "are read from their source every time; if it holds other data, `hpcstagger cache clear %s` "
                 "empties it", name, path, nbytes, name)


def read_file(cache: ByteCache, path: str | os.PathLike[str]) -> memoryview:
    """The whole content of the file ``path``, through ``cache`` (a read-only memoryview).

    A hit costs one ``stat`` and the cache's lookup, whose checksum check is one pass over the
    entry; a miss reads the file (open, fstat, read, fstat) and inserts it. Raises OSError as
    ``open`` would for a missing or unreadable file.
    """
    p = os.fspath(path)
    return _through(cache, p, _key_path(p), None)


class ViewFile(io.RawIOBase):
    """A read-only, seekable binary file over a bytes-like object, without copying it.

    ``read`` returns ``bytes`` (a copy of the part read); :meth:`getbuffer` the whole content.
    """

    def __init__(self, data: Any, name: str | None = None):
        super().__init__()
        view = memoryview(data)
        self._view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        self._pos = 0
        if name is not None:
            self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def getbuffer(self) -> memoryview:
        """The whole content, read-only."""
        return self._view.toreadonly()

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        start = min(self._pos, end)
        self._pos = max(self._pos, end)
        return self._view[start:end].tobytes()

    def readall(self) -> bytes:
        return self.read(-1)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence ({whence})")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def open_file(cache: ByteCache, path: str | os.PathLike[str]) -> ViewFile:
    """The file ``path`` through ``cache`` as a read-only binary file (``tarfile.open(fileobj=...)``
    takes it): :func:`read_file` in a :class:`ViewFile`, which copies nothing. Raises OSError."""
    p = os.fspath(path)
    return ViewFile(read_file(cache, p), name=p)


# ---- torchvision's loaders ------------------------------------------------------------------------

def pil_rgb(data: Any) -> Any:
    """An image's bytes as a PIL Image in RGB, as torchvision's default loader gives it (``Image.open``,
    then ``convert("RGB")``). Raises DependencyError without pillow."""
    try:
        from PIL import Image  # deferred: pillow is needed only to decode images
    except ImportError as exc:
        raise DependencyError(f"decoding images needs pillow ({exc}); pip install pillow") from exc
    with Image.open(cast(Any, ViewFile(data))) as img:  # a binary file, as PIL reads it
        return img.convert("RGB")


class FileLoader:
    """``loader(path)``: the file ``path`` read through a cache and decoded; see :meth:`LoadThrough.file_loader`.

    Picklable (the cache reattaches by name), so it reaches DataLoader workers under fork and spawn.
    """

    def __init__(self, cache: ByteCache, decode: Callable[[memoryview], Any] | None = pil_rgb, *,
                 listed_root: str | os.PathLike[str] | None = None):
        if decode is not None and not callable(decode):
            raise ConfigError(f"file_loader: decode must be a callable on bytes or None, not {decode!r}")
        self.cache = cache
        self.decode = decode
        self.listed_root = ""
        self._names: list[str] = []
        self._tokens = array("Q")
        self._ids: dict[str, int] | None = None
        if listed_root is not None:
            if not os.path.isdir(listed_root):
                raise ConfigError(f"file_loader: listed_root {listed_root} is not a directory (give the dataset's "
                                  f"root, or leave it out to stat each file when it is read)")
            # once per node and run, as DirectorySource lists (the run's later processes read it)
            self.listed_root, self._names, self._tokens = dataset_listing(os.path.abspath(listed_root),
                                                                          Selection(pattern="**/*"))
        self._prefix = os.path.join(self.listed_root, "") if self.listed_root else ""

    def __call__(self, path: str | os.PathLike[str]) -> Any:
        p = os.fspath(path)
        kpath = _key_path(p)
        token = None
        if self._prefix and kpath.startswith(self._prefix):
            ids = self._ids
            if ids is None:
                ids = self._ids = dict(zip(self._names, self._tokens, strict=True))
            token = ids.get(kpath[len(self._prefix):])
        view = _through(self.cache, p, kpath, token, self.listed_root)
        return view if self.decode is None else self.decode(view)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ids"] = None  # rebuilt from the listing in each process
        return state

    def __repr__(self) -> str:
        decode = getattr(self.decode, "__name__", repr(self.decode))
        listed = f", listed_root={self.listed_root!r}" if self.listed_root else ""
        return f"FileLoader({self.cache!r}, decode={decode}{listed})"


# ---- tar shards and webdataset --------------------------------------------------------------------

def _local_path(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme else url
    raise ConfigError(f"the cache opens local files (a node's view of a shared file system), not {url!r}; "
                      f"give shard paths, or read this one with webdataset's own opener")


class ShardOpener:
    """A stage of a ``webdataset`` pipeline: each ``{"url": path}`` (or path) in, the same with a
    ``stream`` opened through the cache (:func:`open_file`) out; webdataset's own opener does the
    same with ``open``. ``handler(exception)`` decides on a shard that cannot be opened, as in
    webdataset: True skips it, False stops; None (default) raises. Picklable."""

    def __init__(self, cache: ByteCache, handler: Callable[[Exception], bool] | None = None):
        self.cache = cache
        self.handler = handler

    def __call__(self, urls: Iterable[Any]) -> Iterator[dict[str, Any]]:
        for item in urls:
            url = item["url"] if isinstance(item, dict) else item
            try:
                path = _local_path(url)
                stream = open_file(self.cache, path)
            except Exception as exn:
                if self.handler is None:
                    raise
                if self.handler(exn):
                    continue
                break
            out = dict(item) if isinstance(item, dict) else {}
            out.update(url=url, stream=stream, local_path=path)
            yield out


class _ShardSamples:
    """The stage :func:`shard_samples` returns (a class, so that it pickles)."""

    def __init__(self, cache: ByteCache, handler: Callable[[Exception], bool] | None,
                 select_files: Callable[[str], bool] | None, rename_files: Callable[[str], str] | None):
        self.opener = ShardOpener(cache, handler)
        self.handler = handler
        self.select_files = select_files
        self.rename_files = rename_files

    def __call__(self, urls: Iterable[Any]) -> Iterator[dict[str, Any]]:
        tariterators = _webdataset_module("tariterators")
        handler = self.handler or tariterators.reraise_exception
        files = tariterators.tar_file_expander(self.opener(urls), handler=handler, select_files=self.select_files,
                                               rename_files=self.rename_files)
        return tariterators.group_by_keys(files, handler=handler)


def shard_samples(cache: ByteCache, *, handler: Callable[[Exception], bool] | None = None,
                  select_files: Callable[[str], bool] | None = None,
                  rename_files: Callable[[str], str] | None = None) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A ``webdataset.DataPipeline`` stage that stands in for ``wds.tarfile_to_samples()``: it opens each
    shard through ``cache`` (read from its file once per node while the cache holds it) and yields
    the shard's samples as dicts (``__key__``, ``__url__`` and one entry per extension). Needs the
    ``webdataset`` package when the pipeline runs (DependencyError otherwise)."""
    return _ShardSamples(cache, handler, select_files, rename_files)


def cached_webdataset(cache: ByteCache, urls: Any, **kwargs: Any) -> Any:
    """``webdataset.WebDataset(urls, **kwargs)`` whose shards are opened through ``cache``: the same
    pipeline (shard shuffle, worker split, ``.shuffle()``, ``.decode()``, ...), with webdataset's own
    opener replaced by :class:`ShardOpener`. Raises ConfigError with ``cache_dir`` (webdataset's own
    disk cache; the node cache replaces it) and DependencyError without webdataset."""
    if kwargs.get("cache_dir") is not None:
        raise ConfigError("cached_webdataset: leave out cache_dir; the shards are cached in the node's cache")
    wds_cache = _webdataset_module("cache")
    compat = _webdataset_module("compat")
    ds = compat.WebDataset(urls, **kwargs)
    handler = kwargs.get("handler")
    for i, stage in enumerate(ds.pipeline):
        if isinstance(stage, wds_cache.StreamingOpen):
            ds.pipeline[i] = ShardOpener(cache, handler)
            return ds
    raise ConfigError("cached_webdataset: this webdataset version builds its pipeline without StreamingOpen; "
                      "build a wds.DataPipeline with hpcstagger's shard_samples(cache) instead")


def _webdataset_module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(f"webdataset.{name}")
    except ImportError as exc:
        raise DependencyError(f"reading tar shards as a webdataset needs webdataset ({exc}); "
                              f"pip install webdataset") from exc
