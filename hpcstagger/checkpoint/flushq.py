"""The node's flush queue: staged checkpoint shards copied to the durable level by any idle process.

With a staging level, a checkpoint is committed to the fast level first, then every rank copies its
shard to the durable level and rank 0 commits there too. With ``flush_by="queue"`` a rank's writer
does not copy its shard itself: it posts a *flush task* in the node's queue and waits, sleeping,
while an idle process on the node (a co-located job waiting out its start delay, calling
:func:`hpcstagger.checkpoint.flusher.idle_flusher`) copies it. The ranks then agree and rank 0
writes the durable manifest last, exactly as when each writer copies its own shard: a flusher only
moves shard bytes, durably (temp file, fsync, rename, fsync of the directory), checking them
against the staged shard's size and xxh3-64 checksum as it copies.

The queue is the directory ``<root>/.flushq``, where ``root`` is the staging directory or a
directory above the staging directories of several jobs. It is created mode 0700; one that is a
symbolic link, belongs to another user or is group- or world-writable is refused, and so is every
file in it that is a link or another user's. Nothing in it is unpickled: the records are JSON.
Per task ``ID`` it holds:

- ``ID.task``: step, rank, source and destination paths (resolved: a flusher refuses them if a
  symbolic link has appeared on the way since), the size and checksum of the staged shard, and the
  owner (pid, process start time, host); written atomically by the owner.
- ``ID.claim``: who copies it (pid, start time, host, a token, the name of its temporary file).
  A flusher claims a task with ``link(2)`` of a fully written private file to this name: the link
  fails when the name exists, so exactly one process wins and no one reads a claim half written.
  We chose a claim file over an ``fcntl`` lock because the owner must see *who* holds the task and
  whether it progresses: a lock vanishes silently with its holder and says neither. The claim's
  mtime is the flusher's heartbeat, touched after every chunk.
- ``flusher-PID.live``: an idle process that flushes: its identity, the file's mtime its heartbeat
  (touched at every call). An owner posts a task only while a live flusher is registered; with
  none (or only dead or silent ones) it copies its shard itself at once, so ``flush_by="queue"``
  costs nothing once no job waits.
- ``ID.done``: written last, atomically, once the copy is renamed into place and its directory
  fsynced: its size, checksum and inode. ``ID.failed``: why a flusher gave the task up.

The owner takes its task back and copies the shard itself when nobody claimed it within
``ckpt_flush_claim_wait`` seconds (at once when the training waits for the save), when the claim's
holder died (same host: its pid is gone or reused), when the claim shows no progress for
``ckpt_flush_stale`` seconds, when the flusher failed, or when a done record does not match the file.
Taking back means moving a stale claim aside, removing its holder's temporary file and claiming the
task in the owner's name; a flusher that wakes up later finds its claim gone (or its temporary file
removed) and renames nothing. A flusher killed at any moment leaves at most a hidden temporary file,
never a file under the shard's name. The owner removes its task's files when it is done; a flusher
removes the tasks of owners that died.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import asdict, dataclass
from typing import Any
from collections.abc import Callable

from hpcstagger import config
from hpcstagger.cache import _fs
from hpcstagger.errors import CheckpointError
from hpcstagger.checkpoint.manifest import step_dirname

__all__ = ["QUEUE_DIR", "FLUSHER_SILENT", "FlushQueue", "register_flusher", "unregister_flusher", "live_flushers",
           "FlushTask", "queue_path", "open_queue", "read_record", "write_record",
           "try_claim", "identity", "holder_gone", "remove_task", "task_ids", "check_secure_dir", "has_file"]

log = logging.getLogger(__name__)

QUEUE_DIR = ".flushq"
POLL = 0.05          # seconds between the owner's looks at its task
FLUSHER_SILENT = 5.0  # seconds without a call after which a registered flusher no longer counts
_MAX_RECORD = 1 << 16
_ID_RE = re.compile(r"s\d{9}-r\d{5}-\d{1,10}-[0-9a-f]{8}")
_SHARD_RE = re.compile(r"shard-\d{5}-of-\d{5}\.h5")
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def queue_path(root: str | os.PathLike[str]) -> str:
    """The flush queue directory of ``root``."""
    return os.path.join(os.path.abspath(os.fspath(root)), QUEUE_DIR)


def check_secure_dir(fd: int, path: str, what: str, *, group_write: bool = False) -> None:
    """Raise CheckpointError unless the open directory ``fd`` belongs to this user and is neither
    world-writable nor (unless ``group_write``) group-writable."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise CheckpointError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
                              "another user could read or forge its files. Use a directory of your own")
    if st.st_mode & (0o002 if group_write else 0o022):
        raise CheckpointError(f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"run 'chmod go-w {path}' or use a directory of your own")


