"""The shard plan: which rank writes which bytes of a replicated state. Pure logic, no I/O.

The tensors of the state, in their flattening order, are laid end to end as one byte string and cut
into ``nshards`` ranges of (nearly) equal size; shard ``r`` is written by rank ``r``. A tensor that
straddles a cut is split there into pieces of whole elements. Tensors smaller than ``min_split``
bytes are never split: each goes whole to the shard that holds its middle byte, so a shard's size is
off its ideal by at most ``min_split`` bytes at each of its two cuts. Every rank computes the same
plan from the same tensor specs, so the plan itself is never sent around.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

__all__ = ["TensorSpec", "Piece", "ShardPlan", "plan_shards", "layout_signature"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the state: its key, dtype name, shape and element size in bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of the flattened tensor ``key``, written to ``shard``."""

    key: str
    shard: int
    start: int
    count: int
    whole: bool

    def byte_range(self, itemsize: int) -> tuple[int, int]:
        """The piece's [first, last) byte offsets inside its tensor."""
        return self.start * itemsize, (self.start + self.count) * itemsize


@dataclass(frozen=True)
class ShardPlan:
    """Every piece of every tensor, and the shard each goes to."""

    nshards: int
    specs: tuple[TensorSpec, ...]
    pieces: tuple[Piece, ...]

    def for_shard(self, shard: int) -> list[Piece]:
        """The pieces shard ``shard`` holds, in state order."""
        return [p for p in self.pieces if p.shard == shard]

    def shard_bytes(self) -> list[int]:
        """Bytes of tensor data in each shard."""
        size = {s.key: s.itemsize for s in self.specs}
        out = [0] * self.nshards
        for p in self.pieces:
            out[p.shard] += p.count * size[p.key]
        return out


def _cut(boundary: int, pos: int, spec: TensorSpec) -> int:
    """The element index where byte ``boundary`` of the whole state cuts the tensor at ``pos``."""
    elems = round((boundary - pos) / spec.itemsize)
    return min(max(elems, 0), spec.numel)


def plan_shards(specs: Sequence[TensorSpec], nshards: int, *, min_split: int = 4 << 20) -> ShardPlan:
    """Split ``specs`` into ``nshards`` size-balanced shards (see the module docstring).

    Raises ValueError for ``nshards < 1``, duplicate keys or a non-positive item size.
    """
    if nshards < 1:
        raise ValueError(f"nshards must be >= 1, not {nshards}")
    keys = set()
    for s in specs:
        if s.key in keys:
            raise ValueError(f"duplicate tensor key {s.key!r}")
        if s.itemsize <= 0:
            raise ValueError(f"tensor {s.key!r} has item size {s.itemsize}")
        keys.add(s.key)
    total = sum(s.nbytes for s in specs)
    bounds = [total * k // nshards for k in range(nshards + 1)]

    def shard_of(byte: float) -> int:
        for k in range(nshards):
            if byte < bounds[k + 1]:
                return k
        return nshards - 1

    pieces: list[Piece] = []
    pos = 0
    for spec in specs:
        nb = spec.nbytes
        if nb < max(min_split, 1) or nshards == 1:
            pieces.append(Piece(spec.key, shard_of(pos + nb / 2), 0, spec.numel, True))
        else:
            for k in range(nshards):
                lo, hi = _cut(bounds[k], pos, spec), _cut(bounds[k + 1], pos, spec)
                if hi > lo:
                    pieces.append(Piece(spec.key, k, lo, hi - lo, lo == 0 and hi == spec.numel))
        pos += nb
    pieces.sort(key=lambda p: p.shard)  # stable: state order inside each shard
    return ShardPlan(nshards, tuple(specs), tuple(pieces))


def layout_signature(specs: Iterable[TensorSpec]) -> str:
    """A short hash of the keys, dtypes and shapes, equal on ranks that hold the same layout."""
    text = json.dumps([[s.key, s.dtype, list(s.shape), s.itemsize] for s in specs], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
