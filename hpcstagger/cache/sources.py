"""Map-style sources of byte samples: ``len(source)``, ``source[i] -> bytes``, ``source.key(i)``.

``key(i)`` names sample ``i`` in a shared cache, so it must be the same in every process and job
that reads the same data and differ for different data. The sources here build it from the real
path of the file (and the dataset name and row for HDF5) *and* an identity token of the file's
version, captured when the source is built (:mod:`hpcstagger.cache._listing`): a job over changed
files misses and reads the new bytes, and never gets the old ones from the cache.

Sources are picklable: they cross into DataLoader workers and other processes under both fork
and spawn, with their listing and identity, so a worker neither lists nor stats again. Whatever
they hold open (an HDF5 file) is opened lazily in each process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import xxhash

from hpcstagger.errors import ConfigError, DependencyError
from hpcstagger.cache._listing import Selection, stat_token
from hpcstagger.cache._nodelisting import dataset_listing

__all__ = ["Source", "SampleRecord", "DirectorySource", "HDF5Source", "read_file", "record_of"]

log = logging.getLogger(__name__)


@runtime_checkable
class Source(Protocol):
    """What :class:`~hpcstagger.cache.CachedDataset` and :class:`ThrottledSource` read from."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> bytes: ...

    def key(self, i: int) -> str | int: ...


@dataclass(frozen=True)
class SampleRecord:
    """Where sample ``index`` comes from: the file that holds it and its key in the cache.

    ``CachedDataset(..., with_record=True)`` hands it to the transform, which can then derive a
    label from the path (a folder name, a file stem) without a wrapper class.
    """

    index: int
    path: str | None  # the file that holds the sample (None: the source has no file, e.g. in memory)
    key: str | int


def record_of(source: Any, i: int) -> SampleRecord:
    """``source.record(i)`` where the source has it; else a record from its ``path(i)`` (when it
    has one) and ``key(i)``."""
    record = getattr(source, "record", None)
    if callable(record):
        return record(i)
    path = getattr(source, "path", None)
    return SampleRecord(i, path(i) if callable(path) else path if isinstance(path, str) else None, source.key(i))


def sample_index(i: Any, n: int) -> int:
    """``i`` as an index into ``n`` samples (negative counts from the end); IndexError out of range."""
    i = int(i) if not isinstance(i, int) else i
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample index {i} out of range for a source of {n} samples")
    return i


def read_file(path: str | os.PathLike[str]) -> bytes:
    """The whole content of a file, in as few system calls as Python allows."""
    return _read_fd(path)[0]


