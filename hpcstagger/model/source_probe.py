"""Measuring the shared source for calibration: its aggregate bandwidth with 1, 2, ... k concurrent
readers, a cache's hit bandwidth, and whether the node's page cache can hold the whole dataset.

What is measured is the source, not the page cache or a library's own cache:

- **Fresh samples, or pages dropped.** A level whose readers fill a cache, or whose source is not
  files, reads samples no reader has read before (:class:`SamplePool`): its own slice of a random
  permutation of the samples not read yet, split into disjoint subsets, one per reader. A reader
  stops when its subset is done, and the level's window closes when the first reader stops. Only
  when the dataset is too small for that are samples read again, and the measurements say so
  (``fresh: false``). A level of a file source whose share of fresh samples would be small reads
  the dataset again instead (a bounded number of samples), its pages dropped first: it comes from
  the source all the same, and the window is as long as the time allows, not as long as a small
  share of fresh samples lasts.
- **Dropped pages.** For file sources (:class:`~hpcstagger.cache.HDF5Source`,
  :class:`~hpcstagger.cache.DirectorySource`, also under a
  :class:`~hpcstagger.cache.ThrottledSource`) the files' pages are dropped from the page cache with
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each level (:func:`drop_pages`).

The page-cache rule (:func:`page_cache_holds`): a file source that is not an emulated
ThrottledSource, whose dataset takes less than half of the memory available here (the node's
``MemAvailable``, or the room its memory cgroup leaves, the smaller: :func:`mem_available`), stays in
the page cache once read; the node then has a transparent shared cache holding the whole dataset.
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import random
import shutil
import tempfile
import time
from typing import Any
from collections.abc import Callable, Sequence

from hpcstagger.errors import ConfigError, ModelError
from hpcstagger.cache.sources import DirectorySource, HDF5Source
from hpcstagger.cache.throttle import ThrottledSource
from hpcstagger._io import drop_cached_pages
from hpcstagger.nodeload import memory_free
from hpcstagger.model.source_levels import (MIN_WINDOW_S, SHORT_SHARE, SPREAD_LIMIT, combine_levels, disagreeing,
                                           trusted_bandwidth, weighted_median)

__all__ = ["SamplePool", "trusted_bandwidth", "measure_readers", "hit_bandwidth", "reread_bandwidth", "preload",
           "source_files", "drop_pages", "parse_meminfo", "mem_available", "page_cache_holds", "PAGE_CACHE_SHARE",
           "MAX_READERS", "REREAD_BELOW", "REREAD_MOST", "SPREAD_LIMIT", "SHORT_SHARE", "MIN_WINDOW_S",
           "weighted_median", "combine_levels", "disagreeing"]

PAGE_CACHE_SHARE = 0.5   # a dataset below this share of the available memory stays in the page cache
MAX_READERS = 16         # most concurrent readers a calibration measures (the last level holds beyond)
REREAD_BELOW = 4096      # a level whose share of fresh samples is smaller reads samples again (pages dropped)
REREAD_MOST = 32768      # ... at most this many (each reader's list is sent to it; each file's pages dropped)


class SamplePool:
    """Sample indices of ``n`` that no reader has read yet, in a random order (``exclude`` counts as read).

    :meth:`take` hands out disjoint subsets; :attr:`fresh` turns False once samples had to be read
    again because the fresh ones ran out. With ``in_order`` each reader gets a contiguous run of
    indices instead, read in file order: what the kernel reads ahead is then read, not wasted, as
    it is over a job's whole pass of a file that the page cache keeps.
    """

    def __init__(self, n: int, seed: int = 0, exclude: Sequence[int] = (), in_order: bool = False):
        self.n = n
        self.in_order = in_order
        order = list(range(n))
        if not in_order:
            random.Random(seed).shuffle(order)
        skip = set(exclude)
        self._left = [i for i in order if i not in skip]
        self._rng = random.Random(seed + 1)
        self.fresh = True

    @property
    def left(self) -> int:
        """How many samples no reader has read yet."""
        return len(self._left)

    def take(self, readers: int, levels_left: int = 1, least: int = 4) -> list[list[int]]:
        """``readers`` disjoint subsets for one level: its share (1 / ``levels_left``) of the fresh
        samples, or, when that gives a reader fewer than ``least``, a fresh permutation of all of
        them (samples read again: :attr:`fresh` becomes False)."""
        count = len(self._left) // max(1, levels_left)
        if count >= least * readers:
            chosen, self._left = self._left[:count], self._left[count:]
        else:
            chosen = list(range(self.n))
            if not self.in_order:
                self._rng.shuffle(chosen)
            self.fresh = False
        return self._split(chosen, readers)

    def again(self, readers: int, most: int | None = None) -> list[list[int]]:
        """``readers`` disjoint subsets of all ``n`` samples, read or not (at most ``most`` of them:
        a run from a random start in order, else a random choice), without using up the fresh
        ones: for a level whose files' pages are dropped first, so that what was read before comes
        from the source again (:func:`measure_levels`)."""
        rng = random.Random(self._rng.random())
        count = self.n if most is None else min(self.n, most)
        if self.in_order:
            start = rng.randrange(self.n - count + 1)
            chosen = list(range(start, start + count))
        else:
            chosen = rng.sample(range(self.n), count)
        return self._split(chosen, readers)

    def _split(self, chosen: list[int], readers: int) -> list[list[int]]:
        if self.in_order:
            return [chosen[r * len(chosen) // readers:(r + 1) * len(chosen) // readers] for r in range(readers)]
        return [chosen[r::readers] for r in range(readers)]


def _reader(source: Any, indices: list[int], barrier: Any, duration: float, queue: Any, cache: Any,
            started: Any) -> None:
    """Child process: read ``indices`` in order until ``duration`` seconds after the LAST reader
    started (``started``: a shared [count, latest start] pair), or until they run out.

    Every reader's window ends at the same instant, counted from the last start: readers pass the
    barrier together but, with more readers than free cores, one may first run long after another
    (whose own window would then be over before it read anything). The first index is read before
    the barrier (files opened, connections made) and not measured. With ``cache``, every sample
    read is put into it (outside the timed read).
    """
    try:
        first = source[indices[0]]
        if cache is not None:
            cache.put(source.key(indices[0]), first)
        barrier.wait(timeout=120)
        start = time.monotonic()
        with started.get_lock():
            started[0] += 1
            started[1] = max(started[1], start)
        k = barrier.parties
        records = []
        exhausted = True
        for i in indices[1:]:
            t0 = time.monotonic()
            if started[0] >= k and t0 >= started[1] + duration:
                exhausted = False
                break
            data = source[i]
            t1 = time.monotonic()
            records.append((t0, t1, len(data)))
            if cache is not None:
                cache.put(source.key(i), data)
        end = started[1] + duration if started[0] >= k else math.inf
        # a reader that ran out of samples stopped reading at its last read's end
        stop = records[-1][1] if exhausted and records else end
        queue.put(("ok", (start, min(stop, end)), records))
    except BaseException as exc:  # reported to the parent
        try:
            barrier.abort()
        except Exception:
            pass
        queue.put(("error", f"{type(exc).__name__}: {exc}", []))


def aggregate(results: list[tuple[tuple[float, float], list[tuple[float, float, int]]]]) -> tuple[float, float]:
    """Bytes/s of all readers inside the window where every reader was reading, and its length.

    Each result is ``((start, stop), [(t0, t1, bytes), ...])``; reads that straddle the window's
    edges count in proportion to their overlap. Raises ModelError when a reader ran out of samples
    before the last one started (the one way left for the windows not to overlap).
    """
    lo = max(span[0] for span, _ in results)
    hi = min(span[1] for span, _ in results)
    if hi <= lo:
        first = min(span[0] for span, _ in results)
        short = min(results, key=lambda r: r[0][1])
        raise ModelError(f"a calibration reader read all of its {len(short[1]) + 1} samples in "
                         f"{short[0][1] - short[0][0]:.3f} s, before the last of the {len(results)} readers "
                         f"started ({lo - first:.3f} s after the first): too few fresh samples per reader; "
                         "give calibrate a larger dataset or fewer readers (--readers)")
    total = 0.0
    for _, records in results:
        for t0, t1, nbytes in records:
            if t1 <= lo or t0 >= hi:
                continue
            if t1 > t0:
                total += nbytes * (min(t1, hi) - max(t0, lo)) / (t1 - t0)
    return total / (hi - lo), hi - lo


def _start(procs: list[Any]) -> None:
    try:
        for p in procs:
            p.start()
    except Exception as exc:
        for p in procs:
            if p.pid is not None:
                p.terminate()
                p.join(timeout=5)
        raise ConfigError(f"the source cannot be sent to a reader process ({type(exc).__name__}: {exc}); "
                          "a source must be picklable: define its class at module level") from exc


def _collect(procs: list[Any], queue: Any, k: int, limit: float) -> tuple[list[Any], list[str]]:
    """The readers' results, or the errors that stopped them; every reader is joined or ended."""
    results: list[Any] = []
    errors: list[str] = []
    try:
        deadline = time.monotonic() + limit
        while len(results) + len(errors) < k:
            try:
                status, a, b = queue.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode is not None and p.exitcode != 0]
                if dead:  # a reader died without reporting (it could not even start)
                    errors.append(f"a reader process exited with status {dead[0].exitcode} before reporting")
                    break
                if time.monotonic() > deadline:
                    errors.append(f"no answer from a reader within {limit:.0f} s")
                    break
                continue
            if status == "ok":
                results.append((a, b))
            else:
                errors.append(a)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return results, errors


