"""NumPy ``.npy`` files and HDF5 datasets as sources, one row per sample, and the pack of arrays.

- :class:`NpySource`: row ``i`` of one ``.npy`` file (the raw row bytes), or row ``i`` of several
  ``.npy`` files of equal length as one pack.
- :class:`HDF5ArraysSource`: row ``i`` of several datasets of one HDF5 file as one pack.
- :func:`pack_arrays`, :func:`unpack_arrays`: the pack of named arrays a multi-array sample is
  stored as. ``source.decode(data)`` turns a sample back into arrays without copying.
- :func:`decode_npy`: a whole ``.npy`` file's bytes as its array, without copying (a
  :class:`~hpcstagger.cache.DirectorySource` of ``.npy`` files, one sample per file).

The pack's format is described in :mod:`hpcstagger.cache._packed`: a short header naming each
array (name, dtype, shape, offset), then the arrays in C order, 64-byte aligned. A pack is
checked before any view is made: a truncated or damaged one raises CacheError.

Keys follow :mod:`hpcstagger.cache.sources`: the files' real paths, the row, and one identity token
over every file's version (:func:`~hpcstagger.cache._listing.stat_token`), the arrays' names, dtypes
and shapes, so that changed data is never served from the cache. Nothing is ever unpickled: an
array of Python objects is refused. This module imports numpy; :mod:`hpcstagger.cache` loads it
only when one of its names is used.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Mapping, Sequence
from typing import IO, Any

import numpy as np
import xxhash

from hpcstagger.cache._listing import stat_token
from hpcstagger.cache import sources
from hpcstagger.cache.sources import SampleRecord, sample_index
from hpcstagger.cache._packed import (PACK_ALIGN, VERSION, Layout, check_dtype, unpack_arrays, pack_arrays,
                                      nbytes_of)
from hpcstagger.errors import CacheError, ConfigError

__all__ = ["NpySource", "HDF5ArraysSource", "pack_arrays", "unpack_arrays", "decode_npy", "PACK_ALIGN"]

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
_NPY_HEADER_MAX = 1 << 16  # numpy reads .npy headers of at most 10000 bytes unless told otherwise



# ---- the sources ---------------------------------------------------------------------------------
class _Rows:
    """What a source of array rows shares: the fields, the layout, the keys, decoding."""

    names: tuple[str, ...]
    dtypes: tuple[np.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    packed: bool  # a sample is a pack of arrays (else one array's raw row)
    _len: int
    _layout: Layout | None
    _prefix: str
    _suffix: str

    def _setup(self, prefix: str, fields: list[tuple[str, np.dtype, tuple[int, ...]]], lengths: list[int],
               labels: list[str], idents: list[str], pack: bool, what: str) -> None:
        """Keys start with ``prefix``; ``labels`` name the arrays in messages; ``idents`` make the token."""
        if len(set(lengths)) > 1:
            each = ", ".join(f"{label}: {n}" for label, n in zip(labels, lengths, strict=True))
            raise ConfigError(f"{what}: the arrays differ in length ({each}); every array needs one row "
                              f"per sample along its first axis")
        self.names = tuple(f[0] for f in fields)
        self.dtypes = tuple(f[1] for f in fields)
        self.shapes = tuple(f[2] for f in fields)
        self.packed = pack
        self._len = lengths[0]
        self._layout = Layout(fields) if pack else None
        ident = "|".join([f"packed-v{VERSION}" if pack else "raw", *idents])
        self.token = xxhash.xxh3_64_intdigest(ident.encode("utf-8", "surrogatepass"))
        self._prefix = prefix
        self._suffix = f"@{self.token:016x}"

    def __len__(self) -> int:
        return self._len

    def key(self, i: int) -> str:
        """The cache key of sample ``i``: the files' real paths, ``i`` and the data's identity token."""
        return f"{self._prefix}{sample_index(i, self._len)}{self._suffix}"

    def record(self, i: int) -> SampleRecord:
        """Sample ``i``'s row, its (first) file and its cache key."""
        i = sample_index(i, self._len)
        return SampleRecord(i, self._record_path(), self.key(i))

    def _record_path(self) -> str:
        paths = getattr(self, "paths", None)
        return paths[0] if paths else str(getattr(self, "path", ""))

    def _join(self, rows: list[bytes]) -> bytes:
        if self._layout is None:
            return rows[0]
        return self._layout.join(rows)

    def decode(self, data: Any) -> Any:
        """Sample bytes back as arrays, without copying: a dict name -> array for a pack source,
        else the row's array. Read-only when ``data`` is (as the cache's views are). Raises
        CacheError for data of another size or layout."""
        if self.packed:
            return unpack_arrays(data)
        mv = memoryview(data)
        want = nbytes_of(self.dtypes[0], self.shapes[0])
        if mv.nbytes != want or not mv.c_contiguous:
            raise CacheError(f"a row of {self.names[0]} has {want} bytes, not {mv.nbytes}: the data is not this "
                             f"source's (clear the cache with `hpcstagger cache clear NAME` if it came from there)")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        return np.frombuffer(mv, self.dtypes[0]).reshape(self.shapes[0])