def _read_fd(path: str | os.PathLike[str]) -> tuple[bytes, os.stat_result]:
    """The whole content of a file and the stat of the version read (one ``fstat``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        size = st.st_size
        data = os.read(fd, size) if size else b""
        if len(data) < size:  # short read (a file that shrank, or an unusual file system)
            chunks = [data]
            while True:
                more = os.read(fd, 1 << 20)
                if not more:
                    break
                chunks.append(more)
            data = b"".join(chunks)
        return data, st
    finally:
        os.close(fd)


class DirectorySource:
    """The regular files under ``root`` that match ``pattern`` (pathlib glob rules, default
    ``**/*``), in sorted order; or, with ``files``, the files of a file list, in the list's order.

    ``files`` is the path of a text file with one path per line (relative to ``root``, or absolute
    under it; blank lines and lines starting with ``#`` are skipped, surrounding blanks stripped),
    or a sequence of such paths (taken as they are).

    The listing records each file's identity (inode, size, mtime, ctime), and ``key(i)`` is the
    file's real absolute path with that identity: a file replaced, rewritten or grown since another
    job cached it is a miss here, read from the file. A file that changes after the listing was
    made is read as it is now (and logged once); a later run (without a run: a new source) lists
    it anew.

    ``listing`` says who lists. None (the default): the first process of the run on the node lists
    and writes the listing under the shm root; every later process of the run on the node reads it
    and makes no metadata call on the dataset's tree. The run is ``run`` when given, else what the
    environment names (``hpcstagger launch``'s run directory, the Slurm job and srun step, torchrun's
    run id: :func:`~hpcstagger.cache._nodelisting.run_identity`); without any, each process lists
    for itself. A path: the same, and a node's first process reads the listing from that file, or
    lists and writes it there, for the run's other nodes (``session.source()`` passes one in the
    run's directory). False: this process lists for itself.

    Raises ConfigError if ``root`` does not exist, is not a directory or nothing matches; if both
    ``pattern`` and ``files`` are given; and for a listed path outside ``root``, missing, not a
    regular file or listed twice (naming its line).
    """

    def __init__(self, root: str | os.PathLike[str], pattern: str | None = None, *,
                 files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
                 listing: str | os.PathLike[str] | bool | None = None, run: str | None = None):
        if pattern is not None and files is not None:
            raise ConfigError("DirectorySource: give a glob pattern or a file list (files=), not both")
        selection = _file_list(files) if files is not None else Selection(pattern=pattern or "**/*")
        given = os.path.abspath(os.fspath(root))
        self.root, names, tokens = dataset_listing(given, selection, listing=listing, run=run)
        self.pattern = selection.pattern
        if not names:
            what = f"no files match {self.pattern!r}" if self.pattern is not None else \
                f"no files listed in {selection.origin}"
            raise ConfigError(f"DirectorySource: {what} under {root}")
        self.files: list[str] = names
        self.tokens = tokens
        self._prefix = "file:" + os.path.join(self.root, "")
        self._changed_logged = False

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> bytes:
        i = sample_index(i, len(self.files))
        data, st = _read_fd(os.path.join(self.root, self.files[i]))
        if stat_token(st) != self.tokens[i] and not self._changed_logged:
            self._changed_logged = True
            log.warning("%s changed after the dataset was listed: read as it is now; restart the job to "
                        "cache it under its new identity (further changes in this process are not logged)",
                        self.path(i))
        return data

    def path(self, i: int) -> str:
        """The file behind sample ``i``."""
        return os.path.join(self.root, self.files[sample_index(i, len(self.files))])

    def key(self, i: int) -> str:
        i = sample_index(i, len(self.files))
        return f"{self._prefix}{self.files[i]}@{self.tokens[i]:016x}"

    def record(self, i: int) -> SampleRecord:
        """Sample ``i``'s index, file and cache key."""
        i = sample_index(i, len(self.files))
        return SampleRecord(i, self.path(i), self.key(i))

    def __repr__(self) -> str:
        what = repr(self.pattern) if self.pattern is not None else "files=[...]"
        return f"DirectorySource({self.root!r}, {what}) with {len(self)} files"


def _file_list(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Selection:
    """The selection of a file list: a list file's text, or the paths of a sequence."""
    if isinstance(files, (str, os.PathLike)):
        path = os.fspath(files)
        try:
            with open(path, "rb") as f:
                return Selection(text=f.read(), origin=path)
        except FileNotFoundError:
            raise ConfigError(f"DirectorySource: the file list {path} does not exist (files= takes a text "
                              f"file of paths, one per line, or a list of paths)") from None
        except OSError as exc:
            raise ConfigError(f"DirectorySource: cannot read the file list {path}: {exc.strerror}") from None
    if isinstance(files, (bytes, bytearray)) or not isinstance(files, Sequence):
        raise ConfigError(f"DirectorySource: files= takes the path of a file list or a sequence of paths, "
                          f"not {type(files).__name__}")
    items = tuple(os.fspath(p) if isinstance(p, (str, os.PathLike)) else p for p in files)
    bad = next((p for p in items if not isinstance(p, str)), None)
    if bad is not None:
        raise ConfigError(f"DirectorySource: files= holds {bad!r}; give each path as a str or a pathlib.Path")
    return Selection(items=items)


class HDF5Source:
    """Row ``i`` of one HDF5 dataset, as bytes (C order). The file is opened lazily in each process.

    The first axis of ``dataset`` indexes the samples. ``key(i)`` is built from the file's real
    path, the dataset name, ``i`` and an identity of this version of the data, taken when the
    source is built: the file's inode, size, mtime and ctime, and the dataset's shape and dtype. A
    file regenerated, replaced or written in place since another job cached it is a miss here.
    Raises ConfigError if the file or dataset is missing, and DependencyError without h5py.
    """

    def __init__(self, path: str | os.PathLike[str], dataset: str):
        if not os.path.exists(path):
            raise ConfigError(f"HDF5Source: {path} does not exist (check the dataset path)")
        if os.path.isdir(path):
            raise ConfigError(f"HDF5Source: {path} is a directory, not an HDF5 file (a directory of "
                              f"files takes DirectorySource)")
        self.path = os.path.realpath(path)
        self.dataset = dataset
        h5 = import_h5py()
        try:
            st = os.stat(self.path)
            with h5.File(self.path, "r") as f:
                if dataset not in f or not isinstance(f[dataset], h5.Dataset):
                    raise ConfigError(f"HDF5Source: {path} has no dataset {dataset!r}")
                shape, dtype = f[dataset].shape, f[dataset].dtype.str
        except OSError as exc:
            raise ConfigError(f"HDF5Source: cannot open {path} as HDF5: {exc}") from None
        if not shape:
            raise ConfigError(f"HDF5Source: dataset {dataset!r} in {path} is a scalar; it needs a sample axis")
        self._len = int(shape[0])
        self._file_token = stat_token(st)
        ident = f"{self._file_token:016x}:{dataset}:{tuple(shape)}:{dtype}".encode("utf-8", "surrogatepass")
        self.token = xxhash.xxh3_64_intdigest(ident)
        self._prefix = f"h5:{self.path}:{self.dataset}:"
        self._suffix = f"@{self.token:016x}"
        self._file: Any = None
        self._ds: Any = None
        self._pid = 0

    def _dataset(self) -> Any:
        pid = os.getpid()
        if self._ds is None or self._pid != pid:
            # After a fork the parent's HDF5 handle must not be used: open our own.
            try:
                changed = stat_token(os.stat(self.path)) != self._file_token
            except OSError:
                changed = True
            if changed:
                log.warning("%s changed after this source was built: its rows are read as they are now; "
                            "restart the job to cache them under the file's new identity", self.path)
            self._file = import_h5py().File(self.path, "r")
            self._ds = self._file[self.dataset]
            self._pid = pid
        return self._ds

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> bytes:
        row = self._dataset()[sample_index(i, self._len)]
        return row.tobytes() if hasattr(row, "tobytes") else bytes(row)

    def key(self, i: int) -> str:
        return f"{self._prefix}{sample_index(i, self._len)}{self._suffix}"

    def record(self, i: int) -> SampleRecord:
        """Sample ``i``'s row, the HDF5 file and the cache key."""
        i = sample_index(i, self._len)
        return SampleRecord(i, self.path, self.key(i))

    def close(self) -> None:
        """Close this process's handle (it reopens on the next read)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = self._ds = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_file=None, _ds=None, _pid=0)
        return state

    def __repr__(self) -> str:
        return f"HDF5Source({self.path!r}, {self.dataset!r}) with {self._len} samples"


def import_h5py(who: str = "HDF5Source") -> Any:
    """The h5py module (imported here, not at import: it is slow); DependencyError without it."""
    try:
        import h5py
    except ImportError as exc:
        raise DependencyError(f"{who} needs h5py ({exc}); pip install h5py") from exc
    return h5py