def measure_readers(source: Any, subsets: list[list[int]], duration: float, ctx: Any, *,
                    cache: Any = None) -> dict[str, Any]:
    """The source's aggregate bytes/s with ``len(subsets)`` concurrent reader processes (context
    ``ctx``), each reading its own subset for at most ``duration`` seconds; with ``cache`` the
    readers put what they read into it. Raises ConfigError for a source that cannot reach a
    process and ModelError when a reader fails. With 2 or more readers whose windows never
    overlapped (one read all of its samples before the last started) the level comes back with no
    window (``window_s`` 0, ``short`` saying why): not trusted (:func:`combine_levels`)."""
    k = len(subsets)
    if any(len(s) < 2 for s in subsets):
        raise ModelError(f"too few samples for {k} concurrent readers; give calibrate a larger dataset")
    barrier = ctx.Barrier(k)
    queue = ctx.Queue()
    started = ctx.Array("d", [0.0, 0.0])  # readers started, the latest start (monotonic: one clock per node)
    procs = [ctx.Process(target=_reader, args=(source, subsets[r], barrier, duration, queue, cache, started),
                         daemon=True) for r in range(k)]
    t0 = time.monotonic()
    _start(procs)
    results, errors = _collect(procs, queue, k, duration + 120)
    if errors:
        raise ModelError(f"reading the source with {k} concurrent reader(s) failed: {errors[0]}; "
                         "check that the source is picklable and readable from a fresh process")
    reads = sum(len(r) for _, r in results)
    try:
        bw, window = aggregate(results)
    except ModelError as exc:
        if k < 2:
            raise
        # a reader ran out before the last one started (few fresh samples, or pages still cached):
        # the level is kept as measured over no window, which is not trusted, and the level before holds
        return {"readers": k, "bandwidth": 0.0, "window_s": 0.0, "elapsed_s": time.monotonic() - t0,
                "reads": reads, "short": str(exc)}
    return {"readers": k, "bandwidth": bw, "window_s": window, "elapsed_s": time.monotonic() - t0, "reads": reads}


