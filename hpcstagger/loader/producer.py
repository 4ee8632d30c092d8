"""The producer of a shared pipeline: one process per node and pipeline, started by its first consumer.

The first consumer to ask for a pipeline creates its control file and forks the producer twice over
(the middle process exits at once, so the producer belongs to no job's process tree and outlives the
consumer that started it). The producer:

- runs a plain ``torch.utils.data.DataLoader`` over the user's dataset with the user's workers,
  collate function and worker init, over the endless batch stream of :class:`StreamOrder`, so the
  decode and augment run in DataLoader worker processes exactly as they would in one job (and reads
  go through the shared cache when the dataset is a ``CachedDataset``);
- copies each finished batch into the next slot of the ring, once every attached consumer has
  released the batch that slot held, and publishes it by advancing ``head``;
- beats every 0.1 s and, every 0.25 s, detaches consumers whose process is gone (so a killed job
  never holds the others back) and drops data-parallel ranks that never arrived;
- stops once no consumer has been attached for ``loader_linger`` seconds, and removes its files.

A failure in the dataset or collate function is written into the control file; every consumer raises
it, naming the producer. The producer's standard streams go to /dev/null and it lets go of the other
pipes, the sockets and the MPI segments it inherited (it must not hold a job's output pipes, a
launcher's sentinel pipes, a rank's connections or its MPI shared memory), so its errors reach users
only through their consumers.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hpcstagger import config
from hpcstagger.comm import Backoff
from hpcstagger.errors import LoaderError, describe_exception
from hpcstagger.loader import _ring as R
from hpcstagger.loader._order import StreamOrder
from hpcstagger.cache._fs import start_time, alive

log = logging.getLogger(__name__)

__all__ = ["Pipeline", "spawn_producer"]

_STUCK_GRACE = 5.0  # how long an unused producer waits for its DataLoader before it exits anyway
_NAP = 0.02  # the longest a producer waiting for a free slot sleeps without being woken


@dataclass
class Pipeline:
    """What a producer runs: the dataset and how to batch it (held in memory, passed by fork)."""

    key: str
    name: str
    dataset: Any
    order: StreamOrder
    num_workers: int
    collate_fn: Any
    worker_init_fn: Any
    prefetch_factor: int | None
    window: int
    slot_bytes: int
    device_uuid: str = ""  # the GPU batches are staged on ("" for host memory only)


class _StreamBatches:
    """A DataLoader batch sampler over the endless stream, from batch ``start``."""

    def __init__(self, order: StreamOrder, start: int = 0):
        self.order, self.start = order, start

    def __iter__(self) -> Iterator[list[int]]:
        g = self.start
        while True:
            yield self.order.indices(g)
            g += 1


# multiprocessing passes a batch's descriptors over a Unix socket at <tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX
_SOCKET_TAIL = len("/pymp-12345678/listener-12345678")
_SUN_PATH = 107  # the bytes a Unix socket's path may have on Linux (sun_path, less its NUL)


def check_socket_dir(num_workers: int) -> None:
    """LoaderError when DataLoader workers could not hand batches to the producer: with torch's
    ``file_descriptor`` sharing they pass descriptors over a Unix socket under the temporary
    directory, and a TMPDIR longer than 75 bytes makes its path too long. The workers' error goes to
    the producer's stderr, which is detached: the jobs would wait for batches that never come."""
    if num_workers <= 0:
        return
    import tempfile

    import torch.multiprocessing

    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    where = tempfile.gettempdir()
    size = len(os.fsencode(where))
    if size + _SOCKET_TAIL > _SUN_PATH:
        raise LoaderError(
            f"the shared loader's DataLoader workers pass batches over a Unix socket under the temporary "
            f"directory {where} ({size} bytes), and Linux allows a socket path {_SUN_PATH} bytes: at most "
            f"{_SUN_PATH - _SOCKET_TAIL} for the directory. Set TMPDIR to a shorter one (export TMPDIR=/tmp), "
            "or num_workers=0")


