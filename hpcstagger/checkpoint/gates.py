"""Gates: "is training busy right now?", asked by the background checkpoint writer before each chunk.

The writer of :class:`~hpcstagger.checkpoint.AsyncCheckpointer` waits, before each chunk it writes,
until its gate says the training is idle, but never longer than the ``ckpt_gate_max_wait`` knob, so
a checkpoint always completes. When ``save()`` or ``wait()`` blocks on a write in flight, the
training is waiting anyway, and the writer stops asking.

- :class:`ActivityGate` counts activities in progress in this process (all-reduces, reads), from
  any thread: ``enter()``/``exit()`` or ``with gate.active():``. The Horovod and DDP integrations in
  :mod:`hpcstagger.integrations` feed one.
- :class:`StepGate` is busy during whole training steps (from a model's forward to its
  optimizer's step), fed by hooks; it is what ``AsyncCheckpointer`` uses by default
  (``gate="auto"``), because on CPU training it is the one that measurably cuts the slowdown
  (benchmarks/RESULTS.md).
- :class:`SharedActivityGate` does the same across processes through a small counter file in
  /dev/shm, so DataLoader worker processes can report reads that go to the source:
  ``gate.source_read_hook()`` is a picklable object with ``enter()``/``exit()``, which
  ``CachedDataset(..., source_read_hook=...)`` calls around every source read.
- :class:`AnyGate` is busy when any of its gates is.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hpcstagger.cache import _fs
from hpcstagger.comm import poll_until
from hpcstagger.errors import CheckpointError

__all__ = ["Gate", "ActivityGate", "StepGate", "AnyGate", "SharedActivityGate", "SourceReadHook", "GATE_PREFIX",
           "gate_owner", "stale_gate_files", "remove_stale_gates"]


class Gate:
    """A gate that is never busy; subclasses override :meth:`busy` (and may override wait_idle)."""

    def busy(self) -> bool:
        """True while the training is busy and the writer should hold off."""
        return False

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the gate is idle, at most ``timeout`` seconds; True if it is idle."""
        deadline = time.monotonic() + max(timeout, 0.0)
        # polled: pauses of 0.5 ms doubling to 5 ms, the last one cut short at the deadline
        return poll_until(deadline, lambda: not self.busy(), first=0.0005, cap=0.005)


class _Marks:
    """``active()`` for a class with ``enter()`` and ``exit()``: the ``with`` body is an activity."""

    if TYPE_CHECKING:  # provided by every class that mixes this in
        def enter(self) -> None: ...

        def exit(self) -> None: ...

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The ``with`` body is an activity (for a source read hook: a read from the source)."""
        self.enter()
        try:
            yield
        finally:
            self.exit()


class ActivityGate(_Marks, Gate):
    """Busy while at least one activity is in progress; safe to use from several threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._count = 0
        self.entered = 0  # activities started so far (for tests and benchmarks)

    def enter(self) -> None:
        """An activity starts."""
        with self._cond:
            self._count += 1
            self.entered += 1

    def exit(self) -> None:
        """An activity ends; an unmatched exit is ignored."""
        with self._cond:
            if self._count > 0:
                self._count -= 1
                if self._count == 0:
                    self._cond.notify_all()

    @property
    def count(self) -> int:
        """Activities in progress now."""
        return self._count

    def busy(self) -> bool:
        return self._count > 0

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._count == 0, timeout=max(timeout, 0.0))


