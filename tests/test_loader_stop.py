"""A run's end stops the shared loaders' idle producers at once, for real.

The consumers are processes of their own (support/loader_job.py) whose producers would linger
30 s: ``stop_idle`` (what ``hpcstagger launch`` and ``hpcstagger clean --after-run`` call when the
run's ranks are gone) must end them within its wait, with their files in /dev/shm and their
DataLoader workers' ``pymp-*`` folders in TMPDIR gone, and must leave a producer alone while a
consumer is attached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from hpcstagger.loader import list_pipelines
from hpcstagger.loader.pipelines import stop_idle
from support.loader_util import REPO, gone, loader_files, start_job, wait_until

pytestmark = pytest.mark.timeout(90)

LONG_LINGER = "30"  # far longer than any wait below: only a stop request ends the producer in time


@pytest.fixture
def lingering(jobs):
    """``jobs`` whose producers linger 30 s and whose temporary folders go to a folder of their own,
    directly in the temporary directory: the workers' Unix sockets under it need a short path."""
    tmp = tempfile.mkdtemp(prefix="stop-")
    jobs.env.update(HPCSTAGGER_LOADER_LINGER=LONG_LINGER, TMPDIR=tmp)
    jobs.tmpdir = tmp
    yield jobs
    shutil.rmtree(tmp, ignore_errors=True)


def _finished_job(jobs, label: str = "a") -> int:
    """A consumer with 2 DataLoader workers that takes one epoch and exits; its producer's pid."""
    job = start_job(jobs, label, 48, 4, 1, gate="", num_workers=2)
    record = job.finish()
    assert record["done"] and len(record["batches"]) == 12, record
    return record["producer_pid"]


def test_an_idle_producer_stops_at_once_and_leaves_nothing(lingering, shm_root):
    pid = _finished_job(lingering)
    # it lingers: alive, its ring in /dev/shm, its workers' folders (multiprocessing's, for the
    # descriptors that carry their batches) in TMPDIR
    assert not gone(pid) and loader_files(shm_root)
    assert [p["state"] for p in list_pipelines(shm_root)] == ["running"]
    assert any(n.startswith("pymp-") for n in os.listdir(lingering.tmpdir))

    asked = stop_idle(shm_root, wait=5.0)

    assert len(asked) == 1 and gone(pid)
    assert loader_files(shm_root) == []
    # the workers ended as a DataLoader ends them, not killed: their folders went with them
    wait_until(lambda: not os.listdir(lingering.tmpdir), 5, "the workers' folders to go")
    lingering.assert_nothing_left(timeout=2.0)


def test_a_producer_with_a_consumer_attached_goes_on(lingering, shm_root):
    busy = start_job(lingering, "busy", 48, 4, 1, gate="", num_workers=1, sleep=0.3)
    record = busy.taken(1)
    pid = record["producer_pid"]

    assert stop_idle(shm_root, wait=1.0) == []
    assert not gone(pid)
    record = busy.finish()
    assert record["done"] and len(record["batches"]) == 12 and all(b["ok"] for b in record["batches"])

    assert len(stop_idle(shm_root, wait=5.0)) == 1 and gone(pid)
    lingering.assert_nothing_left(timeout=2.0)


def test_clean_after_run_stops_the_producer_and_keeps_the_caches(lingering, shm_root):
    pid = _finished_job(lingering)
    cache = os.path.join(shm_root, "c1")
    os.mkdir(cache, 0o700)
    open(os.path.join(cache, "ledger"), "wb").close()
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    out = subprocess.run([sys.executable, "-m", "hpcstagger", "clean", "--after-run", "--root", shm_root],
                         capture_output=True, text=True, env=env, timeout=60)

    assert out.returncode == 0, out.stderr
    assert gone(pid) and loader_files(shm_root) == []
    assert os.path.exists(os.path.join(cache, "ledger"))  # a cache is for the next run
    lingering.assert_nothing_left(timeout=2.0)


def test_clean_after_run_refuses_the_flags_that_remove_used_items(shm_root):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "hpcstagger", "clean", "--after-run", "--force", "--root", shm_root],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "--after-run" in out.stderr and "--force" in out.stderr
