"""nodeload: how busy the node is, read from /proc, against a real spinning process; the warning's
figures and thresholds on literal loads."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

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
    spinning reading is at least 0.6 cores above the quiet one."""
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
    if quiet.others_cores <= busy.cores - 1.0:  # a free core for the child: it takes most of it
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
