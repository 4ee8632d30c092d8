"""The shared loader: one producer per node prepares each batch once, every co-located job consumes it.

Importing this package imports neither torch nor numpy; each name is loaded on first use.

- :class:`SharedLoader`: use it where a DataLoader was built; ``for batch in loader`` stays the same.
- :class:`StreamOrder`: the order of the shared batch stream (epochs, segments, late joins).
- :func:`list_pipelines`: the pipelines in a node's shared memory, with their producer and consumers.
- :func:`to_device`: a batch with its tensors moved to a device.
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SharedLoader": "hpcstagger.loader.consumer",
    "StreamOrder": "hpcstagger.loader._order",
    "list_pipelines": "hpcstagger.loader.pipelines",
    "to_device": "hpcstagger.loader._cuda",
}

__all__ = ["SharedLoader", "StreamOrder", "list_pipelines", "to_device"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
