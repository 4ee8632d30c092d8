"""The order of the shared batch stream: pure, so producer and consumers compute the same batches.

The producer prepares one endless stream of batches, numbered ``g = 0, 1, 2, ...``. The stream is
cut into *rounds* of ``B`` batches (one pass over the dataset each). Consumers join late and still
see every sample exactly once per epoch, which a plain reshuffle per round cannot give: a consumer
joining at batch ``b`` of a round would finish its epoch with the head of the *next* round, whose
samples are different ones. So the order is built from *segments*:

- Once, from the seed, the dataset's indices are permuted and cut into ``S`` segments of ``k``
  whole batches each (the last segment is shorter and ends with the partial batch, if any).
- In every round the samples are reshuffled *within* each segment (seed, round, segment), and the
  segments keep their places.

Any ``B`` consecutive batches that start at a segment boundary therefore hold every sample exactly
once, whatever the round. A consumer's epoch is such a window: it starts at the first segment
boundary it can reach and wraps into the next round. More segments mean shorter waits for a late
consumer (at most ``k`` batches) and a coarser shuffle across epochs (a sample moves only within
its segment's stretch of the epoch); ``segments=1`` is a full reshuffle every round, joinable only
at round boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hpcstagger.errors import ConfigError

__all__ = ["StreamOrder"]


@dataclass(frozen=True)
class StreamOrder:
    """The batches of one pipeline's stream: dataset length, batch size, seed, segments, drop_last,
    and shuffle (False: every round in dataset order, as ``DataLoader(shuffle=False)``)."""

    n: int
    batch_size: int
    seed: int = 0
    segments: int = 8
    drop_last: bool = False
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name, low in (("n", 1), ("batch_size", 1), ("segments", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"shared loader: {name} must be an integer >= {low}, got {value!r}")
        if self.drop_last and self.n < self.batch_size:
            raise ConfigError(f"shared loader: drop_last with batch_size {self.batch_size} leaves no batch of a "
                              f"dataset of {self.n} samples; use a smaller batch_size or drop_last=False")

    @property
    def batches(self) -> int:
        """``B``: batches per round (per epoch of a consumer)."""
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    @property
    def used(self) -> int:
        """Samples per round (all of them, or all but the dropped tail)."""
        return self.batches * self.batch_size if self.drop_last else self.n

    @property
    def segment_batches(self) -> int:
        """``k``: whole batches per segment."""
        return -(-self.batches // min(self.segments, self.batches))

    def is_boundary(self, g: int) -> bool:
        """True if batch ``g`` starts a segment (a consumer's epoch may start there)."""
        return (g % self.batches) % self.segment_batches == 0

    def boundary_at_or_after(self, g: int) -> int:
        """The first segment boundary at or after batch ``g``."""
        b = g % self.batches
        k = self.segment_batches
        nxt = -(-b // k) * k
        return g - b + (nxt if nxt < self.batches else self.batches)

    def indices(self, g: int) -> list[int]:
        """The dataset indices of stream batch ``g`` (in the order they are collated)."""
        if g < 0:
            raise ValueError(f"batch number {g} < 0")
        rnd, b = divmod(g, self.batches)
        order = _round_order(self, rnd)
        lo = b * self.batch_size
        return [int(i) for i in order[lo:min(lo + self.batch_size, self.used)]]


@lru_cache(maxsize=4)
def _round_order(order: StreamOrder, rnd: int) -> np.ndarray:
    if not order.shuffle:  # the same order every round: any B batches from a boundary hold each sample once
        return np.arange(order.used, dtype=np.int64)
    base = np.random.default_rng([order.seed, 0x5EC]).permutation(order.n)
    width = order.segment_batches * order.batch_size
    out = np.empty(order.used, dtype=np.int64)
    for j, lo in enumerate(range(0, order.n, width)):
        seg = base[lo:lo + width]
        rng = np.random.default_rng([order.seed, rnd, j])
        seg = seg[rng.permutation(len(seg))]
        hi = min(lo + width, order.used)  # with drop_last, the dropped tail varies within the last segment
        if hi > lo:
            out[lo:hi] = seg[:hi - lo]
    return out