class StepGate(ActivityGate):
    """Busy from the start of a model's forward pass until its optimizer's ``step()`` returns.

    :meth:`watch` hooks a module (forward pre-hook) and an optimizer (step post-hook); with
    gradient accumulation the gate stays busy from the first forward to the step. A forward pass
    without a following step (evaluation) keeps it busy until the next step, which only slows the
    writer down to one chunk per ``ckpt_gate_max_wait``. :meth:`close` removes the hooks.
    ``AsyncCheckpointer(gate="auto")``, the default, makes one and watches every module and
    optimizer found at the top level of each saved state.
    """

    def __init__(self) -> None:
        super().__init__()
        self._in_step = False
        self._step_lock = threading.Lock()
        self._hooks: list = []
        self._watched: weakref.WeakSet[object] = weakref.WeakSet()

    def _begin(self, *_: object) -> None:
        with self._step_lock:
            if not self._in_step:
                self._in_step = True
                self.enter()

    def _end(self, *_: object) -> None:
        with self._step_lock:
            if self._in_step:
                self._in_step = False
                self.exit()

    def watch(self, obj: object) -> bool:
        """Hook ``obj`` if it is an ``nn.Module`` (forward starts a step) or an optimizer (its
        ``step()`` ends one) not watched yet; returns whether it was hooked."""
        import torch

        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or obj in self._watched:
            return False  # (the type test first: arrays and the like cannot be looked up in a set)
        if isinstance(obj, torch.nn.Module):
            self._hooks.append(obj.register_forward_pre_hook(self._begin))
        else:
            self._hooks.append(obj.register_step_post_hook(self._end))
        self._watched.add(obj)
        return True

    def watch_state(self, state: object) -> None:
        """Watch every module and optimizer among the values of a state dict."""
        if isinstance(state, dict):
            for v in state.values():
                self.watch(v)

    def close(self) -> None:
        """Remove the hooks and leave the gate idle."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._watched = weakref.WeakSet()
        self._end()


class AnyGate(Gate):
    """Busy when any of ``gates`` is busy."""

    def __init__(self, *gates: Gate) -> None:
        self.gates = tuple(g for g in gates if g is not None)

    def busy(self) -> bool:
        return any(g.busy() for g in self.gates)


# ---------------------------------------------------------------------------- across processes
# File layout: 16-byte header (magic, slot count), then one 16-byte slot per process
# (pid, activities in progress), each written only by the process that claimed it.
_MAGIC = b"HSGATE01"
_HEADER = 16
_SLOTS = 1024
_SIZE = _HEADER + 16 * _SLOTS


class _Slot:
    def __init__(self, path: str):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, _SIZE)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                self.index = _claim(self.mm)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self.words = memoryview(self.mm).cast("q")
        self.count = 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process: a worker killed inside a read and not yet reaped by its
    DataLoader (a zombie) holds no activity."""
    return _fs.alive(pid, 0)


