"""The package's shape, checked on its source: no module reaches into another module's private
names, the top level stays small, and modules and functions stay short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hpcstagger"
SOURCES = sorted(PACKAGE.rglob("*.py"))

# Hot numeric loops of the model, kept whole: splitting them costs a call per integration step or
# event, and predict() has a 20 ms budget (benchmarks/RESULTS.md, section Makespan model).
LONG_KERNELS = {("model/_cachestate.py", "advance"), ("model/_engine.py", "run"), ("model/simulate.py", "simulate")}
# Private names of other code that are fine to use: the standard library's os._exit (leave without
# running atexit handlers), and hpcstagger's own tag on a user's optimizer object.
ALLOWED_ATTRS = {"_exit", "_hpcstagger_gate"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_defines(tree: ast.Module) -> set[str]:
    """Names of the classes defined in a module (their private members may be used module-wide)."""
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def cross_module_private_uses(path: Path, root: Path = PACKAGE) -> list[str]:
    """Private names this module takes from another module: ``from x import _y`` where ``_y`` is not
    a submodule, and ``obj._attr`` on anything but ``self``/``cls`` or an object of a class defined
    in this same module (recognised by a name annotated with, or assigned from, such a class)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(root)
    here = path.parent
    local_classes = _module_defines(tree)
    local_objects = {"self", "cls"}
    for node in ast.walk(tree):
        # names bound to this module's own classes: `led: Ledger`, `led = Ledger(...)`
        if isinstance(node, ast.arg) and isinstance(node.annotation, ast.Name) and node.annotation.id in local_classes:
            local_objects.add(node.arg)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(node.annotation, ast.Name) and node.annotation.id in local_classes:
            local_objects.add(node.target.id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id in local_classes:
            local_objects.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = here
            for _ in range(max(node.level - 1, 0)):
                base = base.parent
            if node.level:
                pkg: Path | None = base.joinpath(*(node.module or "").split("."))
            elif (node.module or "").split(".")[0] == root.name:
                pkg = root.parent.joinpath(*(node.module or "").split("."))
            else:
                pkg = None
            for alias in node.names:
                if not _is_private(alias.name):
                    continue
                submodule = pkg is not None and ((pkg / f"{alias.name}.py").exists() or (pkg / alias.name).is_dir())
                if not submodule:
                    found.append(f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {alias.name}")
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in ALLOWED_ATTRS:
            if isinstance(node.value, ast.Name) and node.value.id in local_objects:
                continue
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = [use for path in SOURCES for use in cross_module_private_uses(path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_sees_a_reach_in(tmp_path):
    """The checker flags what it is meant to flag (so an empty result above means something)."""
    pkg = tmp_path
    (pkg / "a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n\n"
                              "def ok(a: A):\n    return a._x\n")
    (pkg / "b.py").write_text("from .a import _helper\nfrom . import _priv_mod\n\ndef f(h):\n    h._done.set()\n")
    (pkg / "_priv_mod.py").write_text("")
    assert cross_module_private_uses(pkg / "a.py", pkg) == []
    uses = cross_module_private_uses(pkg / "b.py", pkg)
    assert [u.split(": ", 1)[1] for u in uses] == ["from .a import _helper", "h._done"], uses


def test_the_top_level_stays_small():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 11, modules


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PACKAGE)) for p in SOURCES])
def test_modules_and_functions_stay_short(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 500, f"{path.name} has {len(text.splitlines())} lines: split it by concept"
    rel = str(path.relative_to(PACKAGE))
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80
            and (rel, n.name) not in LONG_KERNELS]
    assert not long, f"{rel}: functions over 80 lines: {long}"
