"""``PartitionedCache``: the node caches of a job (or a co-located run) as one cache over MPI.

After CoorDL's partitioned caching and NoPFS. Every sample has one owner node, chosen by its key
hash: ``owner = key hash hi % nodes``. The owner keeps it in its ordinary node-local
:class:`~hpcstagger.cache.store.ShmCache`, which every process of that node shares as before.

- A lookup of a sample this node owns is a local :meth:`ShmCache.get`.
- A lookup of another node's sample reads the owner's cache files with one-sided MPI (``MPI_Rget``
  under a ``MPI_Win_lock_all`` epoch): the index slots where the key would be, then the entry.
  Where an entry lies is remembered, so the next lookup of the key (the next epoch's) is one read
  of the entry; a moved, evicted or overwritten entry fails verification, and the index is read.
  The owner's processes take no part, so a busy owner (one that holds the GIL in a training loop)
  serves at full speed. The entry's header and xxh3-64 checksum are verified here, at the reader:
  a corrupt or torn entry is a miss, never wrong bytes.
- A miss everywhere is read from the source by the caller, whose :meth:`put` sends the sample to
  the owner node (one two-sided message: a fixed header, the key and the payload, no pickle). A
  process on the owner node verifies and inserts it the next time it uses the cache.

Faults. Every transfer is polled against a deadline (the ``cache_remote_timeout`` knob); a
transfer that fails or times out marks its node dead for this process, which stops asking it: its
samples then come from the source. Peers on the same host are checked for life before each
transfer. :meth:`close` is collective, bounded by ``collective_timeout``, and frees the MPI
windows only when every rank got there. What MPI itself does when a peer dies is in
docs/partitioned.md.

Forked or spawned processes (DataLoader workers) cannot use MPI: there the cache serves the
samples this node owns and reports the others as misses (so they are read from the source).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from typing import Any

import numpy as np

from hpcstagger import config
from hpcstagger.comm import UNSET, Backoff, Comm, as_comm, mpi_module
from hpcstagger.cache import _fs, _pstats
from hpcstagger.cache._base import LoadThrough
from hpcstagger.cache._layout import ENTRY_HDR, SLOT
from hpcstagger.cache._wire import ABSENT, FOUND, pack_insert, scan_slots, unpack_insert, verify_entry
from hpcstagger.cache.nodes import NodeLayout, discover
from hpcstagger.cache.store import ShmCache, key_hash

__all__ = ["PartitionedCache", "partition_stats"]

log = logging.getLogger(__name__)
PROBE_SLOTS = 8       # index slots fetched per round trip (load factor <= 1/2: chains are short)
MAX_PENDING = 64      # inserts in flight to other nodes per process; more are dropped
MAX_DRAIN = 16        # inserts taken in per call
ALIVE_EVERY = 0.05    # seconds between two looks in /proc at a peer on this host
PROGRESS_EVERY = 0.001  # seconds between two takes of incoming inserts on the remote-hit path
WHERE_MAX = 1 << 18   # remote entries whose place in the owner's arena this process remembers
_TAG = 0x5043


class PartitionedCache(LoadThrough):
    """A cache partitioned across the nodes of ``comm``, used like a :class:`ShmCache`.

    Collective over ``comm`` (a :class:`~hpcstagger.comm.Comm`, an mpi4py communicator, or None for
    one process). ``name``, ``capacity_bytes`` (per node), ``policy`` and ``max_entries`` are
    those of each node's ShmCache. ``root`` defaults to the ``shm_root`` knob; when several nodes
    share a host (emulated nodes, see :mod:`hpcstagger.cache.nodes`) node ``i`` uses
    ``<root>/node<i>``. ``nodes`` > 0 emulates that many nodes (default: the ``cache_nodes`` knob;
    0 finds the real ones). ``timeout`` bounds the collective steps (default ``collective_timeout``).

    :class:`~hpcstagger.cache.dataset.CachedDataset` takes it in place of a ShmCache. Raises
    CacheError or CollectiveError (on every rank) when a node cannot open its cache.
    """

    def __init__(self, name: str, capacity_bytes: int | None, comm: Comm | Any | None = None, *,
                 policy: str = "minio", root: str | os.PathLike[str] | None = None,
                 max_entries: int | None = None, nodes: int | None = None, timeout: Any = UNSET):
        self.comm = as_comm(comm)
        self.layout: NodeLayout = discover(self.comm, nodes=nodes, timeout=timeout)
        base = os.path.abspath(os.fspath(root) if root is not None else config.get("shm_root"))
        self.root = os.path.join(base, f"node{self.layout.node}") if self.layout.emulated else base
        self.name = name
        local: ShmCache | None = None
        with self.comm.guard("open the partitioned cache", timeout=timeout):
            local = ShmCache(name, capacity_bytes, policy=policy, root=self.root, max_entries=max_entries)
        assert local is not None
        self._own_state(local, float(config.get("cache_remote_timeout")))
        if self.layout.count > 1 and self.local.policy.stores:
            self._open_windows(timeout)

    def _own_state(self, local: ShmCache, remote_timeout: float) -> None:
        """This process's state over its node cache ``local`` (``root``, ``name`` and ``layout`` set)."""
        self.local = local
        self.counters = _pstats.Counters(self.root, self.name, {"node": self.layout.node, "nodes": self.layout.count})
        self._pid = os.getpid()
        self._dead: set[int] = set()
        self._abandoned: list[Any] = []  # requests given up on: freeing an active request is erroneous
        self._pending: deque[tuple[Any, bytearray]] = deque()
        self._timeout = remote_timeout
        self._wins: list[Any] = []
        self._icomm: Any = None
        self._peers: list[tuple[str, int, int, int]] = []
        self._checked: dict[int, float] = {}
        self._where: dict[tuple[int, int], tuple[int, int]] = {}  # (hi, lo) -> (arena offset, length)
        self._mpi: Any = None
        self._next_progress = 0.0

    # ---- set-up and tear-down ------------------------------------------------------------------

    def _open_windows(self, timeout: Any) -> None:
        """Expose this process's mappings of its node's index and arena as two MPI windows."""
        MPI = self._mpi = mpi_module()
        index, arena, _ = self.local.regions()
        self._regions = (index, arena)  # the windows point into these mappings: keep them alive
        self._peers = self.comm.allgather((socket.gethostname(), os.getpid(), len(index) // SLOT.size, len(arena)),
                                          timeout=timeout)
        self.comm.barrier(timeout=timeout)  # every rank is here: the blocking creations cannot hang
        c = self.comm.mpi
        for region in (index, arena):
            mem = MPI.memory.fromaddress(np.frombuffer(region, dtype=np.uint8).ctypes.data, len(region))
            win = MPI.Win.Create(mem, 1, MPI.INFO_NULL, c)
            win.Set_errhandler(MPI.ERRORS_RETURN)
            win.Lock_all(MPI.MODE_NOCHECK)  # shared access only, so no lock traffic at all
            self._wins.append(win)
        self._icomm = c.Dup()
        self._icomm.Set_errhandler(MPI.ERRORS_RETURN)
        self._host = socket.gethostname()

    def close(self, *, timeout: Any = UNSET) -> None:
        """Leave the partitioned cache (collective over ``comm``; bounded by ``timeout``, default
        ``collective_timeout``). Sends still in flight are finished and inserts addressed to this
        process taken in first. If a rank never arrives (it died), the MPI windows are left
        allocated rather than freed, so no rank hangs. The object is unusable afterwards."""
        try:
            if self._remote_ok():
                self._leave(timeout)
        finally:
            self._wins, self._icomm = [], None
            self.local.close()

    def _leave(self, timeout: Any) -> None:
        MPI = mpi_module()
        limit = config.get("collective_timeout") if timeout is UNSET else timeout
        deadline = None if limit is None or limit <= 0 else time.monotonic() + float(limit)
        barrier: Any = None
        backoff = Backoff(0.0002, 0.01)
        while True:
            try:
                self.progress()
                if barrier is None and not self._pending:
                    # A barrier with a dead rank never completes, and posting it can block: MPICH over
                    # OFI's tcp provider blocks in the post on a send to a dead peer.
                    if self._dead or self._peer_gone():
                        log.warning("partitioned cache %s: nodes %s are dead, so close() does not wait for "
                                    "the others; the MPI windows stay allocated", self.name, sorted(self._dead))
                        return
                    barrier = self._icomm.Ibarrier()
                if barrier is not None and barrier.Test():
                    break
            except MPI.Exception as exc:
                log.warning("partitioned cache %s: leaving failed (%s); the MPI windows stay allocated", self.name, exc)
                return
            if (deadline is not None and time.monotonic() > deadline) or self._peer_gone():
                log.warning("partitioned cache %s: not every rank reached close() (dead: nodes %s); the MPI "
                            "windows stay allocated", self.name, sorted(self._dead) or "unknown")
                self._abandoned.append(barrier)
                return
            backoff.sleep()
        self.progress()
        for win in self._wins:
            win.Unlock_all()
            win.Free()
        self._icomm.Free()

    def __enter__(self) -> PartitionedCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detached, (self.name, self.root, self.layout))

    def __repr__(self) -> str:
        return (f"PartitionedCache({self.name!r}, node {self.layout.node} of {self.layout.count}, "
                f"root={self.root!r})")

    # ---- ownership and liveness ----------------------------------------------------------------

    def owner(self, key: str | int) -> int:
        """The node that owns ``key``."""
        return key_hash(key)[0] % self.layout.count

    @property
    def dead_nodes(self) -> frozenset[int]:
        """The nodes this process stopped asking after a failed or timed-out transfer."""
        return frozenset(self._dead)

    def _remote_ok(self) -> bool:
        return bool(self._wins) and os.getpid() == self._pid

    def _target(self, node: int) -> int:
        ranks = self.layout.nodes[node]
        return ranks[self.comm.rank % len(ranks)]

    def _mark_dead(self, node: int, why: str) -> None:
        if node not in self._dead:
            self._dead.add(node)
            log.warning("partitioned cache %s: node %d stopped answering (%s); its samples now come from the "
                        "source", self.name, node, why)

    def _alive(self, rank: int) -> bool:
        """False when ``rank`` is known to have ended: a peer on this host is looked up in /proc (at
        most every ``ALIVE_EVERY`` seconds); a peer on another host only a transfer can tell about."""
        host, pid = self._peers[rank][0], self._peers[rank][1]
        if host != self._host:
            return True
        now = time.monotonic()
        if now - self._checked.get(rank, -1.0) < ALIVE_EVERY:
            return True
        self._checked[rank] = now
        return _fs.alive(pid, 0)

    def _peer_gone(self) -> bool:
        for r in range(len(self._peers)):
            if not self._alive(r):
                self._mark_dead(self._node_of(r), f"rank {r} ended")
                return True
        return False

    def _node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.layout.nodes) if rank in ranks)

    def _wait(self, req: Any, node: int, keep: Any, rank: int) -> bool:
        """Poll ``req`` until it completes (True), or fails, passes the deadline or ``rank`` is seen
        to end (False: the node is dead, and the request and its buffer are kept, never freed)."""
        MPI = self._mpi
        deadline = time.monotonic() + self._timeout
        backoff = Backoff(0.00005, 0.005, spins=200)
        try:
            while not req.Test():
                gone = not self._alive(rank)
                if gone or time.monotonic() > deadline:
                    self._abandoned.append((req, keep))
                    self._mark_dead(node, f"rank {rank} ended" if gone else
                                    f"no answer in {self._timeout:g} s (HPCSTAGGER_CACHE_REMOTE_TIMEOUT)")
                    return False
                backoff.sleep()
        except MPI.Exception as exc:
            self._mark_dead(node, f"MPI error: {exc}")
            return False
        return True

    def _rget(self, win: Any, buf: bytearray, node: int, disp: int) -> bool:
        MPI = self._mpi
        target = self._target(node)
        if not self._alive(target):
            self._mark_dead(node, f"rank {target} ended")
            return False
        try:
            req = win.Rget(buf, target, (disp, len(buf), MPI.BYTE))
        except MPI.Exception as exc:
            self._mark_dead(node, f"MPI error: {exc}")
            return False
        return self._wait(req, node, buf, target)

    # ---- reading -------------------------------------------------------------------------------

    def get(self, key: str | int) -> memoryview | None:
        """The sample stored under ``key`` on its owner node as a read-only memoryview, or None.

        Verified end to end: a corrupt entry, local or remote, is a miss. A dead owner is a miss."""
        hi, lo = key_hash(key)
        owner = hi % self.layout.count
        if owner == self.layout.node:
            if self._remote_ok():
                self.progress()
            view = self.local.get(key)
            if view is not None:
                self.counters.add("local_hits")
            return view
        if owner in self._dead or not self._remote_ok():
            return None
        now = time.monotonic()
        if now >= self._next_progress:  # at most every PROGRESS_EVERY s on this path: it is hot
            self._next_progress = now + PROGRESS_EVERY
            self.progress()
        view = self._fetch(owner, hi, lo)
        self.counters.add("remote_hits" if view is not None else "remote_misses")
        return view

    def _fetch(self, node: int, hi: int, lo: int) -> memoryview | None:
        where = self._where.get((hi, lo))
        if where is not None:  # found there before: one round trip, verified like any other
            entry = bytearray(ENTRY_HDR + where[1])
            if self._rget(self._wins[1], entry, node, where[0]):
                view = verify_entry(entry, hi, lo, where[1])
                if view is not None:
                    return view
            del self._where[(hi, lo)]  # moved, evicted or torn: look it up in the index
            if node in self._dead:
                return None
        _, _, slots, arena_bytes = self._peers[self._target(node)]
        mask = slots - 1
        i = lo & mask
        for _ in range(slots // PROBE_SLOTS + 1):
            count = min(PROBE_SLOTS, slots - i)
            buf = bytearray(count * SLOT.size)
            if not self._rget(self._wins[0], buf, node, i * SLOT.size):
                return None
            state, off, n = scan_slots(buf, count, hi, lo)
            if state == FOUND:
                break
            if state == ABSENT:
                return None
            i = (i + count) & mask
        else:
            return None
        if n > self.local.capacity_bytes or off + ENTRY_HDR + n > arena_bytes:
            self.counters.add("remote_failures")  # a torn or corrupt index slot: never read past it
            return None
        entry = bytearray(ENTRY_HDR + n)
        if not self._rget(self._wins[1], entry, node, off):
            return None
        view = verify_entry(entry, hi, lo, n)
        if view is not None:
            if len(self._where) >= WHERE_MAX:
                del self._where[next(iter(self._where))]
            self._where[(hi, lo)] = (off, n)
        else:
            self.counters.add("remote_failures")
            log.warning("cache %s: an entry fetched from node %d failed verification; treated as a miss",
                        self.name, node)
        return view

    def contains(self, key: str | int) -> bool:
        """Whether ``key`` is stored on its owner node (verified; not counted as a lookup)."""
        hi, lo = key_hash(key)
        owner = hi % self.layout.count
        if owner == self.layout.node:
            return self.local.contains(key)
        return owner not in self._dead and self._remote_ok() and self._fetch(owner, hi, lo) is not None

    def __contains__(self, key: object) -> bool:
        try:
            return self.contains(key)  # type: ignore[arg-type]  # any object may be tested
        except TypeError:
            return False

    def count_read(self, nbytes: int, seconds: float) -> None:
        """Record one source read (see :meth:`ShmCache.count_read`)."""
        self.local.count_read(nbytes, seconds)
        self.counters.add("source_reads")
        self.counters.add("source_bytes", max(0, int(nbytes)))

    def read_counters(self) -> tuple[int, float]:
        """This node's source-read bytes and seconds (see :meth:`ShmCache.read_counters`)."""
        return self.local.read_counters()

    def reading(self) -> Any:
        """Context manager around one source read, counted in this node's cache (see :meth:`ShmCache.reading`)."""
        return self.local.reading()

    def watch(self, seconds: float) -> None:
        """Count this node's source reads in flight for the next ``seconds`` (see :meth:`ShmCache.watch`)."""
        self.local.watch(seconds)

    def flight_seconds(self) -> list[float]:
        """This node's seconds at each number of source reads in flight (see :meth:`ShmCache.flight_seconds`)."""
        return self.local.flight_seconds()

    # ---- writing -------------------------------------------------------------------------------

    def put(self, key: str | int, data: Any) -> bool:
        """Store ``data`` under ``key`` at its owner: here, or sent to the owner node to insert.

        Returns whether it is cached here or on its way; False when the local policy refused it,
        the owner is dead, or too many inserts are in flight (it is dropped: only a later read
        from the source is lost)."""
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
            view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
        hi, lo = key_hash(key)
        owner = hi % self.layout.count
        if owner == self.layout.node:
            return self.local.put(key, view)
        if owner in self._dead or not self._remote_ok():
            return False
        return self._send_insert(owner, key, hi, lo, view)

    def _send_insert(self, node: int, key: str | int, hi: int, lo: int, view: memoryview) -> bool:
        MPI = mpi_module()
        self._reap_sends()
        if len(self._pending) >= MAX_PENDING:
            self.counters.add("inserts_dropped")
            return False
        target = self._target(node)
        if not self._alive(target):
            self._mark_dead(node, f"rank {target} ended")
            return False
        msg = pack_insert(key, hi, lo, view)
        try:
            self._pending.append((self._icomm.Isend(msg, target, _TAG), msg))
        except MPI.Exception as exc:
            self._mark_dead(node, f"MPI error: {exc}")
            return False
        self.counters.add("inserts_sent")
        return True

    def _reap_sends(self) -> None:
        MPI = self._mpi
        while self._pending:
            req, msg = self._pending[0]
            try:
                if not req.Test():
                    return
            except MPI.Exception:
                self._abandoned.append((req, msg))
            self._pending.popleft()

    def progress(self) -> None:
        """Take in the inserts other nodes sent to this process and finish sends (called by every
        :meth:`get` and :meth:`put`; call it when the process uses the cache rarely)."""
        if not self._remote_ok():
            return
        MPI = self._mpi
        status = MPI.Status()
        for _ in range(MAX_DRAIN):
            msg = self._icomm.Improbe(MPI.ANY_SOURCE, _TAG, status)
            if msg is None:
                break
            buf = bytearray(status.Get_count(MPI.BYTE))
            source = status.Get_source()
            if not self._wait(msg.Irecv(buf), self._node_of(source), buf, source):
                break
            got = unpack_insert(buf, key_hash)
            if got is None:
                self.counters.add("inserts_dropped")
                log.warning("cache %s: an insert from rank %d failed verification; dropped", self.name, source)
                continue
            self.local.put(*got)
            self.counters.add("inserts_received")
        self._reap_sends()

    # ---- management ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """This node's ShmCache statistics plus the partition's counters summed over this node's
        processes: local_hits, remote_hits, remote_misses, remote_failures, source_reads,
        source_bytes, inserts_sent, inserts_received, inserts_dropped, partition_node,
        partition_nodes, and this process's dead_nodes."""
        out = self.local.stats()
        out.update(_pstats.totals(self.root, self.name) or {})
        out["dead_nodes"] = sorted(self._dead)
        return out

    def clear(self) -> None:
        """Empty this node's cache. The other nodes keep reading the entries they already see
        until the partitioned cache is opened again (the windows expose the files of the time it
        was opened), so clear a partitioned cache only between runs."""
        self.local.clear()


def _detached(name: str, root: str, layout: NodeLayout) -> PartitionedCache:
    """A partitioned cache in a process without MPI (a spawned DataLoader worker): this node's
    samples only."""
    self = PartitionedCache.__new__(PartitionedCache)
    self.comm, self.layout, self.root, self.name = Comm.single(), layout, root, name
    self._own_state(ShmCache(name, None, root=root), 0.0)
    return self


def partition_stats(name: str, root: str) -> dict[str, Any]:
    """The partition counters of cache ``name`` under ``root`` summed over its processes (see
    :meth:`PartitionedCache.stats`), or {} when it was never partitioned."""
    return _pstats.totals(root, name) or {}
