"""The page cache's readahead: ``[cache] readahead`` in the model and the simulator, and its measurement."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from hpcstagger.errors import ConfigError
from hpcstagger.model import Scenario, predict, simulate
from hpcstagger.model.readahead import MAX_READAHEAD, READAHEAD_MOST, fit_factor, io_read_bytes, readahead_factor
from hpcstagger.stagger.scenario_build import scenario_cache


def _scenario(readahead: float, jobs: int = 1, workers: int = 2, epochs: int = 2, **cache) -> Scenario:
    """A page-cache scenario like a small HDF5 file of 3 KiB rows on a 6 MB/s disk, shuffled jobs."""
    return Scenario.from_dict({
        "dataset": {"samples": 1536, "sample_bytes": 3072},
        "storage": {"bandwidth": [6.0e6]},
        "cache": {"capacity": 1536 * 3072, "policy": "minio", "coalesce": True, "readahead": readahead, **cache},
        "job": [{"name": f"j{i}", "sample_time": 3.0e-4 * (1 + i), "epochs": epochs, "workers": workers, "batch": 64,
                 "prep_time": 5.0e-5} for i in range(jobs)]})


def test_readahead_is_the_page_cache_s_and_round_trips():
    sc = _scenario(4.5)
    assert sc.cache.readahead == 4.5
    again = Scenario.from_dict(sc.to_dict())
    assert again.cache.readahead == 4.5 and "readahead = 4.5" in sc.to_toml({})
    assert "readahead" not in _scenario(1.0).to_dict()["cache"]
    with pytest.raises(ConfigError, match="readahead .*cache.coalesce = true"):
        _scenario(2.0, coalesce=False)
    with pytest.raises(ConfigError, match="readahead"):
        _scenario(2.0, policy="lru")
    with pytest.raises(ConfigError, match="readahead"):
        _scenario(0.5)
    with pytest.raises(ConfigError, match="readahead"):
        _scenario(math.inf)


@pytest.mark.parametrize("jobs,workers", [(1, 2), (1, 0), (2, 2), (2, 4)])
def test_fluid_model_follows_the_simulator_with_readahead(jobs, workers):
    sc = _scenario(4.5, jobs, workers)
    pred = predict(sc, [0.0] * jobs).finish
    sims = [simulate(sc, [0.0] * jobs, seed=k).finish for k in range(3)]
    for name in pred:
        measured = float(np.median([s[name] for s in sims]))
        assert pred[name] == pytest.approx(measured, rel=0.03), (name, pred, sims)


def test_readahead_moves_the_reads_to_the_start_of_the_first_epoch():
    """Same bytes from the source, but read early: with workers the first epoch no longer overlaps
    its reads with the compute, and takes longer; without workers (read, then compute) it does not."""
    plain, ahead = predict(_scenario(1.0)), predict(_scenario(4.5))
    for p in (plain, ahead):  # the source's bytes: the dataset once
        t = np.array(p.times)
        moved = float(np.sum(np.diff(t) * np.array(p.bandwidth)[:-1]))
        assert moved == pytest.approx(1536 * 3072, rel=0.05)
    # the job's progress when half the dataset is in the page cache: fewer samples read for it
    half = [next(g for g, c in zip(p.progress["j0"], p.cached, strict=True) if c >= 0.5) for p in (plain, ahead)]
    assert half[1] < 0.5 * half[0]
    assert ahead.makespan > 1.08 * plain.makespan
    no_workers = [predict(_scenario(a, workers=0)).makespan for a in (1.0, 4.5)]
    assert no_workers[1] == pytest.approx(no_workers[0], rel=0.01)
    sims = [simulate(_scenario(a), seed=0).makespan for a in (1.0, 4.5)]
    assert sims[1] > 1.08 * sims[0]


def test_fit_factor_inverts_the_model_s_curve():
    for a in (1.0, 2.5, 5.0, 12.0):
        for x in (0.01, 0.1, 0.25):
            assert fit_factor(x, 1.0 - (1.0 - x) ** a) == pytest.approx(a)
    assert fit_factor(0.1, 1.0) == math.inf and fit_factor(0.1, 0.0) == 0.0


class _Counted:
    """A source of 1,000-byte samples whose reads a fake kernel counter counts ``per_read`` bytes for."""

    def __init__(self, per_read: int):
        self.per_read, self.total = per_read, 0

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> bytes:
        self.total += self.per_read
        return b"x" * 1000


def test_readahead_factor_divides_the_counted_bytes_or_says_why_not():
    src = _Counted(3000)
    got = readahead_factor(src, range(100), 10.0, counter=lambda: src.total)
    assert got["readahead"] == pytest.approx(3.0) and got["samples"] == 100 and "random order" in got["how"]
    fitted = readahead_factor(src, range(100), 10.0, counter=lambda: src.total, dataset=(1000, 1.0e6))
    assert fitted["readahead"] == pytest.approx(fit_factor(0.1, 0.3)) and "30% of the dataset" in fitted["how"]
    silent = readahead_factor(_Counted(0), range(20), 10.0, counter=lambda: 0)
    assert silent["readahead"] == 1.0 and silent["how"].startswith("not measured")
    absent = readahead_factor(src, range(20), 10.0, counter=lambda: None)
    assert absent["readahead"] == 1.0 and "not there" in absent["how"]
    many = _Counted(1000)  # a large dataset: a bounded number of reads, whatever the time allows
    assert readahead_factor(many, range(3 * READAHEAD_MOST), 60.0, counter=lambda: many.total)["samples"] == \
        READAHEAD_MOST
    huge = _Counted(10**6)
    assert readahead_factor(huge, range(20), 10.0, counter=lambda: huge.total)["readahead"] == MAX_READAHEAD


def test_readahead_factor_on_a_real_hdf5_file(tmp_path):
    """3 KiB rows of an HDF5 file on the disk, read in a random order with the pages dropped: the
    kernel reads pages and readahead around each row, more than the row."""
    h5py = pytest.importorskip("h5py")
    from hpcstagger.cache import HDF5Source

    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("samples", data=np.random.default_rng(0).integers(0, 255, (2048, 3072), dtype=np.uint8),
                         chunks=(1, 3072))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped
    os.close(fd)
    source = HDF5Source(str(path), "samples")
    got = readahead_factor(source, range(512), 5.0, dataset=(2048, 2048 * 3072))
    if got["bytes"] <= 0 or io_read_bytes() is None:
        pytest.skip(f"the kernel does not count this file system's reads: {got['how']}")
    assert 1.5 < got["readahead"] <= MAX_READAHEAD, got
    source.close()


def test_calibration_writes_the_page_cache_s_readahead():
    meas = {"samples": 400, "sample_bytes": 1000.0, "hits": {"hit_bandwidth": 1.0e9, "how": "64 reads"},
            "page_cache": {"holds": True, "source": "hdf5", "emulated": False, "dataset_bytes": 4.0e5,
                           "mem_available": 1.0e10, "hit_bandwidth": 2.0e9, "how": "re-reads",
                           "readahead": {"readahead": 3.5, "how": "1.40 MB read by the kernel for 100 samples"}}}

    class _NoCache:
        class cache:
            capacity, policy = 0, "none"

    cache, notes = scenario_cache(meas, _NoCache(), None, None)  # type: ignore[arg-type]
    assert cache.readahead == 3.5 and cache.coalesce and "1.40 MB read by the kernel" in notes["cache.readahead"]
    del meas["page_cache"]["readahead"]  # measured by an older version: none
    cache, notes = scenario_cache(meas, _NoCache(), None, None)  # type: ignore[arg-type]
    assert cache.readahead == 1.0 and "not measured" in notes["cache.readahead"]
