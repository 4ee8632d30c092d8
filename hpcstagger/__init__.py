"""hpcstagger: co-located deep-learning training on HPC nodes.

Importing the package is cheap and has no side effects: torch, mpi4py and every submodule are
imported only when a name that needs them is first used. ``__all__`` lists what a training script
uses; docs/api.md lists every package's public names.
"""

from __future__ import annotations


from hpcstagger._lazy import lazy_exports
from hpcstagger._version import __version__

# Public name -> module that defines it ("module:attribute" for an alias). Resolved lazily by __getattr__.
_EXPORTS: dict[str, str] = {
    "init": "hpcstagger.colocated.coordinator",
    "Session": "hpcstagger.colocated.coordinator",
    "Spec": "hpcstagger.spec.jobspec",
    "ShmCache": "hpcstagger.cache.store",
    "PartitionedCache": "hpcstagger.cache.partitioned",
    "CachedDataset": "hpcstagger.cache.dataset",
    "DirectorySource": "hpcstagger.cache.sources",
    "HDF5Source": "hpcstagger.cache.sources",
    "SharedLoader": "hpcstagger.loader.consumer",
    "AsyncCheckpointer": "hpcstagger.checkpoint.checkpointer",
    "load_checkpoint": "hpcstagger.checkpoint.load:load",
    "restore_checkpoint": "hpcstagger.checkpoint.load:restore",
    "StallProfiler": "hpcstagger.profile",
    "HpcstaggerError": "hpcstagger.errors",
}

# Names the top level exported before it was narrowed to a training script's: each still resolves
# for one release, with a DeprecationWarning naming its home -> (target, that home).
_MOVED: dict[str, tuple[str, str]] = {
    "Comm": ("hpcstagger.comm", "hpcstagger.comm.Comm"),
    "as_comm": ("hpcstagger.comm", "hpcstagger.comm.as_comm"),
    **{name: ("hpcstagger.errors", f"hpcstagger.errors.{name}")
       for name in ("ConfigError", "DependencyError", "CollectiveError", "CollectiveTimeout", "CacheError",
                    "CheckpointError", "LaunchError", "ModelError")},
    "ThrottledSource": ("hpcstagger.cache.throttle", "hpcstagger.cache.ThrottledSource"),
    "load": ("hpcstagger.checkpoint.load:load", "hpcstagger.load_checkpoint"),
    "restore": ("hpcstagger.checkpoint.load:restore", "hpcstagger.restore_checkpoint"),
    **{name: ("hpcstagger.checkpoint.gates", f"hpcstagger.checkpoint.{name}")
       for name in ("ActivityGate", "SharedActivityGate", "AnyGate", "StepGate")},
    **{name: (f"hpcstagger.model.{module}", f"hpcstagger.model.{name}")
       for name, module in (("Scenario", "scenario"), ("Prediction", "fluid"), ("predict", "fluid"),
                            ("simulate", "simulate"), ("Plan", "plan"), ("optimal_plan", "plan"),
                            ("calibrate", "calibrate"))},
}
_DEPRECATED: dict[str, tuple[str, str]] = {
    name: (target, f"hpcstagger.{name} is deprecated; use {home}") for name, (target, home) in _MOVED.items()}

__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), _DEPRECATED)
