"""Cache policies: which inserts a :class:`~hpcstagger.cache.ShmCache` accepts.

The interface is deliberately small. A policy says whether the cache stores anything at all
(``stores``) and, under the cache's lock, whether one insert of ``nbytes`` is admitted given the
current :class:`Space` (``refuse_fast`` lets a full MinIO cache refuse without taking the lock).
``"minio"`` admits while the sample fits and then never changes the contents (CoorDL's MinIO: with
random-order epochs every epoch hits exactly C/D of the data).
``"none"`` stores nothing, for baselines.

Adding ``"lru"`` later would mean: ``admit`` may name victims to evict, and the store must then
stop handing out zero-copy views (a freed region would be rewritten under a reader's feet); that is
what ``stable`` announces. MinIO and none never free a published region, so ``stable`` is True.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hpcstagger.errors import CacheError

__all__ = ["Space", "Policy", "MinIOPolicy", "NoCachePolicy", "POLICIES", "get_policy"]


@dataclass(frozen=True)
class Space:
    """The cache's node-wide occupancy at the moment of an admission decision (payload bytes)."""

    capacity: int
    used: int
    reserved: int
    entries: int
    reserved_entries: int
    max_entries: int

    @property
    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    @property
    def free_entries(self) -> int:
        return self.max_entries - self.entries - self.reserved_entries


class Policy:
    """Base class. ``code`` is stored in the cache's ledger so every process agrees on it."""

    name: ClassVar[str] = "base"
    code: ClassVar[int] = 0
    stores: ClassVar[bool] = True
    stable: ClassVar[bool] = True

    def admit(self, space: Space, nbytes: int) -> bool:
        """Whether to insert a sample of ``nbytes`` now. Called with the cache locked."""
        raise NotImplementedError

    def refuse_fast(self, used: int, capacity: int, nbytes: int) -> bool:
        """True if an insert can be refused from an unlocked look at the bytes used (no lock taken)."""
        return False


class MinIOPolicy(Policy):
    """Insert while the sample fits; once full, the contents never change."""

    name = "minio"
    code = 1

    def admit(self, space: Space, nbytes: int) -> bool:
        return nbytes <= space.free and space.free_entries >= 1

    def refuse_fast(self, used: int, capacity: int, nbytes: int) -> bool:
        return used + nbytes > capacity  # bytes used only grow until clear(): full stays full


class NoCachePolicy(Policy):
    """Pass-through: every lookup misses and every insert is refused (for baselines)."""

    name = "none"
    code = 2
    stores = False

    def admit(self, space: Space, nbytes: int) -> bool:
        return False

    def refuse_fast(self, used: int, capacity: int, nbytes: int) -> bool:
        return True


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (MinIOPolicy, NoCachePolicy)}
_BY_CODE: dict[int, type[Policy]] = {p.code: p for p in POLICIES.values()}


def get_policy(name_or_code: str | int) -> Policy:
    """The policy named ``name_or_code`` (or with that ledger code); CacheError lists the valid ones."""
    cls = _BY_CODE.get(name_or_code) if isinstance(name_or_code, int) else POLICIES.get(name_or_code)
    if cls is None:
        raise CacheError(f"unknown cache policy {name_or_code!r}; valid policies: {', '.join(POLICIES)}")
    return cls()
