"""The vocabulary of a run."""

from __future__ import annotations

__all__: list[str] = []