def preload(source: Any, n: int, count: int, seconds: float, seed: int) -> tuple[list[int], list[tuple[str, bytes]]]:
    """Random samples read into memory for about ``seconds`` (at most ``count``, at least one):
    (their indices, their (key, bytes)). Raises ModelError when a read fails and ConfigError when
    the source does not return bytes."""
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    idx = list(range(n))
    rng.shuffle(idx)
    read: list[int] = []
    held: list[tuple[str, bytes]] = []
    for i in idx[:max(1, count)]:
        try:
            data = source[i]
        except Exception as exc:
            raise ModelError(f"reading sample {i} from the source failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ConfigError(f"source[{i}] returned {type(data).__name__}; a source returns the sample's bytes")
        key = source.key(i) if hasattr(source, "key") else str(i)
        read.append(i)
        held.append((str(key), bytes(data)))
        if time.monotonic() > deadline and len(held) >= min(count, 16):
            break
    return read, held


def hit_bandwidth(samples: list[tuple[str, bytes]], cache: Any, seconds: float) -> dict[str, Any]:
    """Per-reader bytes/s of cache hits: through ``cache`` (put/get) or files in /dev/shm."""
    nbytes, t_used = 0, 0.0
    tmp = None
    try:
        if cache is not None:
            for key, data in samples:
                cache.put(key, data)
            how = f"{type(cache).__name__}.get"

            def read(i: int) -> int:
                got = cache.get(samples[i][0])
                if got is None:
                    raise ModelError(f"the cache lost key {samples[i][0]!r} just put; give calibrate a cache "
                                     "with room for a few samples")
                return len(got)
        else:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else None
            tmp = tempfile.mkdtemp(prefix="hpcstagger-calibrate-", dir=root)
            paths = []
            for i, (_, data) in enumerate(samples):
                path = os.path.join(tmp, f"s{i}")
                with open(path, "wb") as f:
                    f.write(data)
                paths.append(path)
            how = f"files in {root or tempfile.gettempdir()}"

            def read(i: int) -> int:
                with open(paths[i], "rb") as f:
                    return len(f.read())
        nbytes, t_used, reads = _timed_reads(read, len(samples), seconds)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"hit_bandwidth": nbytes / t_used if t_used > 0 else math.inf, "reads": reads, "how": how}


