"""The consumer side of a shared pipeline: :class:`SharedLoader`, used where a DataLoader was built.

Epochs
    A consumer attaches at the first segment boundary it can reach (see :mod:`._order`): the oldest
    one still in the producer's window, or the next one to be produced. Each ``for batch in loader``
    is one epoch of ``len(loader)`` batches: ``B`` consecutive stream batches from there, wrapping
    into the producer's next round, so every sample comes exactly once per epoch. The next epoch
    continues where this one ended. Leaving an epoch early (``break``) skips its remaining batches.
Data-parallel jobs
    Rank ``r`` of a job of ``world`` ranks takes every ``world``-th batch of the job's epochs,
    starting at its ``r``-th, and ``B // world`` of them per epoch (like DistributedSampler with
    ``drop_last``). All ranks of a job agree on the first batch: the first rank to attach reserves
    entries for the others, which hold the producer back until they attach (``loader_rank_wait``).
Batches
    A batch's tensors are views of shared memory, zero-copy, through a private copy-on-write mapping:
    changing them in place changes nothing for the other consumers. They stay valid until this
    consumer has taken ``hold`` more batches (default 1: the previous batch is released when the next
    one is taken); clone what must live longer.
Pace
    The producer keeps ``window`` batches. With ``pace="wait"`` (default) the slowest consumer sets the
    pace of all: a fast one waits for batches while the window is full of batches the slow one has
    not taken. With ``pace="ahead"`` a consumer that would wait *because the window is full* prepares
    the batch itself (in its own process, with the same indices), so it runs at its own speed at the
    cost of its own prep; batches it prepared itself are skipped when the producer publishes them.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import mmap
import os
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from hpcstagger import config
from hpcstagger.cache import _fs
from hpcstagger.comm import Backoff
from hpcstagger.errors import CacheError, ConfigError, LoaderError
from hpcstagger.loader import _cuda, _ring as R
from hpcstagger.loader._order import StreamOrder
from hpcstagger.loader.producer import Pipeline, check_socket_dir, spawn_producer

log = logging.getLogger(__name__)

__all__ = ["SharedLoader"]

_PACES = ("wait", "ahead")
# A waiting consumer sleeps on ``head`` (a futex, woken by the producer's publish) and wakes at least
# every _CHECK_EVERY s to check that the producer lives: a prep-bound consumer waits most of the
# time, and every wake-up takes CPU from the DataLoader workers on the same cores. Where futexes are
# not available it polls, backing off to one poll per _NAP_MAX s; so does a GPU consumer while CUDA
# work it queued is still to finish (it releases those batches as it sees the work done).
_NAP_MAX = 0.005
_CHECK_EVERY = 0.05


class SharedLoader:
    """Iterate over batches that one producer per node prepares for every consumer of a pipeline.

    ``dataset`` (map-style, with ``len``), ``batch_size``, ``num_workers``, ``collate_fn``,
    ``worker_init_fn``, ``prefetch_factor`` and ``drop_last`` mean what they mean for a DataLoader;
    the producer's DataLoader uses them; so does ``shuffle`` (default True: a new order every epoch,
    from ``seed``; False: dataset order). ``name`` names the pipeline:
    consumers with the same name and batching parameters share one producer. ``rank``/``world``/
    ``group`` make this one rank of a data-parallel job (``group`` names the job). ``pace``,
    ``hold``, ``window`` and ``segments`` are explained in the module docs. ``device`` ("cuda",
    "cuda:N") puts batches on that GPU: copied there once per batch for all the consumers on it, and
    (``private``, the default) copied on the device for each consumer; ``private=False`` hands out the
    shared device memory itself, which must then not be changed in place. ``pin_memory`` and
    ``persistent_workers`` are accepted so that a DataLoader's arguments carry over: the producer's
    workers always persist, and host batches are never pinned (a warning says to use ``device``
    instead). Raises ConfigError for bad
    arguments and LoaderError when the producer fails or dies, or shared memory is unsafe.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, *, name: str, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False,
                 worker_init_fn: Callable[[int], None] | None = None, prefetch_factor: int | None = None,
                 pace: str = "wait", hold: int = 1, rank: int = 0, world: int = 1, group: str | None = None,
                 window: int | None = None, segments: int | None = None, slot_bytes: int = 0,
                 timeout: float | None = None, root: str | None = None, device: Any = None,
                 private: bool = True, pin_memory: bool = False, persistent_workers: bool | None = None):
        try:
            _fs.validate_name(name, "shared pipeline name")
        except CacheError as exc:
            raise ConfigError(str(exc)) from None
        n = _map_style_len(dataset)
        window = int(config.get("loader_window") if window is None else window)
        segments = int(config.get("loader_segments") if segments is None else segments)
        if not 2 <= window <= R.MAX_WINDOW:
            raise ConfigError(f"SharedLoader: window must be 2 to {R.MAX_WINDOW} batches, got {window}")
        if pace not in _PACES:
            raise ConfigError(f"SharedLoader: pace must be one of {', '.join(_PACES)}, got {pace!r}")
        if not (isinstance(hold, int) and 1 <= hold < window):
            raise ConfigError(f"SharedLoader: hold must be 1 to window-1 ({window - 1}), got {hold!r}")
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise ConfigError(f"SharedLoader: need 0 <= rank < world, got rank={rank!r} world={world!r}")
        if num_workers < 0:
            raise ConfigError(f"SharedLoader: num_workers must be >= 0, got {num_workers}")
        self.order = StreamOrder(n, batch_size, seed, segments, drop_last, bool(shuffle))
        if self.order.batches < world:
            raise ConfigError(f"SharedLoader: {self.order.batches} batches per epoch cannot be shared by {world} ranks")
        self.name, self.dataset, self.pace, self.hold = name, dataset, pace, hold
        self.rank, self.world, self.window = rank, world, window
        self.group = group or f"pid{os.getpid()}"
        self.timeout = float(config.get("loader_timeout") if timeout is None else timeout)
        self.root = os.path.abspath(root or config.get("shm_root"))
        self._dev: _cuda.DeviceConsumer | None = None
        uuid = ""
        if device is not None:
            index, uuid = _cuda.resolve_device(device)
            self._dev = _cuda.DeviceConsumer(index, bool(private))
        elif not private:
            raise ConfigError("SharedLoader: private=False needs device=...; batches in host memory are always private")
        elif pin_memory:
            log.warning("SharedLoader %r: pin_memory=True has no effect: batches are in shared memory, not pinned; "
                        "pass device='cuda:N' to receive them on the GPU, copied there once for every consumer", name)
        self._uuid = uuid
        self._head_word = R.H_GHEAD if uuid else R.H_HEAD
        # the words that make a pipeline this one name its files too: one list of what must agree
        digest = hashlib.sha256(repr(sorted(self._identity().items())).encode()).hexdigest()
        self.key = f"{name}.{digest[:12]}"
        self._collate = collate_fn
        self._pipe = Pipeline(self.key, name, dataset, self.order, num_workers, collate_fn, worker_init_fn,
                              prefetch_factor, window, int(slot_bytes), uuid)
        self._ctl: R.Ctl | None = None
        self._idx = -1
        self._first = 0
        self._epoch = 0
        self._held: deque[int] = deque()
        self._data_fd = -1
        self._stats = {"batches": 0, "own_prep": 0, "wait_s": 0.0}

    # ---- public -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.order.batches // self.world

    def __iter__(self) -> Iterator[Any]:
        if self._ctl is None:
            self.attach()
        epoch = self._epoch
        self._epoch += 1
        return self._iterate(epoch)

    def attach(self) -> None:
        """Join the pipeline now (``iter`` does it on first use), starting its producer if needed."""
        if self._ctl is not None:
            return
        dir_fd, dir_path = R.loader_dir(self.root)
        try:
            with R.DirLock(dir_fd):
                self._ctl = self._open_or_start(dir_fd, dir_path)
                self._idx, self._first = self._claim(self._ctl)
                self._ctl.wake_producer()
        finally:
            os.close(dir_fd)
        _live.add(self)
        _register_exit()
        log.info("shared loader %s: attached as consumer %d at batch %d (producer pid %d)", self.name,
                 self._idx, self._first, self.producer_pid)

    @property
    def producer_pid(self) -> int:
        """The producer's pid (0 before attaching)."""
        return int(self._ctl.w[R.H_PPID]) if self._ctl is not None else 0

    @property
    def producer_workers(self) -> int:
        """The DataLoader workers of the producer this consumer takes batches from (the number its
        first consumer asked for; before attaching, the number this one asks for)."""
        return int(self._ctl.w[R.H_WORKERS]) if self._ctl is not None else self._pipe.num_workers

    def stats(self) -> dict[str, Any]:
        """This consumer's counters: batches taken, batches it prepared itself, seconds waited."""
        return dict(self._stats, first_batch=self._first, epochs=self._epoch,
                    device=f"cuda:{self._dev.index}" if self._dev is not None else "cpu")

    def close(self) -> None:
        """Detach; the last consumer of a dead producer removes the pipeline's shared memory."""
        ctl, self._ctl = self._ctl, None
        _live.discard(self)
        if ctl is None:
            return
        if int(ctl.cons(self._idx)[R.C_PID]) != os.getpid():  # a forked child: the entry is its parent's
            return
        try:  # never create it here: closing after the root was removed must not bring it back
            dir_fd, _ = R.loader_dir(self.root, create=False)
        except LoaderError:
            dir_fd = -1
        try:
            if dir_fd >= 0:
                with R.DirLock(dir_fd):
                    ctl.cons(self._idx)[R.C_STATE] = R.C_LEFT
                    self._drop_group_pending(ctl)
                    ctl.wake_producer()  # it may wait for this consumer to release a slot
                    if not _producer_running(ctl) and not _others_alive(ctl):
                        R.remove_files(dir_fd, self.key, ctl.ino)
            else:
                ctl.cons(self._idx)[R.C_STATE] = R.C_LEFT
                ctl.wake_producer()
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
            if self._data_fd >= 0:
                os.close(self._data_fd)
                self._data_fd = -1
            if self._dev is not None:
                self._dev.close()
            ctl.close()

    def __enter__(self) -> SharedLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finaliser
            pass

    # ---- attaching ------------------------------------------------------------------------------

    def _open_or_start(self, dir_fd: int, dir_path: str) -> R.Ctl:
        ctl = R.open_ctl(dir_fd, dir_path, self.key)
        if ctl is not None:
            if int(ctl.w[R.H_MAGIC]) == R.MAGIC and _producer_running(ctl):
                self._check_same(ctl)
                return ctl
            log.info("shared loader %s: removing the files of a stopped or dead producer", self.name)
            R.remove_files(dir_fd, self.key, ctl.ino)
            ctl.close()
        check_socket_dir(self._pipe.num_workers)  # before any file: a producer that cannot work would hang its jobs
        ctl = R.open_ctl(dir_fd, dir_path, self.key, create=True)
        assert ctl is not None
        w = ctl.w
        for word, value in (*self._identity().items(), (R.H_WORKERS, self._pipe.num_workers),
                            (R.H_SPAWNER, os.getpid()), (R.H_CREATED, R.now_ns()), (R.H_BEAT, R.now_ns())):
            w[word] = value
        for s in range(self.window):
            ctl.slot(s)[R.S_SEQ] = -1
        w[R.H_STATE] = R.P_STARTING
        w[R.H_MAGIC] = R.MAGIC
        # The producer idles until this consumer's entry is claimed, right after (the lock is held).
        pid, start = spawn_producer(self._pipe, ctl, self.root)
        w[R.H_PPID], w[R.H_PSTART] = pid, start
        log.info("shared loader %s: started producer pid %d", self.name, pid)
        return ctl

    def _identity(self) -> dict[int, int]:
        """The header words that make a pipeline this one (hashed into its key, written at creation, checked
        on attach)."""
        o = self.order
        return {R.H_VERSION: R.VERSION, R.H_WINDOW: self.window, R.H_N: o.n, R.H_BATCH: o.batch_size,
                R.H_SEED: o.seed, R.H_SEGMENTS: o.segments, R.H_DROP: int(o.drop_last) | (0 if o.shuffle else 2),
                R.H_DEVICE: _group_id(self._uuid) if self._uuid else 0}

    def _check_same(self, ctl: R.Ctl) -> None:
        if any(int(ctl.w[k]) != v for k, v in self._identity().items()):
            raise LoaderError(f"the shared pipeline file {ctl.path} does not match pipeline {self.name!r} "
                              "(another hpcstagger version, or a corrupted file); remove it when no job uses it")

    def _claim(self, ctl: R.Ctl) -> tuple[int, int]:
        """Claim this consumer's entry (lock held); return (entry index, first batch of its job)."""
        pid, start = _fs.self_identity()
        group = _group_id(self.group)
        if self.world > 1:
            for i in ctl.attached():
                c = ctl.cons(i)
                if (int(c[R.C_GROUP]), int(c[R.C_WORLD]), int(c[R.C_RANK])) == (group, self.world, self.rank):
                    if int(c[R.C_STATE]) == R.C_PENDING:
                        c[R.C_PID], c[R.C_START], c[R.C_WAITING] = pid, start, 0
                        c[R.C_STATE] = R.C_ATTACHED
                        return i, int(c[R.C_FIRST])
        free = [i for i in range(R.MAX_CONSUMERS) if int(ctl.cons(i)[R.C_STATE]) not in (R.C_ATTACHED, R.C_PENDING)]
        if len(free) < self.world:
            raise LoaderError(f"the shared pipeline {self.name!r} has no room for {self.world} more consumer(s) "
                              f"(at most {R.MAX_CONSUMERS}); use another name for some jobs")
        mine = free[self.rank]
        deadline = R.now_ns() + int(float(config.get("loader_rank_wait")) * 1e9)
        first = -1
        while True:
            head = int(ctl.w[R.H_HEAD])
            lowest = self.order.boundary_at_or_after(max(0, head - self.window + 2))
            if first >= lowest:
                break
            first = lowest
            for r in range(self.world):
                c = ctl.cons(free[r])
                c[R.C_GROUP], c[R.C_RANK], c[R.C_WORLD] = group, r, self.world
                c[R.C_FIRST], c[R.C_RELEASED], c[R.C_TAKEN], c[R.C_OWNPREP] = first, first + r, 0, 0
                c[R.C_DEADLINE], c[R.C_WAITING] = deadline, 0
                if r == self.rank:
                    c[R.C_PID], c[R.C_START] = pid, start
                    c[R.C_STATE] = R.C_ATTACHED
                else:
                    c[R.C_PID], c[R.C_START] = 0, 0
                    c[R.C_STATE] = R.C_PENDING
        return mine, first

    def _drop_group_pending(self, ctl: R.Ctl) -> None:
        group = _group_id(self.group)
        for i in ctl.attached():
            c = ctl.cons(i)
            if int(c[R.C_STATE]) == R.C_PENDING and int(c[R.C_GROUP]) == group:
                c[R.C_STATE] = R.C_DROPPED

    # ---- taking batches ---------------------------------------------------------------------------

    def _iterate(self, epoch: int) -> Iterator[Any]:
        base = self._first + epoch * self.order.batches + self.rank
        for j in range(len(self)):
            yield self._take(base + j * self.world)

    def _take(self, g: int) -> Any:
        ctl = self._ctl
        if ctl is None:
            raise LoaderError(f"shared loader {self.name!r} is closed")
        me = ctl.cons(self._idx)
        self._held.append(g)
        while len(self._held) > self.hold:
            self._held.popleft()
        if self._dev is not None:
            self._dev.release(me, self._held[0])
        else:
            me[R.C_RELEASED] = self._held[0]
        ctl.wake_producer()
        if int(me[R.C_STATE]) != R.C_ATTACHED:
            raise LoaderError(f"this consumer of shared pipeline {self.name!r} was detached by its producer "
                              f"(pid {self.producer_pid}); build a new SharedLoader to attach again")
        self._check_producer(ctl)
        if int(ctl.w[self._head_word]) <= g and not self._wait(ctl, g):
            me[R.C_OWNPREP] += 1
            self._stats["own_prep"] += 1
            batch = self._prepare(g)
            return self._dev.to_device(batch) if self._dev is not None else batch
        s = g % self.window
        if int(ctl.slot(s)[R.S_SEQ]) != g:
            raise LoaderError(f"shared pipeline {self.name!r}: batch {g} was overwritten before this consumer "
                              "took it (a bug; please report it)")
        me[R.C_TAKEN] += 1
        self._stats["batches"] += 1
        if self._dev is not None:
            return self._dev.batch(ctl, self._map_slot(ctl, s), s)
        return R.decode(self._map_slot(ctl, s), 0)

    def _wait(self, ctl: R.Ctl, g: int) -> bool:
        """Wait until batch ``g`` is published (True), or False if this consumer should prepare it."""
        t0 = checked = time.monotonic()
        backoff = Backoff(0.0002, _NAP_MAX)
        me = ctl.cons(self._idx)
        me[R.C_WAITING] = 1  # before reading head again: a publish after that read wakes this process
        try:
            while (head := int(ctl.w[self._head_word])) <= g:
                pending = False
                if self._dev is not None:
                    pending = self._dev.poll(me)
                    ctl.wake_producer()
                now = time.monotonic()
                if now - checked >= _CHECK_EVERY:  # _take checked it just before; /proc costs more than a poll
                    self._check_producer(ctl)
                    checked = now
                if self.pace == "ahead" and int(ctl.w[R.H_BLOCKED]):
                    return False
                waited = now - t0
                if waited > self.timeout:
                    raise LoaderError(f"shared pipeline {self.name!r}: no batch from its producer (pid "
                                      f"{self.producer_pid}, alive) for {waited:.0f} s; a consumer may be stuck "
                                      f"(pace='ahead' lets others go on), or raise the loader_timeout knob")
                nap = min(checked + _CHECK_EVERY - now, t0 + self.timeout - now) + 0.0005
                if pending:  # CUDA work still to finish: look again soon
                    nap = min(nap, backoff.next_pause())
                ctl.wait(self._head_word, head, nap, backoff)
            return True
        finally:
            me[R.C_WAITING] = 0
            self._stats["wait_s"] += time.monotonic() - t0

    def _check_producer(self, ctl: R.Ctl) -> None:
        state = int(ctl.w[R.H_STATE])
        if state == R.P_FAILED:
            err = ctl.error()
            pid = self.producer_pid
            self.close()
            raise LoaderError(f"the producer of shared pipeline {self.name!r} (pid {pid}) failed: {err}")
        if state == R.P_STOPPED or not ctl.producer_alive():
            pid = self.producer_pid
            self.close()
            raise LoaderError(f"the producer of shared pipeline {self.name!r} (pid {pid}) died (killed or "
                              "crashed); the next SharedLoader of this pipeline starts a new one")

    def _map_slot(self, ctl: R.Ctl, s: int) -> mmap.mmap:
        size = int(ctl.w[R.H_SLOT_BYTES])
        if self._data_fd < 0:
            dir_fd, dir_path = R.loader_dir(self.root)
            try:
                self._data_fd = R.open_file(dir_fd, dir_path, self.key + ".data", create=False, size=0)
            finally:
                os.close(dir_fd)
            if self._data_fd < 0:
                raise LoaderError(f"shared pipeline {self.name!r}: its data file is gone (removed by hand?)")
        return mmap.mmap(self._data_fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE,
                         offset=s * size)

    def _prepare(self, g: int) -> Any:
        from torch.utils.data import default_collate

        collate = self._collate or default_collate
        return collate([self.dataset[i] for i in self.order.indices(g)])


