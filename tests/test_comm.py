"""The communicator as a single process (comm=None): same API, local semantics."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcstagger import config
from hpcstagger.comm import Comm, as_comm, launched_by_mpi
from hpcstagger.errors import CollectiveError, HpcstaggerError


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
