"""A partitioned cache over real MPI ranks, each rank its own emulated node (1, 2 and 4 ranks)."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

from hpcstagger import config
from hpcstagger.comm import Comm
from support.cache_util import sample

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def _settle(cache, comm):
    """Every rank's inserts sent, then taken in by their owners."""
    comm.barrier()
    for _ in range(50):
        cache.progress()
        time.sleep(0.002)
    comm.barrier()


def test_every_rank_reads_every_sample_from_its_owner():
    from hpcstagger.cache import PartitionedCache

    comm = Comm.world()
    root = comm.bcast(tempfile.mkdtemp(prefix="hpcs-part-mpi-", dir="/dev/shm") if comm.rank == 0 else None)
    try:
        with config.override(cache_nodes=comm.size):
            cache = PartitionedCache("pmpi", 1 << 22, comm, root=root)
        assert cache.layout.count == comm.size and cache.layout.node == comm.rank
        keys = range(60)
        for k in keys:
            if k % comm.size == comm.rank:  # each rank loads its share, which goes to the owners
                assert cache.get(k) is None
                assert cache.put(k, sample(k))
        _settle(cache, comm)
        for k in keys:  # every rank now finds every sample, locally or on its owner
            v = cache.get(k)
            assert v is not None and bytes(v) == sample(k), k
        s = cache.stats()
        mine = [k for k in keys if cache.owner(k) == comm.rank]
        assert s["entries"] == len(mine)  # each node holds exactly the samples it owns
        assert s["local_hits"] == len(mine) and s["remote_hits"] == len(keys) - len(mine)
        assert cache.dead_nodes == frozenset()
        cache.close()
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
