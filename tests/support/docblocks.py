"""Runnable examples in the docs: a fenced ``python`` block right after a line
``<!-- runnable: NAME -->`` is an example a test runs as it stands, in a fresh directory that the
test has prepared (the data the example names), under a private shm root.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_MARK = re.compile(r"^<!--\s*runnable:\s*([\w.-]+)\s*-->\s*$")


def runnable_blocks(path: str | os.PathLike[str]) -> dict[str, str]:
    """Each runnable block of the markdown file ``path``, by name. A mark not followed by a fenced
    python block, or a name used twice, raises ValueError (a test should fail on it)."""
    lines = Path(path).read_text().splitlines()
    out: dict[str, str] = {}
    i = 0
    while i < len(lines):
        m = _MARK.match(lines[i].strip())
        i += 1
        if not m:
            continue
        name = m.group(1)
        if name in out:
            raise ValueError(f"{path}: runnable example {name!r} is named twice")
        if i >= len(lines) or not re.match(r"^\s*```\s*python\s*$", lines[i]):
            raise ValueError(f"{path}:{i}: the mark of {name!r} is not followed by a ```python block")
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        out[name] = "\n".join(body) + "\n"
    return out


def named_blocks(path: str | os.PathLike[str], names: tuple[str, ...]) -> dict[str, str]:
    """:func:`runnable_blocks` of ``path``; AssertionError naming any of ``names`` it lacks."""
    blocks = runnable_blocks(path)
    missing = [name for name in names if name not in blocks]
    assert not missing, (f"{path} lost its runnable example(s) {missing}: a <!-- runnable: NAME --> line right "
                         f"before a ```python block")
    return blocks


def run_block(code: str, cwd: str | os.PathLike[str], shm_root: str, timeout: float = 300) -> str:
    """Run ``code`` with this interpreter in ``cwd`` (the repository importable, the shm root
    private); return its stdout. AssertionError with its output when it fails."""
    env = dict(os.environ, HPCSTAGGER_SHM_ROOT=shm_root, PYTHONPATH=os.pathsep.join(
        [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    script = Path(cwd) / "example.py"
    script.write_text("import support.torchvision_cpu  # noqa: F401  (see tests/support/torchvision_cpu.py)\n"
                      + code)
    p = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"the example exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p.stdout
