"""Lazy re-exports for package ``__init__`` modules: a name's module is imported on first use."""

from __future__ import annotations

import importlib
from typing import Any
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``exports`` map names to modules.

    A module is given relative to the package (``"store"``) or absolute (``"hpcstagger.comm"``).
    A resolved name is cached in ``namespace`` (the package's globals), so it is looked up once.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        full = module if module.startswith("hpcstagger") else f"{package}.{module}"
        value = getattr(importlib.import_module(full), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