def _npy_header(f: IO[bytes], what: str) -> tuple[np.dtype, tuple[int, ...], int, bool]:
    """(dtype, shape, offset of the data, Fortran order) of the ``.npy`` file open as ``f`` (at its
    start); ``what`` names it in errors."""
    head = f.read(6)
    if head[:4] == b"PK\x03\x04":
        raise ConfigError(f"{what} is a zip archive (.npz): its rows cannot be read without reading a whole "
                          f"member; save each array as its own .npy file (np.save) and list them")
    if head != b"\x93NUMPY":
        raise ConfigError(f"{what} is not a .npy file (written by np.save)")
    f.seek(0)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f".npy format version {version[0]}.{version[1]} is not read here (1.0 and 2.0 are)")
    except ValueError as exc:
        raise ConfigError(f"{what}: cannot read its .npy header: {exc}") from None
    if dtype.hasobject:
        raise ConfigError(f"{what} holds Python objects (dtype {dtype}), which would have to be unpickled, and "
                          f"hpcstagger never unpickles: save it as a numeric, fixed-length string or boolean array "
                          f"(e.g. np.save(path, a.astype('U')))")
    return dtype, tuple(int(s) for s in shape), f.tell(), bool(fortran) and len(shape) > 1


def decode_npy(data: Any) -> np.ndarray:
    """The array of a whole ``.npy`` file's bytes, as a view of ``data`` (read-only when ``data`` is):
    for a :class:`~hpcstagger.cache.DirectorySource` over ``*.npy`` files, one sample per file,
    ``CachedDataset(source, cache, transform=decode_npy)``. Raises ConfigError for an array of
    Python objects (never unpickled) and CacheError for bytes that are not a whole ``.npy``."""
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    end = 12
    if mv.nbytes >= 12:  # only the header (1.0: 10 bytes and its length u16; 2.0: 12 bytes and a u32)
        end = 10 + int.from_bytes(mv[8:10], "little") if mv[6] == 1 else 12 + int.from_bytes(mv[8:12], "little")
    try:
        dtype, shape, offset, fortran = _npy_header(io.BytesIO(bytes(mv[:min(end, _NPY_HEADER_MAX)])), "the sample")
    except ConfigError as exc:
        if "Python objects" in str(exc):
            raise
        raise CacheError(f"{exc}; decode_npy decodes whole .npy files") from None
    n = nbytes_of(dtype, shape)
    if mv.nbytes != offset + n:
        raise CacheError(f"the .npy sample has {mv.nbytes} bytes where its header says {offset + n} (truncated "
                         f"or padded): if it came from the cache, clear it (`hpcstagger cache clear NAME`)")
    return np.frombuffer(mv, dtype, n // dtype.itemsize if dtype.itemsize else 0, offset).reshape(
        shape, order="F" if fortran else "C")


