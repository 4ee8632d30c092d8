"""The public API: a small top level, one lazy export mechanism in every package, and the names
taken out of the top level or a package still resolving for one release, with a DeprecationWarning
that names their new home. docs/api.md lists the same names."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import hpcstagger

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hpcstagger"
SUBPACKAGES = sorted(f"hpcstagger.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py"))
# The CLI's __init__ is its entry point (main, build_parser), not a map of re-exports.
CODE_PACKAGES = {"hpcstagger.cli"}

# What the top level exported before it was narrowed to a training script's names.
FORMER_TOP_LEVEL = {
    "Comm", "as_comm", "ConfigError", "DependencyError", "CollectiveError", "CollectiveTimeout", "CacheError",
    "CheckpointError", "LaunchError", "ModelError", "ThrottledSource", "load", "restore", "ActivityGate",
    "SharedActivityGate", "AnyGate", "StepGate", "Scenario", "Prediction", "predict", "simulate", "Plan",
    "optimal_plan", "calibrate",
}


def _resolve(dotted: str) -> Any:
    """What ``from <module> import <name>`` gives for ``dotted`` = ``<module>.<name>``."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _deprecated() -> list[tuple[str, str, str]]:
    """(package, name, message) of every deprecated name of every package."""
    out = []
    for package in ["hpcstagger", *SUBPACKAGES]:
        for name, (_, message) in getattr(importlib.import_module(package), "_DEPRECATED", {}).items():
            out.append((package, name, message))
    return out


def _public() -> list[tuple[str, str]]:
    return [(package, name) for package in ["hpcstagger", *SUBPACKAGES]
            for name in importlib.import_module(package).__all__]


# ---------------------------------------------------------------------------------- the top level
def test_the_top_level_is_what_a_training_script_uses():
    assert len(hpcstagger.__all__) <= 20, hpcstagger.__all__
    assert len(set(hpcstagger.__all__)) == len(hpcstagger.__all__)
    for name in ("init", "Session", "Spec", "ShmCache", "CachedDataset", "SharedLoader", "AsyncCheckpointer",
                 "load_checkpoint", "restore_checkpoint", "StallProfiler", "HpcstaggerError"):
        assert name in hpcstagger.__all__, name


def test_load_checkpoint_is_the_checkpoint_packages_load():
    from hpcstagger.checkpoint import load, load_checkpoint, restore, restore_checkpoint

    assert hpcstagger.load_checkpoint is load_checkpoint is load
    assert hpcstagger.restore_checkpoint is restore_checkpoint is restore


def test_every_former_top_level_name_is_deprecated_not_removed():
    top = {name for package, name, _ in _deprecated() if package == "hpcstagger"}
    assert FORMER_TOP_LEVEL <= top, FORMER_TOP_LEVEL - top


