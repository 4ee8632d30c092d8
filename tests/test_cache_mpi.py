"""One ShmCache shared by real MPI ranks (runs at 1, 2 and 4 ranks under mpiexec)."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from hpcstagger.comm import Comm
from support.cache_util import sample

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def test_ranks_share_one_cache():
    from hpcstagger.cache import ShmCache

    comm = Comm.world()
    root = comm.bcast(tempfile.mkdtemp(prefix="hpcs-mpi-", dir="/dev/shm") if comm.rank == 0 else None)
    try:
        with comm.guard("open the cache"):
            cache = ShmCache("mpi", 1 << 22, root=root)  # every rank creates-or-attaches at once
        keys = range(40)
        for k in keys:
            if k % comm.size == comm.rank:  # each rank loads its share...
                assert cache.put(k, sample(k))
        comm.barrier()
        for k in keys:  # ...and every rank hits every sample
            v = cache.get(k)
            assert v is not None and bytes(v) == sample(k)
        comm.barrier()
        s = cache.stats()
        assert s["inserts"] == 40 and s["entries"] == 40
        assert s["hits"] == s["lookups"] == 40 * comm.size
        assert s["processes"] == comm.size
        comm.barrier()
        cache.close()
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
