"""Lazy re-exports for package ``__init__`` modules: a name's module is imported on first use.

Every package of hpcstagger with public names declares them the same way::

    _EXPORTS = {"ShmCache": "hpcstagger.cache.store", "load_checkpoint": "hpcstagger.checkpoint.load:load"}
    _DEPRECATED = {"key_hash": ("hpcstagger.cache.store", "hpcstagger.cache.key_hash is deprecated; use ...")}
    __all__ = [...]
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), _DEPRECATED)

A target is an absolute module path, or ``"module:attribute"`` where the exported name differs
from the module's own name for the object.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any
from collections.abc import Callable, Mapping


def _load(target: str, name: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr or name)


def moved(package: str, homes: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The ``deprecated`` table of :func:`lazy_exports` for names of ``package`` that now live in
    the module ``homes[name]``: each warns "<package>.<name> is deprecated; use <module>.<name>"."""
    return {name: (module, f"{package}.{name} is deprecated; use {module}.{name}") for name, module in homes.items()}


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any],
                 deprecated: Mapping[str, tuple[str, str]] | None = None,
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``exports`` map names to targets.

    A target is an absolute module path (``"hpcstagger.cache.store"``), or ``"module:attribute"``
    for an alias. A resolved public name is cached in ``namespace`` (the package's globals), so it
    is looked up once. ``deprecated`` maps names kept for one release to ``(target, message)``:
    each access warns with ``message`` (a :class:`DeprecationWarning` pointing at the caller) and
    the name is neither cached nor listed by ``dir()``.

    An exported name that is also the name of a submodule (``hpcstagger.checkpoint.load``, the
    function, and ``hpcstagger.checkpoint.load``, the module) stays the exported object: importing
    the submodule does not replace the package's attribute with the module, whichever comes first.
    Reach such a module with :func:`importlib.import_module`.

    Raises :class:`AttributeError` for any other name.
    """
    old = deprecated or {}

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = namespace[name] = _load(exports[name], name)
            return value
        if name in old:
            target, message = old[name]
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return _load(target, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    _keep_exports_over_submodules(package, exports, __getattr__)
    return __getattr__, __dir__


def _keep_exports_over_submodules(package: str, exports: Mapping[str, str],
                                  resolve: Callable[[str], Any]) -> None:
    """The import system sets a package's attribute to each submodule it imports; for a submodule
    named like a name the package exports from it, set the exported object instead."""
    shadowed = {name for name, target in exports.items() if target.partition(":")[0] == f"{package}.{name}"}
    if not shadowed:
        return

    class _Package(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if name in shadowed and isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}":
                value = resolve(name)
            super().__setattr__(name, value)

    sys.modules[package].__class__ = _Package
