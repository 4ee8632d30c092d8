"""Combining a source's repeated level measurements into one curve: which measurements are
trusted (a window long enough to say something of the source), and each level's median, with
every measurement counted by its window (:func:`combine_levels`). Used by calibration
(:mod:`hpcstagger.model.source_probe` measures the levels) and by the scenario it writes.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Mapping, Sequence

__all__ = ["MIN_WINDOW_S", "SHORT_SHARE", "SPREAD_LIMIT", "trusted_bandwidth", "weighted_median", "combine_levels",
           "disagreeing"]

SPREAD_LIMIT = 0.10      # measurements of one level further apart than this share are measured again
MIN_WINDOW_S = 0.05  # a level measured over less than this, or a tenth of its run, is not trusted


def trusted_bandwidth(levels: Sequence[Mapping[str, Any]]) -> tuple[list[float], str]:
    """Each level's bandwidth, with any level after the first whose readers overlapped for too
    short a window (under :data:`MIN_WINDOW_S`, or under a tenth of its run: its samples came
    from somewhere faster than the source, such as pages still cached) replaced by the level
    before it; and a note naming the levels replaced ("" when none was)."""
    out: list[float] = []
    held = []
    for k, m in enumerate(levels):
        window = _window(m)
        if k and _too_short(m):
            out.append(out[-1])
            held.append(f"{m['readers']} reader(s) ({m['bandwidth'] / 1e6:.1f} MB/s over {window:.3f} s)")
        else:
            out.append(float(m["bandwidth"]))
    note = (f"; not trusted, too short a window, so the level before holds: {', '.join(held)}" if held else "")
    return out, note


SHORT_SHARE = 1 / 3  # a measurement over less than this share of its level's longest window is not trusted


def _window(m: Mapping[str, Any]) -> float:
    return float(m.get("window_s", 1.0))


def _too_short(m: Mapping[str, Any]) -> bool:
    """A window under :data:`MIN_WINDOW_S` or a tenth of its run: its samples came from somewhere
    faster than the source, such as pages still cached."""
    window = _window(m)
    return window < MIN_WINDOW_S or window < 0.1 * float(m.get("elapsed_s", 0.0))


def _trusted(m: Mapping[str, Any], longest: float) -> bool:
    """Whether a measurement counts: over a window of at least :data:`MIN_WINDOW_S`, a tenth of its
    run (see :func:`trusted_bandwidth`) and :data:`SHORT_SHARE` of ``longest``, the longest window
    its level was measured over. A short window says little of a source that delivers in bursts
    (a kernel throttle lets reads through at the start of each slice), so a longer one outweighs it."""
    return not (_too_short(m) or _window(m) < SHORT_SHARE * longest)


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The median of ``(value, weight)`` pairs, each value counted by its weight: the value at which
    half the total weight lies on either side, or the mean of the two values that meet at exactly
    half (so equal weights give the usual median). Raises ValueError when ``pairs`` is empty."""
    if not pairs:
        raise ValueError("weighted_median of no values")
    ordered = sorted((float(v), max(float(w), 0.0)) for v, w in pairs)
    total = sum(w for _, w in ordered)
    if total <= 0:
        ordered = [(v, 1.0) for v, _ in ordered]
        total = float(len(ordered))
    half, acc = total / 2, 0.0
    for i, (value, weight) in enumerate(ordered):
        acc += weight
        if math.isclose(acc, half, rel_tol=1e-9) and i + 1 < len(ordered):
            return (value + ordered[i + 1][0]) / 2
        if acc > half:
            return value
    return ordered[-1][0]


def combine_levels(levels: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float], str]:
    """The curve of repeated measurements of the levels 1 .. K (in any order, each level at least
    once): per level the median of its trusted measurements, each counted by its window
    (:func:`weighted_median`, :func:`_trusted`; a level with none holds the level before, as
    :func:`trusted_bandwidth` does, and the first level with none keeps its longest); the spread
    of those measurements ((max - min) / that median; 0 with one), and a note naming the
    measurements not trusted ("" when none)."""
    top = max(int(m["readers"]) for m in levels)
    curve: list[float] = []
    spread: list[float] = []
    held = []
    for k in range(1, top + 1):
        mine = [m for m in levels if int(m["readers"]) == k]
        longest = max((_window(m) for m in mine), default=0.0)
        kept = [m for m in mine if _trusted(m, longest)]
        if not kept and not curve and mine:  # nothing before it to hold: the longest measurement stands
            kept = [max(mine, key=_window)]
        held += [f"{k} reader(s) ({m['bandwidth'] / 1e6:.1f} MB/s over {_window(m):.3f} s)"
                 for m in mine if not any(m is t for t in kept)]
        if not kept:
            curve.append(curve[-1])
            spread.append(spread[-1])
            continue
        middle = weighted_median([(float(m["bandwidth"]), _window(m)) for m in kept])
        values = [float(m["bandwidth"]) for m in kept]
        curve.append(middle)
        spread.append((max(values) - min(values)) / middle if len(values) > 1 and middle > 0 else 0.0)
    note = (f"; not trusted, too short a window: {', '.join(held)}" if held else "")
    return curve, spread, note


def disagreeing(levels: Sequence[Mapping[str, Any]], limit: float = SPREAD_LIMIT) -> list[int]:
    """The reader counts whose repeated measurements lie further apart than ``limit`` (a share)."""
    _, spread, _ = combine_levels(levels)
    return [k for k, s in enumerate(spread, start=1) if s > limit]
