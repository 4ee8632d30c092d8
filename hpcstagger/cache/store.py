"""``ShmCache``: the node-local sample cache in /dev/shm shared by every process of every job.

The first reader of a sample fills the cache and every later reader, in any process, hits it. A
hit is a lock-free lookup in a shared hash index and a zero-copy, read-only ``memoryview`` of the
entry in a shared arena, verified (magic, key hash, length, xxh3-64 checksum) on every read. The
layout, locking and crash recovery are described in :mod:`hpcstagger.cache._ledger`.
"""

from __future__ import annotations

import errno
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import xxhash

from hpcstagger import config
from hpcstagger._io import CHECKSUM_ALGORITHM
from hpcstagger.errors import CacheError
from hpcstagger.nodeload import MemoryGuard
from hpcstagger.cache import _claims, _flight, _fs
from hpcstagger.cache._layout import (ENTRY, ENTRY_HDR, ENTRY_MAGIC, H_COALESCED, H_ENTRIES, H_GEN, H_INDEX_USED,
                                      H_MAX_ENTRIES, H_POLICY, H_RESERVED, H_RESERVED_ENTRIES, H_TOP, H_USED, H_WASTED,
                                      LIVE, SLOT, S_DUPLICATES, S_INSERTS, S_INSERT_BYTES, S_READ_BYTES, S_READ_NS,
                                      S_REFUSED, S_RES_GEN, S_RES_OFF, S_RES_PAYLOAD, S_RES_SIZE, align)
from hpcstagger.cache._base import LoadThrough
from hpcstagger.cache._ledger import Ledger
from hpcstagger.cache._reads import Reads, key_digest, key_hash
from hpcstagger.cache.policy import Policy, Space, get_policy

__all__ = ["ShmCache", "key_hash", "default_max_entries"]

log = logging.getLogger(__name__)

