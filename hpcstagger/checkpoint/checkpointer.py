"""AsyncCheckpointer: snapshot in memory, write shards in the background, commit last.

``save(step, state)`` blocks only while it copies this rank's share of the state into reusable host
buffers (see :mod:`.snapshot`) and checks, in one small collective on ``comm``, that every rank
copied the same layout. Every rank of ``comm`` then writes its own shard of the replicated state
(see :mod:`.sharding`) on its background writer thread. Rank 0 commits the manifest only after every
rank reported its shard durably written. This module holds the checkpointer's API and lifetime; the
protocol the ranks run (the agreement, the writer thread, the commit, :class:`SaveHandle`) is in
:mod:`.protocol`.

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
import time
import weakref
from typing import Any
from collections.abc import Mapping

from hpcstagger import config
from hpcstagger.comm import Comm, as_comm
from hpcstagger.errors import CheckpointError, CollectiveError, ConfigError, describe_exception
from hpcstagger.checkpoint import catalog
from hpcstagger.checkpoint.flushq import FlushQueue
from hpcstagger.checkpoint.gates import Gate, StepGate
from hpcstagger.checkpoint.manifest import step_dirname
from hpcstagger.checkpoint.protocol import SaveHandle, agree, check_thread_level, SaveTask, Worker
from hpcstagger.checkpoint.sharding import ShardPlan, layout_signature, plan_shards
from hpcstagger.checkpoint.snapshot import SnapshotBuffers
from hpcstagger.checkpoint.state import Leaf, flatten
from hpcstagger.checkpoint.writer import Pacer, ShardItem, ShardWriter
from hpcstagger.checkpoint.load import load

__all__ = ["AsyncCheckpointer", "SaveHandle"]

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Asynchronous, sharded, atomically committed checkpoints of replicated training state.

    ``directory``: where checkpoints are kept (shared by the ranks of ``comm``). ``comm``: None for
    one process, else the data-parallel ranks (each writes one shard). ``keep``: committed
    checkpoints kept in ``directory``. ``staging_dir``: a fast level (e.g. a directory in /dev/shm)
    committed first, then flushed to ``directory`` in the background; it keeps ``ckpt_staging_keep``
    checkpoints. ``gate``: what the writer defers to before each chunk: "auto" (the default) a
    :class:`~hpcstagger.checkpoint.gates.StepGate` that hooks the modules and optimizers in the saved
    state and is busy from each forward pass to the optimizer's step; None never defers; or any
    :class:`~hpcstagger.checkpoint.gates.Gate`. ``writer``: a :class:`ShardWriter` (subclass it to
    inject faults). ``flush_by``: who copies each staged shard to ``directory``: "self" (this rank's
    writer) or "queue" (an idle process on the node, through the flush queue in ``flush_queue``;
    see :mod:`.flushq`); None reads the ``ckpt_flush_by`` knob ("self"), which matters only with a
    staging level. ``flush_queue``: the directory the queue lives in (``<flush_queue>/.flushq``): the
    staging directory (the default) or a directory above it, shared by several jobs' staging levels.

    Construction and :meth:`close` are collective over ``comm``; so is :meth:`save`. Raises
    ConfigError for bad arguments, CheckpointError when MPI lacks thread support.
    """

    def __init__(self, directory: str | os.PathLike[str], *, comm: Any = None, keep: int = 3,
                 staging_dir: str | os.PathLike[str] | None = None, gate: Gate | str | None = "auto",
                 writer: ShardWriter | None = None, flush_by: str | None = None,
                 flush_queue: str | os.PathLike[str] | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (committed checkpoints to keep), not {keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.staging_dir = None if staging_dir is None else os.path.abspath(os.fspath(staging_dir))
        if self.staging_dir == self.directory:
            raise ConfigError("staging_dir must differ from directory; leave it None for one level")
        self.keep = keep
        if gate == "auto":
            gate = StepGate()
        elif gate is not None and not isinstance(gate, Gate):
            raise ConfigError(f"gate must be 'auto', None or a hpcstagger.checkpoint.gates.Gate, not {gate!r}")
        self.gate = gate
        self._comm = as_comm(comm)
        check_thread_level(self._comm)
        # h5py must first be imported on the main thread: imported first on the writer thread, HDF5's
        # own exit handler calls back into an interpreter that is gone and the process segfaults.
        import h5py  # noqa: F401  (imported for its side effect: the first import, on the main thread)
        import xxhash  # noqa: F401  (likewise imported now, not first on the writer thread)
        self._levels = [d for d in (self.staging_dir, self.directory) if d is not None]
        self._keeps = [max(1, int(config.get("ckpt_staging_keep"))), keep] if self.staging_dir else [keep]
        self._flushq = self._flush_queue(flush_by, flush_queue)

        def make_dirs() -> None:
            for d in self._levels:
                os.makedirs(d, exist_ok=True)
            if self._flushq is not None:
                self._flushq.prepare()

        self._comm.run_all(make_dirs, what="create checkpoint directories")
        self._wcomm = self._comm.dup() if self._comm.is_mpi else Comm.single()
        self._writer = writer or ShardWriter()
        self._buffers = SnapshotBuffers()
        self._plan_key: Any = None
        self._plan: ShardPlan | None = None
        self._current: SaveHandle | None = None
        self._closed = False
        self._worker = Worker(int(config.get("ckpt_writer_nice")))
        # An unclosed checkpointer finishes its save in flight at exit. Registered now, after h5py's
        # own exit handler, so that it runs before h5py tears HDF5 down (atexit runs last-in first).
        atexit.register(self._worker.stop)
        self._finalizer = weakref.finalize(self, self._worker.stop)

    def _flush_queue(self, flush_by: str | None, root: str | os.PathLike[str] | None) -> FlushQueue | None:
        """The flush queue to post to, or None when this rank's writer copies its shard itself."""
        how = config.get("ckpt_flush_by") if flush_by is None else flush_by
        if how not in ("self", "queue"):
            raise ConfigError(f"flush_by must be 'self' or 'queue' (knob ckpt_flush_by), not {how!r}")
        if how == "self" or (self.staging_dir is None and flush_by is None):
            return None
        if self.staging_dir is None:
            raise ConfigError("flush_by='queue' needs a staging_dir: the queue flushes the staging level")
        root = self.staging_dir if root is None else os.path.abspath(os.fspath(root))
        if os.path.commonpath([root, self.staging_dir]) != root:
            raise ConfigError(f"flush_queue {root} must be the staging directory {self.staging_dir} or a "
                              "directory above it (flushers only copy files from under the queue's directory)")
        return FlushQueue(root)

    @property
    def flush_queue(self) -> str | None:
        """The directory whose flush queue this checkpointer posts to, None when its writer flushes."""
        return None if self._flushq is None else self._flushq.root

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
        h.join()
        h.raise_unreported()
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
        self._buffers.touch()

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
            if isinstance(self.gate, StepGate):
                self.gate.watch_state(state)
            tree, leaves = flatten(state)
            plan, sig = self._plan_for(leaves)
            index = {leaf.spec.key: leaf for leaf in leaves}
            mine = [(p, index[p.key]) for p in plan.for_shard(c.rank)]
            self._buffers.ensure(mine)
            views = self._buffers.copy(mine)
            items = [ShardItem(p, leaf.spec, leaf.kind, leaf.storage, v)
                     for (p, leaf), v in zip(mine, views, strict=True)]
            if c.rank == 0:
                for d in self._levels:
                    catalog.clear_step(d, step)
        except Exception as exc:  # shared with every rank below
            local_err = exc
        if c.size > 1:
            try:
                statuses = agree(c, local_err, sig)
            except CollectiveError as exc:
                raise CheckpointError(f"checkpoint of step {step}: the ranks could not agree on the snapshot: "
                                      f"{exc}") from exc
            failures = {r: e for r, (e, _) in enumerate(statuses) if e is not None}
            if failures:
                err = CollectiveError.from_failures(f"checkpoint snapshot of step {step}", failures, c.size)
                raise CheckpointError(str(err)) from local_err
            if len({s for _, s in statuses}) > 1:
                groups: dict[str | None, list[int]] = {}
                for r, (_, s) in enumerate(statuses):
                    groups.setdefault(s, []).append(r)
                raise CheckpointError(
                    f"checkpoint of step {step}: the state's tensors (keys, dtypes, shapes) differ across ranks "
                    f"(groups of ranks: {sorted(groups.values())}); every rank must save the same replicated state")
        elif local_err is not None:
            if isinstance(local_err, CheckpointError):
                raise local_err
            raise CheckpointError(f"checkpoint snapshot of step {step} failed: {describe_exception(local_err)}") \
                from local_err
        pacer = Pacer(self.gate)
        handle = SaveHandle(step, dirs[-1], dirs[0] if self.staging_dir else None, pacer=pacer)
        task = SaveTask(handle=handle, wcomm=self._wcomm, writer=self._writer, plan=plan, leaves=leaves, tree=tree,
                         items=items, levels=self._levels, keeps=self._keeps, pacer=pacer,
                         timeout=float(config.get("ckpt_timeout")), flushq=self._flushq)
        handle.timings["blocking_s"] = time.perf_counter() - t0
        self._current = handle
        self._worker.queue.put(task)
        return handle

    def wait(self) -> str | None:
        """Block until the save in flight (if any) is durable; return its path or None.

        Raises CheckpointError, on every rank, if it failed and that was not yet raised.
        """
        h = self._finish_previous()
        if h is None or h.error is not None:
            return None
        return h.path

    def idle(self) -> bool:
        """True when the writer has nothing left to do: no save in flight and no old checkpoint
        still being deleted (retention runs after a save is durable)."""
        return self._worker.queue.unfinished_tasks == 0

    def drain(self) -> str | None:
        """Like :meth:`wait`, then also wait for the retention work that follows it."""
        path = self.wait()
        self._worker.queue.join()
        return path

    def load(self, step: int | None = None, *, map_location: Any = None, strict: bool = False) -> dict[str, Any]:
        """Wait for the save in flight, then :func:`~hpcstagger.checkpoint.load` from every level."""
        self.wait()
        return load(self._levels, step, comm=self._comm, map_location=map_location, strict=strict)

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
            if isinstance(self.gate, StepGate):
                self.gate.close()
            if self._wcomm.is_mpi:
                self._wcomm.free()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the error in flight; still clean up
            try:
                self.close()
            except CheckpointError as err:
                log.error("checkpoint error while handling another exception: %s", err)