def open_queue(root: str | os.PathLike[str], *, create: bool) -> int | None:
    """Open the flush queue of ``root`` (creating it mode 0700 if asked) and check it; return its
    descriptor, or None when it does not exist and ``create`` is false. Raises CheckpointError when
    it is a symbolic link, not a directory, another user's, or writable by others."""
    path = queue_path(root)
    if create:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _FILE_FLAGS)
    except FileNotFoundError:
        if create:
            raise CheckpointError(f"flush queue {path} vanished as it was created") from None
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointError(f"flush queue {path} is a symbolic link or not a directory; remove it") from None
        raise CheckpointError(f"cannot open flush queue {path}: {exc.strerror}") from None
    try:
        check_secure_dir(fd, path, "flush queue")
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity() -> dict[str, Any]:
    """This process: pid, start time (so a reused pid is told apart) and host."""
    pid, start = _fs.self_identity()
    return {"pid": pid, "start": start, "host": socket.gethostname()}


def holder_gone(who: dict[str, Any]) -> bool:
    """True when the process ``who`` (an :func:`identity`) is known to be dead: only on this host."""
    try:
        if who.get("host") != socket.gethostname():
            return False
        return not _fs.alive(int(who["pid"]), int(who.get("start") or 0))
    except (KeyError, TypeError, ValueError):
        return False


def read_record(qfd: int, name: str) -> dict[str, Any] | None:
    """The JSON object in queue file ``name``, or None when there is none. Raises CheckpointError when
    the file is a link or another user's, or is not a JSON object."""
    try:
        fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=qfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"flush queue file {name} cannot be opened ({exc.strerror}); a link?") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise CheckpointError(f"flush queue file {name} is not a regular file of yours; refused")
        data = os.read(fd, _MAX_RECORD)
    finally:
        os.close(fd)
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise CheckpointError(f"flush queue file {name} is not a JSON object (damaged or being written)")
    return obj


def _write_private(qfd: int, obj: dict[str, Any]) -> str:
    """Write ``obj`` as JSON to a new private file in the queue; return its name."""
    name = f".new-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600, dir_fd=qfd)
    try:
        data = json.dumps(obj, sort_keys=True, allow_nan=False).encode()
        while data:
            data = data[os.write(fd, data):]
    except BaseException:
        os.close(fd)
        os.unlink(name, dir_fd=qfd)
        raise
    os.close(fd)
    return name


def write_record(qfd: int, name: str, obj: dict[str, Any]) -> None:
    """Write queue file ``name`` atomically (private file, then rename). The queue lives on the node's
    fast level, so no fsync: a record need not outlive the node's memory."""
    tmp = _write_private(qfd, obj)
    try:
        os.rename(tmp, name, src_dir_fd=qfd, dst_dir_fd=qfd)
    except BaseException:
        os.unlink(tmp, dir_fd=qfd)
        raise


def try_claim(qfd: int, task_id: str, claim: dict[str, Any]) -> bool:
    """Claim task ``task_id`` with the record ``claim``; False when another process holds it."""
    tmp = _write_private(qfd, claim)
    try:
        os.link(tmp, task_id + ".claim", src_dir_fd=qfd, dst_dir_fd=qfd, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp, dir_fd=qfd)


def _live_name() -> str:
    return f"flusher-{os.getpid()}.live"


def register_flusher(qfd: int) -> None:
    """Register this process as a flusher of the queue ``qfd``, or refresh its heartbeat."""
    name = _live_name()
    try:
        os.utime(name, dir_fd=qfd, follow_symlinks=False)
    except FileNotFoundError:
        write_record(qfd, name, identity())


def unregister_flusher(qfd: int) -> None:
    """Remove this process's flusher registration from the queue ``qfd``."""
    try:
        os.unlink(_live_name(), dir_fd=qfd)
    except FileNotFoundError:
        pass


def live_flushers(qfd: int, *, sweep: bool = False) -> int:
    """How many registered flushers of the queue ``qfd`` are alive and were called within
    :data:`FLUSHER_SILENT` seconds; with ``sweep``, remove the registrations of dead ones."""
    count, now = 0, time.time()
    for name in os.listdir(qfd):
        if not (name.startswith("flusher-") and name.endswith(".live")):
            continue
        try:
            age = now - os.stat(name, dir_fd=qfd, follow_symlinks=False).st_mtime
            who = read_record(qfd, name)
        except (FileNotFoundError, CheckpointError):
            continue
        if who is None:
            continue
        if holder_gone(who):
            if sweep:
                try:
                    os.unlink(name, dir_fd=qfd)
                except FileNotFoundError:
                    pass
        elif age <= FLUSHER_SILENT:
            count += 1
    return count


