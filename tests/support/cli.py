"""Running this checkout's ``hpcstagger`` and the venv's launchers (mpiexec) in subprocesses."""

from __future__ import annotations

import os
import signal
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


def interruptible() -> None:
    """For ``preexec_fn``: the child takes Ctrl-C (SIGINT) as a terminal's foreground process does,
    even when this test run inherited SIGINT ignored (a shell's background job; ``nohup``), which an
    exec'd program keeps."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m hpcstagger ARGS`` in a subprocess and capture its output.

    Past ``timeout`` the command is interrupted (SIGINT, as Ctrl-C: ``hpcstagger launch`` then stops
    its run's process group, which a SIGKILL of the launcher would leave running) and the test
    fails with the command's whole output."""
    argv = [sys.executable, "-m", "hpcstagger", *args]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or cli_env(),
                          cwd=cwd, preexec_fn=interruptible) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(f"'hpcstagger {' '.join(args)}' ran past {timeout:g} s and was interrupted; "
                                 f"its output:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