def _map_style_len(dataset: Any) -> int:
    """``len(dataset)``; ConfigError for an IterableDataset (with or without ``__len__``)."""
    data = sys.modules.get("torch.utils.data")  # a torch dataset has imported it already
    iterable = data is not None and isinstance(dataset, data.IterableDataset)
    try:
        n = len(dataset)
    except TypeError:
        iterable = True
    if iterable:
        raise ConfigError("SharedLoader needs a map-style dataset with len(); an IterableDataset cannot be "
                          "shared (its order is not known in advance)")
    return n


def _group_id(group: str) -> int:
    return int.from_bytes(hashlib.sha256(group.encode()).digest()[:7], "little")


def _producer_running(ctl: R.Ctl) -> bool:
    state = int(ctl.w[R.H_STATE])
    return state in (R.P_STARTING, R.P_RUNNING) and ctl.producer_alive()


def _others_alive(ctl: R.Ctl) -> bool:
    return any(_fs.alive(int(ctl.cons(i)[R.C_PID]), int(ctl.cons(i)[R.C_START])) for i in ctl.attached(pending=False))


_live: weakref.WeakSet[SharedLoader] = weakref.WeakSet()
_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        atexit.register(_close_all)
        _exit_registered = True


def _close_all() -> None:
    for loader in list(_live):
        try:
            loader.close()
        except Exception:  # best effort at exit
            pass