def remove_task(qfd: int, task_id: str) -> None:
    """Remove every file of task ``task_id`` (its task file last but one, its claim last)."""
    for suffix in (".done", ".failed", ".task", ".claim"):
        try:
            os.unlink(task_id + suffix, dir_fd=qfd)
        except FileNotFoundError:
            pass


def task_ids(qfd: int) -> list[str]:
    """The ids of the tasks posted in the queue."""
    return sorted(n[:-5] for n in os.listdir(qfd) if n.endswith(".task") and _ID_RE.fullmatch(n[:-5]))


def _plain_path(path: Any, what: str) -> str:
    if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) != path:
        raise CheckpointError(f"flush task: {what} {path!r} is not an absolute, normalised path")
    return path


@dataclass(frozen=True)
class FlushTask:
    """One shard to flush: what the task file holds."""

    id: str
    step: int
    rank: int
    src: str
    dst: str
    size: int
    checksum: str
    owner: dict[str, Any]
    posted: float

    def encode(self) -> dict[str, Any]:
        """The task as a JSON object."""
        return {"version": 1, **asdict(self)}

    @classmethod
    def decode(cls, obj: dict[str, Any], root: str) -> FlushTask:
        """Validate a task read from the queue of ``root``; raises CheckpointError saying what is wrong.

        The source must be a shard file of the task's step directory under ``root``, the destination
        the same file name in a step directory of the same step; both paths absolute and normalised.
        """
        try:
            task = cls(**{k: obj[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            raise CheckpointError(f"flush task {obj.get('id')!r}: fields missing or unknown") from None
        if obj.get("version") != 1 or not isinstance(task.id, str) or not _ID_RE.fullmatch(task.id):
            raise CheckpointError(f"flush task {task.id!r}: unknown version or bad id")
        for name, typ in (("step", int), ("rank", int), ("size", int), ("checksum", str), ("owner", dict),
                          ("posted", (int, float))):
            if not isinstance(getattr(task, name), typ) or isinstance(getattr(task, name), bool):
                raise CheckpointError(f"flush task {task.id}: field {name!r} has the wrong type")
        src, dst = _plain_path(task.src, "source"), _plain_path(task.dst, "destination")
        sdir = os.path.dirname(src)
        root = os.path.abspath(root)
        if os.path.commonpath([root, sdir]) != root or sdir == root:
            raise CheckpointError(f"flush task {task.id}: source {src} is not in a directory under {root}")
        name = os.path.basename(src)
        if not _SHARD_RE.fullmatch(name) or os.path.basename(dst) != name:
            raise CheckpointError(f"flush task {task.id}: {src} -> {dst} is not a shard file copied under its name")
        want = step_dirname(task.step)
        if os.path.basename(sdir) != want or os.path.basename(os.path.dirname(dst)) != want:
            raise CheckpointError(f"flush task {task.id}: {src} -> {dst} is not in directories of step {task.step}")
        return task


class FlushQueue:
    """The owner's side of the flush queue of ``root``: :meth:`flush` posts a shard's flush, waits
    for an idle process to do it, and takes it back to copy the shard itself when none does."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.realpath(os.fspath(root))

    def prepare(self) -> None:
        """Create the queue directory (mode 0700) and check it; raises CheckpointError."""
        fd = open_queue(self.root, create=True)
        assert fd is not None, "open_queue(create=True) returns a descriptor or raises"
        os.close(fd)

    def flush(self, *, step: int, rank: int, src: str, dst: str, expect: dict[str, Any],
              hurried: Callable[[], bool], copy_self: Callable[[], Any]) -> dict[str, Any]:
        """Have shard ``src`` (its record ``expect``: size, checksum) copied durably to ``dst``.

        Returns how it went: ``by`` ("queue" or "self"), the flusher's ``pid``, or the ``reason`` the
        owner took the task back and ran ``copy_self()`` (whose errors propagate). ``hurried()`` says
        the training waits for the save. Raises CheckpointError when the queue is unusable.
        """
        t0 = time.monotonic()
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        qfd = open_queue(self.root, create=True)
        assert qfd is not None, "open_queue(create=True) returns a descriptor or raises"
        try:
            if not live_flushers(qfd, sweep=True):
                log.debug("flushing %s myself: no idle process flushes on this node", src)
                copy_self()
                return {"by": "self", "reason": "no idle process was flushing", "wait_s": 0.0}
            me = identity()
            task = FlushTask(id=f"s{step:09d}-r{rank:05d}-{me['pid']}-{secrets.token_hex(4)}", step=step,
                             rank=rank, src=os.path.realpath(src),
                             dst=os.path.join(os.path.realpath(os.path.dirname(dst)), os.path.basename(dst)),
                             size=int(expect["size"]), checksum=str(expect["checksum"]), owner=me, posted=time.time())
            write_record(qfd, task.id + ".task", task.encode())
            try:
                reason = self._await(qfd, task, hurried)
                if reason is None:
                    reason, who = self._check_done(qfd, task)
                if reason is None:
                    return {"by": "queue", "pid": who, "wait_s": round(time.monotonic() - t0, 6)}
                log.info("flushing %s myself: %s", src, reason)
                copy_self()
                return {"by": "self", "reason": reason, "wait_s": round(time.monotonic() - t0, 6)}
            finally:
                remove_task(qfd, task.id)
                live_flushers(qfd, sweep=True)  # a flusher killed on this task left its registration
        finally:
            os.close(qfd)

    def _await(self, qfd: int, task: FlushTask, hurried: Callable[[], bool]) -> str | None:
        """Sleep-poll until the task is done (None) or taken back (the reason)."""
        claim_wait = float(config.get("ckpt_flush_claim_wait"))
        stale = float(config.get("ckpt_flush_stale"))
        posted = time.monotonic()
        while True:
            if has_file(qfd, task.id + ".done"):
                return None
            reason: str | None = None
            try:
                failed = read_record(qfd, task.id + ".failed")
            except CheckpointError as exc:
                failed = {"error": str(exc)}
            claim, age = _claim_state(qfd, task.id)
            if failed is not None:
                return f"the flusher (pid {failed.get('pid')}) failed: {failed.get('error')}"
            if claim is None:
                if hurried():
                    reason = "the training waits for the save, and no idle process had claimed its flush"
                elif time.monotonic() - posted > claim_wait:
                    reason = f"no idle process claimed the flush within {claim_wait:g} s"
            else:
                who = claim.get("pid")
                if holder_gone(claim):
                    reason = f"its flusher (pid {who}) died"
                elif age > stale:
                    reason = f"its flusher (pid {who}) made no progress for {age:.1f} s"
            if reason is not None and self._take_back(qfd, task, claim):
                return reason
            time.sleep(POLL)

    def _take_back(self, qfd: int, task: FlushTask, claim: dict[str, Any] | None) -> bool:
        """Claim ``task`` in the owner's name, first moving the stale ``claim`` aside and removing its
        holder's temporary file; False when another process claimed it meanwhile."""
        if claim is not None:
            aside = f".stale-{task.id}-{secrets.token_hex(4)}"
            try:
                os.rename(task.id + ".claim", aside, src_dir_fd=qfd, dst_dir_fd=qfd)
            except FileNotFoundError:
                return False
            os.unlink(aside, dir_fd=qfd)
            tmp = claim.get("tmp")
            if isinstance(tmp, str) and tmp.startswith(f".{os.path.basename(task.dst)}.tmp-") and "/" not in tmp:
                try:
                    os.unlink(os.path.join(os.path.dirname(task.dst), tmp))
                except FileNotFoundError:
                    pass
        return try_claim(qfd, task.id, dict(identity(), token="owner"))

    def _check_done(self, qfd: int, task: FlushTask) -> tuple[str | None, Any]:
        """(None, the flusher's pid) when the done record matches the task and the file now at
        ``dst``; else (what is off, None)."""
        try:
            done = read_record(qfd, task.id + ".done") or {}
            st = os.stat(task.dst, follow_symlinks=False)
        except (OSError, CheckpointError) as exc:
            return f"its done record or flushed file cannot be read ({exc})", None
        if (done.get("size"), done.get("checksum")) != (task.size, task.checksum) or \
                (done.get("ino"), done.get("dev"), st.st_size) != (st.st_ino, st.st_dev, task.size) or \
                not stat.S_ISREG(st.st_mode):
            return f"its done record does not match {task.dst}", None
        return None, done.get("pid")


def has_file(qfd: int, name: str) -> bool:
    """Whether the queue holds a file (or link: it is not followed) called ``name``."""
    try:
        os.stat(name, dir_fd=qfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _claim_state(qfd: int, task_id: str) -> tuple[dict[str, Any] | None, float]:
    """The task's claim (None when there is none; empty when unreadable) and its age in seconds."""
    try:
        age = time.time() - os.stat(task_id + ".claim", dir_fd=qfd, follow_symlinks=False).st_mtime
        claim = read_record(qfd, task_id + ".claim")
    except FileNotFoundError:
        return None, 0.0
    except CheckpointError as exc:  # damaged: judged by its age alone
        log.debug("flush task %s: %s", task_id, exc)
        return {}, age
    return claim, age
