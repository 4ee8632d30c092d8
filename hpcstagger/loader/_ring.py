"""The shared memory of one pipeline: a control file of 64-bit words and a data file of batch slots.

Both live in ``<shm_root>/.loader/`` (mode 0700, checked like the cache's directories), named by the
pipeline's key:

``<key>.ctl`` (32 KiB, created by the first consumer, which then starts the producer)
    A header (configuration, the producer's pid and start time, heartbeat, state, ``head`` = batches
    published, slot size, error text), a table of :data:`MAX_CONSUMERS` consumer entries (pid and
    start time, state, data-parallel group, rank and world, first batch, ``released``, ``waiting``)
    and a table of slot entries (which batch a slot holds, its size). Each word has one writer at a
    time: the producer writes the header and the slots (the GPU stager ``gpu_head`` and its own
    waiting flag), a consumer its own entry; claiming and freeing entries and creating or removing
    the files happen under ``flock`` on the directory.
``<key>.data`` (``window`` slots, created by the producer once it knows a batch's size)
    Batch ``g`` lives in slot ``g % window`` as a JSON descriptor of its structure followed by its
    tensors' bytes, each 64-byte aligned. The producer overwrites a slot only after every attached
    consumer has released the batch it held.

Waiting (see :mod:`._futex`): a process that waits for a word to change sleeps on it in the kernel
(a futex, with a timeout so that it still checks the producer's life and its own deadlines) after
raising its waiting flag: a consumer its entry's ``waiting`` (``head`` or ``gpu_head``), the
producer ``H_PWAIT`` (for ``released`` words, ``gpu_head``, attaching and leaving consumers), the
stager ``H_SWAIT`` (for ``head``). Whoever advances a word wakes it, with a system call only when a
flag is up, so nobody pays one per batch while nobody waits.

Nothing is pickled: the descriptor names dtypes, shapes and offsets, and consumers build tensors over
a private copy-on-write mapping of the slot, so an in-place change by one job never reaches another.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import time
from typing import Any

import numpy as np

from hpcstagger.cache import _fs
from hpcstagger.errors import CacheError, LoaderError
from hpcstagger.loader import _futex

MAGIC = 0x48505353_4C4F4144  # "HPSSLOAD"
VERSION = 3
CTL_BYTES = 32 << 10
MAX_CONSUMERS = 64
MAX_WINDOW = 256
PAGE = mmap.PAGESIZE
ALIGN = 64

# header words
(H_MAGIC, H_VERSION, H_WINDOW, H_N, H_BATCH, H_SEED, H_SEGMENTS, H_DROP, H_PPID, H_PSTART, H_BEAT, H_STATE,
 H_HEAD, H_SLOT_BYTES, H_BLOCKED, H_CREATED, H_ERRLEN, H_WORKERS, H_SPAWNER, H_DEVICE, H_GHEAD, H_GPID,
 H_IPCLEN, H_PWAIT, H_SWAIT, H_QUIT) = range(26)  # H_QUIT: another process asks an idle producer to stop now
ERR_OFF, ERR_MAX = 512, 480                      # error text bytes
IPC_OFF, IPC_MAX = 20480, 1024                   # the GPU ring's handle (JSON), after the slot table
CONS_OFF, CONS_WORDS = 1024, 16                  # consumer table
(C_PID, C_START, C_STATE, C_GROUP, C_RANK, C_WORLD, C_FIRST, C_RELEASED, C_TAKEN, C_DEADLINE,
 C_OWNPREP, C_WAITING) = range(12)
SLOT_OFF = CONS_OFF + MAX_CONSUMERS * CONS_WORDS * 8
SLOT_WORDS = 4
S_SEQ, S_NBYTES = 0, 1

# producer states
P_STARTING, P_RUNNING, P_FAILED, P_STOPPED = 1, 2, 3, 4
# consumer states
C_FREE, C_PENDING, C_ATTACHED, C_LEFT, C_DROPPED = 0, 1, 2, 3, 4
STATE_NAMES = {P_STARTING: "starting", P_RUNNING: "running", P_FAILED: "failed", P_STOPPED: "stopped"}


def now_ns() -> int:
    return time.monotonic_ns()


class Ctl:
    """A mapping of one pipeline's control file, with typed access to its words."""

    def __init__(self, fd: int, path: str):
        self.path = path
        self.ino = os.fstat(fd).st_ino
        self.mm = mmap.mmap(fd, CTL_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.w = np.frombuffer(self.mm, dtype=np.int64)
        base = CONS_OFF // 8 + C_WAITING
        self._waiting = self.w[base:base + MAX_CONSUMERS * CONS_WORDS:CONS_WORDS]  # every entry's flag

    def cons(self, i: int) -> np.ndarray:
        base = (CONS_OFF // 8) + i * CONS_WORDS
        return self.w[base:base + CONS_WORDS]

    def slot(self, s: int) -> np.ndarray:
        base = (SLOT_OFF // 8) + s * SLOT_WORDS
        return self.w[base:base + SLOT_WORDS]

    def error(self) -> str:
        n = int(self.w[H_ERRLEN])
        return bytes(self.mm[ERR_OFF:ERR_OFF + max(0, min(n, ERR_MAX))]).decode("utf-8", "replace")

    def set_error(self, text: str) -> None:
        data = text.encode("utf-8", "replace")[-ERR_MAX:]
        self.mm[ERR_OFF:ERR_OFF + len(data)] = data
        self.w[H_ERRLEN] = len(data)

    def ipc(self) -> dict[str, Any] | None:
        """The GPU ring's record (handle, size), or None before the stager has published it."""
        n = int(self.w[H_IPCLEN])
        if not 0 < n <= IPC_MAX:
            return None
        try:
            rec = json.loads(bytes(self.mm[IPC_OFF:IPC_OFF + n]))
        except ValueError:
            raise LoaderError(f"the GPU ring record in {self.path} is malformed (a corrupted file?)") from None
        return rec if isinstance(rec, dict) else None

    def set_ipc(self, rec: dict[str, Any]) -> None:
        data = json.dumps(rec, separators=(",", ":")).encode()
        if len(data) > IPC_MAX:
            raise LoaderError("the GPU ring record does not fit the control file (a bug; please report it)")
        self.mm[IPC_OFF:IPC_OFF + len(data)] = data
        self.w[H_IPCLEN] = len(data)

    def producer_alive(self) -> bool:
        return _fs.alive(int(self.w[H_PPID]), int(self.w[H_PSTART]))

    def attached(self, *, pending: bool = True) -> list[int]:
        """Indices of consumer entries that hold batches back (attached, or pending if asked)."""
        states = (C_ATTACHED, C_PENDING) if pending else (C_ATTACHED,)
        return [i for i in range(MAX_CONSUMERS) if int(self.cons(i)[C_STATE]) in states]

    # ---- waiting and waking (module docs) ---------------------------------------------------------

    def wait(self, word: int, expected: int, timeout: float, backoff: Any) -> None:
        """Sleep while header word ``word`` holds ``expected``: at most ``timeout`` s, until woken; the
        caller raised its waiting flag first and checks its condition again after."""
        _futex.wait(_futex.address(self.w, word), expected, timeout, backoff)

    def wake_consumers(self, word: int) -> None:
        """Wake the consumers waiting on header word ``word`` (``H_HEAD`` or ``H_GHEAD``), if any wait."""
        if self._waiting.any():
            _futex.wake(_futex.address(self.w, word))

    def wake_producer(self) -> None:
        """Wake the producer if it waits for a slot to free (a batch released, a consumer come or gone)."""
        if self.w[H_PWAIT]:
            _futex.wake(_futex.address(self.w, H_PWAIT))

    def wake_stager(self) -> None:
        """Wake the GPU stager if it waits for ``head``."""
        if self.w[H_SWAIT]:
            _futex.wake(_futex.address(self.w, H_HEAD))

    def close(self) -> None:
        del self._waiting
        del self.w
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


# ---- the directory and its lock ---------------------------------------------------------------

def loader_dir(root: str, *, create: bool = True) -> tuple[int, str]:
    """Open ``<root>/.loader`` (creating it and the root unless ``create`` is false) after the cache's
    safety checks; return (fd, path). LoaderError if it is unsafe, or missing and not created."""
    try:
        root_fd = _fs.open_secure_dir(root, create=create, what="shared memory root")
        try:
            fd = _fs.open_secure_subdir(root_fd, ".loader", root, create=create, what="shared loader directory")
        finally:
            os.close(root_fd)
    except CacheError as exc:
        raise LoaderError(str(exc)) from None
    return fd, os.path.join(os.path.abspath(root), ".loader")


class DirLock:
    """``flock`` on the loader directory: held while entries are claimed or files created or removed."""

    def __init__(self, dir_fd: int):
        self.fd = dir_fd

    def __enter__(self) -> DirLock:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def open_file(dir_fd: int, dir_path: str, name: str, *, create: bool, size: int) -> int:
    """Open ``name`` in the loader directory without following links, checked; create it (0600,
    fully allocated) if asked and absent. Returns the fd, or -1 when absent and not created."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    path = os.path.join(dir_path, name)
    try:
        if create:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.close(fd)
                os.unlink(name, dir_fd=dir_fd)
                raise LoaderError(f"cannot allocate {size} bytes for {path}: {exc.strerror}; free space in "
                                  "/dev/shm or use smaller batches or a smaller window") from None
            return fd
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return -1
    except OSError as exc:
        if exc.errno == 40:  # ELOOP
            raise LoaderError(str(_fs.symlink_error(path, "shared loader file"))) from None
        raise LoaderError(f"cannot open {path}: {exc.strerror}") from None
    try:
        _fs.check_secure_file(fd, path, "shared loader file")
    except CacheError as exc:
        os.close(fd)
        raise LoaderError(str(exc)) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_ctl(dir_fd: int, dir_path: str, key: str, *, create: bool = False) -> Ctl | None:
    """Map pipeline ``key``'s control file (checked like :func:`open_file`; created if asked, else
    None when absent)."""
    fd = open_file(dir_fd, dir_path, key + ".ctl", create=create, size=CTL_BYTES)
    if fd < 0:
        return None
    try:
        return Ctl(fd, os.path.join(dir_path, key + ".ctl"))
    finally:
        os.close(fd)


def remove_files(dir_fd: int, key: str, ino: int) -> None:
    """Remove a pipeline's files if its control file is still the one with inode ``ino`` (a newer
    pipeline of the same key is left alone); the caller holds the directory lock."""
    try:
        if os.stat(key + ".ctl", dir_fd=dir_fd, follow_symlinks=False).st_ino != ino:
            return
    except FileNotFoundError:
        return
    for suffix in (".data", ".ctl"):
        try:
            os.unlink(key + suffix, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


# ---- batches in slots ---------------------------------------------------------------------------

def _dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LoaderError(f"a shared batch names an unknown dtype {name!r}")
    return dt


def flatten(obj: Any, tensors: list[Any]) -> Any:
    """The JSON descriptor of a collated batch; its tensors are appended to ``tensors``."""
    import torch

    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"T": len(tensors) - 1}
    if isinstance(obj, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return {"N": len(tensors) - 1}
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, str):
                raise LoaderError(f"a batch dict has the key {k!r}; the shared loader passes dicts with string keys")
        return {"D": [[k, flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"L" if isinstance(obj, list) else "U": [flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"V": obj}
    raise LoaderError(f"a batch holds a {type(obj).__name__}; the shared loader passes tensors, numpy arrays, "
                      "numbers, strings, and lists, tuples and dicts of them: convert it in collate_fn")


def encode_plan(batch: Any) -> tuple[bytes, list[tuple[Any, int, int]], int]:
    """(header bytes, [(flat byte tensor, offset, nbytes)], total bytes) of a batch in a slot."""
    import torch

    tensors: list[Any] = []
    desc = flatten(batch, tensors)
    metas = []
    parts = []
    offset = 0
    for t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        metas.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
        parts.append((t.reshape(-1).view(torch.uint8) if nbytes else None, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    head = json.dumps({"d": desc, "t": metas}, separators=(",", ":")).encode()
    hlen = 8 + -(-len(head) // ALIGN) * ALIGN
    header = len(head).to_bytes(8, "little") + head
    return header, [(p, o + hlen, n) for p, o, n in parts], hlen + offset


def decode(mm: Any, base: int, ring: Any = None, ring_base: int = 0, private: bool = False) -> Any:
    """Rebuild a batch from the slot mapped at ``mm`` (starting at byte ``base``), zero-copy. With
    ``ring`` (a uint8 device tensor holding the same slot at ``ring_base``) its torch tensors are views
    of the device copy (cloned if ``private``); numpy arrays stay in host memory."""
    import torch

    n = int.from_bytes(mm[base:base + 8], "little")
    meta = json.loads(bytes(mm[base + 8:base + 8 + n]))
    hlen = 8 + -(-n // ALIGN) * ALIGN
    host = _numpy_indices(meta["d"]) if ring is not None else None
    tensors = []
    for i, (dtype, shape, off, nbytes) in enumerate(meta["t"]):
        dt = _dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        on_device = host is not None and i not in host
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dt, device=ring.device if on_device else "cpu"))
        elif on_device:
            start = ring_base + hlen + off
            t = ring[start:start + nbytes].view(dt).view(shape)
            tensors.append(t.clone() if private else t)
        else:
            tensors.append(torch.frombuffer(mm, dtype=dt, count=count, offset=base + hlen + off).view(shape))
    return _build(meta["d"], tensors)


def _numpy_indices(desc: Any) -> set[int]:
    if "N" in desc:
        return {desc["N"]}
    parts = [v for _, v in desc["D"]] if "D" in desc else desc.get("L") or desc.get("U") or []
    return set().union(*(_numpy_indices(v) for v in parts))


def _build(desc: Any, tensors: list[Any]) -> Any:
    if "T" in desc:
        return tensors[desc["T"]]
    if "N" in desc:
        return tensors[desc["N"]].numpy()
    if "D" in desc:
        return {k: _build(v, tensors) for k, v in desc["D"]}
    if "L" in desc:
        return [_build(v, tensors) for v in desc["L"]]
    if "U" in desc:
        return tuple(_build(v, tensors) for v in desc["U"])
    return desc["V"]