assert CHECKSUM_ALGORITHM == "xxh3_64"  # entries carry hpcstagger's checksum, as an integer
_checksum = xxhash.xxh3_64_intdigest
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def default_max_entries(capacity_bytes: int) -> int:
    """The entries a cache of ``capacity_bytes`` indexes when not told: one per
    ``cache_min_sample_bytes`` (4 KiB), at least 64."""
    return max(64, capacity_bytes // max(1, int(config.get("cache_min_sample_bytes"))))


class ShmCache(Reads, LoadThrough):
    """A named cache of byte samples in shared memory, shared by every process on the node.

    ``ShmCache(name, capacity_bytes)`` creates the cache or attaches to it; ``capacity_bytes=None``
    attaches to an existing cache only. ``capacity_bytes`` bounds the payload bytes stored (each
    entry also costs a 64-byte header). ``max_entries`` caps the number of entries (default
    ``capacity_bytes // cache_min_sample_bytes``; the index is sized for it). ``root`` defaults to
    the ``shm_root`` knob (``HPCSTAGGER_SHM_ROOT``, else ``/dev/shm/hpcstagger-<uid>``).

    ``get(key)`` returns a verified, read-only view of a sample or None; ``get_many(keys)`` does the
    same for a batch of keys in one call (see :mod:`hpcstagger.cache._reads`).

    Policies: ``"minio"`` (default) inserts while samples fit and then never changes the contents;
    ``"none"`` is pass-through. Keys are str or int, stored under a 128-bit hash. Stats are counted
    in shared memory and summed over every process using the cache.

    ShmCache objects can be pickled (they reattach by name) and survive fork. Raises CacheError for
    a bad name, an unsafe root or cache directory, an unknown cache (``capacity_bytes=None``), or an
    existing cache created with a different capacity, policy or max_entries.
    """

    def __init__(self, name: str, capacity_bytes: int | None, *, policy: str = "minio",
                 root: str | os.PathLike[str] | None = None, max_entries: int | None = None):
        self.name = _fs.validate_name(name)
        self.root = os.path.abspath(os.fspath(root) if root is not None else config.get("shm_root"))
        pol = get_policy(policy)
        create_max = 0
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
                raise CacheError(f"capacity_bytes must be a non-negative int, not {capacity_bytes!r}")
            if max_entries is not None and (isinstance(max_entries, bool) or not isinstance(max_entries, int)
                                            or max_entries < 1):
                raise CacheError(f"max_entries must be a positive int, not {max_entries!r}")
            create_max = max_entries or default_max_entries(capacity_bytes)
        # An existing cache is checked against an explicit max_entries only: the default derived
        # from the knob applies when the cache is created.
        self._led: Any = Ledger(self.root, self.name, capacity=capacity_bytes, policy_code=pol.code,
                                max_entries=create_max, check_max_entries=max_entries is not None,
                                stores=pol.stores)
        # Dropping the object detaches it (its process slot and file descriptors); views handed out
        # keep their own mappings.
        self._finalizer = weakref.finalize(self, _detach, self._led)
        w = self._led.w
        self.capacity_bytes = self._led.capacity
        self.max_entries = int(w[H_MAX_ENTRIES])
        self.policy: Policy = get_policy(int(w[H_POLICY]))
        self._stores = self.policy.stores
        self._guard: MemoryGuard | None = None  # made at the first insert, when the cache_memory_guard knob is on
        self._guard_said = False
        self._full_at = -1  # the bytes used when the policy last refused an insert for room (-1: never)

    # ---- pickling: reattach by name in the other process ----------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reattach, (self.name, self.root))

    def __repr__(self) -> str:
        return (f"ShmCache({self.name!r}, {self.capacity_bytes}, policy={self.policy.name!r}, "
                f"root={self.root!r})")

    # ---- counting ------------------------------------------------------------------------------

    def _count(self, field: int, n: int = 1, field2: int = -1, n2: int = 0) -> None:
        led = self._led
        with led.clock:
            b = led.base
            if b < 0:
                b = led.claim_slot()
            w = led.w
            w[b + field] += n
            if field2 >= 0:
                w[b + field2] += n2

    def count_read(self, nbytes: int, seconds: float) -> None:
        """Record one miss served from the source behind the cache: ``nbytes`` in ``seconds``.

        :class:`~hpcstagger.cache.dataset.CachedDataset` reports every miss it reads, timed from its
        lookup to its insert; the sums are in :meth:`stats` (``read_bytes``, ``read_seconds``), so a
        watcher sees the bandwidth the jobs get from the source and, over an interval, the mean
        number of misses in flight (read seconds per second).
        """
        self._count(S_READ_BYTES, max(0, int(nbytes)), S_READ_NS, max(0, int(seconds * 1e9)))

    # ---- source reads ----------------------------------------------------------------------------

    def read_through(self, key: str | int, read: Callable[[], Any], *,
                     insert: bool = True) -> tuple[Any, bool, bool]:
        """A miss of ``key``, read once on the node: ``(data, cached, read_here)``.

        Call it after ``get(key)`` missed. If no other process is reading the sample, this one claims
        it, calls ``read()`` and inserts the result (``cached``: :meth:`put`'s answer; ``read_here``
        True). If another process is reading it, this one waits for that insert and returns the
        cached view (``read_here`` False) without touching the source; it reads the sample itself
        when the other's insert was refused, the other process died, or after 30 s (see
        :mod:`hpcstagger.cache._claims`). Once this process has seen the policy refuse an insert for
        room, a full cache's misses are read here unclaimed until :meth:`clear` frees the room.
        Exceptions from ``read`` propagate, the claim released.
        ``insert=False``: ``read()`` inserts what it read itself (under ``key`` for the waiters to
        find it), and ``cached`` is False for a read here.
        """
        led = self._led
        if not self._stores or 0 <= self._full_at <= led.w[H_USED]:
            # full (the policy refuses inserts until clear() lowers the bytes used): a waiter would
            # only wait for a read whose insert is refused, then read the sample itself
            return super().read_through(key, read, insert=insert)
        d, hi, lo = key_digest(key)
        base = led.base if led.base >= 0 else led.claim_slot()
        for _ in range(8):  # a claim that ends without an entry lets the next waiter claim: a few turns at most
            how, i = _claims.claim(led, hi, lo, base, os.getpid())
            if how == _claims.NONE:
                break
            if how == _claims.OWN:
                try:
                    view = self._find(d)  # inserted between the caller's miss and the claim
                    if view is not None:
                        _claims.count_coalesced(led)
                        return view, True, False
                    return super().read_through(key, read, insert=insert)
                finally:
                    _claims.release(led, i, hi, lo)
            wait = _claims.Waiter()
            while _claims.state(led, i, hi, lo, wait.owner_check_due()) and not wait.expired():
                wait.pause()
                view = self._find(d)
                if view is not None:
                    break
            else:
                view = self._find(d)
            if view is not None:
                _claims.count_coalesced(led)
                return view, True, False
            if wait.expired():
                log.warning("cache %s: waited %.0f s for another process's read of a sample; reading it here",
                            self.name, _claims.WAIT_LIMIT)
                break
        return super().read_through(key, read, insert=insert)

    def read_counters(self) -> tuple[int, float]:
        """:meth:`stats`' ``read_bytes`` and ``read_seconds`` alone, cheap enough to poll often."""
        nbytes, ns = self._led.read_totals()
        return nbytes, ns / 1e9

    def reading(self) -> _flight.Reading:
        """Context manager around one read from the source behind the cache, so that the node's
        reads in flight are counted exactly (:meth:`flight_seconds`) while somebody watches
        (:meth:`watch`). :class:`CachedDataset` uses it."""
        return _flight.Reading(self._led)

    def watch(self, seconds: float) -> None:
        """Count the node's source reads in flight for at least the next ``seconds`` (every process
        of the cache). Counting costs each read two takes of the ledger's lock, so it is off until
        asked for; renew it while you poll :meth:`flight_seconds`."""
        _flight.watch(self._led, seconds)

    def flight_seconds(self) -> list[float]:
        """Seconds spent so far with 1, 2, ... (the last: that many or more) source reads in flight
        on the node, from the reads bracketed with :meth:`reading` while watched. Cheap enough to
        poll often."""
        return _flight.seconds(self._led)

    # ---- writing -------------------------------------------------------------------------------

    def put(self, key: str | int, data: Any) -> bool:
        """Store ``data`` (any bytes-like object) under ``key``.

        Returns True if the key is now cached (inserted, or already there), False if the policy
        refused it: the cache is full, the sample is larger than the capacity, the policy is
        ``"none"``, /dev/shm ran out of space (ENOSPC), or the memory would keep less than its
        reserve free (:class:`~hpcstagger.nodeload.MemoryGuard`, knob ``cache_memory_guard``).
        Raises CacheError on other I/O errors.
        """
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
            view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
        n = view.nbytes
        hi, lo = key_hash(key)
        led, w = self._led, self._led.w
        if not self._stores:
            self._count(S_REFUSED)
            return False
        if led.w[H_GEN] != led.gen:
            self.regions()
        if self._probe(hi, lo)[1] == LIVE:  # lock-free: already cached
            self._count(S_DUPLICATES)
            return True
        if n > self.capacity_bytes or self.policy.refuse_fast(int(w[H_USED]), self.capacity_bytes, n):
            if n <= self.capacity_bytes:
                self._full_at = int(w[H_USED])
            self._count(S_REFUSED)
            return False
        if self._guard is None and config.get("cache_memory_guard"):
            self._guard = MemoryGuard()
        if self._guard is not None and not self._guard.allows(n):
            if not self._guard_said:  # once per process: the memory can come back, and inserts with it
                self._guard_said = True
                log.info("cache %s: the memory left (%s MB) is below the reserve (%s MB) kept for the jobs; inserts "
                         "are refused while it is", self.name, (self._guard.free or 0) >> 20, self._guard.reserve >> 20)
            self._count(S_REFUSED)
            return False
        with led.put_lock:  # one reservation in flight per process
            b = led.base if led.base >= 0 else led.claim_slot()
            with led.lock():
                led.map_generation()
                _, state = self._probe(hi, lo)
                if state == LIVE:
                    outcome = "duplicate"
                else:
                    outcome = self._reserve(b, n)
            if outcome == "duplicate":
                self._count(S_DUPLICATES)
                return True
            if outcome != "reserved":
                self._count(S_REFUSED)
                return False
            off, gen = int(w[b + S_RES_OFF]), int(w[b + S_RES_GEN])
            header = ENTRY.pack(ENTRY_MAGIC, hi, lo, n, _checksum(view), gen).ljust(ENTRY_HDR, b"\0")
            try:
                self._write_entry(led.arena_fd, header, view, off)
            except OSError as exc:
                with led.lock():
                    led.drop_reservation(b, reuse=True)
                if exc.errno in _OUT_OF_SPACE:
                    log.info("cache %s: out of space in %s; insert refused", self.name, self.root)
                    self._count(S_REFUSED)
                    return False
                raise CacheError(f"cannot write to cache {led.path}: {exc.strerror}") from exc
            with led.lock():
                outcome = self._publish(b, hi, lo, n, off, gen)
        field = {"inserted": S_INSERTS, "duplicate": S_DUPLICATES}.get(outcome, S_REFUSED)
        self._count(field, 1, S_INSERT_BYTES, n if outcome == "inserted" else 0)
        return outcome != "refused"

    def _reserve(self, b: int, n: int) -> str:
        """Reserve payload and arena space for one entry in slot ``b`` (under the lock)."""
        led = self._led
        w = led.w
        for attempt in (0, 1):
            space = Space(self.capacity_bytes, int(w[H_USED]), int(w[H_RESERVED]), int(w[H_INDEX_USED]),
                          int(w[H_RESERVED_ENTRIES]), self.max_entries)
            if self.policy.admit(space, n):
                off = led.alloc(align(ENTRY_HDR + n))
                if off >= 0:
                    w[b + S_RES_OFF], w[b + S_RES_SIZE] = off, align(ENTRY_HDR + n)
                    w[b + S_RES_PAYLOAD], w[b + S_RES_GEN] = n, led.gen
                    w[H_RESERVED] += n
                    w[H_RESERVED_ENTRIES] += 1
                    return "reserved"
            if attempt or not (w[H_RESERVED] or w[H_RESERVED_ENTRIES]) or not led.reclaim_dead():
                return "refused"
        return "refused"

    def _write_entry(self, fd: int, header: bytes, view: memoryview, off: int) -> None:
        """Write one entry's header and payload at ``off`` (overridden by tests to inject faults)."""
        parts = [memoryview(header), view]
        while parts:
            done = os.pwritev(fd, parts, off)
            off += done
            while parts and done >= len(parts[0]):
                done -= len(parts[0])
                parts.pop(0)
            if parts and done:
                parts[0] = parts[0][done:]

    def _publish(self, b: int, hi: int, lo: int, n: int, off: int, gen: int) -> str:
        """Make a written entry visible (under the lock), or give its space back."""
        led = self._led
        w = led.w
        if gen != w[H_GEN]:  # cleared while we wrote: the region belongs to a dead generation
            led.drop_reservation(b, reuse=False)
            return "refused"
        led.map_generation()
        i, state = self._probe(hi, lo)
        if state == LIVE or i < 0:
            led.drop_reservation(b, reuse=True)
            return "duplicate" if state == LIVE else "refused"
        try:
            # offset and meta first, the key last: a lock-free reader that sees the key sees the rest
            os.pwrite(led.index_fd, SLOT.pack(0, 0, off, (LIVE << 56) | n)[16:], (i << 5) + 16)
            if state == 0:
                os.pwrite(led.index_fd, SLOT.pack(hi, lo, 0, 0)[:16], i << 5)
        except OSError as exc:
            led.drop_reservation(b, reuse=True)
            if exc.errno in _OUT_OF_SPACE:
                return "refused"
            raise CacheError(f"cannot write to cache {led.path}: {exc.strerror}") from exc
        w[H_RESERVED] -= min(int(w[H_RESERVED]), n)
        w[H_RESERVED_ENTRIES] -= min(int(w[H_RESERVED_ENTRIES]), 1)
        w[b + S_RES_OFF] = w[b + S_RES_SIZE] = w[b + S_RES_PAYLOAD] = w[b + S_RES_GEN] = 0
        w[H_USED] += n
        w[H_ENTRIES] += 1
        if state == 0:
            w[H_INDEX_USED] += 1
        return "inserted"

    # ---- management ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Node-wide statistics: counters summed over every process, occupancy, configuration.

        Keys: lookups (= hits + misses: every get() is exactly one of them), hits, misses, inserts,
        refused, duplicates (puts of keys already cached), corrupt, insert_bytes, read_bytes and
        read_seconds (source reads reported by :meth:`count_read`), coalesced (misses served by
        another process's read: :meth:`read_through`), hit_rate, bytes_used, entries,
        reserved_bytes, wasted_bytes, capacity_bytes, max_entries, processes (live attached),
        generation, name, policy, path.
        """
        led = self._led
        w = led.w
        out: dict[str, Any] = led.totals()
        out["read_seconds"] = out.pop("read_ns") / 1e9
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        out["coalesced"] = int(w[H_COALESCED])
        out.update(bytes_used=int(w[H_USED]), entries=int(w[H_ENTRIES]), reserved_bytes=int(w[H_RESERVED]),
                   wasted_bytes=int(w[H_WASTED]), arena_top=int(w[H_TOP]), capacity_bytes=self.capacity_bytes,
                   max_entries=self.max_entries, generation=int(w[H_GEN]), name=self.name,
                   policy=self.policy.name, path=led.path)
        return out

    def clear(self) -> None:
        """Remove every entry (counters are kept). Views handed out earlier stay valid."""
        with self._led.lock() as led:
            led.clear()

    def close(self) -> None:
        """Detach this process (its counters stay in the totals). The object is unusable afterwards."""
        if self._led is not _CLOSED:
            self._finalizer()
            self._led = _CLOSED

    def destroy(self, *, force: bool = False) -> None:
        """Delete the cache from /dev/shm. Raises CacheError if another live process is attached
        (unless ``force``); attached processes would otherwise keep stale files alive."""
        led = self._led
        with led.lock():
            led.release_slot_locked()
            others = len(led.live_pids() - {os.getpid()})
            if others and not force:
                raise CacheError(f"cache {self.name!r} is in use by {others} other live process(es); "
                                 f"stop them first, or clear() it instead")
            for entry in os.listdir(led.dir_fd):
                os.unlink(entry, dir_fd=led.dir_fd)
            root_fd = _fs.open_secure_dir(self.root, create=False, what="cache root")
            try:
                os.rmdir(self.name, dir_fd=root_fd)
            finally:
                os.close(root_fd)
        self.close()

    def __enter__(self) -> ShmCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Closed:
    """Stands in for the ledger of a closed cache: any use raises CacheError."""

    def __getattr__(self, name: str) -> Any:
        raise CacheError("this ShmCache was closed; open the cache again with ShmCache(name, ...)")


_CLOSED: Any = _Closed()


def _detach(led: Ledger) -> None:
    if led.dir_fd >= 0:
        try:
            led.release_slot()
        finally:
            led.close()


def _reattach(name: str, root: str) -> ShmCache:
    return ShmCache(name, None, root=root)
