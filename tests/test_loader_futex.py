"""Waiting on the shared loader's words: futexes across processes, their timeouts, the polled fallback,
and a loader whose consumers sleep (not poll) while they wait, yet still see a killed producer at once.

Files go to pytest's temporary directories and to the test's private /dev/shm root (``shm_root``).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import resource
import signal
import threading
import time

import numpy as np
import pytest
import torch

from hpcstagger import config
from hpcstagger.comm import Backoff
from hpcstagger.errors import LoaderError
from hpcstagger.loader import SharedLoader
from hpcstagger.loader import _futex
from hpcstagger.loader import _ring as R
from support.loader_job import Numbered, expected
from support.loader_util import LINGER, gone, wait_loader_empty, wait_until

pytestmark = pytest.mark.timeout(60)
FORK = mp.get_context("fork")
needs_futex = pytest.mark.skipif(not _futex.available(), reason="no futex here (not Linux on x86_64 or aarch64)")


def _words(path: str) -> tuple[mmap.mmap, np.ndarray]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        mm = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.int64)


def _advance_and_wake(path: str, delay: float, woken) -> None:
    """In another process: map the file, advance word 3 after ``delay`` s and wake its waiters."""
    mm, w = _words(path)
    time.sleep(delay)
    w[3] = (1 << 32) + 7  # the low half changes too
    woken.value = _futex.wake(_futex.address(w, 3))
    del w
    mm.close()


# -------------------------------------------------------------------------------- the futex calls
@needs_futex
def test_a_wait_is_woken_by_another_process(tmp_path):
    path = str(tmp_path / "words")
    mm, w = _words(path)
    w[3] = 7
    woken = FORK.Value("i", -1)
    child = FORK.Process(target=_advance_and_wake, args=(path, 0.3, woken))
    t0 = time.monotonic()
    child.start()
    try:
        while int(w[3]) == 7 and time.monotonic() - t0 < 10:
            _futex.wait(_futex.address(w, 3), 7, 5.0, Backoff())
        took = time.monotonic() - t0
    finally:
        child.join(10)
    assert int(w[3]) == (1 << 32) + 7
    assert 0.25 < took < 2.5, took  # woken, not timed out after 5 s
    assert woken.value == 1  # the child's wake found this process asleep on the word
    del w
    mm.close()


@needs_futex
def test_a_wait_times_out_and_a_changed_word_does_not_sleep(tmp_path):
    mm, w = _words(str(tmp_path / "words"))
    w[0] = 5
    addr = _futex.address(w, 0)
    t0 = time.monotonic()
    _futex.wait(addr, 5, 0.2, Backoff())  # nobody wakes it
    took = time.monotonic() - t0
    assert 0.18 < took < 1.5, took
    t0 = time.monotonic()
    _futex.wait(addr, 6, 5.0, Backoff())  # the word is not 6: no sleep at all
    _futex.wait(addr, 5, 0.0, Backoff())  # no time left: no sleep
    assert time.monotonic() - t0 < 0.5
    assert _futex.wake(addr) == 0  # nobody asleep
    del w
    mm.close()


def test_without_futexes_a_wait_sleeps_the_backoff_pause(tmp_path, monkeypatch):
    monkeypatch.setattr(_futex, "_forced_off", False)
    _futex.set_available(False)
    assert not _futex.available()
    mm, w = _words(str(tmp_path / "words"))
    addr = _futex.address(w, 0)
    t0 = time.monotonic()
    _futex.wait(addr, 0, 5.0, Backoff(0.05, 0.05))
    took = time.monotonic() - t0
    assert 0.04 < took < 1.0, took  # one pause, not the timeout
    t0 = time.monotonic()
    _futex.wait(addr, 0, 0.03, Backoff(0.5, 0.5))
    assert time.monotonic() - t0 < 0.3  # never past the timeout
    assert _futex.wake(addr) == 0
    del w
    mm.close()


@pytest.mark.parametrize("machine, platform_name", [("sparc64", "linux"), ("x86_64", "darwin")])
def test_futexes_are_off_where_the_system_has_none(monkeypatch, machine, platform_name):
    monkeypatch.setattr(_futex, "_checked", False)
    monkeypatch.setattr(_futex, "_syscall", None)
    monkeypatch.setattr(_futex.platform, "machine", lambda: machine)
    monkeypatch.setattr(_futex.sys, "platform", platform_name)
    assert not _futex.available()


def test_a_waker_calls_the_kernel_only_when_someone_waits(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(_futex, "wake", lambda addr: calls.append(addr) or 0)
    fd = os.open(tmp_path / "p.ctl", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, R.CTL_BYTES)
    ctl = R.Ctl(fd, str(tmp_path / "p.ctl"))
    os.close(fd)
    try:
        ctl.wake_consumers(R.H_HEAD)
        ctl.wake_producer()
        ctl.wake_stager()
        assert calls == []
        ctl.cons(R.MAX_CONSUMERS - 1)[R.C_WAITING] = 1  # the last entry's flag counts too
        ctl.wake_consumers(R.H_GHEAD)
        ctl.w[R.H_PWAIT] = ctl.w[R.H_SWAIT] = 1
        ctl.wake_producer()
        ctl.wake_stager()
        base = _futex.address(ctl.w, 0)
        assert calls == [base + 8 * R.H_GHEAD, base + 8 * R.H_PWAIT, base + 8 * R.H_HEAD]
    finally:
        ctl.close()


# ------------------------------------------------------------------------------------- the loader
class _Slow(Numbered):
    """Numbered samples that take ``delay`` s each to prepare."""

    def __init__(self, n: int, delay: float):
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return super().__getitem__(i)


@pytest.fixture
def linger(shm_root):
    with config.override(loader_linger=LINGER):
        yield shm_root


def _switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


@needs_futex
def test_a_waiting_consumer_sleeps_instead_of_polling(linger):
    """One batch takes 0.8 s to prepare; a polling consumer (0.2 ms backing off to 5 ms) would wake
    about 170 times meanwhile, a sleeping one once per 50 ms producer check, about 16 times."""
    loader = SharedLoader(_Slow(8, 0.2), 4, name="p", root=linger)
    it = iter(loader)
    x, i = next(it)  # attached; the producer now prepares the next batch (0.8 s)
    before, t0 = _switches(), time.monotonic()
    x, i = next(it)
    waited, switches = time.monotonic() - t0, _switches() - before
    assert torch.equal(x, expected(i))
    assert waited > 0.5 and loader.stats()["wait_s"] > 0.5
    assert switches < 40, f"{switches} wake-ups in {waited:.2f} s of waiting"
    pid = loader.producer_pid
    loader.close()
    wait_until(lambda: gone(pid), LINGER + 10, f"the producer pid {pid} to stop")
    wait_loader_empty(linger)


@needs_futex
def test_a_sleeping_consumer_sees_a_killed_producer_at_once(linger):
    loader = SharedLoader(_Slow(64, 5.0), 4, name="p", root=linger)  # no batch for 20 s
    loader.attach()
    pid = loader.producer_pid
    killed: list[float] = []

    def kill() -> None:
        time.sleep(0.5)  # the consumer is asleep by now
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        with pytest.raises(LoaderError, match=f"pid {pid}\\) died"):
            next(iter(loader))
    finally:
        killer.join()
    took = time.monotonic() - killed[0]
    assert took < 0.4, f"the producer's death was seen after {took * 1e3:.0f} ms"  # ~50 ms checks
    wait_until(lambda: gone(pid), 5, "the killed producer to go")
    wait_loader_empty(linger)


def test_without_futexes_the_loader_still_delivers_every_batch(linger, monkeypatch):
    monkeypatch.setattr(_futex, "_forced_off", True)  # the producer, forked from here, polls too
    assert not _futex.available()
    loader = SharedLoader(Numbered(48), 4, name="p", root=linger, window=2)  # the producer waits for slots
    seen = []
    for _ in range(2):
        for x, i in loader:
            assert torch.equal(x, expected(i))
            seen += i.tolist()
    assert sorted(seen) == sorted(list(range(48)) * 2)
    pid = loader.producer_pid
    loader.close()
    wait_until(lambda: gone(pid), LINGER + 10, f"the producer pid {pid} to stop")
    wait_loader_empty(linger)
