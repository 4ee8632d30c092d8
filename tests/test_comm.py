"""The communicator as a single process (comm=None): same API, local semantics."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hpcstagger import comm as comm_module
from hpcstagger import config
from hpcstagger.comm import Backoff, Comm, as_comm, launched_by_mpi, poll_until
from hpcstagger.errors import CollectiveError, HpcstaggerError, describe_exception


def test_single_process_collectives():
    c = Comm.single()
    assert (c.rank, c.size, c.is_mpi, c.mpi) == (0, 1, False, None)
    c.barrier()
    assert c.bcast({"a": 1}) == {"a": 1}
    assert c.gather(5) == [5]
    assert c.allgather("x") == ["x"]
    assert c.allreduce(3) == 3 and c.allreduce(3, "max") == 3
    with pytest.raises(ValueError, match="op must be one of"):
        c.allreduce(1, "prod")
    assert c.dup().size == 1
    assert c.split(0).size == 1
    assert c.split(None) is None
    with pytest.raises(ValueError):
        c.split(-2)


def test_as_comm_accepts_none_comm_and_rejects_others():
    assert as_comm(None).size == 1
    c = Comm.single()
    assert as_comm(c) is c
    with pytest.raises(TypeError, match="mpi4py communicator"):
        as_comm(42)


def test_guard_names_the_failing_rank_and_chains_cause():
    c = Comm.single()
    with pytest.raises(CollectiveError) as info:
        with c.guard("load config"):
            raise KeyError("missing-key")
    err = info.value
    assert isinstance(err, HpcstaggerError)
    assert set(err.failures) == {0}
    assert "KeyError" in err.failures[0] and "missing-key" in err.failures[0]
    assert "load config failed on 1 of 1 rank(s): 0" in str(err)
    assert isinstance(err.__cause__, KeyError)


def test_run_all_returns_result_and_passes_arguments():
    c = Comm.single()
    assert c.run_all(lambda a, b=0: a + b, 2, b=3) == 5

    def boom():
        raise ValueError("bad input")

    with pytest.raises(CollectiveError, match="boom failed on 1 of 1"):
        c.run_all(boom)


def test_world_respects_the_mpi_knob(monkeypatch):
    monkeypatch.delenv("PMI_RANK", raising=False)
    with config.override(mpi="0"):
        assert not Comm.world().is_mpi
    # 'auto' outside a launch, with mpi4py not yet imported, is a single process (checked in a
    # fresh interpreter so this test's own imports do not matter).
    code = ("import sys; from hpcstagger.comm import Comm; c = Comm.world(); "
            "print(c.is_mpi, 'mpi4py' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PMI_RANK", "PMI_SIZE", "PMI_FD")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_launched_by_mpi_reads_launcher_variables():
    assert launched_by_mpi({"PMI_RANK": "0"})
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "4"})
    assert not launched_by_mpi({"SLURM_PROCID": "0"})  # srun without an MPI plugin is not an MPI launch


def test_mark_broken_makes_every_collective_refuse():
    c = Comm.single()
    assert c.broken is None and c.abandoned is None
    c.barrier()  # usable before
    request = object()
    c.mark_broken("allgather timed out after 3 s", pending=request)
    assert c.broken == "allgather timed out after 3 s" and c.abandoned is request
    assert "BROKEN" in repr(c)
    for step in (c.barrier, lambda: c.bcast(1), lambda: c.allgather(2), lambda: c.run_all(lambda: 3)):
        with pytest.raises(CollectiveError, match=r"unusable after an earlier failure \(allgather timed out"):
            step()
    c.mark_broken("communicator was freed")  # a later reason without a request keeps the request alive
    assert c.broken == "communicator was freed" and c.abandoned is request


def test_describe_exception_names_type_message_and_place():
    try:
        {}["lr"]
    except KeyError as exc:
        text = describe_exception(exc)
    assert text.startswith("KeyError: 'lr' (at test_comm.py:") and text.endswith(")")
    assert describe_exception(ValueError("no traceback")) == "ValueError: no traceback"
    # the guard sends exactly this text to every rank
    with pytest.raises(CollectiveError) as info, Comm.single().guard("step"):
        raise RuntimeError("boom")
    assert info.value.failures[0] == describe_exception(info.value.__cause__)


def test_backoff_pauses_grow_geometrically_to_the_cap():
    b = Backoff()  # the guarded collectives' schedule
    pauses = [b.next_pause() for _ in range(9)]
    assert pauses == pytest.approx([0.0002, 0.0004, 0.0008, 0.0016, 0.0032, 0.0064, 0.01, 0.01, 0.01])
    b.reset()
    assert b.next_pause() == pytest.approx(0.0002)
    b = Backoff(0.0005, 0.005, factor=3)
    assert [b.next_pause() for _ in range(4)] == pytest.approx([0.0005, 0.0015, 0.0045, 0.005])
    b = Backoff(0.0002, 0.0002, spins=3)  # spin, then a constant pause
    assert [b.next_pause() for _ in range(5)] == pytest.approx([0, 0, 0, 0.0002, 0.0002])
    for bad in ({"first": -1}, {"first": 0.1, "cap": 0.01}, {"factor": 0.5}, {"spins": -1}):
        with pytest.raises(ValueError, match="Backoff needs"):
            Backoff(**bad)


class FakeClock:
    """Stands in for the time module inside hpcstagger.comm: sleeping advances a fake clock."""

    def __init__(self):
        self.now = 0.0
        self.slept = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(comm_module, "time", fake)
    return fake


def test_backoff_sleep_is_limited(clock):
    b = Backoff(0.004, 0.01)
    assert b.sleep() == 0.004 and b.sleep(limit=0.001) == 0.001 and b.sleep(limit=-1) == 0.0
    assert clock.slept == [0.004, 0.001]  # a pause of 0 yields instead of sleeping
    assert b.next_pause() == 0.01  # a limited sleep still advanced the schedule


def test_backoff_spins_yield_without_sleeping(clock, monkeypatch):
    yields = []
    monkeypatch.setattr(comm_module.os, "sched_yield", lambda: yields.append(1))
    b = Backoff(0.0002, 0.0002, spins=3)
    for _ in range(5):
        b.sleep()
    # time.sleep(0) would sleep for the kernel's timer slack (~80 us), longer than a spin's wait
    assert len(yields) == 3 and clock.slept == [0.0002, 0.0002]


def test_poll_until_returns_true_as_soon_as_ready(clock):
    calls = []

    def ready():
        calls.append(clock.now)
        return len(calls) == 4

    assert poll_until(60.0, ready) is True
    assert len(calls) == 4  # not called again once ready
    assert clock.slept == pytest.approx([0.0002, 0.0004, 0.0008])
    clock.slept.clear()
    assert poll_until(None, lambda: True) is True and poll_until(clock.now - 1, lambda: "yes") is True
    assert clock.slept == []  # ready at once: no pause, even past the deadline


def test_poll_until_gives_up_at_the_deadline(clock):
    calls = []
    assert poll_until(0.015, lambda: calls.append(clock.now) or False) is False
    # 0.2 ms doubling, the last pause cut short so that none runs past the deadline
    assert clock.slept == pytest.approx([0.0002, 0.0004, 0.0008, 0.0016, 0.0032, 0.0064, 0.0024])
    assert clock.now == pytest.approx(0.015) and calls[-1] == pytest.approx(0.015)  # last look at the deadline
    calls.clear()
    clock.slept.clear()
    assert poll_until(clock.now, lambda: calls.append(1) or False) is False
    assert calls == [1] and clock.slept == []  # a passed deadline: one look, no pause
    clock.now = 0.0
    assert poll_until(1.0, lambda: False, first=0.5, cap=0.5) is False
    assert clock.slept == [0.5, 0.5]


def test_poll_until_spins_then_sleeps_and_waits_for_ever_without_deadline(clock, monkeypatch):
    yields = []
    monkeypatch.setattr(comm_module.os, "sched_yield", lambda: yields.append(1))
    calls = iter(range(205))
    assert poll_until(None, lambda: next(calls) == 204, first=0.0002, cap=0.0002, spins=199) is True
    assert len(yields) == 199 and clock.slept == [0.0002] * 5


def test_poll_until_really_sleeps():
    calls = []
    start = time.monotonic()
    assert poll_until(start + 0.1, lambda: calls.append(1) or False) is False
    assert time.monotonic() - start >= 0.1
    assert 5 <= len(calls) < 30  # pauses of 0.2 ms doubling to 10 ms: not a busy loop
