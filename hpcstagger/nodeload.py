"""How busy this node is before a measurement: the cores usable here, what other work takes, and
the memory this process's cgroup lets it use.

Timings taken on a node where other processes hold the cores (a login node, a shared node, a
leftover job) are slower than the same jobs alone, and a plan calibrated or judged from them is off.
:func:`sample` measures the node for a short window from ``/proc`` (no dependency), and
:func:`busy_warning` says, with the figures, when other work takes a noticeable share of the cores.

:func:`memory_limit` reads the memory cgroup this process lives in (cgroup v1 or v2, the tightest
limit on its path), as Slurm's ``task/cgroup`` plugin sets one for every job: the page cache and
``/dev/shm`` pages are charged to it, so a job's page cache can hold far less than the node's
``MemAvailable`` says. :func:`memory_total` is that limit, or the node's RAM without one.

:func:`memory_free` is what this process can still fill now: the node's ``MemAvailable``, or
the room its memory cgroup leaves, the smaller. :class:`MemoryGuard` says whether a /dev/shm
cache may take more bytes and still leave :func:`memory_reserve` free, so that filling the cache
never pushes the jobs beside it into the kernel's out-of-memory killer.

:class:`PeakMemory` follows a process tree (a command and every process it starts: MPI ranks,
DataLoader workers) and keeps the peaks of their anonymous memory (what a job holds that the kernel cannot drop) and
of their mapped file pages (its libraries'), each page counted once however many processes share
it (the sums of ``Pss_Anon`` and ``Pss_File``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from hpcstagger.errors import HpcstaggerError

__all__ = ["NodeLoad", "MemoryLimit", "memory_limit", "memory_total", "memory_free", "memory_reserve", "MemoryGuard",
           "usable_cores", "sample", "busy_warning", "tree_memory", "PeakMemory", "RESERVE_SHARE", "RESERVE_MIN",
           "process_started"]

log = logging.getLogger(__name__)

RESERVE_SHARE = 0.05     # of the memory, kept free beside a /dev/shm cache (launcher, coordinator, MPI, libraries)
RESERVE_MIN = 96 << 20   # bytes, the least of that reserve

# Other processes' CPU use, in cores, above which a measurement is flagged (a quarter of a core, or
# a tenth of the usable cores on a large node).
_BUSY_CORES = 0.25
_BUSY_SHARE = 0.10


def process_started(most: float = 60.0) -> float:
    """The ``time.monotonic()`` at which this process started (its interpreter and imports took the
    time since), from ``/proc/self/stat``; at most ``most`` seconds ago, and now where /proc cannot say.
    A command with a time budget counts it from here, so that the whole command keeps it."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime", encoding="ascii") as f:
            age = float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - min(max(age, 0.0), most)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class NodeLoad:
    """One look at the node: ``others_cores`` is the CPU time other processes used per second of
    the window (in cores; None where /proc/stat cannot be read), ``load1`` the 1-minute load average,
    ``cores`` the cores usable here and ``window_s`` the window's length."""

    cores: int
    others_cores: float | None
    load1: float | None
    window_s: float

    @property
    def busy(self) -> bool:
        """Whether other work takes a noticeable share of the usable cores."""
        if self.others_cores is None:
            return self.load1 is not None and self.load1 > self.cores
        return self.others_cores > max(_BUSY_CORES, _BUSY_SHARE * self.cores)


def _node_busy_ticks() -> int | None:
    """All CPUs' busy time since boot, in clock ticks (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 8 or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)


def _load1() -> float | None:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def sample(window_s: float = 0.5) -> NodeLoad:
    """Measure the node for ``window_s`` seconds: other processes' CPU use (the whole node's busy
    time less this process's own), the load average and the usable cores. Never raises."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    t0, own0, busy0 = time.monotonic(), time.process_time(), _node_busy_ticks()
    time.sleep(max(0.0, window_s))
    t1, own1, busy1 = time.monotonic(), time.process_time(), _node_busy_ticks()
    others = None
    if busy0 is not None and busy1 is not None and t1 > t0:
        node_s = (busy1 - busy0) / hz
        others = max(0.0, (node_s - (own1 - own0)) / (t1 - t0))
    return NodeLoad(cores=usable_cores(), others_cores=others, load1=_load1(), window_s=t1 - t0)


