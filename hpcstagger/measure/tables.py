"""Small text utilities shared by the CLI and the demo: byte counts and aligned tables."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

__all__ = ["human_bytes", "table"]


def human_bytes(n: Any) -> str:
    """``n`` bytes in binary units (``"4.9 KiB"``); ``"?"`` when ``n`` is not a number."""
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return "?"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(round(x))} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(n)  # not reached


def table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as left-aligned columns two spaces apart (the first row is the header)."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
