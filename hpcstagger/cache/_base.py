"""What a node cache and the partitioned cache share over their own ``get`` and ``put``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LoadThrough"]


class LoadThrough:
    """``get_or_load`` over a cache's own ``get`` and ``put`` (:class:`ShmCache`, and the
    partitioned cache, whose ``put`` stores at the sample's owner node)."""

    def get(self, key: str | int) -> memoryview | None:
        raise NotImplementedError

    def put(self, key: str | int, data: Any) -> bool:
        raise NotImplementedError

    def get_or_load(self, key: str | int, loader: Callable[[], Any]) -> Any:
        """The cached sample for ``key``, or ``loader()``'s bytes-like result, inserted if the policy allows.

        The caller always gets its bytes: a refused insert (full cache, full /dev/shm) only means
        the next reader loads it again.
        """
        view = self.get(key)
        if view is not None:
            return view
        data = loader()
        self.put(key, data)
        return data