# ------------------------------------------------------------------------------- public names resolve
@pytest.mark.parametrize("package, name", _public(), ids=[f"{p}.{n}" for p, n in _public()])
def test_every_public_name_resolves_without_a_warning(package, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert getattr(importlib.import_module(package), name) is not None


# ---------------------------------------------------------------------------------- deprecated names
@pytest.mark.parametrize("package, name, message", _deprecated(), ids=[f"{p}.{n}" for p, n, _ in _deprecated()])
def test_a_deprecated_name_warns_and_is_its_new_home(package, name, message):
    module = importlib.import_module(package)
    assert name not in module.__all__
    assert name not in dir(module)
    match = re.fullmatch(rf"{re.escape(package)}\.{name} is deprecated; use (hpcstagger(\.\w+)+)", message)
    assert match, f"{package}.{name}: the warning names no new home: {message!r}"
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        value = getattr(module, name)
    assert value is _resolve(match.group(1))
    with pytest.warns(DeprecationWarning):  # every use warns, not only the first
        getattr(module, name)


def test_the_warning_points_at_the_caller():
    with pytest.warns(DeprecationWarning) as record:
        hpcstagger.predict  # noqa: B018  (the attribute access is what is tested)
    assert record[0].filename == __file__


def test_unknown_names_raise_attribute_error():
    for package in ["hpcstagger", *SUBPACKAGES]:
        with pytest.raises(AttributeError, match="no_such_name"):
            importlib.import_module(package).no_such_name  # noqa: B018


# ---------------------------------------------------------------------------- one export mechanism
def _init_tree(package: str) -> ast.Module:
    return ast.parse((PACKAGE / package.split(".")[1] / "__init__.py").read_text())


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_subpackage_exports_through_lazy_exports(package):
    tree = _init_tree(package)
    assigned = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    assert "__all__" in assigned, f"{package} has no explicit __all__"
    if package in CODE_PACKAGES:
        return
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    allowed = {"from __future__ import annotations", "from hpcstagger._lazy import lazy_exports",
               "from hpcstagger._lazy import lazy_exports, moved"}  # moved: the deprecated names' table
    assert set(imports) <= allowed, f"{package} imports eagerly: {sorted(set(imports) - allowed)}"
    if importlib.import_module(package).__all__:
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "lazy_exports" in calls, f"{package} exports names without lazy_exports"


@pytest.mark.parametrize("package", ["hpcstagger", *SUBPACKAGES])
def test_export_maps_use_absolute_module_paths(package):
    module = importlib.import_module(package)
    targets = [*getattr(module, "_EXPORTS", {}).values(), *(t for t, _ in getattr(module, "_DEPRECATED", {}).values())]
    relative = [t for t in targets if not t.startswith("hpcstagger.")]
    assert not relative, f"{package}: relative targets {relative}"


# --------------------------------------------------------------------- names that are also modules
PROBE_SHADOWED = r"""
import importlib, json, types
import hpcstagger.checkpoint.load, hpcstagger.model.simulate, hpcstagger.model.calibrate, hpcstagger.colocated.launch
import hpcstagger.checkpoint as ckpt, hpcstagger.model as model, hpcstagger.colocated as colocated
from hpcstagger.model import simulate
print(json.dumps({
    "load": callable(ckpt.load) and not isinstance(ckpt.load, types.ModuleType),
    "simulate": callable(model.simulate) and model.simulate is simulate,
    "calibrate": callable(model.calibrate) and not isinstance(model.calibrate, types.ModuleType),
    "launch": callable(colocated.launch) and not isinstance(colocated.launch, types.ModuleType),
    "module": isinstance(importlib.import_module("hpcstagger.checkpoint.load"), types.ModuleType),
}))
"""


def test_an_exported_function_wins_over_its_submodule_whatever_is_imported_first():
    out = subprocess.run([sys.executable, "-c", PROBE_SHADOWED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert all(result.values()), result


def test_import_model_imports_neither_numpy_nor_scipy():
    probe = ("import json, sys; import hpcstagger.model as m; m.Scenario; "
             "print(json.dumps({n: n in sys.modules for n in ('numpy', 'scipy', 'torch')}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not any(json.loads(out.stdout).values()), out.stdout


# ------------------------------------------------------------------- the repository's own uses
def _deprecated_uses(path: Path, deprecated: dict[str, set[str]]) -> list[str]:
    tree = ast.parse(path.read_text())
    aliases = {a.asname or a.name: a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names if a.name in deprecated}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in deprecated:
            found += [f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name in deprecated[node.module]]
        if isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            owner = aliases.get(owner, owner)
            if node.attr in deprecated.get(owner, ()):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {owner}.{node.attr}")
    return found


def test_the_repository_uses_no_deprecated_name():
    deprecated: dict[str, set[str]] = {}
    for package, name, _ in _deprecated():
        deprecated.setdefault(package, set()).add(name)
    paths = [p for d in ("hpcstagger", "tests", "benchmarks", "examples") for p in sorted((REPO / d).rglob("*.py"))]
    found = [use for p in paths if p != Path(__file__).resolve() for use in _deprecated_uses(p, deprecated)]
    assert not found, "deprecated names used:\n" + "\n".join(found)