def _timed_reads(read: Any, count: int, seconds: float) -> tuple[int, float, int]:
    """Call ``read(i % count)`` for ``seconds`` (at least ``count`` times): (bytes, seconds, calls)."""
    nbytes, i = 0, 0
    start = time.perf_counter()
    while True:
        nbytes += read(i % count)
        i += 1
        t_used = time.perf_counter() - start
        if t_used >= seconds and i >= count:
            return nbytes, t_used, i


def reread_bandwidth(source: Any, indices: list[int], seconds: float) -> dict[str, Any]:
    """Per-reader bytes/s of reading ``indices`` again through ``source`` (pages already in the
    page cache): what a hit of the page cache costs a reader."""
    def read(i: int) -> int:
        return len(source[indices[i]])

    nbytes, t_used, reads = _timed_reads(read, len(indices), seconds)
    return {"hit_bandwidth": nbytes / t_used if t_used > 0 else math.inf, "reads": reads,
            "how": f"{type(source).__name__} reads of samples in the page cache"}


# ---------------------------------------------------------------------------- files and the page cache


def source_files(source: Any) -> tuple[str, bool, Any]:
    """(kind, emulated, file source): kind is "hdf5", "directory" or "other"; emulated is True under
    a ThrottledSource, whose pacing, not the files, sets the read time."""
    emulated = isinstance(source, ThrottledSource)
    inner = source.source if emulated else source
    if isinstance(inner, HDF5Source):
        return "hdf5", emulated, inner
    if isinstance(inner, DirectorySource):
        return "directory", emulated, inner
    return "other", emulated, inner


def _drop(path: str) -> bool:
    try:
        drop_cached_pages(path)
        return True
    except OSError:
        return False


