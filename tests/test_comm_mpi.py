"""The communicator on real MPI ranks. Run by scripts/run-tests under mpiexec -n 1, 2 and 4:

    mpiexec -n 4 python -m pytest --with-mpi -m mpi tests/test_comm_mpi.py
"""

from __future__ import annotations

import time

import pytest

from hpcstagger.comm import Comm
from hpcstagger.errors import CollectiveError, CollectiveTimeout

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture
def world() -> Comm:
    c = Comm.world()
    assert c.is_mpi, "pytest --with-mpi should have initialised MPI"
    return c


def test_rank_and_size_match_mpi(world):
    from mpi4py import MPI

    assert world.size == MPI.COMM_WORLD.Get_size()
    assert world.allgather(world.rank) == list(range(world.size))


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_barrier_holds_every_rank(world, timeout):
    time.sleep(0.05 * world.rank)
    entered = time.time()
    world.barrier(timeout=timeout)
    left = time.time()
    times = world.allgather((entered, left))
    assert min(t[1] for t in times) >= max(t[0] for t in times) - 0.005


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_bcast_from_every_root(world, timeout):
    for root in range(world.size):
        mine = {"root": root, "data": list(range(root + 3))} if world.rank == root else None
        got = world.bcast(mine, root=root, timeout=timeout)
        assert got == {"root": root, "data": list(range(root + 3))}


def test_gather_to_every_root(world):
    for root in range(world.size):
        got = world.gather(("r", world.rank), root=root)
        if world.rank == root:
            assert got == [("r", r) for r in range(world.size)]
        else:
            assert got is None


def test_allgather_and_allreduce(world):
    assert world.allgather(world.rank * 10) == [r * 10 for r in range(world.size)]
    n = world.size
    assert world.allreduce(world.rank + 1) == n * (n + 1) // 2
    assert world.allreduce(world.rank, "max") == n - 1
    assert world.allreduce(world.rank, "min") == 0


def test_split_by_color_with_key_order(world):
    color = world.rank % 2
    sub = world.split(color, key=-world.rank)  # reversed order inside each colour
    members = sub.allgather(world.rank)
    assert members == sorted((r for r in range(world.size) if r % 2 == color), reverse=True)
    assert sub.rank == members.index(world.rank)
    sub.free()


def test_split_with_none_color_leaves_rank_out(world):
    sub = world.split(None if world.rank == 0 else 1)
    if world.rank == 0:
        assert sub is None
    else:
        assert sub.size == world.size - 1
        assert sub.allreduce(1) == world.size - 1
        sub.free()


def test_dup_is_congruent_but_separate(world):
    from mpi4py import MPI

    d = world.dup()
    assert (d.rank, d.size) == (world.rank, world.size)
    assert MPI.Comm.Compare(d.mpi, world.mpi) == MPI.CONGRUENT
    # A message posted on the duplicate is not matched by a receive on the original.
    if world.size > 1:
        if world.rank == 0:
            d.mpi.send("on-dup", dest=1, tag=7)
            world.mpi.send("on-world", dest=1, tag=7)
        elif world.rank == 1:
            assert world.mpi.recv(source=0, tag=7) == "on-world"
            assert d.mpi.recv(source=0, tag=7) == "on-dup"
    assert d.bcast("x") == "x"
    d.free()


def test_guard_reports_the_one_failing_rank_on_every_rank(world):
    for bad in range(world.size):
        with pytest.raises(CollectiveError) as info:
            with world.guard("parse input"):
                if world.rank == bad:
                    raise ValueError(f"rank {bad} got bad input")
        err = info.value
        assert set(err.failures) == {bad}
        assert f"rank {bad} got bad input" in err.failures[bad]
        assert f"parse input failed on 1 of {world.size} rank(s): {bad}" in str(err)
        assert isinstance(err.__cause__, ValueError) == (world.rank == bad)


def test_guard_lists_several_failing_ranks(world):
    failing = {r for r in range(world.size) if r % 2 == 1} or {0}
    with pytest.raises(CollectiveError) as info:
        world.run_all(lambda: 1 / 0 if world.rank in failing else None, what="divide")
    assert set(info.value.failures) == failing
    assert all("ZeroDivisionError" in m for m in info.value.failures.values())


def test_guard_passes_when_no_rank_fails(world):
    assert world.run_all(lambda: world.rank * 2) == world.rank * 2


@pytest.mark.mpi(min_size=2)
def test_timeout_when_a_rank_never_arrives(world):
    c = world.dup()
    raw = c.mpi
    late = world.size - 1
    if world.rank == late:
        time.sleep(2.0)  # never reaches the guarded barrier in time
        raw.Ibarrier().Wait()  # join afterwards so the others' abandoned request completes
    else:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="not every rank arrived"):
            c.barrier(timeout=0.5)
        assert 0.45 <= time.monotonic() - start < 1.9
        # The communicator is now unusable and says so at once instead of hanging.
        with pytest.raises(CollectiveError, match="unusable after an earlier failure"):
            c.bcast(1, timeout=None)
        assert c.broken == "barrier timed out after 0.5 s" and "BROKEN" in repr(c)
        c.abandoned.Wait()  # the others joined late: the abandoned barrier completes
    raw.Free()
    world.barrier()