def busy_warning(load: NodeLoad, what: str) -> str | None:
    """One line saying that ``what`` (e.g. "calibration") runs on a busy node, with the figures, or
    None when the node is quiet enough."""
    if not load.busy:
        return None
    parts = []
    if load.others_cores is not None:
        parts.append(f"other processes used {load.others_cores:.2f} of {load.cores} usable cores "
                     f"over {load.window_s:.1f} s")
    if load.load1 is not None:
        parts.append(f"load average {load.load1:.2f}")
    return (f"the node is busy ({'; '.join(parts)}): {what} measures slower jobs than the same jobs "
            f"on a quiet node; stop the other work or expect its figures to be off")


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory cgroup limit on this process's path: ``limit``, what the group holds now
    (``usage``, page cache and /dev/shm included) and of that the file pages the kernel can drop
    (``file``), all bytes; ``path`` the group's directory."""

    limit: int
    usage: int
    file: int
    path: str

    @property
    def available(self) -> int:
        """What the group can still take in: its limit less what it holds beyond droppable file pages."""
        return max(0, self.limit - max(0, self.usage - self.file))


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text) if text.isdigit() else None


def _stat_file_bytes(path: str, keys: tuple[str, ...]) -> int:
    try:
        with open(path, encoding="ascii") as f:
            fields = dict(line.split(None, 1) for line in f if " " in line)
    except OSError:
        return 0
    return sum(int(fields.get(k, "0")) for k in keys)


def memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> MemoryLimit | None:
    """The tightest memory limit among this process's cgroup and its ancestors (see
    :class:`MemoryLimit`), or None: no limit, or none that can be read. Never raises."""
    try:
        with open(proc_cgroup, encoding="ascii") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    v1 = next((p for _, ctl, p in lines if "memory" in ctl.split(",")), None)
    if v1 is not None:
        base, limit_f, usage_f, stat_f = os.path.join(root, "memory"), "memory.limit_in_bytes", \
            "memory.usage_in_bytes", ("memory.stat", ("total_active_file", "total_inactive_file"))
        rel = v1
    else:
        v2 = next((p for h, ctl, p in lines if h == "0" and ctl == ""), None)
        if v2 is None:
            return None
        rel = v2
        base, limit_f, usage_f, stat_f = root, "memory.max", "memory.current", \
            ("memory.stat", ("active_file", "inactive_file"))
    best: MemoryLimit | None = None
    parts = [p for p in rel.split("/") if p and p != ".."]
    total = _mem_total()
    for depth in range(len(parts), -1, -1):
        path = os.path.join(base, *parts[:depth])
        limit, usage = _read_int(os.path.join(path, limit_f)), _read_int(os.path.join(path, usage_f))
        if limit is None or usage is None or (total is not None and limit >= total):
            continue  # no limit here (v1 writes a huge number for none)
        got = MemoryLimit(limit, usage, _stat_file_bytes(os.path.join(path, stat_f[0]), stat_f[1]), path)
        if best is None or got.available < best.available:
            best = got
    return best


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_total() -> int | None:
    """All the memory this process's processes may hold: its memory cgroup's limit
    (:func:`memory_limit`), or the node's ``MemTotal`` without one; None when neither can be read."""
    group = memory_limit()
    return group.limit if group is not None else _mem_total()


def _parent_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
        return int(text[text.rindex(")") + 2:].split()[1])  # state, ppid
    except (OSError, ValueError, IndexError):
        return None


def _pss(pid: str) -> tuple[int, int]:
    """A process's share of its anonymous pages (``Pss_Anon``, else its ``Pss`` less file and shmem
    pages) and of its mapped file pages (``Pss_File``), bytes; 0s when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii", errors="replace") as f:
            pairs = (line.partition(":") for line in f)
            fields = {k: int(v.split()[0]) for k, _, v in pairs if v.strip()[:1].isdigit()}
    except (OSError, ValueError):
        return 0, 0
    file = fields.get("Pss_File", 0)
    anon = fields.get("Pss_Anon", max(0, fields.get("Pss", 0) - file - fields.get("Pss_Shmem", 0)))
    return anon * 1024, file * 1024


def _program(pid: str) -> tuple[str, bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.readlink(f"/proc/{pid}/exe"), f.read()
    except OSError:
        return "", b""


def _is_worker(me: tuple[str, bytes], parent: tuple[str, bytes]) -> bool:
    """A DataLoader (multiprocessing) worker of ``parent``: the same program, forked with its
    command line, or started by multiprocessing's spawn or forkserver."""
    return bool(me[0]) and me[0] == parent[0] and (me[1] == parent[1] or b"multiprocessing" in me[1])


def _tree(root: int, children: Mapping[int, list[str]]) -> list[tuple[str, bool]]:
    """The pids of ``root`` and all its descendants, each with whether it is a worker (a
    multiprocessing child of a process of the same program: a DataLoader worker)."""
    out: list[tuple[str, bool]] = []
    todo: list[tuple[str, tuple[str, bytes]]] = [(str(root), ("", b""))]
    while todo:
        pid, parent = todo.pop()
        me = _program(pid)
        out.append((pid, _is_worker(me, parent)))
        todo.extend((c, me) for c in children.get(int(pid), ()))
    return out


