"""``ThrottledSource``: an emulated shared remote repository, for tests, benchmarks and the demo.

It wraps any source and makes each read take as long as it would on a shared file system whose
bandwidth every reading process on the node shares. It is an emulator, not a production rate
limiter: it exists so that the cache, the performance model (whose ``[storage]
bandwidth`` list is exactly ``bytes_per_second``) and the demo can be exercised without a real
parallel file system.

The model (processor sharing). ``bytes_per_second`` is one number or a list
``[aggregate with 1 concurrent reader, with 2, ...]``, the last value holding beyond. While ``k``
processes are reading under the same ``shared_name``, the aggregate rate is ``bandwidth[k-1]``,
shared equally: each reader progresses at ``bandwidth[k-1] / k``. A read of ``n`` bytes therefore
takes ``latency + n / (bandwidth[k-1] / k)`` seconds while ``k`` stays fixed. ``k`` is re-evaluated
every 10 ms of a long read, and a process counts as reading from the start of a read until 1 ms
after its end (so back-to-back reads count as continuous). The inner read happens first and its
own time is part of the budget; sleeping is paced on a virtual clock, so oversleeping is paid back
on the next read and the long-run rate matches the model.

Shared state: one small file per ``shared_name`` in the ``throttle_dir`` knob (default
``<shm_root>/.throttle``), mapped by every process: a slot per reading process with its pid, start
time and "busy until" time (CLOCK_MONOTONIC, which all processes share). Slots are claimed under
``flock``; slots of dead processes are dropped (checked on attach and every 0.25 s while reading),
so a reader killed mid-read stops counting. ``close()`` detaches a process and removes the file
when no live process is left; ``unlink()`` removes it outright.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import time
import weakref
from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger import config
from hpcstagger.errors import CacheError, ConfigError
from hpcstagger.cache import _fs
from hpcstagger.cache.sources import SampleRecord, Source, record_of

__all__ = ["ThrottledSource", "throttle_dir", "remove_if_idle"]

_MAGIC = int.from_bytes(b"HPCSTHR1", "little")
_NSLOTS = 256
_HDR = 64
_PIDS = _HDR
_STARTS = _PIDS + 8 * _NSLOTS
_BUSY = _STARTS + 8 * _NSLOTS
_SIZE = _BUSY + 8 * _NSLOTS
QUANTUM = 0.010     # re-evaluate the number of readers this often during a long read
GRACE = 0.001       # a reader still counts this long after its read ends
SWEEP = 0.25        # check other readers' liveness this often
MAX_CREDIT = 0.010  # most oversleep carried into the next read


def throttle_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where throttle state lives: the ``throttle_dir`` knob, else ``<shm_root>/.throttle``, as
    this process sees the knobs, or a process with the environment ``environ``."""
    return os.path.abspath(config.get("throttle_dir", environ)
                           or os.path.join(config.get("shm_root", environ), ".throttle"))


def _anyone_alive(pids: Sequence[int], starts: Sequence[int]) -> bool:
    """Whether any slot of the reader table (its pids and start times) belongs to a live process."""
    return any(p and _fs.alive(p, t) for p, t in zip(pids, starts, strict=True))


def remove_if_idle(shared_name: str, state_dir: str | os.PathLike[str] | None = None) -> bool:
    """Remove the shared state file of ``shared_name`` when no live process is attached to it; True
    if it was removed. A run's readers leave it behind when the last of them to exit still saw
    others alive (forked DataLoader workers do not detach), so a launcher calls this after its run.
    Raises CacheError for an unsafe state directory or file."""
    name = _fs.validate_name(shared_name, "throttle shared_name")
    directory = os.path.abspath(os.fspath(state_dir)) if state_dir is not None else throttle_dir()
    if not os.path.lexists(os.path.join(directory, name)):
        return False
    dir_fd = _fs.open_secure_dir(directory, create=False, what="throttle state directory")
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = _fs.check_secure_file(fd, os.path.join(directory, name), "throttle state file")
            if st.st_nlink == 0 or st.st_size != _SIZE:
                return False  # gone already, or not ours to judge: left alone
            words = os.pread(fd, _BUSY - _PIDS, _PIDS)
            pids = struct.unpack_from(f"<{_NSLOTS}q", words)
            starts = struct.unpack_from(f"<{_NSLOTS}q", words, 8 * _NSLOTS)
            if _anyone_alive(pids, starts):
                return False
            os.unlink(name, dir_fd=dir_fd)
            return True
        finally:
            os.close(fd)  # (releases the lock)
    finally:
        os.close(dir_fd)


