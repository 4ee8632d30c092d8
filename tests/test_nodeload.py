"""nodeload: how busy the node is, read from /proc, against a real spinning process; the warning's
figures and thresholds on literal loads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpcstagger import nodeload
from hpcstagger.errors import LoaderError
from support.cgroups import memory_group, v1_memory
from hpcstagger.nodeload import NodeLoad, busy_warning, sample, usable_cores

pytestmark = pytest.mark.timeout(60)


def _cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_spinning_process_reads_as_other_work():
    """The window's CPU use of a real busy loop in a child process counts as other processes' use.
    Other work on a small shared node moves both readings, so the checks are relative: the sample
    holds at least what the child itself used, and, when the node had a core to spare, the
    spinning reading is at least 0.6 cores above the quiet one. (Other work that moves by more than
    half a core between the two windows, as other tests running beside this one do, can take that
    core back: the relative check is made only on a node that is near idle, at most half a core
    used by others in the quiet window.)"""
    quiet = sample(1.0)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # past the interpreter's start
        before = _cpu_seconds(spin.pid)
        busy = sample(1.0)
        child = (_cpu_seconds(spin.pid) - before) / busy.window_s
    finally:
        spin.kill()
        spin.wait()
    assert quiet.others_cores is not None and busy.others_cores is not None
    assert busy.cores == quiet.cores == usable_cores()
    assert 0.9 <= busy.window_s < 3.0 and busy.load1 is not None and busy.load1 >= 0
    assert busy.others_cores >= child - 0.1, (busy, child)  # the child's own CPU time is in the sample
    if quiet.others_cores <= 0.5:  # a free core for the child, and little else running: it takes most of it
        assert busy.others_cores >= quiet.others_cores + 0.6, (quiet, busy, child)
    if child >= 0.5:
        assert busy.busy and busy_warning(busy, "the demo") is not None


def test_the_busy_threshold_and_the_warnings_figures():
    quiet = NodeLoad(cores=2, others_cores=0.2, load1=0.4, window_s=1.0)
    assert not quiet.busy and busy_warning(quiet, "the demo") is None
    busy = NodeLoad(cores=2, others_cores=1.9, load1=3.0, window_s=1.0)
    assert busy.busy
    assert busy_warning(busy, "the demo") == (
        "the node is busy (other processes used 1.90 of 2 usable cores over 1.0 s; load average 3.00): the demo "
        "measures slower jobs than the same jobs on a quiet node; stop the other work or expect its figures to be off")
    # on a large node a tenth of the cores counts, not a quarter core
    assert not NodeLoad(cores=64, others_cores=3.0, load1=3.0, window_s=1.0).busy
    assert NodeLoad(cores=64, others_cores=7.0, load1=7.0, window_s=1.0).busy
    # without /proc/stat the load average against the cores decides
    assert NodeLoad(cores=2, others_cores=None, load1=3.0, window_s=1.0).busy
    assert not NodeLoad(cores=2, others_cores=None, load1=1.5, window_s=1.0).busy
    assert not NodeLoad(cores=2, others_cores=None, load1=None, window_s=1.0).busy
    assert busy_warning(NodeLoad(cores=2, others_cores=None, load1=3.0, window_s=1.0), "x").startswith(
        "the node is busy (load average 3.00): x measures")


# ------------------------------------------------------------------------------- memory cgroups
def _tree(tmp_path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = tmp_path / "cg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path / "cg")


def test_a_v1_memory_limit_is_read_with_its_droppable_file_pages(tmp_path):
    from hpcstagger.nodeload import memory_limit

    proc = tmp_path / "cgroup"
    proc.write_text("12:cpuset:/\n7:memory:/slurm/uid_0/job_42\n1:name=systemd:/x\n")
    root = _tree(tmp_path, {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: no limit
        "memory/memory.usage_in_bytes": "1000\n",
        "memory/slurm/uid_0/job_42/memory.limit_in_bytes": str(2 << 30),
        "memory/slurm/uid_0/job_42/memory.usage_in_bytes": str(1 << 30),
        "memory/slurm/uid_0/job_42/memory.stat": "cache 700\ntotal_active_file 100000000\n"
                                                  "total_inactive_file 200000000\ntotal_shmem 300000000\n"})
    got = memory_limit(str(proc), root)
    assert got is not None and got.limit == 2 << 30 and got.usage == 1 << 30 and got.file == 300_000_000
    assert got.available == (2 << 30) - ((1 << 30) - 300_000_000)  # /dev/shm pages are not droppable
    assert got.path.endswith("job_42")


def test_the_tightest_v2_limit_on_the_path_counts_and_max_is_none(tmp_path):
    from hpcstagger.nodeload import memory_limit

    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/job/step\n")
    root = _tree(tmp_path, {
        "system.slice/job/memory.max": str(1 << 30), "system.slice/job/memory.current": str(900 << 20),
        "system.slice/job/memory.stat": "active_file 0\ninactive_file 104857600\n",
        "system.slice/job/step/memory.max": "max\n", "system.slice/job/step/memory.current": str(800 << 20)})
    got = memory_limit(str(proc), root)
    assert got is not None and got.limit == 1 << 30 and got.available == (1 << 30) - (800 << 20)
    proc.write_text("0::/system.slice/job/step\n")
    assert memory_limit(str(proc), str(tmp_path / "none")) is None  # nothing readable: no limit known
    assert memory_limit(str(tmp_path / "missing"), root) is None


@pytest.mark.skipif(v1_memory() is None, reason="needs a writable cgroup v1 memory hierarchy (root)")
def test_a_process_in_a_real_memory_cgroup_sees_its_room_not_the_nodes(tmp_path):
    """The page-cache rule's memory (source_probe.mem_available) in a real 256 MiB memory cgroup:
    at most the limit, where the node's MemAvailable is far larger."""
    code = ("import json; from hpcstagger.model.source_probe import mem_available, parse_meminfo; "
            "from hpcstagger.nodeload import memory_limit; m = memory_limit(); "
            "print(json.dumps([mem_available(), m.limit if m else None, "
            "parse_meminfo(open('/proc/meminfo').read())['MemAvailable']]))")
    with memory_group(256 << 20, "room") as (_, join):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=join)
    assert out.returncode == 0, out.stderr
    avail, limit, node = json.loads(out.stdout)
    assert limit == 256 << 20 and 0 < avail <= 256 << 20
    if node > 1 << 30:  # the check can fail: the node's own figure is above the group's room
        assert avail < node


