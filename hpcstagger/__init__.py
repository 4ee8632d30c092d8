"""hpcstagger: co-located deep-learning training on HPC nodes.

Importing the package is cheap and has no side effects: torch, mpi4py and every submodule are
imported only when a name that needs them is first used.
"""

from __future__ import annotations


from ._lazy import lazy_exports
from ._version import __version__

# Public name -> module that defines it. Resolved lazily by __getattr__.
_EXPORTS: dict[str, str] = {
    "init": "hpcstagger.colocated.coordinator",
    "Session": "hpcstagger.colocated.coordinator",
    "Spec": "hpcstagger.colocated.spec",
    "Comm": "hpcstagger.comm",
    "as_comm": "hpcstagger.comm",
    "HpcstaggerError": "hpcstagger.errors",
    "ConfigError": "hpcstagger.errors",
    "DependencyError": "hpcstagger.errors",
    "CollectiveError": "hpcstagger.errors",
    "CollectiveTimeout": "hpcstagger.errors",
    "CacheError": "hpcstagger.errors",
    "CheckpointError": "hpcstagger.errors",
    "LaunchError": "hpcstagger.errors",
    "ModelError": "hpcstagger.errors",
    "ShmCache": "hpcstagger.cache.store",
    "PartitionedCache": "hpcstagger.cache.partitioned",
    "DirectorySource": "hpcstagger.cache.sources",
    "HDF5Source": "hpcstagger.cache.sources",
    "ThrottledSource": "hpcstagger.cache.throttle",
    "CachedDataset": "hpcstagger.cache.dataset",
    # checkpoints
    "AsyncCheckpointer": "hpcstagger.checkpoint.checkpointer",
    "load": "hpcstagger.checkpoint.load",
    "restore": "hpcstagger.checkpoint.load",
    "ActivityGate": "hpcstagger.checkpoint.gates",
    "SharedActivityGate": "hpcstagger.checkpoint.gates",
    "AnyGate": "hpcstagger.checkpoint.gates",
    "StepGate": "hpcstagger.checkpoint.gates",
    "Scenario": "hpcstagger.model",
    "Prediction": "hpcstagger.model",
    "predict": "hpcstagger.model",
    "simulate": "hpcstagger.model",
    "Plan": "hpcstagger.model",
    "optimal_plan": "hpcstagger.model",
    "calibrate": "hpcstagger.model",
    "StallProfiler": "hpcstagger.profile",
}

__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