class _State:
    """One process's attachment to the shared reader table of one shared_name."""

    def __init__(self, directory: str, name: str):
        self.pid, start = _fs.self_identity()
        self.path = os.path.join(directory, name)
        self.credit = 0.0
        self.next_sweep = 0.0
        self.slot = -1
        dir_fd = _fs.open_secure_dir(directory, create=True, what="throttle state directory")
        try:
            fd, self.map = self._open(dir_fd, name)
        except BaseException:
            os.close(dir_fd)
            raise
        self.pids = memoryview(self.map)[_PIDS:_STARTS].cast("q")
        self.starts = memoryview(self.map)[_STARTS:_BUSY].cast("q")
        self.busy = memoryview(self.map)[_BUSY:_SIZE].cast("d")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            for s in range(_NSLOTS):
                if self.pids[s] == 0 or not _fs.alive(self.pids[s], self.starts[s]):
                    self.busy[s] = 0.0
                    self.starts[s], self.pids[s] = start, self.pid
                    self.slot = s
                    break
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        # Detach at interpreter exit too (forked DataLoader workers skip this; their slots are
        # dropped by the next attach once their pid is dead).
        self._finalizer = weakref.finalize(self, _release, fd, dir_fd, self.pid, self.slot, name, self.map)
        if self.slot < 0:
            self.detach(remove_if_last=False)
            raise CacheError(f"throttle {self.path} already has {_NSLOTS} live readers")

    def _open(self, dir_fd: int, name: str) -> tuple[int, mmap.mmap]:
        for _ in range(100):
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                st = _fs.check_secure_file(fd, self.path, "throttle state file")
                if st.st_nlink == 0:  # removed by the last reader between our open and our lock
                    os.close(fd)
                    continue
                if st.st_size == 0:
                    os.write(fd, struct.pack("<QQQ", _MAGIC, 1, _NSLOTS).ljust(_HDR, b"\0") + bytes(_SIZE - _HDR))
                elif st.st_size != _SIZE:
                    raise CacheError(f"throttle state file {self.path} has the wrong size; remove it")
                mp = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                if struct.unpack_from("<QQQ", mp) != (_MAGIC, 1, _NSLOTS):
                    mp.close()
                    raise CacheError(f"{self.path} is not a throttle state file; remove it")
                fcntl.flock(fd, fcntl.LOCK_UN)
                return fd, mp
            except BaseException:
                os.close(fd)
                raise
        raise CacheError(f"cannot attach to throttle state {self.path}: it keeps being removed")

    def active_others(self, since: float) -> int:
        busy = self.busy.tolist()
        n = sum(1 for t in busy if t > since)
        return n - (busy[self.slot] > since)

    def sweep(self) -> None:
        """Forget readers that died (their busy time would otherwise count until it passes)."""
        now = time.monotonic()
        for s, t in enumerate(self.busy.tolist()):
            if s != self.slot and t > now and not _fs.alive(self.pids[s], self.starts[s]):
                self.busy[s] = 0.0
        self.next_sweep = now + SWEEP

    def detach(self, *, remove_if_last: bool) -> None:
        """Free this process's slot, close the files, and remove the state file if asked and last."""
        for view in (self.pids, self.starts, self.busy):
            view.release()
        info = self._finalizer.detach()
        if info is not None:
            _, func, args, _ = info
            func(*args, remove_if_last=remove_if_last)


