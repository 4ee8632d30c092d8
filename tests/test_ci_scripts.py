"""The CI scripts: scripts/check-tree (the suite leaves the checkout as it found it), the PYTHON
handling of scripts/install-horovod, each run on a throwaway git repository, and the stages of
scripts/run-tests, run with a stand-in Python that logs its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.cli import REPO

pytestmark = pytest.mark.timeout(60)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=30,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def repo(tmp_path):
    """A git checkout with scripts/check-tree, a tracked file, an ignored venv and a .gitignore."""
    r = tmp_path / "repo"
    (r / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "check-tree", r / "scripts" / "check-tree")
    (r / "tracked.txt").write_text("one\n")
    (r / ".gitignore").write_text(".venv/\n__pycache__/\n/runs-*/\n")  # as in this repository
    _git(r, "init", "-q")
    _git(r, "add", "-A")
    _git(r, "commit", "-qm", "init")
    (r / ".venv").mkdir()
    (r / ".venv" / "python").write_text("")
    (r / "pkg" / "__pycache__").mkdir(parents=True)
    return r


def _check(repo: Path, action: str, snap: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "check-tree"), action, str(snap)], capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("litter, shown", [
    (lambda r: (r / "new.json").write_text("{}"), "?? new.json"),
    (lambda r: (r / "tracked.txt").write_text("two\n"), " M tracked.txt"),
    (lambda r: (r / "tracked.txt").unlink(), " D tracked.txt"),
    (lambda r: (r / "runs-1" / "a.0.json").parent.mkdir() or (r / "runs-1" / "a.0.json").write_text("{}"),
     "!! runs-1/"),  # ignored by .gitignore, and still litter
])
def test_check_tree_reports_what_the_tests_added_or_changed(repo, tmp_path, litter, shown):
    snap = tmp_path / "snap"
    assert _check(repo, "snapshot", snap).returncode == 0
    assert _check(repo, "compare", snap).returncode == 0  # nothing happened yet
    litter(repo)
    out = _check(repo, "compare", snap)
    assert out.returncode == 1, out
    assert "the checkout gained or changed these entries" in out.stderr and shown in out.stderr, out.stderr


def test_check_tree_ignores_pycache_and_what_was_there_before(repo, tmp_path):
    (repo / "tracked.txt").write_text("edited before the tests\n")
    snap = tmp_path / "snap"
    out = _check(repo, "snapshot", snap)
    assert out.returncode == 0 and "local changes already" in out.stdout
    (repo / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"")
    (repo / "tests" / "__pycache__").mkdir(parents=True)
    assert _check(repo, "compare", snap).returncode == 0
    (repo / "tracked.txt").write_text("edited by a test\n")  # the same file, changed again
    assert _check(repo, "compare", snap).returncode == 1


def test_check_tree_usage_errors(repo, tmp_path):
    out = _check(repo, "compare", tmp_path / "missing")
    assert out.returncode == 2 and "no snapshot" in out.stderr
    out = _check(repo, "bogus", tmp_path / "x")
    assert out.returncode == 2 and "usage" in out.stderr


def test_install_horovod_resolves_a_relative_python_before_changing_directory(tmp_path):
    """The build runs in the sdist's directory, where a relative PYTHON=.venv/bin/python named nothing.
    A fake venv whose python logs the directory it ran in and which path it was called by shows
    that every call after the first check uses an absolute path."""
    venv = tmp_path / "proj" / ".venv" / "bin"
    venv.mkdir(parents=True)
    log = tmp_path / "calls.log"
    fake = venv / "python"
    # 'import torch' succeeds; 'import horovod...' (the already-installed check) fails; the tag query
    # prints a tag; 'pip download' fails, which ends the script with its own error message.
    fake.write_text(f"""#!/bin/bash
echo "$0 $PWD $*" >> {log}
case "$*" in
  "-c import torch") exit 0 ;;
  -c*sys.version_info*) echo py311-torchX; exit 0 ;;
  -) exit 1 ;;
  *) exit 1 ;;
esac
""")
    fake.chmod(0o755)
    for tool in ("mpicxx", "cmake"):
        (venv / tool).write_text("#!/bin/bash\necho fake\n")
        (venv / tool).chmod(0o755)
    env = {**os.environ, "PYTHON": ".venv/bin/python", "HPCSTAGGER_WHEEL_CACHE": str(tmp_path / "wheels")}
    out = subprocess.run(["bash", str(REPO / "scripts" / "install-horovod")], cwd=tmp_path / "proj", env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "could not download the horovod" in out.stderr, out.stderr
    calls = log.read_text().splitlines()
    assert len(calls) >= 3, calls
    assert all(c.split()[0] == str(fake) for c in calls), calls  # $0: always the absolute path


@pytest.fixture
def fake_python(tmp_path):
    """A venv bin directory whose python logs its arguments (one line per call) and exits with
    $FAKE_PYTEST_RC for pytest and 0 for ruff and mypy; its mpiexec drops '-n N' and runs the rest."""
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    log = tmp_path / "calls.log"
    (bin_ / "python").write_text(f"""#!/bin/bash
echo "$*" >> {log}
case "$2" in pytest) exit ${{FAKE_PYTEST_RC:-0}} ;; *) exit 0 ;; esac
""")
    (bin_ / "mpiexec").write_text('#!/bin/bash\nshift 2\nexec "$@"\n')
    for f in ("python", "mpiexec"):
        (bin_ / f).chmod(0o755)
    return bin_ / "python", log


def _run_tests(fake, *args, **env):
    python, log = fake
    return subprocess.run(["bash", str(REPO / "scripts" / "run-tests"), *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "PYTHON": str(python), **env})


def test_run_tests_runs_the_serial_suite_on_workers_then_the_alone_tests(fake_python):
    out = _run_tests(fake_python, HPCSTAGGER_TEST_WORKERS="3")
    assert out.returncode == 0, out.stdout + out.stderr
    pytests = [c for c in fake_python[1].read_text().splitlines() if c.startswith("-m pytest")]
    assert len(pytests) == 5, pytests  # serial, alone, and mpiexec -n 1, 2, 4
    assert "-m not mpi and not alone -n 3 " in pytests[0]
    assert "-m not mpi and alone " in pytests[1] and " -n " not in pytests[1]
    assert all("--with-mpi -m mpi" in c for c in pytests[2:])


def test_run_tests_fails_a_stage_that_collects_nothing_unless_the_arguments_deselected_it(fake_python):
    out = _run_tests(fake_python, FAKE_PYTEST_RC="5")
    assert out.returncode == 1 and out.stdout.count("no tests were collected (pytest exit 5): failing") == 5
    out = _run_tests(fake_python, "-k", "nothing_matches", FAKE_PYTEST_RC="5")
    assert out.returncode == 0, out.stdout
    assert "=== alone: the arguments given (-k nothing_matches) selected no test of this stage" in out.stdout
    out = _run_tests(fake_python, "-k", "x", FAKE_PYTEST_RC="1")
    assert out.returncode == 1 and "serial: FAILED (exit 1)" in out.stdout


def test_run_tests_refuses_a_worker_count_that_is_not_a_number(fake_python):
    out = _run_tests(fake_python, HPCSTAGGER_TEST_WORKERS="two")
    assert out.returncode == 1
    assert "HPCSTAGGER_TEST_WORKERS=two is not a whole number" in out.stderr
    assert not fake_python[1].exists()  # nothing ran
