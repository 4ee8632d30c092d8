"""Map-style sources of byte samples: ``len(source)``, ``source[i] -> bytes``, ``source.key(i)``.

``key(i)`` names sample ``i`` in a shared cache, so it must be the same in every process and job
that reads the same data and differ for different data: the sources here use the real path of the
file (and the dataset name and row for HDF5). The cache assumes the data does not change while it
is cached.

Sources are picklable: they cross into DataLoader workers and other processes under both fork
and spawn. Whatever they hold open (an HDF5 file) is opened lazily in each process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError

__all__ = ["Source", "DirectorySource", "HDF5Source", "read_file"]


@runtime_checkable
class Source(Protocol):
    """What :class:`~hpcstagger.cache.CachedDataset` and :class:`ThrottledSource` read from."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> bytes: ...

    def key(self, i: int) -> str | int: ...


def _index(i: Any, n: int) -> int:
    i = int(i) if not isinstance(i, int) else i
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample index {i} out of range for a source of {n} samples")
    return i


def read_file(path: str | os.PathLike[str]) -> bytes:
    """The whole content of a file, in as few system calls as Python allows."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size) if size else b""
        if len(data) < size:  # short read (a file that shrank, or an unusual file system)
            chunks = [data]
            while True:
                more = os.read(fd, 1 << 20)
                if not more:
                    break
                chunks.append(more)
            data = b"".join(chunks)
        return data
    finally:
        os.close(fd)


class DirectorySource:
    """Every regular file under ``root`` matching ``pattern`` (pathlib glob), in sorted order.

    ``key(i)`` is the file's real absolute path. Raises ConfigError if ``root`` is not a directory
    or nothing matches.
    """

    def __init__(self, root: str | os.PathLike[str], pattern: str = "**/*"):
        base = Path(root)
        if not base.is_dir():
            raise ConfigError(f"DirectorySource: {root} is not a directory")
        self.root = os.path.realpath(base)
        self.pattern = pattern
        files = sorted(p.relative_to(base).as_posix() for p in base.glob(pattern) if p.is_file())
        if not files:
            raise ConfigError(f"DirectorySource: no files match {pattern!r} under {root}")
        self.files: list[str] = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> bytes:
        return read_file(self.path(i))

    def path(self, i: int) -> str:
        """The file behind sample ``i``."""
        return os.path.join(self.root, self.files[_index(i, len(self.files))])

    def key(self, i: int) -> str:
        return "file:" + self.path(i)

    def __repr__(self) -> str:
        return f"DirectorySource({self.root!r}, {self.pattern!r}) with {len(self)} files"


class HDF5Source:
    """Row ``i`` of one HDF5 dataset, as bytes (C order). The file is opened lazily in each process.

    The first axis of ``dataset`` indexes the samples. ``key(i)`` is built from the file's real
    path, the dataset name and ``i``. Raises ConfigError if the file or dataset is missing, and
    DependencyError without h5py.
    """

    def __init__(self, path: str | os.PathLike[str], dataset: str):
        self.path = os.path.realpath(path)
        self.dataset = dataset
        h5 = _h5py()
        try:
            with h5.File(self.path, "r") as f:
                if dataset not in f or not isinstance(f[dataset], h5.Dataset):
                    raise ConfigError(f"HDF5Source: {path} has no dataset {dataset!r}")
                shape = f[dataset].shape
        except OSError as exc:
            raise ConfigError(f"HDF5Source: cannot open {path}: {exc}") from None
        if not shape:
            raise ConfigError(f"HDF5Source: dataset {dataset!r} in {path} is a scalar; it needs a sample axis")
        self._len = int(shape[0])
        self._file: Any = None
        self._ds: Any = None
        self._pid = 0

    def _dataset(self) -> Any:
        pid = os.getpid()
        if self._ds is None or self._pid != pid:
            # After a fork the parent's HDF5 handle must not be used: open our own.
            self._file = _h5py().File(self.path, "r")
            self._ds = self._file[self.dataset]
            self._pid = pid
        return self._ds

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> bytes:
        row = self._dataset()[_index(i, self._len)]
        return row.tobytes() if hasattr(row, "tobytes") else bytes(row)

    def key(self, i: int) -> str:
        return f"h5:{self.path}:{self.dataset}:{_index(i, self._len)}"

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


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:
        from ..errors import DependencyError

        raise DependencyError(f"HDF5Source needs h5py ({exc}); pip install h5py") from exc
    return h5py
