"""What must live in a conftest: the session hooks, the hypothesis profile, and the registration
of the suite's fixtures (support/fixtures.py). Utilities live in support/ and tests import them
from there (``from support.cli import run_cli``), never from this file.

pytest puts tests/ on sys.path before it imports this file (tests/ is no package, so the default
"prepend" import mode inserts it), which makes ``support`` importable here and in the tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from support.cli import in_ci
from support.shm import new_shm_entries, remove_stale_mpich_segments

# Fixtures: slurm_cluster, slurm_two_nodes, batch_job, batch_job_on, shm_root, jobs. pytest allows this
# only in a conftest it loads at start-up (this one is, for every run under tests/), not in one
# it finds while collecting.
pytest_plugins = ["support.fixtures"]

# Property tests are derandomized (the same examples on every run, so a red run is reproducible)
# and keep no example database. Hypothesis's other caches go to a temporary directory removed at
# the end, not to .hypothesis/ in the checkout.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="hpcstagger-hypothesis-")
try:
    from hypothesis import settings as _hypothesis_settings
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # pragma: no cover - the test extra brings it
    pass
else:
    set_hypothesis_home_dir(_HYPOTHESIS_HOME)
    _hypothesis_settings.register_profile("hpcstagger", derandomize=True, database=None)
    _hypothesis_settings.load_profile("hpcstagger")


def pytest_unconfigure(config):
    shutil.rmtree(_HYPOTHESIS_HOME, ignore_errors=True)


# ---------------------------------------------------------------------------- /dev/shm hygiene
_SESSION_START = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Clean MPICH leftovers of aborted runs, then fail (under CI) if a test left /dev/shm files.

    Under pytest-xdist only the controller looks, once every worker has finished: a worker that
    finishes first would see the entries of tests still running in the others."""
    if hasattr(session.config, "workerinput"):
        return
    remove_stale_mpich_segments(_SESSION_START)
    rank = os.environ.get("PMI_RANK", "0")
    if rank != "0":
        return  # under mpiexec, rank 0 reports for all
    leftovers = [str(p) for p in new_shm_entries(_SESSION_START)]
    if leftovers:
        msg = f"tests left {len(leftovers)} entr(y/ies) in /dev/shm: {', '.join(sorted(leftovers)[:10])}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"{'ERROR' if in_ci() else 'WARNING'}: {msg}", red=True)
        if in_ci() and session.exitstatus == 0:
            session.exitstatus = 1
