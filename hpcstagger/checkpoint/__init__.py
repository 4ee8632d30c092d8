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
- :mod:`.load`: :func:`load`, :func:`restore`, :func:`verify_checkpoint`
- :mod:`.gates`: what the writer asks before each chunk; :mod:`.rng`: generator states
- :mod:`.probe`: optional timing of the writer's steps (off by default; for benchmarks)

Names are imported lazily, so ``import hpcstagger.checkpoint.sharding`` does not import torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "AsyncCheckpointer": "checkpointer", "SaveHandle": "checkpointer",
    "load": "load", "restore": "load", "read_checkpoint": "load", "verify_checkpoint": "load",
    "list_entries": "load", "load_entry": "load",
    "Gate": "gates", "ActivityGate": "gates", "StepGate": "gates", "AnyGate": "gates", "SharedActivityGate": "gates",
    "SourceReadHook": "gates",
    "ShardWriter": "writer", "Pacer": "writer",
    "capture_rng": "rng", "restore_rng": "rng",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
