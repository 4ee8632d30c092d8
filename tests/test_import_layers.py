"""The package's import graph is a DAG of declared layers, and imports inside functions keep imports cheap.

Layers, lowest first. A module may import its own layer group and any lower layer, never a higher
one nor a sibling group of its own layer. Every import counts: at the top, inside functions, under
``TYPE_CHECKING`` and in a package's lazy export table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.imports import Graph

PACKAGE = Path(__file__).resolve().parents[1] / "hpcstagger"

LAYERS: list[list[tuple[str, ...]]] = [
    [("hpcstagger._version", "hpcstagger._lazy", "hpcstagger.errors", "hpcstagger.config", "hpcstagger._io",
      "hpcstagger._schema")],                                        # the floor
    [("hpcstagger.comm",), ("hpcstagger.nodeload",), ("hpcstagger.slurm",)],
    [("hpcstagger.cache",)],                                         # the node cache and its sources
    [("hpcstagger.checkpoint",), ("hpcstagger.loader",), ("hpcstagger.model",)],
    [("hpcstagger.profile",), ("hpcstagger.integrations",)],
    [("hpcstagger.spec",)],                                          # the vocabulary of a run
    [("hpcstagger.stagger",)],                                       # deciding the stagger
    [("hpcstagger.colocated",)],                                     # the run
    [("hpcstagger",)],                                               # the public names (lazy)
    [("hpcstagger.measure",)],                                       # tools over whole runs
    [("hpcstagger.demo",)],
    [("hpcstagger.cli", "hpcstagger.__main__")],
]


def place(module: str) -> tuple[int, int] | None:
    """(layer, group) of ``module``: the group with the longest prefix of its name."""
    best: tuple[int, int, int] | None = None
    for i, groups in enumerate(LAYERS):
        for j, group in enumerate(groups):
            for prefix in group:
                if module == prefix or module.startswith(prefix + "."):
                    if best is None or len(prefix) > best[2]:
                        best = (i, j, len(prefix))
    return None if best is None else best[:2]


def against_layers(graph: Graph) -> list[str]:
    bad = []
    for e in graph.own():
        a, b = place(e.src), place(e.dst)
        if a is None or b is None:
            continue
        if b[0] > a[0] or (b[0] == a[0] and b[1] != a[1]):
            where = "lazy export" if e.lazy_export else f"line {e.line}" + (" (in a function)" if e.in_function else "")
            bad.append(f"{e.src} -> {e.dst} ({where})")
    return bad


@pytest.fixture(scope="module")
def graph() -> Graph:
    return Graph(PACKAGE)


def test_every_module_has_a_layer(graph):
    assert not [m for m in graph.paths if place(m) is None]


def test_no_import_loops(graph):
    assert not graph.cycles(), "import loops:\n" + "\n".join(" <-> ".join(c) for c in graph.cycles())


def test_no_import_against_the_layers(graph):
    bad = against_layers(graph)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


# Modules whose functions may defer any import, and why: the command line imports every
# subcommand's module to build its parser, so each loads what it runs only when it runs, and
# `hpcstagger --help` (or any one subcommand) does not load the planner, the run and the cache.
DEFERRING = ("hpcstagger.cli.cmd_",)


def test_imports_inside_functions_only_defer_heavy_modules(graph):
    """An import inside a function defers a heavy module (torch, numpy, mpi4py, h5py, matplotlib, or
    a module of the package that loads one at its top); every other import sits at the module's top."""
    heavy = graph.heavy()
    light = [f"{e.src}:{e.line} imports {e.dst}" for e in graph.edges
             if e.in_function and not e.lazy_export and e.dst.split(".")[0] == "hpcstagger" and e.dst not in heavy
             and e.dst in graph.paths and not e.src.startswith(DEFERRING)]
    assert not light, "imports inside functions of modules that are cheap to import:\n" + "\n".join(light)


def test_the_checks_see_a_loop_a_layer_breach_and_a_needless_deferral(tmp_path):
    """Each check flags what it is meant to flag, so empty results above mean something."""
    pkg = tmp_path / "hpcstagger"
    for sub in ("cache", "spec"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cache" / "a.py").write_text("from hpcstagger.spec import b\n")
    (pkg / "spec" / "b.py").write_text("def f():\n    from hpcstagger.cache import a\n")
    (pkg / "spec" / "c.py").write_text("def g():\n    import numpy\n    from hpcstagger.spec import b\n")
    g = Graph(pkg)
    assert g.cycles() == [["hpcstagger.cache.a", "hpcstagger.spec.b"]]
    assert against_layers(g) == ["hpcstagger.cache.a -> hpcstagger.spec.b (line 1)"]
    deferred = [(e.src, e.dst) for e in g.edges if e.in_function and e.dst in g.paths and e.dst not in g.heavy()]
    assert ("hpcstagger.spec.c", "hpcstagger.spec.b") in deferred
    assert "numpy" not in g.paths and g.heavy() == set()
