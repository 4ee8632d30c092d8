"""The idle flusher: an idle process on the node copies other jobs' staged checkpoint shards.

A co-located job waiting out its start delay has cores and time to spare, and the running jobs'
writers, with ``flush_by="queue"``, post their shards' flushes in the node's flush queue (see
:mod:`.flushq`, which also describes the queue's files and the owner's side)::

    from hpcstagger.checkpoint.flusher import idle_flusher

    flush = idle_flusher("/dev/shm/ckpt/run1")    # the root the running jobs' queue lives in
    try:
        while waiting():
            flush(seconds_left)                   # returns within about 0.2 s
    finally:
        flush.close()                             # gives back a task it holds, at once

Calling it claims the oldest open task of this host, copies it in a background thread of this
process at a lower CPU priority (``ckpt_flush_nice``, and under Linux's ``SCHED_IDLE`` policy
unless ``ckpt_flush_sched_idle`` is off: it then takes only CPU time that no other thread wants,
so a running job on the same cores is not preempted by it), and waits for that thread at most
``min(budget, 0.2)`` seconds. Each chunk is read from the staged shard, hashed (xxh3-64, as the
manifest) and written to a hidden temporary file beside the destination; the file is fsynced,
checked against the task's size and checksum, renamed into place only if the claim is still this
process's, and its directory fsynced; the done record is written last. The copy goes on between
calls only while they keep coming: about a second after the last call, it is given up (the
temporary file removed, the claim released), so that the owner takes the task back at once
rather than after ``ckpt_flush_stale`` seconds. A task the flusher cannot do (a damaged staged
shard, a path that leaves the staging root or runs through a symbolic link, a file of another
user) is marked failed, and its owner copies the shard itself and reports the error.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import stat
import threading
import time
from typing import Any

from hpcstagger import config
from hpcstagger.errors import CheckpointError, describe_exception
from hpcstagger.checkpoint.flushq import (FlushTask, check_secure_dir, has_file, holder_gone, identity, live_flushers,
                                          open_queue, read_record, register_flusher, remove_task, task_ids, try_claim,
                                          unregister_flusher, write_record)
from hpcstagger.checkpoint.protocol import idle_policy, renice_thread
from hpcstagger.checkpoint.writer import check_copy, copy_hashed

__all__ = ["IdleFlusher", "idle_flusher"]

log = logging.getLogger(__name__)

SLICE = 0.2          # seconds a call waits at most for the copy in progress
IDLE_POLL = 0.25     # seconds a call sleeps on an empty queue (linger=True)
LEASE_GRACE = 1.0    # seconds the copy goes on past the last call before it is given up
LEFTOVER_AGE = 60.0  # seconds after which a queue file without its task is swept away


class _GiveUp(Exception):
    """The copy stops without failing the task: closed, no longer called, or taken back."""


class IdleFlusher:
    """Flushes staged checkpoint shards posted in the flush queue of ``root``; see :func:`idle_flusher`.

    Subclass it and override :meth:`after_chunk` to slow a copy down or kill it at a chosen point.
    ``flushed`` and ``failed`` count the tasks it completed and failed.
    """

    def __init__(self, root: str | os.PathLike[str], *, linger: bool = True, nice: int | None = None,
                 chunk_bytes: int | None = None):
        self.root = os.path.realpath(os.fspath(root))
        self.linger = linger
        self.nice = int(config.get("ckpt_flush_nice") if nice is None else nice)
        self.sched_idle = bool(config.get("ckpt_flush_sched_idle"))
        self.chunk_bytes = int(chunk_bytes or config.get("ckpt_flush_chunk_bytes"))
        self.flushed = 0
        self.failed = 0
        self._host = socket.gethostname()
        self._thread: threading.Thread | None = None
        self._lease = 0.0
        self._closed = False
        self._broken = False
        self._stop = threading.Event()

    def __repr__(self) -> str:
        return f"<IdleFlusher {self.root} flushed={self.flushed} failed={self.failed}>"

    def __call__(self, budget: float) -> bool:
        """Work on the queue for at most about ``min(budget, 0.2)`` seconds; True to be called again.

        False once closed, when the queue is unusable (logged), or with ``linger=False`` when no
        task is open. Never raises for a task's failure: that goes to the task's owner.
        """
        if self._closed or self._broken:
            return False
        piece = max(0.0, min(float(budget), SLICE))
        self._lease = time.monotonic() + piece + LEASE_GRACE
        if self._thread is None or not self._thread.is_alive():
            job = self._claim_next()
            if job is None:
                if self._broken or not self.linger:
                    return False
                time.sleep(max(0.0, min(float(budget), IDLE_POLL)))
                return True
            self._thread = threading.Thread(target=self._run, args=job, name="hpcstagger-flusher", daemon=True)
            self._thread.start()
        self._thread.join(piece)
        return True

    def busy(self) -> bool:
        """True while a copy is in progress."""
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: a copy in progress is given up at its next chunk (its task goes back to its owner)."""
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            qfd = open_queue(self.root, create=False)
        except CheckpointError:
            return
        if qfd is not None:
            try:
                unregister_flusher(qfd)
            finally:
                os.close(qfd)

    def __enter__(self) -> IdleFlusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def after_chunk(self, task: FlushTask, copied: int) -> None:
        """Called in the copying thread after each chunk is written (``copied`` bytes so far); a
        hook for tests. Does nothing."""

    # ------------------------------------------------------------------ claiming
    def _claim_next(self) -> tuple[FlushTask, dict[str, Any]] | None:
        try:
            qfd = open_queue(self.root, create=False)
        except CheckpointError as exc:
            log.error("the idle checkpoint flusher stops: %s", exc)
            self._broken = True
            return None
        if qfd is None:
            return None
        try:
            register_flusher(qfd)  # owners post their flushes only while a flusher is registered
            self._sweep(qfd)
            for tid in task_ids(qfd):
                job = self._consider(qfd, tid)
                if job is not None:
                    return job
        except OSError as exc:
            log.warning("the idle checkpoint flusher cannot read its queue %s: %s", self.root, exc)
        finally:
            os.close(qfd)
        return None

    def _consider(self, qfd: int, tid: str) -> tuple[FlushTask, dict[str, Any]] | None:
        """Claim task ``tid`` if it is open, this host's and sound; remove it if its owner died."""
        if any(has_file(qfd, tid + s) for s in (".claim", ".done", ".failed")):
            return None
        try:
            obj = read_record(qfd, tid + ".task")
            if obj is None:
                return None
            owner = obj.get("owner")
            if not isinstance(owner, dict):
                owner = {}
            if owner.get("host") != self._host:
                return None  # another node's (a staging level on a shared file system): its own node flushes it
            if holder_gone(owner):
                log.info("removing flush task %s: its owner (pid %s) is gone", tid, owner.get("pid"))
                remove_task(qfd, tid)
                return None
            task = FlushTask.decode(obj, self.root)
        except CheckpointError as exc:
            log.warning("refusing flush task %s: %s", tid, exc)
            write_record(qfd, tid + ".failed", {"pid": os.getpid(), "error": str(exc)})
            return None
        token = secrets.token_hex(6)
        claim = dict(identity(), token=token, tmp=f".{os.path.basename(task.dst)}.tmp-{os.getpid()}-{token}")
        return (task, claim) if try_claim(qfd, tid, claim) else None

    def _sweep(self, qfd: int) -> None:
        """Remove records whose task is gone and private files of killed writers, once they are old."""
        live_flushers(qfd, sweep=True)
        names = set(os.listdir(qfd))
        now = time.time()
        for name in names:
            base, dot, suffix = name.rpartition(".")
            orphan = dot and suffix in ("claim", "done", "failed") and base + ".task" not in names
            if orphan or name.startswith((".new-", ".stale-")):
                try:
                    if now - os.stat(name, dir_fd=qfd, follow_symlinks=False).st_mtime > LEFTOVER_AGE:
                        os.unlink(name, dir_fd=qfd)
                except FileNotFoundError:
                    pass

    # ------------------------------------------------------------------ copying (the flusher's thread)
    def _run(self, task: FlushTask, claim: dict[str, Any]) -> None:
        renice_thread(self.nice, "the idle checkpoint flusher")
        if self.sched_idle:
            idle_policy("the idle checkpoint flusher")
        qfd = None
        try:
            qfd = open_queue(self.root, create=False)
            if qfd is None:
                return
            self._copy(qfd, task, claim)
            self.flushed += 1
            log.info("flushed %s to %s for pid %s", task.src, task.dst, task.owner.get("pid"))
        except _GiveUp as why:
            log.info("gave up flushing %s: %s", task.src, why)
            if qfd is not None and self._mine(qfd, task, claim):
                os.unlink(task.id + ".claim", dir_fd=qfd)
        except Exception as exc:  # the owner copies the shard itself and reports what is wrong
            self.failed += 1
            text = str(exc) if isinstance(exc, CheckpointError) else describe_exception(exc)
            log.warning("flushing %s failed: %s", task.src, text)
            if qfd is not None and self._mine(qfd, task, claim):
                try:
                    write_record(qfd, task.id + ".failed", {"pid": os.getpid(), "error": text})
                except OSError as exc2:
                    log.warning("cannot mark flush task %s failed: %s", task.id, exc2)
        finally:
            if qfd is not None:
                os.close(qfd)

    def _mine(self, qfd: int, task: FlushTask, claim: dict[str, Any]) -> bool:
        try:
            now = read_record(qfd, task.id + ".claim")
        except CheckpointError:
            return False
        return now is not None and now.get("token") == claim["token"] and has_file(qfd, task.id + ".task")

    def _copy(self, qfd: int, task: FlushTask, claim: dict[str, Any]) -> None:
        """Copy the task's shard durably, verified, then write its done record (last)."""
        for d in (os.path.dirname(task.src), os.path.dirname(task.dst)):
            if os.path.realpath(d) != d:
                raise CheckpointError(f"{d} is now reached through a symbolic link; refused")
        try:
            sfd = os.open(task.src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(f"staged shard {task.src} is a symbolic link; refused") from None
            raise
        try:
            st = os.fstat(sfd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise CheckpointError(f"staged shard {task.src} is not a regular file of yours; refused")
            if st.st_size != task.size:
                raise CheckpointError(f"staged shard {task.src} is {st.st_size} bytes, its record says "
                                      f"{task.size}: it changed; the fast level is damaged")
            ddir = os.path.dirname(task.dst)
            dfd = os.open(ddir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                check_secure_dir(dfd, ddir, "checkpoint directory", group_write=True)
                done = self._write(qfd, sfd, dfd, task, claim)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)
        write_record(qfd, task.id + ".done", done)

    def _write(self, qfd: int, sfd: int, dfd: int, task: FlushTask, claim: dict[str, Any]) -> dict[str, Any]:
        tmp, name = claim["tmp"], os.path.basename(task.dst)
        tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        renamed = False

        def before() -> None:
            if self._stop.is_set():
                raise _GiveUp("the flusher was closed")
            if time.monotonic() > self._lease:
                raise _GiveUp("no longer called: its process moved on")

        def after(copied: int) -> None:
            if not self._mine(qfd, task, claim):
                raise _GiveUp("its owner took the task back")
            os.utime(task.id + ".claim", dir_fd=qfd, follow_symlinks=False)  # the heartbeat
            register_flusher(qfd)  # still flushing: owners keep posting
            self.after_chunk(task, copied)

        try:
            size, digest = copy_hashed(sfd, tfd, self.chunk_bytes, before=before, after=after)
            os.fsync(tfd)
            check_copy(task.src, size, digest, {"size": task.size, "checksum": task.checksum})
            if not self._mine(qfd, task, claim):
                raise _GiveUp("its owner took the task back")
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            renamed = True
            os.fsync(dfd)
            st = os.fstat(tfd)
        finally:
            os.close(tfd)
            if not renamed:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
        return {"pid": os.getpid(), "size": size, "checksum": digest, "ino": st.st_ino, "dev": st.st_dev}


def idle_flusher(root: str | os.PathLike[str], *, linger: bool = True, nice: int | None = None) -> IdleFlusher:
    """An idle-work function that flushes the staged checkpoints posted in the flush queue of ``root``.

    ``root`` is the directory the running jobs' queue lives in (their ``flush_queue``, by default
    their staging directory). The result ``f`` matches the colocated idle-work hook: ``f(seconds_left)``
    works at most about ``min(seconds_left, 0.2)`` seconds (sleeping up to 0.25 s on an empty queue)
    and returns True to be called again. With ``linger=True`` (the default) it keeps returning True
    while the queue is empty, since running jobs post new flushes at every save; put it last among
    idle work. With ``linger=False`` it returns False once no task is open. It returns False for
    good after ``f.close()`` or when the queue is unusable (a link, another user's; logged). Call
    ``f.close()`` when the waiting ends: a copy in progress is given back to its owner at once.
    ``nice``: how much lower the copying thread's CPU priority is (default ``ckpt_flush_nice``).
    """
    return IdleFlusher(root, linger=linger, nice=nice)

