"""The import graph of a package, read from its source: every import, where it sits and what it names.

An import is an edge from the importing module to the module it loads: ``from a.b import c`` names
``a.b.c`` when that is a module, else ``a.b``; a lazily exported name of a package's ``__init__``
(its ``_EXPORTS``) names the module that defines it. Imports inside functions, under
``if TYPE_CHECKING:`` and in a package's lazy export tables all count: each is a dependency, even
when it is not paid at import time.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Third-party modules whose import costs a second or pulls in a large runtime: an hpcstagger module
# may import these (or an hpcstagger module that imports them at its top) inside a function, to
# keep `import hpcstagger` and the command line cheap.
HEAVY = frozenset({"torch", "numpy", "scipy", "h5py", "mpi4py", "matplotlib", "PIL", "torchvision", "lmdb",
                   "webdataset", "horovod"})


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    in_function: bool
    type_only: bool
    lazy_export: bool = False


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exports(tree: ast.Module) -> dict[str, str]:
    """A package ``__init__``'s lazy export table: name -> module (``"module:attr"`` targets too)."""
    out: dict[str, str] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id.startswith("_EXPORTS") and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                    out[str(k.value)] = v.value.split(":")[0]
    return out


class Graph:
    """The modules of the package at ``root`` and every import between them (and to HEAVY ones)."""

    def __init__(self, root: Path):
        self.root = root
        self.paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
        self.trees = {m: ast.parse(p.read_text()) for m, p in self.paths.items()}
        self.exports = {m: _exports(t) for m, t in self.trees.items() if self.paths[m].name == "__init__.py"}
        self.edges = [e for m in self.paths for e in self._edges_of(m)]

    def _resolve(self, module: str, name: str) -> str:
        full = f"{module}.{name}"
        if full in self.paths:
            return full
        target = self.exports.get(module, {}).get(name)
        if target is not None:
            return target if target.startswith(self.root.name) else f"{module}.{target}"
        return module

    def _edges_of(self, m: str) -> list[Edge]:
        is_pkg = self.paths[m].name == "__init__.py"
        found: list[Edge] = []

        def visit(node: ast.AST, in_fn: bool, type_only: bool) -> None:
            for c in ast.iter_child_nodes(node):
                f = in_fn or isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                t = type_only or (isinstance(c, ast.If) and "TYPE_CHECKING" in ast.unparse(c.test))
                if isinstance(c, ast.Import):
                    found.extend(Edge(m, a.name, c.lineno, f, t) for a in c.names)
                elif isinstance(c, ast.ImportFrom):
                    base = (m.split(".") if is_pkg else m.split(".")[:-1])
                    base = base[:len(base) - c.level + 1] if c.level else []
                    mod = ".".join(base + [c.module]) if c.module else ".".join(base)
                    found.extend(Edge(m, self._resolve(mod, a.name), c.lineno, f, t) for a in c.names)
                visit(c, f, t)

        visit(self.trees[m], False, False)
        found.extend(Edge(m, target if target.startswith(self.root.name) else f"{m}.{target}", 0, True, False, True)
                     for target in self.exports.get(m, {}).values())
        return found

    def own(self) -> list[Edge]:
        """The edges between two different modules of the package."""
        return [e for e in self.edges if e.dst in self.paths and e.src != e.dst]

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module (Tarjan's algorithm)."""
        succ: dict[str, set[str]] = {m: set() for m in self.paths}
        for e in self.own():
            succ[e.src].add(e.dst)
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on: set[str] = set()
        out: list[list[str]] = []

        def strong(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on.add(v)
            for w in succ[v]:
                if w not in index:
                    strong(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        for v in succ:
            if v not in index:
                strong(v)
        return out

    def heavy(self) -> set[str]:
        """Modules whose import (at their top level, transitively) loads a HEAVY module."""
        top: dict[str, set[str]] = {}
        for e in self.edges:
            if not e.in_function and not e.type_only:
                top.setdefault(e.src, set()).add(e.dst)
        memo: dict[str, bool] = {}

        def is_heavy(m: str, seen: frozenset[str]) -> bool:
            if m.split(".")[0] in HEAVY:
                return True
            if m not in self.paths or m in seen:
                return False
            if m not in memo:
                memo[m] = any(is_heavy(d, seen | {m}) for d in top.get(m, ()))
            return memo[m]

        return {m for m in self.paths if is_heavy(m, frozenset())}