def drop_pages(source: Any, indices: Sequence[int] | None = None) -> int:
    """Drop the page-cache pages of ``source``'s files (an HDF5 file whole; a directory's files of
    ``indices``, default all) with ``posix_fadvise(DONTNEED)``; return how many files were advised
    (0 for a source that is not a file source)."""
    kind, _, inner = source_files(source)
    if not hasattr(os, "posix_fadvise"):
        return 0
    if kind == "hdf5":
        return int(_drop(inner.path))
    if kind == "directory":
        chosen = range(len(inner)) if indices is None else indices
        return sum(_drop(inner.path(i)) for i in chosen)
    return 0


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` text as {field: bytes} (the ``kB`` values times 1024)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        words = rest.split()
        if not sep or not words:
            continue
        try:
            value = int(words[0])
        except ValueError:
            continue
        out[name.strip()] = value * 1024 if len(words) > 1 and words[1].lower() == "kb" else value
    return out


def mem_available(path: str = "/proc/meminfo") -> int | None:
    """The memory this process can still fill (:func:`hpcstagger.nodeload.memory_free`)."""
    return memory_free(path)


def page_cache_holds(dataset_bytes: float, available: int | None, *, file_source: bool, emulated: bool) -> bool:
    """True when the node's page cache keeps the whole dataset once read: a file source, not an
    emulated one (ThrottledSource), taking less than ``PAGE_CACHE_SHARE`` (half) of ``available``
    (:func:`mem_available`, bytes; None: unknown, so False)."""
    if not file_source or emulated or available is None:
        return False
    return dataset_bytes < PAGE_CACHE_SHARE * available


def measure_levels(source: Any, pool: SamplePool, levels: Sequence[int], seconds: float, ctx: Any, bar: Any, *,
                   later_levels: int = 0, cache: Any = None, longest: float = math.inf,
                   on_level: Callable[[dict[str, Any]], None] | None = None,
                   overhead: float = 0.0) -> list[dict[str, Any]]:
    """The source's aggregate bandwidth at each reader count of ``levels``, in turn, sharing ``seconds``
    (at most ``longest`` seconds each). A level takes its window and its readers' start-up: ``overhead``
    is that start-up as levels measured before showed it, until a level of this call measures it.

    Before each level the files' pages are dropped (:func:`drop_pages`). Its readers read fresh
    samples from ``pool`` (which keeps a share for ``later_levels`` levels measured afterwards),
    except when the level's share would be under :data:`REREAD_BELOW` samples, no ``cache`` is
    being filled (the readers put what they read into it) and the source's pages can be dropped.
    Then they read the dataset again (:meth:`SamplePool.again`, at most :data:`REREAD_MOST`
    samples): with the pages dropped it comes from the source, and the level's window is not cut
    short by a small share of fresh samples (on a small dataset a share can be read in a tenth of
    a second, shorter than a kernel throttle's bursts). Each level's entry says what it did, and
    is handed to ``on_level`` as soon as it is measured (to be kept).
    """
    deadline = time.monotonic() + seconds
    out: list[dict[str, Any]] = []
    droppable = source_files(source)[0] != "other" and hasattr(os, "posix_fadvise")
    for pos, k in enumerate(levels):
        left = len(levels) - pos
        reread = cache is None and droppable and pool.left // (left + later_levels) < REREAD_BELOW
        subsets = pool.again(k, REREAD_MOST) if reread else pool.take(k, left + later_levels)
        dropped = drop_pages(source, [i for s in subsets for i in s])
        if reread:
            how = "the dataset read again"
        else:
            how = "fresh samples" if pool.fresh else "samples read again (the dataset is too small)"
        if dropped:
            how += ", page cache dropped"
        bar.set_postfix_str(f"source with {k} reader(s): {how}")
        window = min(longest, max(0.2, (deadline - time.monotonic()) / left - overhead))
        m = measure_readers(source, subsets, window, ctx, cache=cache)
        overhead = max(0.0, m["elapsed_s"] - window)  # process start-up, learnt from the last level
        m.update(fresh=pool.fresh and not reread, dropped_files=dropped, how=how)
        out.append(m)
        if on_level is not None:
            on_level(m)
        bar.update(1)
    return out