def _release(fd: int, dir_fd: int, pid: int, slot: int, name: str, mp: mmap.mmap, *,
             remove_if_last: bool = True) -> None:
    if pid != os.getpid():
        return  # an inherited copy after fork: the parent's attachment, not ours
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            pids = memoryview(mp)[_PIDS:_STARTS].cast("q")
            starts = memoryview(mp)[_STARTS:_BUSY].cast("q")
            busy = memoryview(mp)[_BUSY:_SIZE].cast("d")
            if slot >= 0:
                busy[slot] = 0.0
                pids[slot] = 0
            last = not _anyone_alive(pids, starts)
            for view in (pids, starts, busy):
                view.release()
            if remove_if_last and last and os.fstat(fd).st_nlink:
                os.unlink(name, dir_fd=dir_fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        try:
            mp.close()
        except BufferError:
            pass  # views still exported at interpreter exit: the mapping goes with the process
        os.close(fd)
        os.close(dir_fd)


class ThrottledSource:
    """Emulates a shared remote repository: ``source``'s reads, slowed to a shared bandwidth.

    ``bytes_per_second`` is one aggregate rate or a list ``[aggregate with 1 concurrent reader,
    with 2, ...]``, the last value holding beyond. All processes that use the same
    ``shared_name`` share it: with ``k`` reading at once each gets ``bandwidth[k-1] / k``.
    ``latency`` seconds are added to every read. See the module docstring for the exact model.

    This is an emulator for tests, benchmarks and the demo, not a production rate limiter.
    ``state_dir`` defaults to the ``throttle_dir`` knob. Raises ConfigError for bad rates and
    CacheError for a bad ``shared_name`` or an unsafe state directory.
    """

    def __init__(self, source: Source, bytes_per_second: float | Sequence[float], *, shared_name: str,
                 latency: float = 0.0, state_dir: str | os.PathLike[str] | None = None):
        rates = [bytes_per_second] if isinstance(bytes_per_second, (int, float)) else list(bytes_per_second)
        if not rates or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 for r in rates):
            raise ConfigError(f"ThrottledSource: bytes_per_second must be a positive number or a non-empty "
                              f"list of them ([aggregate with 1 reader, with 2, ...]), not {bytes_per_second!r}")
        if not isinstance(latency, (int, float)) or latency < 0:
            raise ConfigError(f"ThrottledSource: latency must be >= 0 seconds, not {latency!r}")
        self.source = source
        self.bandwidth: tuple[float, ...] = tuple(float(r) for r in rates)
        self.shared_name = _fs.validate_name(shared_name, "throttle shared_name")
        self.latency = float(latency)
        self.state_dir = os.path.abspath(os.fspath(state_dir)) if state_dir is not None else throttle_dir()
        self._st: _State | None = None

    def per_reader_rate(self, k: int) -> float:
        """Bytes per second each of ``k`` concurrent readers gets: ``bandwidth[k-1] / k``."""
        return self.bandwidth[min(k, len(self.bandwidth)) - 1] / k

    def __len__(self) -> int:
        return len(self.source)

    def key(self, i: int) -> str | int:
        return self.source.key(i)

    def record(self, i: int) -> SampleRecord:
        """The wrapped source's record of sample ``i``."""
        return record_of(self.source, i)

    def __getitem__(self, i: int) -> bytes:
        st = self._state()
        t0 = time.monotonic()
        # reading from now on: the others count this reader while its inner read runs too (a
        # reader that did not count while it waited for its inner read, on a busy CPU, left the
        # others a larger share and the aggregate above the bandwidth)
        st.busy[st.slot] = math.inf
        try:
            data = self.source[i]
        except BaseException:
            st.busy[st.slot] = time.monotonic()
            raise
        self._pace(len(data), t0)
        return data

    def _state(self) -> _State:
        st = self._st
        if st is None or st.pid != os.getpid():
            st = self._st = _State(self.state_dir, self.shared_name)
        return st

    def _pace(self, nbytes: int, t0: float) -> None:
        st = self._state()
        busy, slot = st.busy, st.slot
        t = t0 - min(st.credit, MAX_CREDIT) + self.latency  # virtual end of the work done so far
        remaining = float(nbytes)
        while True:
            now = time.monotonic()
            if now >= st.next_sweep:
                st.sweep()
            rate = self.per_reader_rate(1 + st.active_others(now - GRACE))
            step = min(remaining / rate, QUANTUM)
            t += step
            remaining -= step * rate
            busy[slot] = t + max(remaining, 0.0) / rate
            delay = t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if remaining <= 1e-6:
                break
        woke = time.monotonic()
        st.credit = max(0.0, woke - t)
        busy[slot] = t  # count as reading until GRACE after the virtual end

    def close(self) -> None:
        """Detach this process; the state file is removed when no live process is left attached."""
        if self._st is not None and self._st.pid == os.getpid():
            self._st.detach(remove_if_last=True)
        self._st = None

    def unlink(self) -> None:
        """Remove the shared state file (for everyone) and this process's attachment."""
        self.close()
        try:
            os.unlink(os.path.join(self.state_dir, self.shared_name))
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.state_dir)  # only if empty
        except OSError:
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_st"] = None
        return state

    def __repr__(self) -> str:
        return (f"ThrottledSource({self.source!r}, {list(self.bandwidth)}, shared_name={self.shared_name!r}, "
                f"latency={self.latency})")
