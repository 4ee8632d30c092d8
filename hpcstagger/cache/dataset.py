"""``CachedDataset``: a torch map-style Dataset that reads its samples through a :class:`ShmCache`.

This module imports torch; :mod:`hpcstagger.cache` loads it only when ``CachedDataset`` is used.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Protocol
from collections.abc import Callable

import torch.utils.data

from hpcstagger.errors import ConfigError
from hpcstagger.cache.sources import SampleRecord, Source, record_of
from hpcstagger.cache.store import ShmCache

__all__ = ["CachedDataset", "SourceReadHook", "SampleMeter"]

log = logging.getLogger(__name__)
_refusal_logged = False  # once per process: see CachedDataset._refused


class SourceReadHook(Protocol):
    """Called around every read that goes to the source (a cache miss): ``enter()``, then ``exit()``.

    The checkpoint gate implements it so checkpoint writes stay out of the way of source reads.
    It must be picklable to reach DataLoader workers.
    """

    def enter(self) -> None: ...

    def exit(self) -> None: ...


class SampleMeter(Protocol):
    """Told the cost of every sample read (calibration mode; see :mod:`hpcstagger.colocated.jobmeter`).

    A hit is a lookup (``get_s``) and a transform; a miss is a lookup, the source's read
    (``read_s``, of which ``read_cpu_s`` the process's CPU time), the insert (``insert_s``) and a
    transform. It must be picklable to reach DataLoader workers.
    """

    def sample(self, hit: bool, nbytes: int, get_s: float, read_s: float, insert_s: float,
               transform_s: float, read_cpu_s: float = 0.0) -> None: ...


class CachedDataset(torch.utils.data.Dataset):
    """Sample ``i`` of ``source``, through ``cache`` under ``source.key(i)``, as ``transform(data)``.

    A hit returns the cached sample; a miss reads ``source[i]`` (between ``source_read_hook.enter()``
    and ``.exit()`` if a hook is given) and inserts it if the cache's policy allows. A miss of a
    sample that another process on the node is reading already (jobs with the same sample order, in
    step) waits for that read's insert instead of reading it again (``ShmCache.read_through``).
    ``transform`` receives a read-only bytes-like object (``bytes`` or a ``memoryview``); without a transform the
    dataset returns ``bytes``. Works with ``DataLoader(num_workers>0)`` under fork and spawn: the
    cache reattaches by name and the source reopens its files in each worker.

    ``meter`` (None by default) is told the cost of every sample; ``session.loader(loader)`` sets
    it in calibration mode (``hpcstagger calibrate --spec``), before the loader's workers start.

    ``with_index=True`` calls ``transform(data, i)``, and ``with_record=True`` calls
    ``transform(data, record)``, the record being the sample's
    :class:`~hpcstagger.cache.sources.SampleRecord` (its ``index``, ``path``, the file behind it,
    and cache ``key``), so a transform can derive a label without a wrapper class. Either needs a
    transform; the two exclude each other. Raises ConfigError otherwise.

    A DataLoader with a batch size calls :meth:`__getitems__` with a batch's indices: its lookups
    go to ``cache.get_many(keys)`` when the cache has it, in one call.
    """

    meter: SampleMeter | None = None

    def __init__(self, source: Source, cache: ShmCache, transform: Callable[..., Any] | None = None, *,
                 source_read_hook: SourceReadHook | None = None, with_index: bool = False, with_record: bool = False):
        if with_index and with_record:
            raise ConfigError("CachedDataset: with_index and with_record exclude each other (a transform takes "
                              "(data, i) or (data, record)); choose one")
        if (with_index or with_record) and transform is None:
            raise ConfigError(f"CachedDataset: {'with_index' if with_index else 'with_record'}=True needs a "
                              f"transform to hand it to")
        self.source = source
        self.cache = cache
        self.transform = transform
        self.source_read_hook = source_read_hook
        self.with_index = with_index
        self.with_record = with_record

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        if self.meter is not None:
            return self._measured(i, self.meter)
        key = self.source.key(i)
        t = time.perf_counter()
        data: Any = self.cache.get(key)
        if data is None:
            data = self._miss(i, key, t)
        return self._finish(data, i)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """``[self[i] for i in indices]``, with the batch's lookups in one ``cache.get_many(keys)``
        where the cache has it (else one ``get`` each); misses read the source one by one and are
        inserted, as in ``__getitem__``. With a meter set, item by item."""
        meter = self.meter
        if meter is not None:
            return [self._measured(i, meter) for i in indices]
        keys = [self.source.key(i) for i in indices]
        get_many = getattr(self.cache, "get_many", None)
        found: list[Any] = list(get_many(keys)) if get_many is not None else [self.cache.get(k) for k in keys]
        if len(found) != len(keys):
            raise TypeError(f"{type(self.cache).__name__}.get_many returned {len(found)} results for {len(keys)} "
                            f"keys; it must return one (a view or None) per key")
        out = []
        for i, key, data in zip(indices, keys, found, strict=True):
            if data is None:
                data = self._miss(i, key, time.perf_counter())
            out.append(self._finish(data, i))
        return out

    def _miss(self, i: int, key: str | int, t: float) -> Any:
        """Sample ``i`` after its lookup (begun at ``t``, ``time.perf_counter``) missed: read from the
        source and inserted, or, where another process is reading it already, that read's entry
        (``cache.read_through``: one read for the node). A read here is counted
        (:meth:`_count_miss`); a wait for another's read is not, as it took nothing from the source."""
        through = getattr(self.cache, "read_through", None)
        if through is None:
            data = self._read(i)
            stored, here = self.cache.put(key, data), True
        else:
            data, stored, here = through(key, lambda: self._read(i))
        if here:
            if not stored:
                self._refused()
            self._count_miss(data, time.perf_counter() - t)
        return data

    def _refused(self) -> None:
        """Log once per process that the cache refuses inserts while it stores: the samples it does
        not hold are read from the source every time (by design when the dataset is larger than the
        cache; a sign of a cache full of other data when it is not)."""
        global _refusal_logged
        if _refusal_logged or not getattr(getattr(self.cache, "policy", None), "stores", False):
            return
        _refusal_logged = True
        name = getattr(self.cache, "name", "?")
        log.info("cache %s refused an insert (full, or /dev/shm is): samples it does not hold are read from the "
                 "source each time; if it holds other data, `hpcstagger cache clear %s` empties it", name, name)

    def _count_miss(self, data: Any, seconds: float) -> None:
        """Report a miss to the cache's counters (:meth:`ShmCache.count_read`): its bytes, and the
        seconds from the lookup to the insert (what a miss costs the loader)."""
        try:
            n = memoryview(data).nbytes
        except TypeError:
            n = 0
        self.cache.count_read(n, seconds)

    def _read(self, i: int) -> Any:
        """Sample ``i`` from the source (a miss), inside the read hook if there is one, and counted
        in flight by the cache when it counts (:meth:`ShmCache.reading`)."""
        reading = getattr(self.cache, "reading", None)
        with reading() if reading is not None else contextlib.nullcontext():
            hook = self.source_read_hook
            if hook is None:
                return self.source[i]
            hook.enter()
            try:
                return self.source[i]
            finally:
                hook.exit()

    def _finish(self, data: Any, i: int) -> Any:
        transform = self.transform
        if transform is None:
            return data if isinstance(data, bytes) else bytes(data)
        if self.with_index:
            return transform(data, i)
        if self.with_record:
            return transform(data, self._record(i))
        return transform(data)

    def _record(self, i: int) -> SampleRecord:
        """What ``with_record`` hands the transform (:func:`~hpcstagger.cache.sources.record_of`)."""
        return record_of(self.source, i)

    def _measured(self, i: int, meter: SampleMeter) -> Any:
        """``self[i]``, each part timed into ``meter``."""
        t0 = time.perf_counter()
        key = self.source.key(i)
        data: Any = self.cache.get(key)
        t1 = time.perf_counter()
        hit = data is not None
        read_s = insert_s = read_cpu_s = 0.0
        if not hit:
            c1 = time.process_time()
            data = self._read(i)
            read_cpu_s = time.process_time() - c1
            t2 = time.perf_counter()
            if not self.cache.put(key, data):
                self._refused()
            t3 = time.perf_counter()
            read_s, insert_s = t2 - t1, t3 - t2
            self._count_miss(data, t3 - t0)
        t4 = time.perf_counter()
        out = self._finish(data, i)
        meter.sample(hit, len(data), t1 - t0, read_s, insert_s, time.perf_counter() - t4, read_cpu_s)
        return out

    def __repr__(self) -> str:
        return f"CachedDataset({self.source!r}, {self.cache!r})"
