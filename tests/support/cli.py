"""Running this checkout's ``hpcstagger`` and the venv's launchers (mpiexec) in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for running ``hpcstagger`` and ``mpiexec`` from this interpreter's venv."""
    env = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    env.pop("MPIR_CVAR_PMI_VERSION", None)
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m hpcstagger ARGS`` in a subprocess and capture its output."""
    return subprocess.run([sys.executable, "-m", "hpcstagger", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env(), cwd=cwd)
