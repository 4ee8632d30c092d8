"""`import hpcstagger` is cheap and has no side effects."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, logging, sys, time
handlers_before = list(logging.getLogger().handlers)
t = time.perf_counter()
import hpcstagger
elapsed = time.perf_counter() - t
names = {n: n in sys.modules for n in ("torch", "mpi4py", "numpy", "h5py", "scipy", "matplotlib")}
hpcstagger.HpcstaggerError, hpcstagger.Spec  # lazy names resolve without heavy imports
after = {n: n in sys.modules for n in ("torch", "mpi4py")}
print(json.dumps({"elapsed": elapsed, "modules": names, "after_names": after,
                  "handlers_changed": logging.getLogger().handlers != handlers_before}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_import_is_fast_and_imports_neither_torch_nor_mpi4py():
    runs = [_probe() for _ in range(3)]
    best = min(r["elapsed"] for r in runs)
    assert best < 0.3, f"import hpcstagger took {best:.3f} s (best of 3)"
    for r in runs:
        assert not any(r["modules"].values()), r["modules"]
        assert not any(r["after_names"].values()), r["after_names"]
        assert not r["handlers_changed"]


def test_public_names_resolve_and_unknown_names_raise():
    import hpcstagger

    for name in hpcstagger.__all__:
        assert getattr(hpcstagger, name) is not None
    try:
        hpcstagger.no_such_thing  # noqa: B018  (the attribute access is what is tested)
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("unknown attribute did not raise")
