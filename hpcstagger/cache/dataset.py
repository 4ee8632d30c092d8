"""``CachedDataset``: a torch map-style Dataset that reads its samples through a :class:`ShmCache`.

This module imports torch; :mod:`hpcstagger.cache` loads it only when ``CachedDataset`` is used.
"""

from __future__ import annotations

from typing import Any, Protocol
from collections.abc import Callable

import torch.utils.data

from .sources import Source
from .store import ShmCache

__all__ = ["CachedDataset", "SourceReadHook"]


class SourceReadHook(Protocol):
    """Called around every read that goes to the source (a cache miss): ``enter()``, then ``exit()``.

    The checkpoint gate implements it so checkpoint writes stay out of the way of source reads.
    It must be picklable to reach DataLoader workers.
    """

    def enter(self) -> None: ...

    def exit(self) -> None: ...


class CachedDataset(torch.utils.data.Dataset):
    """Sample ``i`` of ``source``, through ``cache`` under ``source.key(i)``, as ``transform(data)``.

    A hit returns the cached sample; a miss reads ``source[i]`` (between ``source_read_hook.enter()``
    and ``.exit()`` if a hook is given) and inserts it if the cache's policy allows. ``transform``
    receives a read-only bytes-like object (``bytes`` or a ``memoryview``); without a transform the
    dataset returns ``bytes``. Works with ``DataLoader(num_workers>0)`` under fork and spawn: the
    cache reattaches by name and the source reopens its files in each worker.
    """

    def __init__(self, source: Source, cache: ShmCache, transform: Callable[[Any], Any] | None = None, *,
                 source_read_hook: SourceReadHook | None = None):
        self.source = source
        self.cache = cache
        self.transform = transform
        self.source_read_hook = source_read_hook

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        key = self.source.key(i)
        data: Any = self.cache.get(key)
        if data is None:
            hook = self.source_read_hook
            if hook is not None:
                hook.enter()
                try:
                    data = self.source[i]
                finally:
                    hook.exit()
            else:
                data = self.source[i]
            self.cache.put(key, data)
        if self.transform is not None:
            return self.transform(data)
        return data if isinstance(data, bytes) else bytes(data)

    def __repr__(self) -> str:
        return f"CachedDataset({self.source!r}, {self.cache!r})"
