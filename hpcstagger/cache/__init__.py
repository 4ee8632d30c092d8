"""The shared node-local sample cache in /dev/shm, its data sources, and a torch Dataset over both.

Importing this package imports neither torch nor h5py; each name is loaded on first use.

- :class:`ShmCache`: a named cache shared by every process on the node (MinIO policy).
- :class:`PartitionedCache`: the node caches of a job as one cache partitioned across nodes over MPI.
- :class:`DirectorySource`, :class:`HDF5Source`: map-style sources of byte samples;
  :class:`NpySource`, :class:`HDF5ArraysSource`: rows of NumPy and HDF5 arrays, several arrays a
  sample packed as one (:func:`pack_arrays`, :func:`unpack_arrays`); :class:`SampleRecord`: where a
  sample comes from (``CachedDataset(..., with_record=True)``).
- Users' own datasets: ``cache.file_loader()`` (:class:`FileLoader`) for torchvision's
  ``ImageFolder``; :func:`shard_samples`, :func:`cached_webdataset`, :class:`ShardOpener` for
  webdataset tar shards read once per node; :func:`decode_npy`.
- :class:`ThrottledSource`: an emulated shared remote repository, for tests, benchmarks and the demo.
- :class:`CachedDataset`: a torch map-style Dataset reading through the cache.
- :func:`list_caches`: the caches under the shm root; :class:`Policy`: the base of the insertion
  policies; :class:`Source`: the protocol a source implements.
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports, moved

_EXPORTS: dict[str, str] = {
    "ShmCache": "hpcstagger.cache.store",
    "PartitionedCache": "hpcstagger.cache.partitioned",
    "list_caches": "hpcstagger.cache.admin",
    "Policy": "hpcstagger.cache.policy",
    "Source": "hpcstagger.cache.sources",
    "DirectorySource": "hpcstagger.cache.sources",
    "HDF5Source": "hpcstagger.cache.sources",
    "ThrottledSource": "hpcstagger.cache.throttle",
    "CachedDataset": "hpcstagger.cache.dataset",
    "SampleRecord": "hpcstagger.cache.sources",
    "NpySource": "hpcstagger.cache.arrays",
    "HDF5ArraysSource": "hpcstagger.cache.arrays",
    "pack_arrays": "hpcstagger.cache.arrays",
    "unpack_arrays": "hpcstagger.cache.arrays",
    "decode_npy": "hpcstagger.cache.arrays",
    "FileLoader": "hpcstagger.cache.wholefile",
    "ShardOpener": "hpcstagger.cache.wholefile",
    "shard_samples": "hpcstagger.cache.wholefile",
    "cached_webdataset": "hpcstagger.cache.wholefile",
}
# Kept for one release: name -> (target, warning).
_DEPRECATED = moved(__name__, {"key_hash": "hpcstagger.cache.store"})

__all__ = ["ShmCache", "PartitionedCache", "list_caches", "Policy", "Source", "DirectorySource", "HDF5Source",
           "ThrottledSource", "CachedDataset", "SampleRecord", "NpySource", "HDF5ArraysSource", "pack_arrays",
           "unpack_arrays", "decode_npy", "FileLoader", "ShardOpener", "shard_samples", "cached_webdataset"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), _DEPRECATED)
