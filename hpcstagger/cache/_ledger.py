"""The on-disk layout of one cache and the shared ledger that every process maps.

A cache is a directory ``<root>/<name>/`` (mode 0700) holding three files:

``ledger``
    A fixed-size file (fully allocated, so writing through the mapping can never hit a full
    /dev/shm) that every process maps read-write. A 4 KiB header of 64-bit words holds the
    configuration (capacity, policy, index and arena sizes), the generation, the node-wide
    occupancy (payload bytes used, entries, bytes and entries reserved by writers in flight, the
    arena's bump pointer, a short list of free holes) and a ``dirty`` word. Then come
    :data:`NSLOTS` process slots of 16 words: owner pid and start time, that process's counters
    (lookups, hits, misses, inserts, refused, ...) and its one in-flight reservation.
``index.<gen>``
    An open-addressing hash table of 32-byte slots ``(key hash hi, key hash lo, offset, meta)``,
    ``meta = length | state << 56``. Written only with ``pwrite`` under the lock, read lock-free
    through a read-only mapping.
``arena.<gen>``
    The entries: a 64-byte header (magic, key hash, length, xxh3-64 checksum, generation) and the
    payload, 64-byte aligned. Written with ``pwrite`` (so a full /dev/shm is an ENOSPC error, not a
    SIGBUS), read through a read-only mapping, so a hit is a verified zero-copy view.

Every change of shared state happens under ``flock`` on the cache directory, with ``dirty`` set
for the duration: a process killed inside the lock leaves ``dirty`` set and the next process to
take the lock recounts everything from the index. A process killed while writing an entry (outside
the lock) leaves only its reservation, which the next opener (or the next insert that finds the
space reserved) returns to the free holes. Published regions are never rewritten: MinIO never
evicts, a corrupt entry's region is abandoned, and ``clear()`` starts a new generation of index and
arena files instead of reusing the old ones, so a view handed out earlier never changes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from typing import Any

from hpcstagger.errors import CacheError
from hpcstagger.cache import _files, _flight, _fs
from hpcstagger.cache._layout import (ALIGN, COUNTERS, ENTRY_HDR, HEADER_BYTES, H_ARENA_BYTES, H_CAPACITY, H_DIRTY,
                                      H_FLIGHT_N, H_ENTRIES, H_GEN, H_HOLES, H_INDEX_SLOTS, H_INDEX_USED, H_MAGIC,
                                      H_MAX_ENTRIES, H_NHOLES, H_NSLOTS, H_POLICY, H_RESERVED, H_RESERVED_ENTRIES,
                                      H_TOP, H_USED, H_VERSION, H_WASTED, LEDGER_BYTES, LEN_MASK, LIVE, MAGIC,
                                      MAX_HOLES, NSLOTS, SLOT, SLOT_WORDS, S_PID, S_FLIGHT, S_RES_GEN, S_RES_OFF,
                                      S_RES_PAYLOAD, S_RES_SIZE, S_START, VERSION)
from hpcstagger.cache.policy import get_policy

_open_ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for led in list(_open_ledgers):
        led._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Ledger:
    """One process's handle on one cache's shared files. Private to :mod:`hpcstagger.cache`."""

    lmap: mmap.mmap | None  # the ledger's mapping: set once the ledger file is open, None after close()

    def __init__(self, root: str, name: str, *, capacity: int | None, policy_code: int,
                 max_entries: int, check_max_entries: bool, stores: bool):
        self.root, self.name = root, name
        self.path = os.path.join(root, name)
        self.dir_fd = self.ledger_fd = -1
        self.index_fd = self.arena_fd = -1
        self.imv: Any = None
        self.amv: Any = None
        self.gen = 0
        self._lock_fd = -1
        self._lock_pid = 0
        self.tlock = threading.RLock()
        self.clock = threading.Lock()
        self.put_lock = threading.Lock()
        self.base = -1
        self.flight_swept = 0  # when this process last swept the reads in flight (_flight)
        if capacity is None and not os.path.lexists(root):
            raise CacheError(f"no cache named {name!r}: the cache root {root} does not exist, so no "
                             "cache has been created there yet (set HPCSTAGGER_SHM_ROOT or --root if "
                             "the caches live elsewhere)")
        root_fd = _fs.open_secure_dir(root, create=capacity is not None, what="cache root")
        try:
            if capacity is None and not _files.exists(name, root_fd):
                raise CacheError(f"no cache named {name!r} under {root}; 'hpcstagger cache ls "
                                 f"--root {root}' lists the caches there")
            self.dir_fd = _fs.open_secure_subdir(root_fd, name, root, create=capacity is not None,
                                                 what="cache directory")
        finally:
            os.close(root_fd)
        try:
            self._open_or_create(capacity, policy_code, max_entries, check_max_entries, stores)
        except BaseException:
            self.close()
            raise
        _open_ledgers.add(self)

    # ---- files ---------------------------------------------------------------------------------

    def _open_or_create(self, capacity: int | None, policy_code: int, max_entries: int,
                        check_max_entries: bool, stores: bool) -> None:
        lock_fd = self._lockfd()
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # creation and first attach are serialised
        try:
            if not _files.exists("ledger", self.dir_fd):
                if capacity is None:
                    raise CacheError(f"cache {self.name!r} under {self.root} is incomplete (no ledger); "
                                     f"remove it with 'hpcstagger cache clear {self.name}'")
                _files.create_cache(self.dir_fd, self.path, self.root, capacity, policy_code, max_entries,
                                    stores)
            self.ledger_fd = self._open_file("ledger")
            st = _fs.check_secure_file(self.ledger_fd, os.path.join(self.path, "ledger"), "cache ledger")
            if st.st_size != LEDGER_BYTES:
                raise CacheError(f"cache ledger {self.path}/ledger has the wrong size ({st.st_size} bytes); "
                                 f"remove the cache with 'hpcstagger cache clear {self.name}'")
            self.lmap = mmap.mmap(self.ledger_fd, LEDGER_BYTES, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            self.w = memoryview(self.lmap).cast("Q")
            w = self.w
            if w[H_MAGIC] != MAGIC or w[H_VERSION] != VERSION or w[H_NSLOTS] != NSLOTS:
                raise CacheError(f"{self.path}/ledger is not a version-{VERSION} hpcstagger cache ledger; "
                                 f"remove the cache with 'hpcstagger cache clear {self.name}'")
            if capacity is not None and (w[H_CAPACITY], w[H_POLICY]) != (capacity, policy_code) or (
                    check_max_entries and w[H_MAX_ENTRIES] != max_entries):
                raise CacheError(
                    f"cache {self.name!r} already exists with capacity_bytes={w[H_CAPACITY]}, "
                    f"policy={get_policy(int(w[H_POLICY])).name!r}, max_entries={w[H_MAX_ENTRIES]}; "
                    f"open it with the same values (or capacity_bytes=None), use another name, or "
                    f"remove it first with 'hpcstagger cache clear {self.name}'")
            self.capacity = int(w[H_CAPACITY])
            self.index_slots = int(w[H_INDEX_SLOTS])
            self.arena_bytes = int(w[H_ARENA_BYTES])
            self.mask = self.index_slots - 1
            self.stores = self.index_slots > 0
            self._begin()
            try:
                self._remove_stale_generations()
                self.reclaim_dead()
                self.map_generation()
            finally:
                self._end()
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)

    def _open_file(self, name: str) -> int:
        return _files.open_file(self.dir_fd, self.path, self.name, name)

    def _create_file(self, name: str, size: int, *, allocate: bool) -> None:
        """Create ``name`` of ``size`` bytes (the index allocated, the arena sparse: see
        :func:`hpcstagger.cache._files.create_file`)."""
        _files.create_file(self.dir_fd, self.path, self.root, name, size, allocate=allocate)

    def _remove_stale_generations(self) -> None:
        keep = {f"index.{self.w[H_GEN]}", f"arena.{self.w[H_GEN]}", "ledger"}
        for entry in os.listdir(self.dir_fd):
            if entry not in keep:
                try:
                    os.unlink(entry, dir_fd=self.dir_fd)
                except FileNotFoundError:
                    pass

    def map_generation(self) -> None:
        """Map the current generation's index and arena (called under the lock)."""
        gen = int(self.w[H_GEN])
        if gen == self.gen or not self.stores:
            self.gen = gen
            return
        fds = []
        try:
            for kind, size in (("index", self.index_slots * SLOT.size), ("arena", self.arena_bytes)):
                name = f"{kind}.{gen}"
                fd = self._open_file(name)
                fds.append(fd)
                st = _fs.check_secure_file(fd, os.path.join(self.path, name), "cache file")
                if st.st_size != size:
                    raise CacheError(f"cache file {self.path}/{name} has size {st.st_size}, expected {size}; "
                                     f"remove the cache with 'hpcstagger cache clear {self.name}'")
            maps = [mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                    for fd, size in zip(fds, (self.index_slots * SLOT.size, self.arena_bytes), strict=True)]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        for fd in (self.index_fd, self.arena_fd):
            if fd >= 0:
                os.close(fd)
        # Old mappings are only dropped, never closed: views handed out keep them alive.
        self.index_fd, self.arena_fd = fds
        self.imv, self.amv = memoryview(maps[0]), memoryview(maps[1])
        self.gen = gen

    # ---- locking -------------------------------------------------------------------------------

    def _after_fork(self) -> None:
        self.tlock = threading.RLock()
        self.clock = threading.Lock()
        self.put_lock = threading.Lock()
        self._lock_fd = -1  # the inherited one shares the parent's flock; open our own
        self.base = -1      # and count in our own process slot

    def _lockfd(self) -> int:
        pid = os.getpid()
        if self._lock_fd < 0 or self._lock_pid != pid:
            self._lock_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dir_fd)
            self._lock_pid = pid
        return self._lock_fd

    def lock(self) -> _Locked:
        """Context manager: thread lock + flock, with crash recovery via the dirty word."""
        return _Locked(self)

    def _begin(self) -> None:
        if self.w[H_DIRTY]:
            self.recount()
        self.w[H_DIRTY] = 1

    def _end(self) -> None:
        self.w[H_DIRTY] = 0

    # ---- process slots -------------------------------------------------------------------------

    def claim_slot(self) -> int:
        """This process's slot base word (claimed under the lock on first use)."""
        with self.lock():
            if self.base >= 0:
                return self.base
            w = self.w
            pid, start = _fs.self_identity()
            free = dead = -1
            for s in range(NSLOTS):
                b = HEADER_BYTES // 8 + s * SLOT_WORDS
                if w[b + S_PID] == 0:
                    free = b
                    break
                if dead < 0 and not _fs.alive(int(w[b + S_PID]), int(w[b + S_START])):
                    dead = b
            b = free if free >= 0 else dead
            if b < 0:
                raise CacheError(f"cache {self.name!r} has {NSLOTS} live processes attached; "
                                 "no slot is left for this one (close unused ShmCache objects)")
            self.drop_reservation(b, reuse=True)
            w[b + S_FLIGHT] = 0
            w[b + S_START] = start
            w[b + S_PID] = pid
            self.base = b
            return b

    def release_slot(self) -> None:
        if self.base < 0 or self.dir_fd < 0:
            return
        with self.lock():
            self.release_slot_locked()

    def release_slot_locked(self) -> None:
        if self.base >= 0:
            self.drop_reservation(self.base, reuse=True)
            self.w[self.base + S_FLIGHT] = 0
            self.w[self.base + S_PID] = 0
            self.w[self.base + S_START] = 0
            self.base = -1

    def drop_reservation(self, b: int, *, reuse: bool, account: bool = True) -> None:
        """Release reservation slot ``b`` (with ``reuse``, its arena bytes go back to the free space)."""
        w = self.w
        size = int(w[b + S_RES_SIZE])
        if size:
            if account:
                w[H_RESERVED] -= min(int(w[H_RESERVED]), int(w[b + S_RES_PAYLOAD]))
                w[H_RESERVED_ENTRIES] -= min(int(w[H_RESERVED_ENTRIES]), 1)
            if reuse and w[b + S_RES_GEN] == w[H_GEN]:
                self.add_hole(int(w[b + S_RES_OFF]), size)
        w[b + S_RES_OFF] = w[b + S_RES_SIZE] = w[b + S_RES_PAYLOAD] = w[b + S_RES_GEN] = 0

    def slot_bases(self) -> range:
        return range(HEADER_BYTES // 8, HEADER_BYTES // 8 + NSLOTS * SLOT_WORDS, SLOT_WORDS)

    def reclaim_dead(self) -> int:
        """Return the reservations of dead writers to the free holes (under the lock). Count them."""
        w = self.w
        n = 0
        for b in self.slot_bases():
            if w[b + S_RES_SIZE] and not _fs.alive(int(w[b + S_PID]), int(w[b + S_START])):
                self.drop_reservation(b, reuse=True)
                n += 1
        return n

    # ---- arena space ---------------------------------------------------------------------------

    def alloc(self, size: int) -> int:
        """Offset of ``size`` free arena bytes (first fit in the holes, else the bump pointer), or -1."""
        w = self.w
        for h in range(int(w[H_NHOLES])):
            o, s = int(w[H_HOLES + 2 * h]), int(w[H_HOLES + 2 * h + 1])
            if s >= size:
                if s == size:
                    self._remove_hole(h)
                else:
                    w[H_HOLES + 2 * h], w[H_HOLES + 2 * h + 1] = o + size, s - size
                return o
        top = int(w[H_TOP])
        if top + size > self.arena_bytes:
            return -1
        w[H_TOP] = top + size
        return top

    def add_hole(self, off: int, size: int) -> None:
        w = self.w
        if off + size == w[H_TOP]:
            w[H_TOP] = off
            return
        n = int(w[H_NHOLES])
        if n >= MAX_HOLES:
            w[H_WASTED] += size
            return
        w[H_HOLES + 2 * n], w[H_HOLES + 2 * n + 1] = off, size
        w[H_NHOLES] = n + 1

    def _remove_hole(self, h: int) -> None:
        w = self.w
        last = int(w[H_NHOLES]) - 1
        w[H_HOLES + 2 * h], w[H_HOLES + 2 * h + 1] = w[H_HOLES + 2 * last], w[H_HOLES + 2 * last + 1]
        w[H_NHOLES] = last

    # ---- recovery ------------------------------------------------------------------------------

    def recount(self) -> None:
        """Rebuild the occupancy words from the index after a process died inside the lock."""
        import numpy as np

        w = self.w
        self.map_generation()
        live_offsets: Any = np.zeros(0, dtype=np.uint64)
        used = entries = index_used = live_arena = 0
        if self.stores:
            table = np.frombuffer(self.imv, dtype="<u8").reshape(-1, 4)
            state = table[:, 3] >> np.uint64(56)
            live = state == LIVE
            lengths = table[live, 3] & np.uint64(LEN_MASK)
            live_offsets = table[live, 2]
            used, entries = int(lengths.sum()), int(live.sum())
            index_used = int(((table[:, 0] | table[:, 1]) != 0).sum())
            live_arena = int(((lengths + np.uint64(ENTRY_HDR + ALIGN - 1)) // np.uint64(ALIGN)).sum()) * ALIGN
        # The free-hole list may have been half edited: forget it (its space counts as wasted) so
        # that no region can ever be handed out twice.
        w[H_NHOLES] = 0
        reserved = reserved_entries = reserved_arena = 0
        for b in self.slot_bases():
            if not w[b + S_RES_SIZE]:
                continue
            if _fs.alive(int(w[b + S_PID]), int(w[b + S_START])):
                # a live writer still holds it (even from an older generation): it stays accounted
                # until that writer publishes or gives it back
                reserved += int(w[b + S_RES_PAYLOAD])
                reserved_entries += 1
                if w[b + S_RES_GEN] == w[H_GEN]:
                    reserved_arena += int(w[b + S_RES_SIZE])
                continue
            # Died inside the lock, perhaps after publishing: only an unpublished region is free.
            published = bool((live_offsets == np.uint64(w[b + S_RES_OFF])).any())
            self.drop_reservation(b, reuse=not published, account=False)
        holes = sum(int(w[H_HOLES + 2 * h + 1]) for h in range(int(w[H_NHOLES])))
        w[H_USED], w[H_ENTRIES], w[H_INDEX_USED] = used, entries, index_used
        w[H_RESERVED], w[H_RESERVED_ENTRIES] = reserved, reserved_entries
        w[H_FLIGHT_N] = _flight.sweep(self)
        w[H_WASTED] = max(0, int(w[H_TOP]) - live_arena - holes - reserved_arena)

    def clear(self) -> None:
        """Start a new, empty generation of index and arena; unlink the old one (under the lock)."""
        w = self.w
        old, new = int(w[H_GEN]), int(w[H_GEN]) + 1
        if self.stores:
            self._create_file(f"index.{new}", self.index_slots * SLOT.size, allocate=True)
            try:
                self._create_file(f"arena.{new}", self.arena_bytes, allocate=False)
            except CacheError:
                os.unlink(f"index.{new}", dir_fd=self.dir_fd)
                raise
        w[H_USED] = w[H_ENTRIES] = w[H_INDEX_USED] = w[H_TOP] = w[H_NHOLES] = w[H_WASTED] = 0
        w[H_GEN] = new
        for kind in ("index", "arena"):
            try:
                os.unlink(f"{kind}.{old}", dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
        self.map_generation()

    # ---- reporting -----------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        words = self.w[HEADER_BYTES // 8:].tolist()
        out = {k: sum(words[i::SLOT_WORDS]) for k, i in COUNTERS.items()}
        out["lookups"] = out["hits"] + out["misses"]
        out["processes"] = len(self.live_pids())
        return out

    def read_totals(self) -> tuple[int, int]:
        """The source-read sums alone (bytes, nanoseconds): no liveness checks, cheap to poll."""
        words = self.w[HEADER_BYTES // 8:]
        return (sum(words[COUNTERS["read_bytes"]::SLOT_WORDS]), sum(words[COUNTERS["read_ns"]::SLOT_WORDS]))

    def live_pids(self) -> set[int]:
        """Pids of the live processes attached to this cache (those holding a process slot)."""
        words = self.w[HEADER_BYTES // 8:].tolist()
        return {words[b + S_PID] for b in range(0, len(words), SLOT_WORDS)
                if words[b + S_PID] and _fs.alive(words[b + S_PID], words[b + S_START])}

    def close(self) -> None:
        for attr in ("ledger_fd", "index_fd", "arena_fd", "dir_fd", "_lock_fd"):
            fd = getattr(self, attr, -1)
            if fd >= 0 and (attr != "_lock_fd" or self._lock_pid == os.getpid()):
                try:
                    os.close(fd)
                except OSError:
                    pass
            setattr(self, attr, -1)
        self.imv = self.amv = None  # dropped, not closed: views handed out keep their mapping alive
        lmap = getattr(self, "lmap", None)
        if lmap is not None:
            self.w.release()
            lmap.close()
            self.lmap = None
        _open_ledgers.discard(self)


class _Locked:
    __slots__ = ("led",)

    def __init__(self, led: Ledger):
        self.led = led

    def __enter__(self) -> Ledger:
        led = self.led
        led.tlock.acquire()
        try:
            fd = led._lockfd()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            led.tlock.release()
            raise
        try:
            led._begin()
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)
            led.tlock.release()
            raise
        return led

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        led = self.led
        try:
            if exc_type is None:
                led._end()  # on an exception dirty stays set: the next locker recounts
        finally:
            fcntl.flock(led._lock_fd, fcntl.LOCK_UN)
            led.tlock.release()
