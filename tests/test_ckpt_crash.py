"""Crash consistency: training that saves often is SIGKILLed at random moments.

After every kill, the newest committed checkpoint loads (never a partial one), it is bit for bit
one of the snapshots the run took, every committed checkpoint passes a full verify, and resuming
from it reproduces the uninterrupted run's final parameters bit for bit. Children are forked from
a forkserver that has already imported torch, so each trial costs milliseconds to start.
Trials run in pairs. The seed is HPCSTAGGER_TEST_SEED (default 4), printed on failure.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib
import random
import shutil
import tempfile
import threading
import time

import pytest

from hpcstagger.checkpoint.catalog import scan
from hpcstagger.checkpoint.load import verify_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRIALS = 20
STEPS = 60
SAVE_EVERY = 2


@pytest.fixture
def shm_path():
    """A directory in /dev/shm: a SIGKILL leaves the page cache intact, so fsync latency (tens of
    milliseconds per call on this machine's disk) would only slow the trials down."""
    d = tempfile.mkdtemp(prefix="hpcstagger-test-crash-", dir="/dev/shm")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["support.ckpt_crash_child"])
    # The forkserver finds modules through PYTHONPATH only (Python 3.11 ignores the parent's sys.path
    # there, and a failed preload is silent), so put this directory (the one that holds support/) on
    # it while the server starts.
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here)] + ([saved] if saved else []))
    try:
        p = c.Process(target=_preloaded)  # starts the forkserver (imports torch) before any timing
        p.start()
        p.join(120)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    assert p.exitcode == 0, "the forkserver did not preload support.ckpt_crash_child"
    return c


def _preloaded():
    import sys

    sys.exit(0 if "support.ckpt_crash_child" in sys.modules else 1)


def _start(ctx, directory, out, progress=None, **kw):
    from support import ckpt_crash_child

    p = ctx.Process(target=ckpt_crash_child.run, args=(str(directory), str(out)),
                    kwargs=dict(steps=STEPS, save_every=SAVE_EVERY, progress=progress, **kw))
    p.start()
    return p


def _join(p, timeout=120):
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(10)
        raise AssertionError("a training child did not finish in time")
    assert p.exitcode == 0, f"training child exited with {p.exitcode}"


def _kill_at(p, progress, step, delay, deadline=120):
    """SIGKILL ``p`` ``delay`` seconds after it starts training step ``step``: kills land at random
    moments of the run however fast this (shared) machine is today."""
    end = time.monotonic() + deadline
    while progress.value < step and p.is_alive() and time.monotonic() < end:
        time.sleep(0.0005)
    time.sleep(delay)
    p.kill()
    p.join(30)


def test_sigkill_at_random_moments_never_breaks_a_checkpoint(ctx, shm_path):
    tmp_path = shm_path
    seed = int(os.environ.get("HPCSTAGGER_TEST_SEED", "4"))
    rng = random.Random(seed)
    ref = _start(ctx, tmp_path / "ref", tmp_path / "ref.json", resume=False, record=True)
    _join(ref)
    reference = json.loads((tmp_path / "ref.json").read_text())
    saves = {int(k): v for k, v in reference["saves"].items()}
    assert len(saves) == (STEPS + SAVE_EVERY - 1) // SAVE_EVERY

    outcomes = []
    for pair in range(TRIALS // 2):
        trials = []
        for j in range(2):
            d = tmp_path / f"t{pair}-{j}"
            progress = ctx.Value("i", -1, lock=False)
            at, delay = rng.randrange(STEPS), rng.uniform(0.0, 0.02)
            p = _start(ctx, d, tmp_path / f"killed-{d.name}.json", progress=progress, resume=False, record=False)
            trials.append((d, at, delay, p, progress))
        killers = [threading.Thread(target=_kill_at, args=(p, progress, at, delay))
                   for d, at, delay, p, progress in trials]
        for k in killers:
            k.start()
        for k in killers:
            k.join()
        resumed = []
        for d, at, delay, p, _progress in trials:
            # -9: killed; 0: the run had ended (a kill chosen in the last step can come too late).
            assert p.exitcode in (-9, 0), f"trial {d.name} exited with {p.exitcode}"
            entries = scan([str(d)])
            committed = [e.step for e in entries if e.committed]
            for e in entries:
                if e.committed:
                    assert verify_checkpoint(e.path) == [], f"seed {seed}: committed {e.path} is damaged"
            out = tmp_path / f"resumed-{d.name}.json"
            resumed.append((d, at, delay, committed, len(entries) - len(committed), out,
                            _start(ctx, d, out, resume=True, record=False)))
        for d, at, delay, committed, partial, out, p in resumed:
            _join(p)
            got = json.loads(out.read_text())
            where = f"seed {seed}, trial {d.name}, killed {delay * 1e3:.1f} ms into step {at}"
            newest = max(committed) if committed else None
            assert got["loaded_step"] == newest, f"{where}: loaded {got['loaded_step']}, newest commit {newest}"
            if newest is not None:
                assert got["loaded_digest"] == saves[newest], f"{where}: step {newest} is not the snapshot taken"
            assert got["final"] == reference["final"], f"{where}: resuming did not reproduce the run"
            outcomes.append((at, newest, partial))
    assert len(outcomes) >= 20
    # What the kills hit (shown with -s): a kill with an uncommitted directory hit a save in flight.
    print(f"seed {seed}: (killed in step, newest committed step, uncommitted dirs) = "
          + ", ".join(f"({a}, {n}, {p})" for a, n, p in outcomes))