def spawn_producer(pipe: Pipeline, ctl: R.Ctl, root: str) -> tuple[int, int]:
    """Fork the producer (detached, in its own session); return its (pid, start time)."""
    rfd, wfd = os.pipe()
    child = os.fork()
    if child == 0:  # the middle process
        try:
            os.close(rfd)
            os.setsid()
            pid = os.fork()
            if pid == 0:
                os.close(wfd)
                code = 1
                try:
                    code = _Producer(pipe, ctl, root).main()
                finally:
                    os._exit(code)
            os.write(wfd, str(pid).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    try:
        text = b""
        while chunk := os.read(rfd, 64):
            text += chunk
    finally:
        os.close(rfd)
        os.waitpid(child, 0)
    if not text:
        raise LoaderError("could not start the shared loader's producer process (fork failed)")
    pid = int(text)

    return pid, start_time(pid)


class _Producer:
    def __init__(self, pipe: Pipeline, ctl: R.Ctl, root: str):
        # Its own descriptor of the directory: flock is per open file description, and the one
        # inherited from the consumer that forked it would share that consumer's lock.
        self.dir_fd, self.dir_path = R.loader_dir(root)
        self.pipe, self.ctl = pipe, ctl
        self.removed = False
        self.stop = threading.Event()
        self.left_loop = threading.Event()  # the main thread is out of the DataLoader
        self.linger = float(config.get("loader_linger"))
        self.data_mm: Any = None
        self.data_view: Any = None
        self.stager: Any = None

    def main(self) -> int:
        _release_inherited()
        import torch

        torch.set_num_threads(1)
        w = self.ctl.w
        w[R.H_BEAT] = R.now_ns()
        w[R.H_STATE] = R.P_RUNNING
        beat = threading.Thread(target=self._beat, name="hpcstagger-loader-beat", daemon=True)
        code = 0
        try:
            if self.pipe.device_uuid:
                self.stager = _start_stager(self.dir_path, self.pipe.key, self.ctl.ino, self.pipe.device_uuid)
            beat.start()
            self._produce()
        except BaseException as exc:  # every failure must reach the consumers
            code = 1
            self.ctl.set_error(describe_exception(exc))
            w[R.H_STATE] = R.P_FAILED
            self.stop.set()
        finally:
            self.left_loop.set()
            self.stop.set()
            if beat.is_alive():
                beat.join(timeout=2.0)
            w[R.H_BEAT] = R.now_ns()
            self._finish()
        return code

    # ---- the stream -------------------------------------------------------------------------

    def _loader(self) -> Any:
        import multiprocessing

        from torch.utils.data import DataLoader

        p = self.pipe
        kwargs: dict[str, Any] = {}
        if p.num_workers > 0:
            kwargs["multiprocessing_context"] = multiprocessing.get_context("fork")
            if p.prefetch_factor is not None:
                kwargs["prefetch_factor"] = p.prefetch_factor
        if p.collate_fn is not None:
            kwargs["collate_fn"] = p.collate_fn
        return DataLoader(p.dataset, batch_sampler=_StreamBatches(p.order), num_workers=p.num_workers,
                          worker_init_fn=p.worker_init_fn, **kwargs)

    def _produce(self) -> None:
        it = iter(self._loader())
        try:
            g = 0
            while not self.stop.is_set():
                batch = next(it)
                header, parts, nbytes = R.encode_plan(batch)
                if self.data_mm is None:
                    self._make_data(nbytes)
                slot_bytes = int(self.ctl.w[R.H_SLOT_BYTES])
                if nbytes > slot_bytes:
                    raise LoaderError(f"batch {g} of the shared pipeline {self.pipe.name!r} needs {nbytes} bytes "
                                      f"but its slots hold {slot_bytes}; batches vary in size: pass "
                                      f"slot_bytes={nbytes * 2} (or more) to SharedLoader")
                if not self._wait_free(g):
                    return
                s = g % self.pipe.window
                base = s * slot_bytes
                self.data_mm[base:base + len(header)] = header
                for flat, off, n in parts:
                    if n:
                        self.data_view[base + off:base + off + n].copy_(flat)
                slot = self.ctl.slot(s)
                slot[R.S_NBYTES] = nbytes
                slot[R.S_SEQ] = g
                self.ctl.w[R.H_HEAD] = g + 1
                self._wake_head()
                g += 1
        finally:
            # Shut the DataLoader's workers down now: on a failure the iterator sits in a reference
            # cycle through the exception's traceback (torch's reraise), so dropping it would leave
            # them running after this process exits, until their watchdog notices (up to 5 s).
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            del it

    def _make_data(self, nbytes: int) -> None:
        import mmap

        import torch

        size = self.pipe.slot_bytes or int(nbytes * 1.5) + 4096
        size = -(-size // R.PAGE) * R.PAGE
        with R.DirLock(self.dir_fd):
            fd = R.open_file(self.dir_fd, self.dir_path, self.pipe.key + ".data", create=True,
                             size=size * self.pipe.window)
        try:
            self.data_mm = mmap.mmap(fd, size * self.pipe.window, mmap.MAP_SHARED,
                                     mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.data_view = torch.frombuffer(self.data_mm, dtype=torch.uint8)
        self.ctl.w[R.H_SLOT_BYTES] = size

    def _wake_head(self) -> None:
        """Wake whoever waits for ``head``: the consumers, or the GPU stager (consumers wait for it)."""
        if self.stager is not None:
            self.ctl.wake_stager()
        else:
            self.ctl.wake_consumers(R.H_HEAD)

    def _wait_free(self, g: int) -> bool:
        """Wait until slot ``g % window`` may be overwritten; False if told to stop meanwhile. It sleeps
        on ``H_PWAIT`` (module docs of :mod:`._ring`): consumers wake it when they release a batch,
        attach or leave, the stager when it advances ``gpu_head``, the beat thread when it detaches a
        consumer or stops; every _NAP s it looks anyway."""
        w, window = self.ctl.w, self.pipe.window
        staged = g - window if self.stager is not None else -1  # the stager has copied the slot's batch
        backoff = Backoff(0.0002, 0.004)
        blocked = False
        w[R.H_PWAIT] = 1  # before reading the words it waits for
        try:
            while not self.stop.is_set():
                holders = self.ctl.attached()
                if holders and all(int(self.ctl.cons(i)[R.C_RELEASED]) > g - window for i in holders) \
                        and int(w[R.H_GHEAD]) > staged:
                    if blocked:
                        w[R.H_BLOCKED] = 0
                    return True
                if holders and not blocked:
                    w[R.H_BLOCKED] = R.now_ns()
                    blocked = True
                    # pace="ahead" consumers waiting for a batch now prepare it themselves
                    self.ctl.wake_consumers(R.H_GHEAD if self.stager is not None else R.H_HEAD)
                self.ctl.wait(R.H_PWAIT, 1, _NAP, backoff)
            return False
        finally:
            w[R.H_PWAIT] = 0

    # ---- liveness ---------------------------------------------------------------------------

    def _beat(self) -> None:
        w = self.ctl.w
        empty_since: float | None = None
        last_sweep = 0.0
        while not self.stop.wait(0.1):
            w[R.H_BEAT] = R.now_ns()
            if self.stager is not None and self.stager.poll() is not None:
                self._stager_died()
                return
            now = time.monotonic()
            quit_asked = bool(w[R.H_QUIT])  # the run is over (stop_idle): no linger once nobody is attached
            if now - last_sweep < 0.25 and not quit_asked:
                continue
            last_sweep = now
            with R.DirLock(self.dir_fd):
                live = self._sweep(now)
                self.ctl.wake_producer()  # a consumer it detached may have held a slot back
                if live:
                    empty_since = None
                    if quit_asked:  # someone attached after all: the request was for an idle producer
                        w[R.H_QUIT] = 0
                elif empty_since is None and not quit_asked:
                    empty_since = now
                elif quit_asked or (empty_since is not None and now - empty_since >= self.linger):
                    w[R.H_STATE] = R.P_STOPPED
                    R.remove_files(self.dir_fd, self.pipe.key, self.ctl.ino)
                    self.removed = True
                    self.stop.set()
                    self.ctl.wake_producer()
        # Out of the directory's lock (other pipelines' consumers take it): once the linger has removed
        # the files, the main thread should leave the DataLoader at once. If it does not, it waits on a
        # worker that never answers (a dataset that hangs); nobody is attached: end it all here.
        if self.removed and not self.left_loop.wait(_STUCK_GRACE):
            _kill_children()
            os._exit(1)

    def _sweep(self, now: float) -> int:
        """Detach dead consumers and expired pending ranks (lock held); return how many remain."""
        live = 0
        for i in self.ctl.attached():
            c = self.ctl.cons(i)
            if int(c[R.C_STATE]) == R.C_PENDING:
                if now * 1e9 > int(c[R.C_DEADLINE]):
                    c[R.C_STATE] = R.C_DROPPED
                    continue
            elif not alive(int(c[R.C_PID]), int(c[R.C_START])):
                c[R.C_STATE] = R.C_DROPPED
                c[R.C_WAITING] = 0  # killed while it waited: publishing need not wake it
                log.info("shared loader %s: detached consumer pid %d (gone)", self.pipe.name, int(c[R.C_PID]))
                continue
            live += 1
        return live

    def _stager_died(self) -> None:
        code = self.stager.returncode
        err = self.ctl.error() if int(self.ctl.w[R.H_ERRLEN]) else ""
        if not err.startswith("GPU stager"):
            err = f"GPU stager (pid {self.stager.pid}) exited with code {code} (killed?)"
        self.ctl.set_error(err)
        self.ctl.w[R.H_STATE] = R.P_FAILED
        self.stop.set()
        self.ctl.wake_producer()

    def _finish(self) -> None:
        """Remove the pipeline's files if no consumer is left; else the last consumer removes them."""
        with R.DirLock(self.dir_fd):
            if int(self.ctl.w[R.H_STATE]) in (R.P_STARTING, R.P_RUNNING):
                self.ctl.w[R.H_STATE] = R.P_STOPPED
            if not self.removed and not self._sweep(time.monotonic()):
                R.remove_files(self.dir_fd, self.pipe.key, self.ctl.ino)
                self.removed = True
        # Waiting consumers and the stager see the state now, not at their next look.
        self.ctl.wake_consumers(R.H_HEAD)
        self.ctl.wake_consumers(R.H_GHEAD)
        self.ctl.wake_stager()
        os.close(self.dir_fd)
        if self.stager is not None:  # it sees the state and exits, freeing its device memory
            try:
                self.stager.wait(timeout=5.0)
            except Exception:  # subprocess.TimeoutExpired
                self.stager.kill()
                self.stager.wait()


def _start_stager(dir_path: str, key: str, ino: int, uuid: str) -> Any:
    """Start the GPU stager as a new interpreter (CUDA cannot be used in this forked process)."""
    import subprocess
    import sys

    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    root = os.path.dirname(dir_path)
    return subprocess.Popen([sys.executable, "-m", "hpcstagger.loader.stager", root, key, str(ino), uuid],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, close_fds=True)


def _release_inherited() -> None:
    """Let go of what the producer inherited from the consumer that forked it and must not hold.

    - Standard streams: a job's output pipes must close when it ends.
    - Other pipes: whoever waits for their other end to close must not wait for the producer
      (multiprocessing's and torch's ``spawn`` join a child by such a pipe, its sentinel, and a job's
      launcher may read extra pipes to their end).
    - Sockets: a rank's peers (torch.distributed's store and process group, a PMI connection) must
      see it gone when it dies, not when the producer ends.
    - The MPI library's shared-memory segments, open and mapped, when the consumer is an MPI rank: the
      producer never calls MPI, and a segment it holds looks in use to the launch's cleanup after a
      killed rank, so the segment's file would stay in /dev/shm for good.

    Each such descriptor is replaced by /dev/null, not closed: Python objects copied from the consumer
    (a ``multiprocessing`` connection, a ``subprocess`` pipe) still name its number and close it when
    they are collected. A closed number would be reused by the producer's own DataLoader queues, and
    that later close would cut a queue: its worker then waits forever for indices sent to nowhere.
    """
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                mode = os.fstat(fd).st_mode
                if fd > 2 and fd != null and (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
                                              or os.readlink(f"/proc/self/fd/{fd}").startswith(_MPI_SEGMENTS)):
                    os.dup2(null, fd)
            except OSError:  # the descriptor of the listing itself, closed by now
                pass
    finally:
        os.close(null)
    _unmap_mpi_segments()


def _unmap_mpi_segments() -> None:
    import ctypes

    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(_MPI_SEGMENTS):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((lo, hi - lo))
    except OSError:
        return
    if not spans:
        return
    munmap = ctypes.CDLL(None, use_errno=True).munmap
    munmap.argtypes, munmap.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    for lo, size in spans:
        if munmap(lo, size) != 0:
            log.debug("could not unmap an MPI segment at %#x: errno %d", lo, ctypes.get_errno())


# MPICH's, UCX's and Open MPI's shared-memory segments
_MPI_SEGMENTS = ("/dev/shm/mpich_shm_", "/dev/shm/ucx_shm_posix_", "/dev/shm/vader_segment", "/dev/shm/sm_segment")


def _kill_children() -> None:
    """SIGKILL this process's children (its DataLoader workers, the GPU stager)."""
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