def _children() -> dict[int, list[str]]:
    children: dict[int, list[str]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            children.setdefault(_parent_of(pid) or 0, []).append(pid)
    return children


def tree_memory(root: int) -> tuple[int, int, int]:
    """What process ``root`` and all its descendants hold (MPI launchers put their ranks in sessions
    of their own), bytes, each shared page counted once: the anonymous memory of all of them, of
    the workers among them (multiprocessing children of a process of the same program: DataLoader
    workers), and their mapped file pages (their libraries)."""
    return _held(_tree(root, _children()))


def _held(tree: Iterable[tuple[str, bool]]) -> tuple[int, int, int]:
    """What the processes of ``tree`` (:func:`_tree`) hold: anonymous, of the workers, mapped files."""
    anon = workers = file = 0
    for pid, worker in tree:
        a, f = _pss(pid)
        anon, file = anon + a, file + f
        workers += a if worker else 0
    return anon, workers, file


class PeakMemory:
    """The peaks of :func:`tree_memory` of one process tree, sampled every ``every`` seconds by a
    daemon thread between :meth:`start` and :meth:`stop`: ``peak`` (anonymous), ``workers_peak``
    (the DataLoader workers' anonymous memory) and ``file_peak`` (mapped files), bytes, 0 until a
    sample.

    ``adopted`` names the processes the tree started that left it: given the tree's pids, the
    roots of other trees that belong to it (a shared loader's producer, which a consumer starts
    detached, in a session of its own under init). Their anonymous memory counts in ``peak`` and
    apart in ``adopted_peak``, not among the workers."""

    def __init__(self, every: float = 0.25, adopted: Callable[[set[int]], Iterable[int]] | None = None):
        self.every, self.peak, self.workers_peak, self.file_peak, self.samples = every, 0, 0, 0, 0
        self.adopted_peak = 0
        self._adopted = adopted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, pid: int) -> None:
        """Take one sample of ``pid``'s tree (and of what it adopted) now."""
        children = _children()
        tree = _tree(pid, children)
        anon, workers, file = _held(tree)
        extra = 0
        if self._adopted is not None:
            mine = {int(p) for p, _ in tree}
            try:
                roots = [r for r in self._adopted(mine) if r not in mine]
            except (OSError, ValueError, HpcstaggerError) as exc:  # advisory: the tree's own memory still counts
                log.debug("cannot list the processes a tree started detached: %s", exc)
                roots = []
            others = []  # their processes, each once, none of the tree's
            for root in roots:
                for p, worker in _tree(root, children):
                    if int(p) not in mine:
                        mine.add(int(p))
                        others.append((p, worker))
            extra, _, more_files = _held(others)  # their workers are the producer's, not the job's
            file += more_files
        self.peak, self.workers_peak = max(self.peak, anon + extra), max(self.workers_peak, workers)
        self.adopted_peak = max(self.adopted_peak, extra)
        self.file_peak = max(self.file_peak, file)
        self.samples += 1

    def start(self, pid: int) -> None:
        """Follow process ``pid`` and its descendants."""
        def run() -> None:
            while True:
                self.sample(pid)
                if self._stop.wait(self.every):
                    return

        self._thread = threading.Thread(target=run, name="hpcstagger-peak-memory", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop sampling; the anonymous peak."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak


def memory_free(meminfo: str = "/proc/meminfo") -> int | None:
    """The memory this process can still fill, in bytes: the node's ``MemAvailable``, or less where
    its memory cgroup (a Slurm job's, say) leaves less room (:func:`memory_limit`); None when
    neither can be read."""
    node = None
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    node = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        node = None
    group = memory_limit()
    if group is None:
        return node
    return group.available if node is None else min(node, group.available)


def memory_reserve(total: int | None) -> int:
    """The bytes a /dev/shm cache leaves free of ``total`` (:func:`memory_total`): :data:`RESERVE_SHARE`
    of it, at least :data:`RESERVE_MIN`."""
    return max(RESERVE_MIN, int(RESERVE_SHARE * (total or 0)))


class MemoryGuard:
    """Whether ``n`` more bytes of /dev/shm leave :func:`memory_reserve` free (:meth:`allows`). The
    memory is looked at (:func:`memory_free`) at most every ``every`` seconds; in between, what this
    process was allowed is taken off. Where it cannot be read, everything is allowed."""

    def __init__(self, every: float = 0.1):
        self.every, self.reserve = every, memory_reserve(memory_total())
        self.free: int | None = None
        self._next = 0.0

    def allows(self, n: int) -> bool:
        now = time.monotonic()
        if now >= self._next:
            self.free, self._next = memory_free(), now + self.every
        if self.free is None:
            return True
        if self.free - n < self.reserve:
            return False
        self.free -= n
        return True
