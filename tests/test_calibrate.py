"""Calibration against a real HDF5 file behind a source that degrades under concurrency.

The readers are real separate processes (multiprocessing, spawn); the source reads HDF5 rows with
h5py and emulates a shared source of 8 MB/s with one reader and 4.8 MB/s with two. A slow source gives
each concurrency level a window of about 0.4 s (of 48 rows): at 40 MB/s the windows were 0.08 s, and on
a loaded host one late wake-up moved a level's figure by a fifth.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import numpy as np
import pytest

from hpcstagger.errors import ConfigError, ModelError
from hpcstagger.model import Scenario, calibrate
from support.calib_sources import DictCache, ThrottledH5Source, sleepy_step
from support.cli import cli_env, run_cli

ROW = 262144
BW = [8.0e6, 4.8e6]


@pytest.fixture(autouse=True)
def _scrubbed(monkeypatch):
    """The budget knob's variable: a caller's value never reaches these tests."""
    monkeypatch.delenv("HPCSTAGGER_CALIBRATE_BUDGET", raising=False)


@pytest.fixture(scope="module")
def h5file(tmp_path_factory):
    import h5py

    path = tmp_path_factory.mktemp("calib") / "data.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(0).integers(0, 255, size=(48, ROW), dtype=np.uint8)
    return str(path)


def source(h5file):
    return ThrottledH5Source(h5file, "x", BW, multiprocessing.get_context("spawn").Value("i", 0))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calibrate_measures_source_hits_and_jobs(h5file, tmp_path):
    out = tmp_path / "scenario.toml"
    t0 = time.monotonic()
    cal = calibrate(source(h5file), {"small": sleepy_step(0.003), "big": sleepy_step(0.001)}, budget=8.0,
                    epochs={"small": 3}, capacity="50%", policy="lru", cache=DictCache(), out=out, progress=False)
    elapsed = time.monotonic() - t0
    assert elapsed < 8.0 * 1.25 + 3, elapsed               # the budget holds (plus process start-up)
    sc = cal.scenario
    assert sc.dataset.samples == 48 and sc.dataset.sample_bytes == ROW
    bw1, bw2 = sc.storage.bandwidth
    # h5py's own read time costs a little; the window's edges may add a little (a read that straddles an
    # edge counts in proportion to its overlap, exact only on average: a level once read 2% above
    # its emulated rate)
    assert 0.6 * BW[0] < bw1 <= 1.05 * BW[0]
    assert 0.7 * BW[1] < bw2 <= 1.05 * BW[1] and bw2 < 0.85 * bw1   # concurrency loss is measured
    assert sc.job_names == ("small", "big")
    assert sc.jobs[0].sample_time == pytest.approx(0.003, rel=0.25) and sc.jobs[0].epochs == 3
    assert sc.jobs[1].sample_time == pytest.approx(0.001, rel=0.35) and sc.jobs[1].epochs == 1
    assert sc.cache.capacity == pytest.approx(0.5 * 48 * ROW) and sc.cache.policy == "lru"
    assert sc.cache.hit_bandwidth > 10 * bw1
    assert cal.measurements["hits"]["how"] == "DictCache.get"
    assert [m["readers"] for m in cal.measurements["source"]] == [1, 2, 1, 2]   # every level twice
    assert len(sc.storage.spread) == 2 and all(0 <= s < 1 for s in sc.storage.spread)
    # the file is the scenario, with how each number was measured
    text = out.read_text()
    assert f"holds {bw1 / 1e6:.1f}, {bw2 / 1e6:.1f} MB/s with 1 .. 2 readers" in text and "in-memory batches" in text
    assert "(max - min) / median: " in text
    assert Scenario.from_toml(out) == sc
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp file left


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.alone
def test_calibrate_cli_with_dev_shm_hits_and_progress(h5file, tmp_path):
    out = tmp_path / "cli.toml"
    env = cli_env(HPCSTAGGER_TEST_H5=h5file, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    shm_before = set(os.listdir("/dev/shm"))
    res = run_cli("calibrate", "--source", "support.calib_sources:make_source",
                  "--job", "one=support.calib_sources:make_step",
                  "--epochs", "2", "--capacity", "1e6", "--budget", "6", "-o", str(out), "--json",
                  env=env, timeout=150)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["path"] == str(out) and d["scenario"]["job"][0]["epochs"] == 2
    assert "calibrate" in res.stderr and "100%" in res.stderr        # tqdm progress on stderr
    assert d["measurements"]["hits"]["how"].startswith("files in /dev/shm")
    assert set(os.listdir("/dev/shm")) - shm_before == set()          # nothing left behind
    sc = Scenario.from_toml(out)
    assert sc.jobs[0].sample_time == pytest.approx(0.002, rel=0.35) and sc.cache.capacity == 1e6
    assert sc.storage.bandwidth[1] < sc.storage.bandwidth[0]


def test_calibrate_rejects_bad_arguments(h5file):
    src = source(h5file)
    with pytest.raises(ConfigError, match="at least one job"):
        calibrate(src, {})
    with pytest.raises(ConfigError, match="expected a callable"):
        calibrate(src, {"a": 3})
    with pytest.raises(ConfigError, match="readers must be 1, 2, ... k"):
        calibrate(src, {"a": sleepy_step(0.001)}, readers=[2, 3])
    with pytest.raises(ConfigError, match="policy must be one of"):
        calibrate(src, {"a": sleepy_step(0.001)}, policy="fifo")
    with pytest.raises(ConfigError, match="support len"):
        calibrate(object(), {"a": sleepy_step(0.001)})


@pytest.mark.timeout(60)
def test_a_source_that_fails_in_the_reader_process_is_reported(h5file):
    class Unpicklable:  # defined in a function: spawn cannot rebuild it in the reader process
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return b"x" * 100

    with pytest.raises(ConfigError, match="a source must be picklable"):
        calibrate(Unpicklable(), {"a": sleepy_step(0.0001)}, budget=2.0, progress=False)


class BrokenSource:
    """Picklable, but every read fails (in the reader processes too)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        raise OSError("disk on fire")


@pytest.mark.timeout(60)
def test_a_source_that_fails_to_read_is_reported():
    from support.calib_sources import FailsInReaders

    with pytest.raises(ModelError, match="sample .* failed: OSError: disk on fire"):
        calibrate(BrokenSource(), {"a": sleepy_step(0.0001)}, budget=2.0, progress=False, readers=1)
    with pytest.raises(ModelError, match="1 concurrent reader.*storage unreachable from this process"):
        calibrate(FailsInReaders(), {"a": sleepy_step(0.0001)}, budget=2.0, progress=False, readers=1)


def test_cli_bad_specs_are_one_line(tmp_path):
    env = cli_env(PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    res = run_cli("calibrate", "--source", "nosuchmodule:make", "--job", "a=support.calib_sources:make_step",
                  "-o", str(tmp_path / "x.toml"), env=env)
    assert res.returncode == 1 and "cannot load source" in res.stderr and "nosuchmodule" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = run_cli("calibrate", "--source", "support.calib_sources:make_source", "--job", "noequals",
                  "-o", str(tmp_path / "x.toml"), env=env)
    assert res.returncode == 1 and "--job takes NAME=MODULE:FUNCTION" in res.stderr