class NpySource(_Rows):
    """Row ``i`` of ``.npy`` files as sample ``i``, read with ``pread`` from files opened lazily
    (a pickled source holds none; a forked process shares its parent's). Not through a memory map:
    a file truncated under a map kills the reader with SIGBUS, where a short read is an error.

    ``files`` is one path: a sample is the raw bytes of its row (C order) and :meth:`decode` gives
    the row's array. Or several paths (a list, the names being the files' stems) or a mapping name
    -> path: the files must have equal first axes, and a sample is the pack of every file's row
    (:func:`unpack_arrays`; :meth:`decode` gives the dict name -> array).

    ``key(i)`` is built from the files' real paths, ``i`` and an identity of this version of the
    data, taken when the source is built: each file's inode, size, mtime and ctime, dtype and
    shape. A file changed since another job cached it is a miss here. A file changed after this
    source was built is read as it is now (logged), and one whose dtype, row shape or header
    changed, or that shrank, raises ConfigError: rebuild the source. Raises ConfigError for a
    missing file, a file that is not a ``.npy`` (an ``.npz`` included), an array of Python objects,
    a scalar, Fortran order, or arrays of different lengths.
    """

    def __init__(self, files: PathLike | Sequence[PathLike] | Mapping[str, PathLike]):
        if isinstance(files, (str, os.PathLike)):
            named, pack = [("", files)], False
        elif isinstance(files, Mapping):
            named, pack = [(str(k), v) for k, v in files.items()], True
        else:
            named = [(os.path.splitext(os.path.basename(os.fspath(p)))[0], p) for p in files]
            pack = True
        if not named:
            raise ConfigError("NpySource: no files given")
        self.paths: tuple[str, ...] = tuple(os.path.realpath(p) for _, p in named)
        fields, lengths, idents = [], [], []
        self._where: list[tuple[int, int]] = []  # (data offset, row bytes) per file
        self._tokens: list[int] = []
        for (name, given), path in zip(named, self.paths, strict=True):
            dtype, shape, offset, token = self._inspect(given, path)
            name = name or os.path.splitext(os.path.basename(path))[0]
            fields.append((name, dtype, shape[1:]))
            lengths.append(shape[0])
            row = nbytes_of(dtype, shape[1:])
            self._where.append((offset, row))
            self._tokens.append(token)
            idents.append(f"{name}={token:016x}:{np.lib.format.dtype_to_descr(dtype)!s}:{shape}:{offset}")
        self._setup(f"npy:{','.join(self.paths)}:", fields, lengths, list(self.paths), idents, pack, "NpySource")
        self._fds: list[int] = []

    @staticmethod
    def _inspect(given: PathLike, path: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        if not os.path.exists(path):
            raise ConfigError(f"NpySource: {given} does not exist (check the dataset path)")
        if os.path.isdir(path):
            raise ConfigError(f"NpySource: {given} is a directory; give the .npy file(s)")
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            dtype, shape, offset, fortran = _npy_header(f, f"NpySource: {os.fspath(given)}")
        if fortran:
            raise ConfigError(f"NpySource: {given} is in Fortran order, so a row is not contiguous: save it in C "
                              f"order (np.save(path, np.ascontiguousarray(a)))")
        if not shape:
            raise ConfigError(f"NpySource: {given} holds a scalar; it needs a sample axis")
        if st.st_size < offset + nbytes_of(dtype, shape):
            raise ConfigError(f"NpySource: {given} is truncated: its header describes {shape} {dtype}, more than "
                              f"its {st.st_size} bytes hold")
        return dtype, shape, offset, stat_token(st)

    def _open(self) -> list[int]:
        # A forked process keeps using the descriptors it inherited: pread has no file position to
        # share. A pickled source (spawn) comes without them and opens its own here.
        if self._fds:
            return self._fds
        try:
            for k, path in enumerate(self.paths):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self._fds.append(fd)
                if stat_token(os.fstat(fd)) != self._tokens[k]:
                    self._check_changed(k, fd)
        except BaseException:
            self.close()
            raise
        return self._fds

    def _check_changed(self, k: int, fd: int) -> None:
        path = self.paths[k]
        with open(fd, "rb", closefd=False) as f:
            dtype, shape, offset, fortran = _npy_header(f, f"NpySource: {path}")
        if fortran or dtype != self.dtypes[k] or shape[1:] != self.shapes[k] or offset != self._where[k][0]:
            raise ConfigError(f"NpySource: {path} changed after this source was built (now {shape} {dtype}, was "
                              f"rows of {self.shapes[k]} {self.dtypes[k]}): build the source again")
        log.warning("%s changed after this source was built: its rows are read as they are now; restart the job "
                    "to cache them under the file's new identity", path)

    def __getitem__(self, i: int) -> bytes:
        i = sample_index(i, self._len)
        rows = []
        for k, fd in enumerate(self._open()):
            offset, n = self._where[k]
            row = os.pread(fd, n, offset + i * n) if n else b""
            if len(row) < n:
                raise ConfigError(f"NpySource: {self.paths[k]} is shorter than when this source was built (it "
                                  f"was rewritten): build the source again")
            rows.append(row)
        return self._join(rows)

    def close(self) -> None:
        """Close this process's files (they reopen on the next read)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError, TypeError):
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_fds=[])
        return state

    def __repr__(self) -> str:
        pairs = zip(self.names, self.paths, strict=True)
        what = ", ".join(f"{n}={p!r}" for n, p in pairs) if self.packed else repr(self.paths[0])
        return f"NpySource({what}) with {self._len} samples"


class HDF5ArraysSource(_Rows):
    """Row ``i`` of several datasets of one HDF5 file as sample ``i``: the pack of their rows
    (:func:`unpack_arrays`; :meth:`decode` gives the dict name -> array). The file is opened lazily
    in each process (after a fork too; a pickled source holds no handle).

    ``datasets`` is a list of dataset paths (``["images", "labels"]``; each array is named by its
    dataset path) or a mapping name -> dataset path. Their first axes must be equal. ``key(i)`` is
    built from the file's real path, ``i`` and an identity of this version of the data, taken when
    the source is built: the file's inode, size, mtime and ctime, and each dataset's name, shape
    and dtype. Raises ConfigError if the file or a dataset is missing, a dataset is a scalar, holds
    Python objects (variable-length strings) or a compound type, or the lengths differ, and
    DependencyError without h5py.
    """

    def __init__(self, path: PathLike, datasets: Sequence[str] | Mapping[str, str]):
        if isinstance(datasets, str):
            raise ConfigError(f"HDF5ArraysSource: datasets is a list of dataset names, not {datasets!r}; "
                              f"one dataset alone takes HDF5Source")
        named = list(datasets.items()) if isinstance(datasets, Mapping) else [(d, d) for d in datasets]
        if not named:
            raise ConfigError("HDF5ArraysSource: no datasets given")
        if not os.path.exists(path):
            raise ConfigError(f"HDF5ArraysSource: {path} does not exist (check the dataset path)")
        if os.path.isdir(path):
            raise ConfigError(f"HDF5ArraysSource: {path} is a directory, not an HDF5 file")
        self.path = os.path.realpath(path)
        self.datasets: tuple[str, ...] = tuple(d for _, d in named)
        h5 = _h5py()
        fields, lengths, idents = [], [], []
        try:
            st = os.stat(self.path)
            with h5.File(self.path, "r") as f:
                for name, ds in named:
                    if ds not in f or not isinstance(f[ds], h5.Dataset):
                        have = ", ".join(sorted(f.keys())) or "none"
                        raise ConfigError(f"HDF5ArraysSource: {path} has no dataset {ds!r} (top-level names: {have})")
                    shape, dtype = tuple(int(s) for s in f[ds].shape), f[ds].dtype
                    if not shape:
                        raise ConfigError(f"HDF5ArraysSource: dataset {ds!r} in {path} is a scalar; it needs a "
                                          f"sample axis")
                    check_dtype(dtype, f"HDF5ArraysSource: dataset {ds!r} in {path}")
                    fields.append((name, dtype, shape[1:]))
                    lengths.append(shape[0])
                    idents.append(f"{name}={ds}:{shape}:{dtype.str}")
        except OSError as exc:
            raise ConfigError(f"HDF5ArraysSource: cannot open {path} as HDF5: {exc}") from None
        self._file_token = stat_token(st)
        self._setup(f"h5rec:{self.path}:{','.join(self.datasets)}:", fields, lengths, list(self.datasets),
                    [f"{self._file_token:016x}", *idents], True, f"HDF5ArraysSource: {path}")
        self._file: Any = None
        self._dsets: list[Any] = []
        self._pid = 0

    def _open(self) -> list[Any]:
        pid = os.getpid()
        if self._dsets and self._pid == pid:
            return self._dsets
        # After a fork the parent's HDF5 handle must not be used: open our own.
        try:
            changed = stat_token(os.stat(self.path)) != self._file_token
        except OSError:
            changed = True
        f = _h5py().File(self.path, "r")
        try:
            dsets = [f[d] for d in self.datasets]
            for d, ds, dtype, shape in zip(self.datasets, dsets, self.dtypes, self.shapes, strict=True):
                if ds.dtype != dtype or tuple(ds.shape[1:]) != shape:
                    raise ConfigError(f"HDF5ArraysSource: dataset {d!r} in {self.path} changed after this source "
                                      f"was built (now rows of {tuple(ds.shape[1:])} {ds.dtype}, was {shape} "
                                      f"{dtype}): build the source again")
        except BaseException:
            f.close()
            raise
        if changed:
            log.warning("%s changed after this source was built: its rows are read as they are now; restart the job "
                        "to cache them under the file's new identity", self.path)
        self._file, self._dsets, self._pid = f, dsets, pid
        return dsets

    def __getitem__(self, i: int) -> bytes:
        i = sample_index(i, self._len)
        rows = [ds[i:i + 1].tobytes() for ds in self._open()]
        for row, n, d in zip(rows, self._layout.sizes if self._layout else (), self.datasets, strict=True):
            if len(row) != n:
                raise ConfigError(f"HDF5ArraysSource: dataset {d!r} in {self.path} has no row {i} any more (it "
                                  f"was rewritten): build the source again")
        return self._join(rows)

    def close(self) -> None:
        """Close this process's handle (it reopens on the next read)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file, self._dsets = None, []

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_file=None, _dsets=[], _pid=0)
        return state

    def __repr__(self) -> str:
        return f"HDF5ArraysSource({self.path!r}, {list(self.datasets)!r}) with {self._len} samples"


def _h5py() -> Any:
    return sources.import_h5py("HDF5ArraysSource")
