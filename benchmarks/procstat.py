"""Reading CPU time, scheduling delay and writeback counters from /proc (Linux), for the benchmarks.

Parsers are pure (text in, dict out; tested on literal strings in tests/test_ckpt_probe.py); the
readers around them do the I/O and return {} for a thread or process that is gone.
Times are seconds; /proc/stat and /proc/<pid>/stat count in clock ticks (``hz``).
"""

from __future__ import annotations

import os

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def parse_cpu(text: str, hz: int = HZ) -> dict[str, float]:
    """The machine-wide ``cpu`` line of /proc/stat: seconds per category, summed over CPUs."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            vals = [int(x) for x in line.split()[1:1 + len(CPU_FIELDS)]]
            return {k: v / hz for k, v in zip(CPU_FIELDS, vals, strict=True)}
    raise ValueError("no 'cpu' line in /proc/stat text")


def parse_task_stat(text: str, hz: int = HZ) -> dict[str, object]:
    """/proc/<pid>[/task/<tid>]/stat: name, parent, minor/major faults, user and system seconds."""
    lo, hi = text.index("("), text.rindex(")")
    rest = text[hi + 2:].split()  # fields from 3 (state) on; rest[i] is field i + 3
    return {"comm": text[lo + 1:hi], "ppid": int(rest[1]), "minflt": int(rest[7]), "majflt": int(rest[9]),
            "utime": int(rest[11]) / hz, "stime": int(rest[12]) / hz}


def parse_schedstat(text: str) -> dict[str, float]:
    """/proc/.../schedstat: seconds on a CPU, seconds runnable but waiting for one, time slices."""
    on, delay, slices = text.split()[:3]
    return {"oncpu": int(on) * 1e-9, "rundelay": int(delay) * 1e-9, "slices": int(slices)}


def parse_ctxt(text: str) -> dict[str, int]:
    """Voluntary and involuntary context switches from /proc/.../status."""
    out = {}
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            out["vol"] = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            out["invol"] = int(line.split()[1])
    return out


def parse_vmstat(text: str) -> dict[str, int]:
    """/proc/vmstat as name -> value."""
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v:
            out[k] = int(v)
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def thread(tid: int, pid: int | None = None) -> dict[str, object]:
    """One thread's stat, schedstat and context switches (``pid`` None: a thread of this process)."""
    base = f"/proc/self/task/{tid}" if pid is None else f"/proc/{pid}/task/{tid}"
    try:
        out = parse_task_stat(_read(base + "/stat"))
        out.update(parse_schedstat(_read(base + "/schedstat")))
        out.update(parse_ctxt(_read(base + "/status")))
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return out


def own_threads() -> dict[int, dict[str, object]]:
    """Every thread of this process: tid -> :func:`thread`."""
    out = {}
    for name in os.listdir("/proc/self/task"):
        t = thread(int(name))
        if t:
            out[int(name)] = t
    return out


def kernel_threads() -> dict[str, float]:
    """Seconds on a CPU of the kernel's threads (children of kthreadd), by kind: kworker, ksoftirqd,
    kswapd, jbd2 and other. Threads that ended since are missing, so compare nearby readings only."""
    out = {"kworker": 0.0, "ksoftirqd": 0.0, "kswapd": 0.0, "jbd2": 0.0, "other": 0.0}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            st = parse_task_stat(_read(f"/proc/{name}/stat"))
            if st["ppid"] != 2:
                continue
            on = parse_schedstat(_read(f"/proc/{name}/schedstat"))["oncpu"]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        comm = str(st["comm"])
        kind = next((k for k in ("kworker", "ksoftirqd", "kswapd", "jbd2") if comm.startswith(k)), "other")
        out[kind] += on
    return out


def machine() -> dict[str, object]:
    """Machine-wide: /proc/stat CPU seconds by category, /proc/vmstat, kernel threads' CPU seconds."""
    return {"cpu": parse_cpu(_read("/proc/stat")), "vm": parse_vmstat(_read("/proc/vmstat")),
            "kthreads": kernel_threads()}


def vm_gauges() -> tuple[int, int]:
    """(nr_dirty, nr_writeback) now, in pages."""
    vm = parse_vmstat(_read("/proc/vmstat"))
    return vm.get("nr_dirty", 0), vm.get("nr_writeback", 0)
