"""The shared node-local sample cache in /dev/shm, its data sources, and a torch Dataset over both.

Importing this package imports neither torch nor h5py; each name is loaded on first use.

- :class:`ShmCache`: a named cache shared by every process on the node (MinIO policy).
- :class:`PartitionedCache`: the node caches of a job as one cache partitioned across nodes over MPI.
- :class:`DirectorySource`, :class:`HDF5Source`: map-style sources of byte samples.
- :class:`ThrottledSource`: an emulated shared remote repository, for tests, benchmarks and the demo.
- :class:`CachedDataset`: a torch map-style Dataset reading through the cache.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ShmCache": "store",
    "PartitionedCache": "partitioned",
    "list_caches": "admin",
    "key_hash": "store",
    "Policy": "policy",
    "Source": "sources",
    "DirectorySource": "sources",
    "HDF5Source": "sources",
    "ThrottledSource": "throttle",
    "CachedDataset": "dataset",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
