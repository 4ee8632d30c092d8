"""Tools over whole runs."""

from __future__ import annotations

__all__: list[str] = []