def _claim(mm: mmap.mmap) -> int:
    if mm[:8] != _MAGIC:
        raise CheckpointError("the shared gate file is not a hpcstagger gate; was it replaced?")
    words = memoryview(mm).cast("q")
    try:
        for i in range(_SLOTS):
            pid = words[_HEADER // 8 + 2 * i]
            if pid == 0 or not _alive(pid):
                words[_HEADER // 8 + 2 * i + 1] = 0
                words[_HEADER // 8 + 2 * i] = os.getpid()
                return i
    finally:
        words.release()
    raise CheckpointError(f"all {_SLOTS} slots of the shared gate are held by live processes; "
                          "use fewer DataLoader workers per gate")


_local: dict[str, _Slot] = {}
_local_lock = threading.Lock()


def _slot(path: str) -> _Slot:
    s = _local.get(path)
    if s is None or s.pid != os.getpid():  # first use in this process, or inherited over fork
        with _local_lock:
            s = _local.get(path)
            if s is None or s.pid != os.getpid():
                try:
                    s = _Slot(path)
                except FileNotFoundError:
                    raise CheckpointError(f"shared gate {path} is gone: the SharedActivityGate that made it "
                                          "was closed; keep it open while its hooks are in use") from None
                _local[path] = s
    return s


class SourceReadHook(_Marks):
    """Picklable ``enter()``/``exit()`` pair that marks a :class:`SharedActivityGate` busy.

    Pass it as ``CachedDataset(..., source_read_hook=hook)``; it works in any process on the node
    (DataLoader workers, forked or spawned) while the gate that made it is open.
    """

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (SourceReadHook, (self.path,))

    def __repr__(self) -> str:
        return f"SourceReadHook({self.path!r})"

    def enter(self) -> None:
        """A read from the source starts in this process."""
        s = _slot(self.path)
        with s.lock:
            s.count += 1
            s.words[_HEADER // 8 + 2 * s.index + 1] = s.count

    def exit(self) -> None:
        """The read ends; an unmatched exit is ignored."""
        s = _slot(self.path)
        with s.lock:
            if s.count > 0:
                s.count -= 1
                s.words[_HEADER // 8 + 2 * s.index + 1] = s.count


GATE_PREFIX = "hpcstagger-gate-"  # then <uid>-<owner pid>-<random>: the owner's liveness is in the name


def gate_owner(name: str, uid: int | None = None) -> int | None:
    """The pid of the process that made gate file ``name``, or None when ``name`` is not a gate file
    of user ``uid`` (default: this user)."""
    prefix = f"{GATE_PREFIX}{os.getuid() if uid is None else uid}-"
    if not name.startswith(prefix):
        return None
    pid, _, token = name[len(prefix):].partition("-")
    return int(pid) if pid.isdigit() and token else None


def stale_gate_files(directory: str = "/dev/shm") -> list[str]:
    """Paths of this user's gate files in ``directory`` whose owner is dead: a process killed by a
    signal or ended with ``os._exit`` (MPI_Abort, a rank's fail-fast exit) skips the removal."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names
                  if (pid := gate_owner(n)) is not None and pid != os.getpid() and not _alive(pid))


def remove_stale_gates(directory: str = "/dev/shm") -> list[str]:
    """Remove :func:`stale_gate_files`; return the paths removed. A process that still has such a
    file mapped keeps using its mapping."""
    removed = []
    for path in stale_gate_files(directory):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def _unlink(path: str, owner: int) -> None:
    if os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _local.pop(path, None)


class SharedActivityGate(_Marks, Gate):
    """Busy while any process is inside ``enter()``/``exit()`` of one of this gate's hooks.

    The counters live in a 16 KiB file in ``directory`` (default /dev/shm) under a unique name that
    carries this user's uid and this process's pid, removed by :meth:`close` or when the gate is
    garbage collected or the process exits normally. A process that ends without Python's exit
    handlers (a signal, ``os._exit``) cannot remove it; the next gate made in ``directory``, a
    launch that ends and ``hpcstagger clean`` remove the files of dead owners
    (:func:`remove_stale_gates`). A process that dies inside a read does not hold the gate busy:
    slots of dead processes are ignored. Raises CheckpointError if the file cannot be made.
    """

    def __init__(self, directory: str = "/dev/shm"):
        remove_stale_gates(directory)
        name = f"{GATE_PREFIX}{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(directory, name)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise CheckpointError(f"cannot create the shared gate file {self.path}: {exc}; "
                                  "pass a writable directory on a RAM file system") from None
        try:
            os.ftruncate(fd, _SIZE)
            os.pwrite(fd, _MAGIC + struct.pack("<q", _SLOTS), 0)
            self._mm = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
        except BaseException as exc:  # a full /dev/shm, an interrupt: leave no file behind
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            if isinstance(exc, OSError):
                raise CheckpointError(f"cannot set up the shared gate file {self.path}: {exc}; "
                                      "free space in /dev/shm or pass another directory") from None
            raise
        finally:
            os.close(fd)
        self._words: memoryview | None = memoryview(self._mm).cast("q")
        self._hook = SourceReadHook(self.path)
        self._finalizer = weakref.finalize(self, _unlink, self.path, os.getpid())

    def source_read_hook(self) -> SourceReadHook:
        """The picklable hook that marks this gate busy (give it to ``CachedDataset``)."""
        return self._hook

    def enter(self) -> None:
        """An activity starts in this process."""
        self._hook.enter()

    def exit(self) -> None:
        """An activity ends in this process."""
        self._hook.exit()

    def busy_processes(self) -> list[int]:
        """PIDs of live processes with an activity in progress."""
        if self._words is None:
            return []
        out = []
        w = self._words
        for i in range(_SLOTS):
            pid = w[_HEADER // 8 + 2 * i]
            if pid == 0:  # slots are claimed in order and never given back to 0
                break
            if w[_HEADER // 8 + 2 * i + 1] > 0 and _alive(pid):
                out.append(pid)
        return out

    def busy(self) -> bool:
        return bool(self.busy_processes())

    def close(self) -> None:
        """Remove the counter file; hooks used afterwards in new processes raise CheckpointError."""
        if self._words is not None:
            self._words.release()
            self._words = None
            self._mm.close()
        self._finalizer()

    def __enter__(self) -> SharedActivityGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
