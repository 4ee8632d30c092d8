"""AsyncCheckpointer: snapshot in memory, write shards in the background, commit last.

``save(step, state)`` blocks only while it copies this rank's share of the state into reusable host
buffers (see :mod:`.snapshot`) and checks, in one small collective on ``comm``, that every rank
copied the same layout. Every rank of ``comm`` then writes its own shard of the replicated state
(see :mod:`.plan`) on its background writer thread. Rank 0 commits the manifest only after every
rank reported its shard durably written.

**How the ranks' writers talk.** The writer threads use their own duplicate of ``comm``, made in the
constructor, never ``comm`` itself, so they cannot interleave with the training's collectives.
MPI must therefore provide ``MPI_THREAD_MULTIPLE`` (``hpcstagger.comm`` initialises MPI that way).
We chose a duplicated communicator over a file-based protocol (each rank drops a marker file, rank 0
polls for them) because the staging level is often node-local (/dev/shm), where rank 0 cannot see
other nodes' files, and because a message carries each rank's error text to every rank. Each
writer's collectives are polled (a non-blocking barrier, then the collective), so a writer waiting
for a slower rank sleeps rather than spinning a core, and gives up after ``ckpt_timeout`` seconds.
Per save, on the duplicate: gather every rank's result to rank 0; rank 0 commits (or not) and
broadcasts the outcome; with a staging level, the same again for the flush. Every rank thus learns
the same outcome, and a failure anywhere is raised on every rank by the next ``save()``/``wait()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Mapping

from .. import config
from ..comm import Comm, _describe_exc, as_comm
from ..errors import CheckpointError, CollectiveError, ConfigError
from . import catalog
from .gates import Gate
from .manifest import build_manifest, shard_filename, step_dirname, versions
from .plan import ShardPlan, layout_signature, plan_shards
from .snapshot import SnapshotBuffers
from .state import Leaf, flatten
from .writer import Pacer, ShardItem, ShardWriter

__all__ = ["AsyncCheckpointer", "SaveHandle"]

log = logging.getLogger(__name__)


class SaveHandle:
    """One save: :meth:`wait` until it is durable on every level (returns the checkpoint's path)."""

    def __init__(self, step: int, path: str, staging_path: str | None):
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
        self._pacer: Pacer | None = None

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done.is_set() else "in flight"
        return f"<SaveHandle step={self.step} {state}>"

    def done(self) -> bool:
        """True once the save finished, committed or failed."""
        return self._done.is_set()

    def _block(self, event: threading.Event, timeout: float | None) -> bool:
        if not event.is_set() and self._pacer is not None:
            self._pacer.hurry()  # the caller waits anyway: stop deferring to the gate
        return event.wait(timeout)

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


class _Worker:
    """The one background writer thread of a checkpointer."""

    def __init__(self, nice: int):
        self.queue: "queue.Queue[Any]" = queue.Queue()
        self.nice = nice
        self.thread = threading.Thread(target=self._loop, name="hpcstagger-ckpt-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self.nice:
            try:  # on Linux this renices only this thread
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(
                    os.PRIO_PROCESS, threading.get_native_id()) + self.nice)
            except OSError as exc:
                log.debug("could not renice the checkpoint writer: %s", exc)
        while True:
            job = self.queue.get()
            if job is None:
                return
            job.run()

    def stop(self) -> None:
        """Finish the job in flight, then end the thread (also run at interpreter exit)."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()


class _SaveJob:
    """Everything the writer thread needs for one save; runs the completion protocol."""

    def __init__(self, *, handle: SaveHandle, wcomm: Comm, writer: ShardWriter, plan: ShardPlan,
                 leaves: list[Leaf], tree: Any, items: list[ShardItem], levels: list[str], keeps: list[int],
                 pacer: Pacer, timeout: float):
        self.h, self.wcomm, self.writer, self.plan = handle, wcomm, writer, plan
        self.meta = [(leaf.spec, leaf.kind, leaf.device, leaf.storage) for leaf in leaves]  # no live tensors
        self.tree, self.items, self.levels, self.keeps = tree, items, levels, keeps
        self.pacer, self.timeout = pacer, timeout
        self.record: dict[str, Any] | None = None
        self.manifest: dict[str, Any] | None = None

    def run(self) -> None:
        h = self.h
        t0 = time.perf_counter()
        try:
            for i, root in enumerate(self.levels):
                self._level(i, root)
                if i == 0:
                    h.timings["staged_s"] = time.perf_counter() - t0
                    h._staged_ok = True
                    h._staged.set()
            h.timings["durable_s"] = time.perf_counter() - t0
        except CheckpointError as exc:
            h._error = exc
        except Exception as exc:  # noqa: BLE001 - a bug or a broken communicator; never lost
            h._error = CheckpointError(f"rank {self.wcomm.rank}: checkpoint of step {h.step} failed: "
                                       f"{_describe_exc(exc)}")
            h._error.__cause__ = exc
        finally:
            if h._error is not None:  # also raised by the next save()/wait(); logged in case none comes
                log.error("%s", h._error)
            h.stats = self.pacer.stats()
            self.items = []  # drop references to the snapshot buffer
            h._staged.set()
            h._done.set()

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
                self.writer.copy_shard(step=h.step, rank=c.rank, src=src, dst=path, expect=self.record,
                                       pacer=self.pacer)
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            verb = "writing" if i == 0 else "flushing to"
            err = str(exc) if isinstance(exc, CheckpointError) else f"{verb} {path}: {_describe_exc(exc)}"
        results = c.gather((self.record if i == 0 else None, err), timeout=self.timeout)
        outcome = None
        if c.rank == 0:
            failures = {r: e for r, (_, e) in enumerate(results) if e is not None}
            if not failures:
                try:
                    if self.manifest is None:
                        self.manifest = self._build([rec for rec, _ in results])
                    catalog.commit(step_dir, self.manifest)
                except Exception as exc:  # noqa: BLE001
                    failures[0] = f"committing {os.path.join(step_dir, 'manifest.json')}: {_describe_exc(exc)}"
            if not failures:
                try:
                    catalog.prune(root, self.keeps[i], protect=h.step)
                except Exception as exc:  # noqa: BLE001 - retention must not fail a good checkpoint
                    log.warning("checkpoint retention in %s failed: %s", root, exc)
            outcome = failures or None
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


def _agree(c: Comm, local_err: BaseException | None, sig: str | None) -> list[tuple[str | None, str | None]]:
    """Every rank's (error or None, layout signature), in rank order, at the end of save().

    This sits in the blocking part of every save, so the common case is one small non-blocking
    all-gather of fixed-size records, polled finely (the guarded collectives of Comm back off to
    10 ms sleeps, which would add milliseconds to every save); error texts travel only on failure.
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
    start = time.monotonic()
    spins = 0
    while not req.Test():
        if limit is not None and time.monotonic() - start > limit:
            c._pending, c._broken = req, "checkpoint snapshot agreement timed out"
            raise CollectiveError(f"rank {c.rank}: not every rank reached save() within {limit:g} s; a rank has "
                                  "crashed, hung or skipped the save (every rank must call save for each step)")
        spins += 1
        time.sleep(0 if spins < 200 else 0.0002)
    sigs = [f"{int(a):016x}{int(b):016x}" for _, a, b in every]
    if not every[:, 0].any():
        return [(None, s_) for s_ in sigs]
    errs = c.allgather(None if local_err is None else _describe_exc(local_err))
    return list(zip(errs, sigs))


def _check_thread_level(comm: Comm) -> None:
    if comm.size <= 1:
        return
    from ..comm import mpi_module

    MPI = mpi_module()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise CheckpointError(
            "MPI was initialised without MPI_THREAD_MULTIPLE, which the background checkpoint writer needs; "
            "initialise MPI through hpcstagger.comm (or set mpi4py.rc.thread_level = 'multiple' before "
            "importing mpi4py.MPI)")


class AsyncCheckpointer:
    """Asynchronous, sharded, atomically committed checkpoints of replicated training state.

    ``directory``: where checkpoints are kept (shared by the ranks of ``comm``). ``comm``: None for
    one process, else the data-parallel ranks (each writes one shard). ``keep``: committed
    checkpoints kept in ``directory``. ``staging_dir``: a fast level (e.g. a directory in /dev/shm)
    committed first, then flushed to ``directory`` in the background; it keeps ``ckpt_staging_keep``
    checkpoints. ``gate``: a :class:`~hpcstagger.checkpoint.gates.Gate` the writer defers to before
    each chunk (None: never defer). ``writer``: a :class:`ShardWriter` (subclass it to inject faults).

    Construction and :meth:`close` are collective over ``comm``; so is :meth:`save`. Raises
    ConfigError for bad arguments, CheckpointError when MPI lacks thread support.
    """

    def __init__(self, directory: str | os.PathLike[str], *, comm: Any = None, keep: int = 3,
                 staging_dir: str | os.PathLike[str] | None = None, gate: Gate | None = None,
                 writer: ShardWriter | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (committed checkpoints to keep), not {keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.staging_dir = None if staging_dir is None else os.path.abspath(os.fspath(staging_dir))
        if self.staging_dir == self.directory:
            raise ConfigError("staging_dir must differ from directory; leave it None for one level")
        self.keep = keep
        self.gate = gate
        self._comm = as_comm(comm)
        _check_thread_level(self._comm)
        # h5py must first be imported on the main thread: imported first on the writer thread, HDF5's
        # own exit handler calls back into an interpreter that is gone and the process segfaults.
        import h5py  # noqa: F401
        import xxhash  # noqa: F401
        self._levels = [d for d in (self.staging_dir, self.directory) if d is not None]
        self._keeps = [max(1, int(config.get("ckpt_staging_keep"))), keep] if self.staging_dir else [keep]

        def make_dirs() -> None:
            for d in self._levels:
                os.makedirs(d, exist_ok=True)

        self._comm.run_all(make_dirs, what="create checkpoint directories")
        self._wcomm = self._comm.dup() if self._comm.is_mpi else Comm.single()
        self._writer = writer or ShardWriter()
        self._buffers = SnapshotBuffers()
        self._plan_key: Any = None
        self._plan: ShardPlan | None = None
        self._current: SaveHandle | None = None
        self._closed = False
        self._worker = _Worker(int(config.get("ckpt_writer_nice")))
        # An unclosed checkpointer finishes its save in flight at exit. Registered now, after h5py's
        # own exit handler, so that it runs before h5py tears HDF5 down (atexit runs last-in first).
        atexit.register(self._worker.stop)
        self._finalizer = weakref.finalize(self, self._worker.stop)

    # ------------------------------------------------------------------ properties
    @property
    def comm(self) -> Comm:
        """The communicator the checkpoint is sharded over."""
        return self._comm

    @property
    def levels(self) -> list[str]:
        """The checkpoint directories, fastest first."""
        return list(self._levels)

    def __repr__(self) -> str:
        return (f"<AsyncCheckpointer {self.directory} rank={self._comm.rank}/{self._comm.size} keep={self.keep}"
                f"{' staging=' + self.staging_dir if self.staging_dir else ''}>")

    # ------------------------------------------------------------------ saving
    def _finish_previous(self) -> SaveHandle | None:
        h = self._current
        if h is None:
            return None
        h._block(h._done, None)
        if h._error is not None and not h._reported:
            h._reported = True
            raise h._error
        return h

    def _plan_for(self, leaves: list[Leaf]) -> tuple[ShardPlan, str]:
        specs = [leaf.spec for leaf in leaves]
        sig = layout_signature(specs)
        key = (sig, self._comm.size)
        if key != self._plan_key:
            self._plan = plan_shards(specs, self._comm.size, min_split=int(config.get("ckpt_min_split_bytes")))
            self._plan_key = key
        assert self._plan is not None
        return self._plan, sig

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Allocate the snapshot buffers for ``state`` now, so the first save does not pay for it."""
        self._check_open()
        _, leaves = flatten(state)
        plan, _ = self._plan_for(leaves)
        index = {leaf.spec.key: leaf for leaf in leaves}
        self._buffers.ensure([(p, index[p.key]) for p in plan.for_shard(self._comm.rank)])
        self._buffers._np[:] = 0  # touch every page now

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and write it in the background; returns a SaveHandle.

        Waits first for a save still in flight. Raises CheckpointError if an earlier save failed
        (once per failure), if the state holds something a checkpoint cannot, or if the ranks'
        states differ in layout; the error is raised on every rank.
        """
        self._check_open()
        self._finish_previous()
        t0 = time.perf_counter()
        c = self._comm
        dirs = [os.path.join(d, step_dirname(step)) for d in self._levels]
        local_err: BaseException | None = None
        sig = None
        try:
            tree, leaves = flatten(state)
            plan, sig = self._plan_for(leaves)
            index = {leaf.spec.key: leaf for leaf in leaves}
            mine = [(p, index[p.key]) for p in plan.for_shard(c.rank)]
            self._buffers.ensure(mine)
            views = self._buffers.copy(mine)
            items = [ShardItem(p, leaf.spec, leaf.kind, leaf.storage, v) for (p, leaf), v in zip(mine, views)]
            if c.rank == 0:
                for d in self._levels:
                    catalog.clear_step(d, step)
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            local_err = exc
        if c.size > 1:
            try:
                statuses = _agree(c, local_err, sig)
            except CollectiveError as exc:
                raise CheckpointError(f"checkpoint of step {step}: the ranks could not agree on the snapshot: "
                                      f"{exc}") from exc
            failures = {r: e for r, (e, _) in enumerate(statuses) if e is not None}
            if failures:
                err = CollectiveError.from_failures(f"checkpoint snapshot of step {step}", failures, c.size)
                raise CheckpointError(str(err)) from local_err
            if len({s for _, s in statuses}) > 1:
                groups: dict[str, list[int]] = {}
                for r, (_, s) in enumerate(statuses):
                    groups.setdefault(s, []).append(r)
                raise CheckpointError(
                    f"checkpoint of step {step}: the state's tensors (keys, dtypes, shapes) differ across ranks "
                    f"(groups of ranks: {sorted(groups.values())}); every rank must save the same replicated state")
        elif local_err is not None:
            if isinstance(local_err, CheckpointError):
                raise local_err
            raise CheckpointError(f"checkpoint snapshot of step {step} failed: {_describe_exc(local_err)}") \
                from local_err
        handle = SaveHandle(step, dirs[-1], dirs[0] if self.staging_dir else None)
        pacer = Pacer(self.gate)
        handle._pacer = pacer
        job = _SaveJob(handle=handle, wcomm=self._wcomm, writer=self._writer, plan=plan, leaves=leaves, tree=tree,
                       items=items, levels=self._levels, keeps=self._keeps, pacer=pacer,
                       timeout=float(config.get("ckpt_timeout")))
        handle.timings["blocking_s"] = time.perf_counter() - t0
        self._current = handle
        self._worker.queue.put(job)
        return handle

    def wait(self) -> str | None:
        """Block until the save in flight (if any) is durable; return its path or None.

        Raises CheckpointError, on every rank, if it failed and that was not yet raised.
        """
        h = self._finish_previous()
        if h is None or h._error is not None:
            return None
        return h.path

    def load(self, step: int | None = None, *, map_location: Any = None) -> dict[str, Any]:
        """Wait for the save in flight, then :func:`~hpcstagger.checkpoint.load` from every level."""
        from .load import load

        self.wait()
        return load(self._levels, step, comm=self._comm, map_location=map_location)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed; create a new one")

    def close(self) -> None:
        """Wait for the save in flight, stop the writer thread, free the writers' communicator.

        Collective. Raises the in-flight save's error, if any, after cleaning up.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_previous()
        finally:
            self._finalizer()
            atexit.unregister(self._worker.stop)
            self._buffers.release()
            if self._wcomm.is_mpi:
                self._wcomm.free()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the error in flight; still clean up
            try:
                self.close()
            except CheckpointError as err:
                log.error("checkpoint error while handling another exception: %s", err)
