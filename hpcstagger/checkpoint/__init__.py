"""Asynchronous, sharded, verifiable checkpoints of PyTorch training state, in HDF5.

Modules, by concept:

- :mod:`.state`: a state dict to a JSON tree plus tensors and back (nothing pickled)
- :mod:`.sharding`: the size-balanced shard plan: which rank writes which bytes (pure)
- :mod:`.snapshot`: the copy into reusable (pinned) host buffers
- :mod:`.writer`: one shard as an HDF5 file, written in gated chunks; copies between levels
- :mod:`.manifest`: the manifest, names and validation (pure); :mod:`.catalog`: commit, listing, retention
- :mod:`.checkpointer`: :class:`AsyncCheckpointer`: its API, the snapshot, the hand-over to the writer
- :mod:`.protocol`: :class:`SaveHandle`, the writer thread and the ranks' protocol (snapshot
  agreement, gather, commit, broadcast of the outcome)
- :mod:`.load`: :func:`load`, :func:`restore` (also exported as ``load_checkpoint`` and
  ``restore_checkpoint``), :func:`verify_checkpoint`
- :mod:`.gates`: what the writer asks before each chunk; :mod:`.rng`: generator states
- :mod:`.probe`: optional timing of the writer's steps (off by default; for benchmarks)

Names are imported lazily, so ``import hpcstagger.checkpoint.sharding`` does not import torch.
``hpcstagger.checkpoint.load`` is the function, also after ``import hpcstagger.checkpoint.load``;
``importlib.import_module("hpcstagger.checkpoint.load")`` gives the module.
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports, moved

_EXPORTS: dict[str, str] = {
    "AsyncCheckpointer": "hpcstagger.checkpoint.checkpointer",
    "SaveHandle": "hpcstagger.checkpoint.checkpointer",
    "load": "hpcstagger.checkpoint.load",
    "restore": "hpcstagger.checkpoint.load",
    "load_checkpoint": "hpcstagger.checkpoint.load:load",
    "restore_checkpoint": "hpcstagger.checkpoint.load:restore",
    "verify_checkpoint": "hpcstagger.checkpoint.load",
    "Gate": "hpcstagger.checkpoint.gates",
    "ActivityGate": "hpcstagger.checkpoint.gates",
    "StepGate": "hpcstagger.checkpoint.gates",
    "AnyGate": "hpcstagger.checkpoint.gates",
    "SharedActivityGate": "hpcstagger.checkpoint.gates",
    "SourceReadHook": "hpcstagger.checkpoint.gates",
    "capture_rng": "hpcstagger.checkpoint.rng",
    "restore_rng": "hpcstagger.checkpoint.rng",
}
# The writer's and the catalog's internals, exported for one release: name -> (target, warning).
_DEPRECATED = moved(__name__, {"ShardWriter": "hpcstagger.checkpoint.writer", "Pacer": "hpcstagger.checkpoint.writer",
                               "list_entries": "hpcstagger.checkpoint.load", "load_entry": "hpcstagger.checkpoint.load",
                               "read_checkpoint": "hpcstagger.checkpoint.load"})

__all__ = ["AsyncCheckpointer", "SaveHandle", "load", "restore", "load_checkpoint", "restore_checkpoint",
           "verify_checkpoint", "Gate", "ActivityGate", "StepGate", "AnyGate", "SharedActivityGate", "SourceReadHook",
           "capture_rng", "restore_rng"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), _DEPRECATED)
