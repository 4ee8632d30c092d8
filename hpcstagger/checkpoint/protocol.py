"""The ranks' checkpoint protocol: the snapshot agreement, the background writer, the commit.

:class:`SaveHandle` is what ``AsyncCheckpointer.save()`` returns. In ``save()``, :func:`agree`
checks, in one small non-blocking all-gather, that every rank took its snapshot of the same layout.
One writer thread (:class:`Worker`) per :class:`~hpcstagger.checkpoint.AsyncCheckpointer` then runs
one :class:`SaveTask` per save, over the writers' own duplicate of the checkpointer's communicator
(why a duplicate, and the per-save exchange: see :mod:`.checkpointer`). Retention runs after the
save's handle is released.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from hpcstagger import config
from hpcstagger.comm import Comm, poll_until, mpi_module
from hpcstagger.errors import CheckpointError, CollectiveError, describe_exception
from hpcstagger.checkpoint import catalog, probe
from hpcstagger.checkpoint.flushq import FlushQueue
from hpcstagger.checkpoint.manifest import build_manifest, shard_filename, step_dirname, versions
from hpcstagger.checkpoint.sharding import ShardPlan
from hpcstagger.checkpoint.state import Leaf
from hpcstagger.checkpoint.writer import Pacer, ShardItem, ShardWriter

__all__ = ["SaveHandle", "SaveTask", "Worker", "agree", "check_thread_level", "renice_thread"]

log = logging.getLogger(__name__)


class SaveHandle:
    """One save: :meth:`wait` until it is durable on every level (returns the checkpoint's path)."""

    def __init__(self, step: int, path: str, staging_path: str | None, *, pacer: Pacer | None = None):
        self.step = step
        self.path = path
        self.staging_path = staging_path
        self.timings: dict[str, float] = {}
        self.stats: dict[str, Any] = {}
        self._done = threading.Event()
        self._staged = threading.Event()
        self._error: CheckpointError | None = None
        self._reported = False
        self._staged_ok = False
        self._pacer = pacer  # hurried when someone waits on this save

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done.is_set() else "in flight"
        return f"<SaveHandle step={self.step} {state}>"

    def done(self) -> bool:
        """True once the save finished, committed or failed."""
        return self._done.is_set()

    def staged(self) -> bool:
        """True once the save is committed on the fastest level (or finished: then see :meth:`done`)."""
        return self._staged.is_set()

    @property
    def error(self) -> CheckpointError | None:
        """The save's error once it failed, else None (read it after :meth:`done`)."""
        return self._error

    def _block(self, event: threading.Event, timeout: float | None) -> bool:
        if not event.is_set() and self._pacer is not None:
            self._pacer.hurry()  # the caller waits anyway: stop deferring to the gate
        return event.wait(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Block until the save finished, committed or failed (the writer stops deferring to its
        gate meanwhile); True if it has. Raises nothing: see :meth:`raise_unreported`."""
        return self._block(self._done, timeout)

    def raise_unreported(self) -> None:
        """Raise the save's error if it failed and the error was not raised yet (by :meth:`wait`,
        :meth:`wait_staged` or this), so that each failure is raised once."""
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    # The writer thread's side, per save: mark_staged() and fail() at most once each, finish() once, last.
    def mark_staged(self) -> None:
        """The fastest level is committed: :meth:`wait_staged` returns from now on."""
        self._staged_ok = True
        self._staged.set()

    def fail(self, error: CheckpointError) -> None:
        """Record why the save failed; :meth:`finish` then releases the waiters, who raise it."""
        self._error = error

    def finish(self) -> None:
        """The save ended, committed or failed: release every waiter (staged first, then done)."""
        self._staged.set()
        self._done.set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is committed on every level; return its directory.

        Raises CheckpointError if the save failed on any rank (naming the ranks and paths) or,
        with ``timeout``, if it has not finished in time.
        """
        if not self._block(self._done, timeout):
            raise CheckpointError(f"checkpoint of step {self.step} not finished after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def wait_staged(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is committed on the fastest level; return that directory."""
        if not self._block(self._staged, timeout):
            raise CheckpointError(f"checkpoint of step {self.step} not staged after {timeout} s")
        if not self._staged_ok:
            self._reported = True
            raise self._error or CheckpointError(f"checkpoint of step {self.step} was not staged")
        return self.staging_path or self.path


def renice_thread(increment: int, what: str) -> None:
    """Lower the calling thread's CPU priority by ``increment`` nice steps (on Linux only this thread);
    a failure is logged (at debug level, naming ``what``), not raised."""
    if not increment:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError as exc:
        log.debug("could not renice %s: %s", what, exc)


def idle_policy(what: str) -> bool:
    """Put the calling thread under Linux's ``SCHED_IDLE`` policy: it runs only when a CPU has nothing
    else to run, and never preempts another thread. A thread cannot leave that policy unprivileged, so
    only a thread that ends with its work may call this. Returns whether it took; a failure (not
    Linux) is logged at debug level, naming ``what``."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        log.debug("no SCHED_IDLE here for %s", what)
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        log.debug("could not put %s under SCHED_IDLE: %s", what, exc)
        return False
    return True


class Worker:
    """The one background writer thread of a checkpointer."""

    def __init__(self, nice: int):
        self.queue: queue.Queue[Any] = queue.Queue()
        self.nice = nice
        self.thread = threading.Thread(target=self._loop, name="hpcstagger-ckpt-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        renice_thread(self.nice, "the checkpoint writer")
        while True:
            task = self.queue.get()
            try:
                if task is None:
                    return
                task.run()
            finally:
                self.queue.task_done()

    def stop(self) -> None:
        """Finish the save in flight, then end the thread (also run at interpreter exit)."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()


class SaveTask:
    """Everything the writer thread needs for one save; runs the completion protocol."""

    def __init__(self, *, handle: SaveHandle, wcomm: Comm, writer: ShardWriter, plan: ShardPlan,
                 leaves: list[Leaf], tree: Any, items: list[ShardItem], levels: list[str], keeps: list[int],
                 pacer: Pacer, timeout: float, flushq: FlushQueue | None = None):
        self.h, self.wcomm, self.writer, self.plan = handle, wcomm, writer, plan
        self.flushq = flushq  # with a staging level: post the flush there rather than copy the shard
        self.meta = [(leaf.spec, leaf.kind, leaf.device, leaf.storage) for leaf in leaves]  # no live tensors
        self.tree, self.items, self.levels, self.keeps = tree, items, levels, keeps
        self.pacer, self.timeout = pacer, timeout
        self.record: dict[str, Any] | None = None
        self.manifest: dict[str, Any] | None = None

    def run(self) -> None:
        h = self.h
        t0 = time.perf_counter()
        committed: list[int] = []
        try:
            for i, root in enumerate(self.levels):
                self._level(i, root)
                committed.append(i)
                if i == 0:
                    h.timings["staged_s"] = time.perf_counter() - t0
                    h.mark_staged()
            h.timings["durable_s"] = time.perf_counter() - t0
        except CheckpointError as exc:
            h.fail(exc)
        except Exception as exc:  # a bug or a broken communicator; never lost
            err = CheckpointError(f"rank {self.wcomm.rank}: checkpoint of step {h.step} failed: "
                                  f"{describe_exception(exc)}")
            err.__cause__ = exc
            h.fail(err)
        finally:
            if h.error is not None:  # also raised by the next save()/wait(); logged in case none comes
                log.error("%s", h.error)
            h.stats.update(self.pacer.stats())
            self.items = []  # drop references to the snapshot buffer
            h.finish()
        # Retention runs after the handle is released: deleting a large old checkpoint takes a while
        # (hundreds of ms for 200 MB here) and delays neither the time until durable nor the next
        # save's snapshot, only the next save's write (this thread is the only writer).
        if self.wcomm.rank == 0:
            for i in committed:
                try:
                    with probe.timed("prune"):
                        catalog.prune(self.levels[i], self.keeps[i], protect=h.step)
                except Exception as exc:  # retention must not fail a good checkpoint
                    log.warning("checkpoint retention in %s failed: %s", self.levels[i], exc)

    def _level(self, i: int, root: str) -> None:
        h, c = self.h, self.wcomm
        step_dir = os.path.join(root, step_dirname(h.step))
        path = os.path.join(step_dir, shard_filename(c.rank, self.plan.nshards))
        err = None
        try:
            if i == 0:
                self.record = self.writer.write_shard(step=h.step, rank=c.rank, nshards=self.plan.nshards,
                                                      path=path, items=self.items, pacer=self.pacer)
            else:
                src = os.path.join(self.levels[0], step_dirname(h.step), shard_filename(c.rank, self.plan.nshards))
                record = self.record
                assert record is not None, "level 0 committed, so it left its shard's record"

                def copy() -> Any:
                    return self.writer.copy_shard(step=h.step, rank=c.rank, src=src, dst=path, expect=record,
                                                  pacer=self.pacer)

                if self.flushq is None:
                    copy()
                else:
                    h.stats["flush"] = self.flushq.flush(step=h.step, rank=c.rank, src=src, dst=path, expect=record,
                                                         hurried=self.pacer.hurried, copy_self=copy)
        except Exception as exc:  # every rank learns it below
            verb = "writing" if i == 0 else "flushing to"
            err = str(exc) if isinstance(exc, CheckpointError) else f"{verb} {path}: {describe_exception(exc)}"
        with probe.timed("collectives"):
            results = c.gather((self.record if i == 0 else None, err), timeout=self.timeout)
        outcome = None
        if c.rank == 0:
            assert results is not None, "rank 0 is the gather's root"
            failures = {r: e for r, (_, e) in enumerate(results) if e is not None}
            if not failures:
                try:
                    if self.manifest is None:  # level 0, where every rank without an error sent its record
                        records = []
                        for rec, _ in results:
                            assert rec is not None, "a rank without an error sends its shard's record"
                            records.append(rec)
                        self.manifest = self._build(records)
                    with probe.timed("commit"):
                        catalog.commit(step_dir, self.manifest)
                except Exception as exc:
                    failures[0] = f"committing {os.path.join(step_dir, 'manifest.json')}: {describe_exception(exc)}"
            outcome = failures or None
        with probe.timed("collectives"):
            outcome = c.bcast(outcome, timeout=self.timeout)
        if outcome:
            lines = [f"checkpoint of step {h.step} in {root} failed on rank(s) "
                     f"{', '.join(map(str, sorted(outcome)))} of {c.size} and was not committed; "
                     "the previous checkpoint is intact"]
            lines += [f"  rank {r}: {msg}" for r, msg in sorted(outcome.items())]
            raise CheckpointError("\n".join(lines))

    def _build(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        tensors: dict[str, dict[str, Any]] = {}
        for s, kind, device, storage in self.meta:
            tensors[s.key] = {"kind": kind, "dtype": s.dtype, "shape": list(s.shape), "device": device,
                              "storage": storage, "pieces": []}
        for rec in records:
            for p in rec["pieces"]:
                tensors[p["key"]]["pieces"].append({"shard": rec["rank"], "dataset": p["dataset"],
                                                    "start": p["start"], "count": p["count"],
                                                    "checksum": p["checksum"]})
        shards = [{"rank": r["rank"], "file": r["file"], "size": r["size"], "checksum": r["checksum"]}
                  for r in records]
        return build_manifest(step=self.h.step, world_size=self.plan.nshards, tree=self.tree, tensors=tensors,
                              shards=shards, versions=versions())


def agree(c: Comm, local_err: BaseException | None, sig: str | None) -> list[tuple[str | None, str | None]]:
    """Every rank's (error or None, layout signature), in rank order, at the end of save().

    This sits in the blocking part of every save, so the common case is one small non-blocking
    all-gather of fixed-size records, polled finely: 199 bare yields, then 0.2 ms sleeps (the
    guarded collectives of Comm back off to 10 ms sleeps, which would add milliseconds to every
    save); error texts travel only on failure.
    """
    import numpy as np

    mine = np.zeros(3, dtype=np.uint64)
    mine[0] = local_err is not None
    if sig is not None:
        mine[1], mine[2] = int(sig[:16], 16), int(sig[16:32], 16)
    every = np.zeros((c.size, 3), dtype=np.uint64)
    req = c.mpi.Iallgather(mine, every)
    limit = config.get("collective_timeout")
    limit = float(limit) if limit is not None and 0 < float(limit) < float("inf") else None
    deadline = None if limit is None else time.monotonic() + limit
    if not poll_until(deadline, req.Test, first=0.0002, cap=0.0002, spins=199):
        c.mark_broken("checkpoint snapshot agreement timed out", pending=req)
        raise CollectiveError(f"rank {c.rank}: not every rank reached save() within {limit:g} s; a rank has "
                              "crashed, hung or skipped the save (every rank must call save for each step)")
    sigs = [f"{int(a):016x}{int(b):016x}" for _, a, b in every]
    if not every[:, 0].any():
        return [(None, s_) for s_ in sigs]
    errs = c.allgather(None if local_err is None else describe_exception(local_err))
    return list(zip(errs, sigs, strict=True))


def check_thread_level(comm: Comm) -> None:
    """Raise CheckpointError unless MPI allows the writer thread's collectives (MPI_THREAD_MULTIPLE)."""
    if comm.size <= 1:
        return

    MPI = mpi_module()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise CheckpointError(
            "MPI was initialised without MPI_THREAD_MULTIPLE, which the background checkpoint writer needs; "
            "initialise MPI through hpcstagger.comm (or set mpi4py.rc.thread_level = 'multiple' before "
            "importing mpi4py.MPI)")