def test_peak_memory_follows_a_process_tree_and_tells_its_workers():
    """A parent with a forked multiprocessing worker that touches 100 MB and a child program (in a
    session of its own, as MPI launchers start ranks) that touches 160 MB: the peak counts both once,
    and only the worker as a worker; a process outside the tree is not counted."""
    touch = "import time; b = bytearray({n} << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep({s})"
    outsider = subprocess.Popen([sys.executable, "-c", touch.format(n=300, s=4)])
    parent_code = (
        "import multiprocessing as mp, subprocess, sys\n"
        "def work():\n"
        "    exec(sys.argv[2])\n"
        "if __name__ == '__main__':\n"
        "    w = mp.get_context('fork').Process(target=work)\n"
        "    w.start()\n"
        "    subprocess.run([sys.executable, '-c', sys.argv[1]], start_new_session=True, check=True)\n"
        "    w.join()\n")
    try:
        parent = subprocess.Popen([sys.executable, "-c", parent_code, touch.format(n=160, s=2),
                                   touch.format(n=100, s=2)])
        meter = nodeload.PeakMemory(every=0.1)
        meter.start(parent.pid)
        assert parent.wait(timeout=60) == 0
        peak = meter.stop()
    finally:
        outsider.kill()
        outsider.wait()
    assert meter.samples >= 5
    assert 260 << 20 < peak < 380 << 20, peak / 2**20        # 160 + 100 MB and the interpreters, not 300 MB more
    assert 100 << 20 < meter.workers_peak < 130 << 20, meter.workers_peak / 2**20  # the forked worker only
    assert meter.file_peak > 256 << 10  # the interpreters' mapped files (1,043,456 bytes under a busy CI run)
    assert nodeload.tree_memory(os.getpid())[0] > 0


def test_peak_memory_counts_what_a_tree_started_detached_when_told(tmp_path):
    """A parent that starts a child detached, as a shared loader's consumer starts its producer
    (forked twice, in a session of its own, under init), and writes its pid: the tree alone misses
    the child's 150 MB; with ``adopted`` naming it, the peak counts it once, apart, not as a worker."""
    pidfile = tmp_path / "child.pid"
    touch = "b = bytearray(150 << 20); b[::4096] = b'x' * len(b[::4096])"
    parent_code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    mid = os.getpid()\n"
        "    if os.fork() == 0:\n"
        "        while os.getppid() == mid:\n"  # touch only once out of the tree: the middle process exited
        "            time.sleep(0.01)\n"
        f"        {touch}\n"
        "        tmp = sys.argv[1] + '.tmp'\n"
        "        open(tmp, 'w').write(str(os.getpid())); os.rename(tmp, sys.argv[1])\n"
        "        time.sleep(3)\n"
        "    os._exit(0)\n"
        "while not os.path.exists(sys.argv[1]):\n"  # the child has touched its memory: count both
        "    time.sleep(0.01)\n"
        "time.sleep(1.0)\n")

    def child(pids: set[int]) -> list[int]:
        return [int(pidfile.read_text())] if pidfile.exists() else []

    runs = {}
    for adopted in (None, child):
        pidfile.unlink(missing_ok=True)
        parent = subprocess.Popen([sys.executable, "-c", parent_code, str(pidfile)])
        meter = nodeload.PeakMemory(every=0.1, adopted=adopted)
        meter.start(parent.pid)
        assert parent.wait(timeout=60) == 0
        runs[adopted is None] = (meter.stop(), meter.adopted_peak, meter.workers_peak)
        if pidfile.exists():  # leave nothing running
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
    (alone, none_adopted, _), (peak, adopted_peak, workers) = runs[True], runs[False]
    assert none_adopted == 0 and alone < 100 << 20, alone / 2**20           # the interpreter alone
    assert 145 << 20 < adopted_peak < 200 << 20, adopted_peak / 2**20      # the detached child
    # the parent counts too: what it does not share with the child it forked (PSS splits the rest)
    assert peak >= adopted_peak + (alone // 8) and workers < 50 << 20, ((peak - adopted_peak) / 2**20, alone / 2**20)


def test_peak_memory_keeps_sampling_when_the_adopted_processes_cannot_be_listed():
    """The list of detached processes is advisory: a loader directory that cannot be read costs
    their memory, not the tree's own, and does not end the sampling."""
    def broken(pids: set[int]) -> list[int]:
        raise LoaderError("a control file of another version")

    meter = nodeload.PeakMemory(adopted=broken)
    meter.sample(os.getpid())
    meter.sample(os.getpid())
    assert meter.samples == 2 and meter.peak > 0 and meter.adopted_peak == 0
