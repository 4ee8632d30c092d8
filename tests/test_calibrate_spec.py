"""Calibration of jobs from their own commands (`hpcstagger calibrate --spec`), and its parts:
the loader wrapper in and out of calibration mode, the early exit on every rank, the reports'
analysis, the source's fresh samples and dropped pages, and the page-cache rule."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hpcstagger.colocated import jobmeter as C
from hpcstagger.measure import startup_again
from hpcstagger.stagger import jobfields as F
from hpcstagger.stagger import scenario_build as S
from hpcstagger.errors import ModelError
from hpcstagger.model import Scenario
from hpcstagger.model.source_probe import (SamplePool, drop_pages, page_cache_holds, parse_meminfo,
                                               source_files)
from support.calib_checks import comment_mismatches
from support.cli import BIN, cli_env, run_cli

JOB = Path(__file__).resolve().parent / "support" / "calib_job.py"
ROW = 4097  # a label byte and 4096 pixels


def _dataset(path: Path, samples: int) -> None:
    import h5py

    rows = np.random.default_rng(0).integers(0, 255, size=(samples, ROW), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("samples", data=rows, chunks=(1, ROW))


@pytest.fixture(autouse=True)
def _scrubbed(monkeypatch):
    """Calibration reads these from the environment: a caller's values never reach these tests."""
    for name in ("HPCSTAGGER_SPEC", "HPCSTAGGER_JOB", "HPCSTAGGER_CALIBRATE", "HPCSTAGGER_CALIBRATE_UNTIL",
                 "HPCSTAGGER_RUN_DIR", "HPCSTAGGER_ONLY_JOBS", "HPCSTAGGER_PLAN_MODE", "HPCSTAGGER_DELAYS",
                 "HPCSTAGGER_CALIBRATE_BUDGET", "HPCSTAGGER_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def shm_dir():
    """A private shm root for the subprocesses; the test fails if calibration left anything in it."""
    root = tempfile.mkdtemp(prefix="hpcs-calspec-", dir="/dev/shm")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _leftovers(root: str) -> list[str]:
    """What is left in an shm root besides empty state directories."""
    return [str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()]


# ------------------------------------------------------------------------------- the whole command
SPEC = """
[run]
name = "calspec"
workdir = "work"
[dataset]
path = "data.h5"
name = "samples"
throttle = [4.0e6, 3.0e6]
[cache]
capacity = "auto"
[[job]]
name = "ddp"
command = "python calib_job.py --workers 1 --batch 16"
ranks = 2
backend = "ddp"
epochs = 2
[[job]]
name = "plain"
command = "python calib_job.py --workers 2 --batch 8"
epochs = 3
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calibrate_spec_measures_every_job_from_its_own_command(tmp_path, shm_dir):
    _dataset(tmp_path / "data.h5", 3000)
    shutil.copy(JOB, tmp_path / "calib_job.py")
    (tmp_path / "spec.toml").write_text(SPEC)
    budget = 40.0
    t0 = time.monotonic()
    root = os.path.join(shm_dir, "root")  # not there yet: calibration makes it, and removes it emptied
    res = run_cli("calibrate", "--spec", "spec.toml", "--budget", str(budget), "-o", "scenario.toml", "--json",
                  env=cli_env(HPCSTAGGER_SHM_ROOT=root), cwd=tmp_path, timeout=240)
    wall = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(res.stdout)
    meas = d["measurements"]
    assert meas["elapsed_s"] <= budget * 1.1 and wall <= budget * 1.1 + 5, (meas["elapsed_s"], wall)
    # the budget's clock starts with the command's process (its imports count), and stops just before its exit
    assert 0 < wall - meas["elapsed_s"] < 1.5, (meas["elapsed_s"], wall)
    assert meas["budget_s"] == budget  # what the summary's over-budget line compares with
    sc = Scenario.from_toml(tmp_path / "scenario.toml")
    assert sc.node.cores == len(os.sched_getaffinity(0))  # the cores the jobs share
    ddp, plain = sc.jobs
    # the loader shapes, read from the jobs' own DataLoaders and communicators
    assert (ddp.name, ddp.ranks, ddp.workers, ddp.batch, ddp.prefetch, ddp.epochs) == ("ddp", 2, 1, 16, 2, 2)
    assert (plain.name, plain.ranks, plain.workers, plain.batch, plain.prefetch, plain.epochs) == \
        ("plain", 1, 2, 8, 2, 3)
    assert ddp.order == plain.order == "DistributedSampler(seed=0)"  # the same seed: the same order
    for job in sc.jobs:
        assert 0 < job.sample_time < 0.01 and 0 < job.handoff < 0.05 and 0 < job.prep_time < 0.01, job
        assert 0 < job.startup < 30, job  # backend, model and starting the loader's workers
        m = meas["jobs"][job.name]
        assert m["route"] == "command" and m["batches"] >= C.MIN_BATCHES and m["probes"] >= 1
    assert meas["jobs"]["ddp"]["misses"] > 0   # its workers read the throttled source: miss costs measured
    # the source curve reaches the jobs' fetchers: 2 ranks x 1 worker + 1 rank x 2 workers
    assert meas["fetchers"] == 4 and len(sc.storage.bandwidth) == 4
    assert all(m["dropped_files"] == 1 for m in meas["source"])   # the HDF5 file's pages
    # the first level fills the calibration cache with fresh samples; the later ones read the file again
    assert meas["source"][0]["fresh"] and meas["source"][0]["readers"] == 1
    assert all(m["how"].startswith("the dataset read again") and not m["fresh"] for m in meas["source"][1:])
    assert 2.0e6 < sc.storage.bandwidth[0] < 4.4e6
    assert meas["page_cache"]["emulated"] and not meas["page_cache"]["holds"]
    # the jobs' own source reads, counted in flight while each ran: what they got of the curve
    counted = meas["jobs"]["ddp"]["source_reads"]
    assert counted["bytes"] > 0 and sum(k * t for k, t in enumerate(counted["flight"], 1)) > 0.5 * counted["seconds"]
    assert sc.storage.fit_baseline == meas["fit_baseline"] and 0.5 <= sc.storage.fit_baseline <= 2.0
    text = (tmp_path / "scenario.toml").read_text()
    assert text.count("measured from its command") == 2 and "page cache dropped before each level" in text
    assert comment_mismatches(text, sc) == []                    # every comment states the value held
    assert "\n# the node before measuring: " in text and meas["node_load"]["cores"] >= 1
    assert len(sc.storage.spread) == 4                          # every level measured at least twice
    assert all(sum(m["readers"] == k for m in meas["source"]) >= 2 for k in (1, 2, 3, 4))
    assert "fit_baseline = " in text and "counted in flight while each ran alone" in text
    assert "job ddp: " in res.stderr and "calibrate" in res.stderr          # progress on stderr
    # each job's processes followed while it ran: every rank and DataLoader worker holds a Python with torch
    memory = {j: (m["memory"], m["memory_file"]) for j, m in meas["jobs"].items()}
    assert memory["ddp"][0] > 4 * 20e6 and memory["plain"][0] > 3 * 20e6, memory
    files = max(meas["jobs"][j]["memory_file"] for j in ("ddp", "plain"))
    assert sc.node.jobs_memory == meas["jobs"]["ddp"]["memory"] + meas["jobs"]["plain"]["memory"] + files > 0
    assert f"  # {sc.node.jobs_memory / 1e6:.0f} MB: each job's processes followed alone" in text
    # capacity "auto" beside an emulated source (no page cache): the dataset, which fits in this node's memory
    dataset = sc.dataset.samples * sc.dataset.sample_bytes
    assert sc.cache.capacity == int(dataset * 1.01) + (1 << 20) and meas["cache_sizing"]["room"] > dataset
    assert 'capacity "auto": the dataset' in text and '[cache] capacity "auto": the dataset' in res.stderr
    reports = Path(meas["reports"])
    assert {p.name for p in reports.iterdir()} >= {"ddp", "plain", "measurements.json"}
    assert _leftovers(shm_dir) == [] and not os.path.exists(root)            # private cache, throttle, root removed


def test_fit_baseline_pools_the_jobs_counted_reads():
    from hpcstagger.measure.spec_calibration import BASELINE_RANGE, fit_baseline

    curve, size = (4.0e6, 6.0e6), 4096.0
    # one job 1 s with one read in flight, the other 1 s with two: 10 MB expected, 8.5 MB read
    jobs = {"a": {"source_reads": {"bytes": 3.4e6, "seconds": 1.0, "flight": [1.0, 0.0]}},
            "b": {"source_reads": {"bytes": 5.1e6, "seconds": 2.0, "flight": [0.0, 1.0]}},
            "c": {"route": "step"}}  # timed in memory: no reads
    factor, note = fit_baseline(jobs, curve, size)
    assert factor == pytest.approx(0.85) and "counted in flight" in note
    # too few reads, no counts, counts that cover too little, or a figure no read pattern explains
    few = {"a": {"source_reads": {"bytes": 10 * size, "seconds": 0.01, "flight": [0.01, 0.0]}}}
    assert fit_baseline(few, curve, size) == (1.0, "not measured: the jobs read 10 sample(s) from the source "
                                                    "while calibrated")
    assert fit_baseline({"c": {"route": "step"}}, curve, size)[0] == 1.0
    thin = {"a": {"source_reads": {"bytes": 3.4e6, "seconds": 3.0, "flight": [1.0, 0.0]}}}
    assert fit_baseline(thin, curve, size) == (1.0, "not measured: the jobs' source reads were not counted in flight")
    low = {"a": {"source_reads": {"bytes": 0.4 * BASELINE_RANGE[0] * 4.0e6, "seconds": 1.0, "flight": [1.0, 0.0]}}}
    factor, note = fit_baseline(low, curve, size)
    assert factor == 1.0 and note.startswith("not used:") and "0.20 of the curve" in note


# ------------------------------------------------------------------------------- the early exit
_TWO_RANKS = 'name = "ddp"\ncommand = "python calib_job.py"\nranks = 2\nbackend = "ddp"'


def _one_job_spec(tmp_path: Path, job: str = _TWO_RANKS, samples: int = 400) -> Path:
    """A spec of one job (its ``[[job]]`` lines ``job``) over an HDF5 file of ``samples`` samples."""
    _dataset(tmp_path / "data.h5", samples)
    shutil.copy(JOB, tmp_path / "calib_job.py")
    spec = tmp_path / "spec.toml"
    spec.write_text('[run]\nname = "early"\nworkdir = "work"\n[dataset]\npath = "data.h5"\nname = "samples"\n'
                    f'[cache]\ncapacity = "16MB"\n[[job]]\n{job}\n')
    return spec


@pytest.mark.timeout(180)
def test_a_two_rank_job_stops_together_with_status_0(tmp_path, shm_dir):
    spec = _one_job_spec(tmp_path)
    reports = tmp_path / "reports"
    out = tmp_path / "out"
    out.mkdir()
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm_dir, HPCSTAGGER_SPEC=str(spec), HPCSTAGGER_JOB="ddp",
                  HPCSTAGGER_CALIBRATE=str(reports), HPCSTAGGER_CALIBRATE_UNTIL=str(time.time() + 3),
                  HPCSTAGGER_RUN_DIR=str(reports / "status"))
    res = subprocess.run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(tmp_path / "calib_job.py"),
                          "--workers", "1", "--batch", "4", "--forever", "--out", str(out)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "calibrating for 'hpcstagger calibrate': no plan, no delay" in res.stderr
    assert list(out.iterdir()) == []           # no rank went on past its loop: the job ended in it
    loops = [json.loads((reports / f"loop.{r}.json").read_text()) for r in (0, 1)]
    assert len(loops[0]["records"]) == len(loops[1]["records"]) > C.MIN_BATCHES   # the same batch on both
    job = json.loads((reports / "job.json").read_text())
    assert job["stopped"] and job["shape"]["ranks"] == 2 and job["shape"]["workers"] == 1
    for r in (0, 1):
        status = json.loads((reports / "status" / f"ddp.{r}.json").read_text())
        assert status["state"] == "done" and status["mode"] == "calibrate", status
        assert status["metrics"]["calibration"] == job["stopped"]
    assert list(reports.glob("samples.*.json")), "the workers' sample costs"
    assert [p for p in Path(shm_dir).iterdir() if p.name == "early-calibrate"]  # the private cache, not the run's
    assert not [p for p in Path(shm_dir).iterdir() if p.name == "early"]


# ------------------------------------------------------------------------------- a start-up measured twice
# (hpcstagger.measure.startup_again): the lesser kept, when the budget has the time
@pytest.mark.timeout(240)
def test_a_start_up_slowed_once_is_measured_again_and_the_lesser_is_the_scenarios(tmp_path, shm_dir):
    _one_job_spec(tmp_path, 'name = "slow"\ncommand = "python calib_job.py --workers 1 --batch 16 '
                  '--slow-first-start first-start.txt"\nepochs = 2', samples=600)
    res = run_cli("calibrate", "--spec", "spec.toml", "--budget", "30", "-o", "scenario.toml", "--json",
                  env=cli_env(HPCSTAGGER_SHM_ROOT=shm_dir), cwd=tmp_path, timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "first-start.txt").exists()  # the first start was the slowed one
    job = json.loads(res.stdout)["measurements"]["jobs"]["slow"]
    assert job["startup_first"] >= 2.0, job  # its 2 s sleep
    assert job["startup_again"] < job["startup_first"] - 1.0, job
    assert job["startup"] == job["startup_again"]
    sc = Scenario.from_toml(tmp_path / "scenario.toml")
    assert sc.jobs[0].startup == pytest.approx(job["startup_again"], abs=1e-6)
    assert "calibrate: job slow: start-up again" in res.stderr
    assert [p.name for p in Path(shm_dir).rglob("*") if p.is_file()] == []


def test_without_the_time_left_each_jobs_one_measurement_stands():
    said: list[str] = []
    fields = {"route": "command", "startup": 2.5}
    run = SimpleNamespace(spec=SimpleNamespace(jobs=[SimpleNamespace(name="a")]), budget=60.0,
                          left=lambda: 0.3 * 60.0, say=said.append)
    assert startup_again.measure_again(run, {"jobs": {"a": fields}}) == []
    assert fields == {"route": "command", "startup": 2.5}
    assert len(said) == 1 and "no time left to measure the start-up of a again" in said[0]
    # a job timed as a step factory, or one measured again already (a resumed calibration), is not run again
    run.left = lambda: 60.0
    for f in ({"route": "step", "startup": 0.0}, {"route": "command", "startup": 1.0, "startup_again": 1.0}):
        assert startup_again.measure_again(run, {"jobs": {"a": dict(f)}}) == []


# ------------------------------------------------------------------------------- in one process
def test_loader_is_a_pass_through_outside_calibration(monkeypatch):
    import hpcstagger
    from hpcstagger.profile import StallProfiler

    monkeypatch.delenv("HPCSTAGGER_CALIBRATE", raising=False)
    monkeypatch.delenv("HPCSTAGGER_SPEC", raising=False)
    session = hpcstagger.init(backend="none", verbose=False)
    assert session.calibrating == ""
    batches = [[1, 2], [3, 4], [5]]
    assert session.loader(batches) is batches
    prof = StallProfiler("job", warmup=0)
    assert list(session.loader(batches, profiler=prof)) == batches
    assert prof.samples == [2, 2, 1]


@pytest.mark.timeout(120)
def test_calibration_mode_in_one_process_measures_and_exits_0(monkeypatch, tmp_path, shm_root):
    import torch

    import hpcstagger
    from hpcstagger.cache import CachedDataset, ShmCache

    class Source:
        def __len__(self):
            return 4000

        def __getitem__(self, i):
            return bytes([i % 256]) * 256

        def key(self, i):
            return f"s{i}"

    reports = tmp_path / "reports"
    monkeypatch.delenv("HPCSTAGGER_SPEC", raising=False)
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE", str(reports))
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE_UNTIL", str(time.time() + 60))
    session = hpcstagger.init(backend="none", verbose=False)
    assert session.calibrating == str(reports) and session.mode == "calibrate" and session.delay == 0
    cache = ShmCache("calmode", 4 << 20)
    dataset = CachedDataset(Source(), cache, transform=lambda b: torch.tensor(len(b)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=0)
    seen = 0
    with pytest.raises(SystemExit) as stop:
        for _ in range(100):
            for _ in session.loader(loader):
                seen += 1
    assert stop.value.code == 0
    report = F.read_reports(str(reports))
    f = F.job_fields("job", report["job"], report["loops"], report["samples"])
    assert f["batches"] == C.TARGET_BATCHES and seen == C.TARGET_BATCHES + 2   # 2 warm-up batches
    assert (f["ranks"], f["workers"], f["batch"], f["prefetch"]) == (1, 0, 4, None)
    assert f["misses"] > 0 and f["prep_time"] > 0 and f["sample_time"] > 0 and f["handoff"] > 0
    assert dataset.meter is not None
    cache.destroy(force=True)


def _burn(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


class _BurningSource:
    """A source whose every read costs ``ms`` of CPU (a format's decoding of its container)."""

    def __init__(self, n: int, ms: float):
        self.n, self.ms = n, ms

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        _burn(self.ms)
        return bytes([i % 256]) * 512

    def key(self, i):
        return f"b{i}"


def _half_ms_transform(data):
    import torch

    _burn(0.5)
    return torch.tensor(len(data))


@pytest.mark.timeout(120)
def test_a_reads_cpu_is_its_own_field_and_not_charged_to_hits(monkeypatch, tmp_path, shm_root):
    """A source that burns 4 ms of CPU per read, a transform that burns 0.5 ms, and a dataset small
    enough that most measured samples are hits: the read's CPU is ``read_cpu``, per miss, and the
    prep (paid by hits and misses alike) holds the transform, not the reads."""
    import torch

    import hpcstagger
    from hpcstagger.cache import CachedDataset, ShmCache

    reports = tmp_path / "reports"
    monkeypatch.delenv("HPCSTAGGER_SPEC", raising=False)
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE", str(reports))
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE_UNTIL", str(time.time() + 60))
    session = hpcstagger.init(backend="none", verbose=False)
    cache = ShmCache("readcpu", 4 << 20)
    try:
        dataset = CachedDataset(_BurningSource(160, 4.0), cache, transform=_half_ms_transform)
        loader = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=2, persistent_workers=True)
        with pytest.raises(SystemExit) as stop:
            for _ in range(100):
                for _ in session.loader(loader):
                    pass
        assert stop.value.code == 0
    finally:
        cache.destroy(force=True)
    report = F.read_reports(str(reports))
    f = F.job_fields("job", report["job"], report["loops"], report["samples"])
    miss_share = f["misses"] / (f["hits"] + f["misses"])
    assert 0.2 < miss_share < 0.5, (f["hits"], f["misses"])
    assert 0.0035 < f["read_cpu"] < 0.008, f["read_cpu"]
    # the transform's 0.5 ms, collate and hand-over; with the reads' CPU spread over every sample it
    # would be 0.5 + 4 * miss_share ms, above 1.3 ms here
    assert 0.0004 < f["prep_time"] < 0.0012, (f["prep_time"], miss_share)
    assert "a read's CPU 4." in S.describe_job(f) or "a read's CPU 5." in S.describe_job(f)
    job = S.scenario_job("job", {**f, "route": "command"}, 2)
    assert job.read_cpu == f["read_cpu"] and job.prep_time == f["prep_time"]


class _Burn:
    """A Dataset that is no CachedDataset (as an ImageFolder is): each sample costs ``ms`` of CPU."""

    def __init__(self, n: int, ms: float):
        self.n, self.ms = n, ms

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        _burn(self.ms)
        return torch.full((8,), float(i))


@pytest.mark.timeout(120)
def test_without_a_cached_dataset_the_workers_cpu_per_sample_is_the_prep(monkeypatch, tmp_path):
    """An ImageFolder or any other Dataset: no CachedDataset counts the samples, so the job's loop
    counts its DataLoader workers' CPU over the measured batches (2 ms of CPU per sample here)."""
    import torch

    import hpcstagger

    reports = tmp_path / "reports"
    monkeypatch.delenv("HPCSTAGGER_SPEC", raising=False)
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE", str(reports))
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE_UNTIL", str(time.time() + 60))
    session = hpcstagger.init(backend="none", verbose=False)
    loader = torch.utils.data.DataLoader(_Burn(100000, 2.0), batch_size=8, num_workers=2, persistent_workers=True)
    with pytest.raises(SystemExit) as stop:
        for _ in session.loader(loader):
            pass
    assert stop.value.code == 0
    report = F.read_reports(str(reports))
    counted = report["job"]["worker_cpu"]
    assert 8 * (C.TARGET_BATCHES - 2) <= counted["samples"] <= 8 * C.TARGET_BATCHES and counted["cpu_s"] > 0
    f = F.job_fields("job", report["job"], report["loops"], report["samples"])
    assert f["prep_from_workers"] and not f["samples_seen"]
    assert 0.0015 < f["prep_time"] < 0.006, f["prep_time"]  # the 2 ms burn, plus collate and hand-over
    assert "prep is its DataLoader workers' CPU per sample" in S.describe_job(f)


@pytest.mark.timeout(120)
def test_one_wrapper_iterated_every_epoch_is_measured_over_every_epoch(monkeypatch, tmp_path):
    """``batches = session.loader(loader)`` once, then ``for x in batches`` every epoch: a calibration
    measures the second epoch too (it once saw an empty second pass, and stopped short)."""
    import torch

    import hpcstagger

    reports = tmp_path / "reports"
    monkeypatch.delenv("HPCSTAGGER_SPEC", raising=False)
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE", str(reports))
    monkeypatch.setenv("HPCSTAGGER_CALIBRATE_UNTIL", str(time.time() + 60))
    session = hpcstagger.init(backend="none", verbose=False)
    loader = torch.utils.data.DataLoader(_Burn(8 * 40, 0.0), batch_size=8, num_workers=0)
    batches = session.loader(loader)
    assert len(batches) == 40
    seen = 0
    with pytest.raises(SystemExit) as stop:
        for _ in range(5):
            for _ in batches:
                seen += 1
    assert stop.value.code == 0 and seen > 40
    report = F.read_reports(str(reports))
    assert report["job"]["segments"] >= 2 and report["job"]["measured"] == C.TARGET_BATCHES


def test_job_fields_take_the_workers_cpu_only_where_no_cached_dataset_counted():
    loop = _loop(0, [(0.5, 0.2, 8, 1, 0), (0.001, 0.010, 8, 0, 0), (0.001, 0.010, 8, 0, 0)])
    job = {"shape": {"ranks": 1, "workers": 2, "batch": 8, "prefetch": 2}, "stopped": "done", "setup_s": 1.0,
           "iter_s": [0.05], "worker_cpu": {"cpu_s": 0.048, "samples": 16}}
    f = F.job_fields("j", job, [loop], [])
    assert f["prep_from_workers"] and f["prep_time"] == pytest.approx(0.003) and f["worker_cpu_per_sample"] == 0.003
    counted = [{"worker": True, "hits": 16, "misses": 0, "hit_transform_s": 0.016, "cpu_s": 0.032, "hit_get_s": 0.0}]
    g = F.job_fields("j", job, [loop], counted)  # a CachedDataset counted: its figures, not the workers' total
    assert not g["prep_from_workers"] and g["prep_time"] == pytest.approx(0.002)
    h = F.job_fields("j", {**job, "shape": {**job["shape"], "workers": 0}}, [loop], [])
    assert not h["prep_from_workers"] and h["prep_time"] == 0.0  # no workers: the loop's own wait holds it


# ------------------------------------------------------------------------------- pure parts
def _loop(rank, rows):
    return {"rank": rank, "size": 2, "records": [list(r) for r in rows]}


def test_job_fields_from_reports():
    # rank 1 waits longer for its data; rank 0 then waits for it in the all-reduce (its step is longer)
    loop0 = _loop(0, [(0.5, 0.2, 8, 1, 0), (0.001, 0.030, 8, 0, 0), (0.001, 0.010, 8, 0, 0),
                      (0.002, 0.010, 8, 0, 1), (0.001, 0.012, 8, 0, 0)])
    loop1 = _loop(1, [(0.6, 0.1, 8, 1, 0), (0.021, 0.010, 8, 0, 0), (0.001, 0.010, 8, 0, 0),
                      (0.001, 0.011, 8, 0, 1), (0.003, 0.010, 8, 0, 0)])
    job = {"shape": {"ranks": 2, "workers": 2, "batch": 8, "prefetch": 3}, "stopped": "done",
           "setup_s": 1.25, "iter_s": [0.05]}
    samples = [{"hits": 10, "hit_transform_s": 0.010, "misses": 30, "miss_transform_s": 0.030, "miss_get_s": 0.003,
                "miss_insert_s": 0.006, "miss_read_s": 0.3, "collates": 4, "collate_samples": 32, "collate_s": 0.016},
               {"hits": 0, "misses": 10, "miss_transform_s": 0.010, "miss_get_s": 0.001, "miss_insert_s": 0.0}]
    f = F.job_fields("j", job, [loop0, loop1], samples)
    assert f["batches"] == 4 and f["probes"] == 1                  # the warm-up row is left out
    assert f["sample_time"] == pytest.approx((0.010 + 0.010 + 0.010 + 0.010) / (4 * 8 * 2))  # per-batch min
    waits = sorted([0.001, 0.001, 0.002, 0.001, 0.021, 0.001, 0.001, 0.003])
    assert f["handoff"] == pytest.approx(F.quantile(waits, 0.10)) and f["handoff"] == pytest.approx(0.001)
    assert f["prep_time"] == pytest.approx(0.050 / 50 + 0.016 / 32)   # transform + collate per sample
    assert f["miss_overhead"] == pytest.approx(0.010 / 40)            # lookup and insert per miss
    assert (f["ranks"], f["workers"], f["batch"], f["prefetch"]) == (2, 2, 8, 3)
    # start-up: set-up before the loop plus the first iter(); workers not persistent: respawned each epoch
    assert f["startup"] == pytest.approx(1.30) and f["epoch_start"] == pytest.approx(0.05)
    persistent = F.job_fields("j", {**job, "shape": {**job["shape"], "persistent": True}}, [loop0, loop1], samples)
    assert persistent["epoch_start"] == 0.0
    # main-process loading: the handoff is the collate per batch, and the prep has no collate share
    g = F.job_fields("j", {**job, "shape": {**job["shape"], "workers": 0, "prefetch": None}}, [loop0, loop1], samples)
    assert g["handoff"] == pytest.approx(0.016 / 4) and g["prep_time"] == pytest.approx(0.050 / 50)
    with pytest.raises(ModelError, match="no batch after its warm-up"):
        F.job_fields("j", job, [_loop(0, [(0.1, 0.1, 8, 1, 0)])], [])


def _steps_loop(ms):
    """One rank's loop records: a warm-up batch, then one measured batch per step time in ``ms``."""
    return _loop(0, [(0.5, 0.2, 8, 1, 0)] + [(0.001, t / 1e3, 8, 0, 0) for t in ms])


def test_a_job_whose_steps_slow_while_measured_is_flagged_and_a_steady_one_is_not():
    job = {"shape": {"ranks": 1, "workers": 2, "batch": 8, "prefetch": 2}, "setup_s": 1.0, "iter_s": [0.0],
           "stopped": "64 batches measured"}
    # a model that fits its data and computes on denormal floats from then on: 10 ms steps, then 30 ms
    slowed = F.job_fields("cnn", job, [_steps_loop([10.0] * 24 + [30.0] * 24)], [])
    assert slowed["step_first_s"] == pytest.approx(0.010) and slowed["step_last_s"] == pytest.approx(0.030)
    assert slowed["step_drift"] == pytest.approx(3.0)
    line = S.describe_job(slowed)
    assert "its steps slowed while measured" in line and "3.0x" in line and "torch.set_flush_denormal(True)" in line
    # steady steps with noise, and steps that got faster (a warm-up), say nothing
    rng = np.random.default_rng(0)
    steady = F.job_fields("cnn", job, [_steps_loop(list(10.0 * rng.uniform(0.8, 1.25, 48)))], [])
    assert steady["step_drift"] < F.STEP_DRIFT_WARN and "slowed" not in S.describe_job(steady)
    faster = F.job_fields("cnn", job, [_steps_loop([30.0] * 24 + [10.0] * 24)], [])
    assert faster["step_drift"] == pytest.approx(1 / 3) and "slowed" not in S.describe_job(faster)
    # too few batches to split in thirds: no drift
    short = F.job_fields("cnn", job, [_steps_loop([10.0] * 5 + [40.0] * 5)], [])
    assert short["step_drift"] == 1.0 and "slowed" not in S.describe_job(short)


def test_job_fields_take_full_speed_times_from_cpu_records():
    # records with CPU seconds: a step whose process had the core for less than its wall time
    # counts its CPU time (the job's own workers took the core); a multi-threaded step (CPU above
    # wall) counts its wall time
    rows = [(0.5, 0.2, 8, 1, 0, 0.0, 0.1), (0.001, 0.020, 8, 0, 0, 0.001, 0.010),
            (0.001, 0.010, 8, 0, 0, 0.001, 0.018), (0.001, 0.012, 8, 0, 0, 0.001, 0.006)]
    job = {"shape": {"ranks": 1, "workers": 2, "batch": 8, "prefetch": 2}, "setup_s": 1.0, "iter_s": [0.0]}
    workers = [{"worker": True, "hits": 30, "hit_get_s": 0.003, "misses": 10, "miss_get_s": 0.001,
                "miss_insert_s": 0.002, "hit_transform_s": 0.01, "miss_transform_s": 0.003, "cpu_s": 0.046},
               {"worker": True, "hits": 40, "hit_get_s": 0.004, "misses": 0, "cpu_s": 0.054},
               {"worker": False, "hits": 0, "misses": 0, "cpu_s": 5.0}]  # the main process: not a worker
    f = F.job_fields("j", job, [_loop(0, rows)], workers)
    assert f["sample_time"] == pytest.approx((0.010 + 0.010 + 0.006) / (3 * 8))
    assert f["step_wall_s"] == pytest.approx((0.020 + 0.010 + 0.012) / 3)
    # workers' CPU per sample (0.1 s over 80 samples) less their lookups (0.010 s over 80)
    assert f["worker_cpu_per_sample"] == pytest.approx(0.100 / 80)
    assert f["prep_time"] == pytest.approx((0.100 - 0.010) / 80)
    assert f["read_cpu"] == 0.0
    # the reads' CPU (20 ms over 10 misses) is a miss's own, not every sample's prep
    workers[0]["miss_read_cpu_s"] = 0.020
    g = F.job_fields("j", job, [_loop(0, rows)], workers)
    assert g["read_cpu"] == pytest.approx(0.002) and g["prep_time"] == pytest.approx((0.100 - 0.010 - 0.020) / 80)


def test_quantile():
    assert F.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert F.quantile([0.0, 10.0], 0.1) == pytest.approx(1.0)
    assert F.quantile([5.0], 0.1) == 5.0


def test_loader_shape_reads_the_dataloader():
    import torch

    data = list(range(10))
    shape = C.loader_shape(torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, prefetch_factor=3), 2)
    assert (shape["workers"], shape["batch"], shape["prefetch"], shape["ranks"]) == (2, 4, 3, 2)
    shape = C.loader_shape(torch.utils.data.DataLoader(data, batch_size=5), 1)
    assert (shape["workers"], shape["batch"], shape["prefetch"], shape["dataloader"]) == (0, 5, None, True)
    assert C.loader_shape(iter(data), 1)["dataloader"] is False


def test_sampler_order_names_what_decides_the_permutation():
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(10))
    assert C.sampler_order(DataLoader(data, batch_size=4)) == "sequential"
    assert C.sampler_order(DataLoader(data, batch_size=4, shuffle=True)) == ""  # the process's own RNG
    dist = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    assert C.sampler_order(DataLoader(data, batch_size=4, sampler=dist)) == "DistributedSampler(seed=3)"
    assert C.sampler_order(DataLoader(data, sampler=DistributedSampler(data, num_replicas=1, rank=0,
                                                                     shuffle=False))) == "sequential"
    gen = torch.Generator()
    gen.manual_seed(5)
    assert C.sampler_order(DataLoader(data, batch_size=4, shuffle=True, generator=gen)) == "RandomSampler(seed=5)"
    assert C.sampler_order(iter(data)) == ""


MEMINFO = """MemTotal:       24683520 kB
MemFree:        24052104 kB
MemAvailable:   24171784 kB
Buffers:            2100 kB
HugePages_Total:       0
"""


def test_page_cache_rule():
    info = parse_meminfo(MEMINFO)
    assert info["MemAvailable"] == 24171784 * 1024 and info["HugePages_Total"] == 0
    avail = info["MemAvailable"]
    assert page_cache_holds(0.4 * avail, avail, file_source=True, emulated=False)
    assert not page_cache_holds(0.6 * avail, avail, file_source=True, emulated=False)      # too large
    assert not page_cache_holds(0.1 * avail, avail, file_source=True, emulated=True)       # ThrottledSource
    assert not page_cache_holds(0.1 * avail, avail, file_source=False, emulated=False)     # not files
    assert not page_cache_holds(0.1 * avail, None, file_source=True, emulated=False)       # unknown memory


def test_sample_pool_hands_out_fresh_disjoint_samples():
    pool = SamplePool(100, seed=3, exclude=range(10))
    first = pool.take(1, levels_left=3)
    second = pool.take(2, levels_left=2)
    third = pool.take(3, levels_left=1)
    seen = [i for part in first + second + third for i in part]
    assert len(seen) == len(set(seen)) == 90 and not set(seen) & set(range(10)) and pool.fresh
    assert [len(s) for s in second] == [15, 15]
    again = pool.take(4)                  # nothing fresh is left: samples are read again, and it says so
    assert not pool.fresh and sorted(i for s in again for i in s) == list(range(100))


def test_drop_pages_on_file_sources(tmp_path, shm_root):
    from hpcstagger.cache import DirectorySource, HDF5Source, ThrottledSource

    _dataset(tmp_path / "d.h5", 4)
    files = tmp_path / "files"
    files.mkdir()
    for i in range(5):
        (files / f"{i}.bin").write_bytes(b"x" * 100)
    h5 = HDF5Source(str(tmp_path / "d.h5"), "samples")
    throttled = ThrottledSource(h5, 1e9, shared_name="drop-test")
    assert source_files(throttled)[:2] == ("hdf5", True) and source_files(h5)[:2] == ("hdf5", False)
    assert drop_pages(h5) == 1 and drop_pages(throttled) == 1
    assert drop_pages(DirectorySource(files), [0, 3]) == 2 and drop_pages(DirectorySource(files)) == 5
    assert drop_pages(["not", "files"]) == 0 and source_files(["x"])[0] == "other"
    throttled.unlink()


def test_a_level_read_over_too_short_a_window_is_not_trusted():
    from hpcstagger.model.source_probe import trusted_bandwidth

    levels = [{"readers": 1, "bandwidth": 3.1e6, "window_s": 0.98, "elapsed_s": 0.99},
              {"readers": 2, "bandwidth": 3.9e6, "window_s": 0.49, "elapsed_s": 0.86},
              # the real-fs calibration of 2026-11-24: 665 reads of pages still cached, in 3 ms
              {"readers": 4, "bandwidth": 2.79e8, "window_s": 0.003, "elapsed_s": 0.35}]
    bw, note = trusted_bandwidth(levels)
    assert bw == [3.1e6, 3.9e6, 3.9e6]
    assert "not trusted" in note and "4 reader(s) (279.0 MB/s over 0.003 s)" in note
    assert trusted_bandwidth(levels[:2]) == ([3.1e6, 3.9e6], "")
    # the first level always counts: there is nothing before it to hold
    assert trusted_bandwidth([dict(levels[2], readers=1)])[0] == [2.79e8]


def test_weighted_median_counts_each_value_by_its_weight():
    from hpcstagger.model.source_levels import weighted_median

    assert weighted_median([(3.0, 1.0), (1.0, 1.0), (2.0, 1.0)]) == 2.0       # equal weights: the median
    assert weighted_median([(4.0, 1.0), (2.0, 1.0)]) == 3.0                   # meeting at half: their mean
    assert weighted_median([(25.8e6, 0.2), (6.0e6, 1.5), (6.4e6, 1.4)]) == 6.4e6
    assert weighted_median([(6.0e6, 1.5), (9.0e6, 1.4)]) == 6.0e6             # the longer one holds
    assert weighted_median([(5.0, 0.0), (7.0, 0.0)]) == 6.0                   # no weight: the usual median
    with pytest.raises(ValueError):
        weighted_median([])


def test_a_burst_over_a_short_window_does_not_set_the_curve():
    """Kernel-throttled ext4 (6 MB/s): one reader measured 25.8 MB/s over 0.2 s beside 6 MB/s over
    1.5 s; the median of the two was 15.9 MB/s, two and a half times the device's rate."""
    from hpcstagger.model.source_probe import combine_levels, disagreeing

    levels = [{"readers": 1, "bandwidth": 25.8e6, "window_s": 0.2, "elapsed_s": 0.5},
              {"readers": 1, "bandwidth": 6.0e6, "window_s": 1.5, "elapsed_s": 1.9},
              {"readers": 2, "bandwidth": 5.9e6, "window_s": 1.4, "elapsed_s": 1.8},
              {"readers": 2, "bandwidth": 6.1e6, "window_s": 1.2, "elapsed_s": 1.6}]
    curve, spread, note = combine_levels(levels)
    assert curve == [6.0e6, 5.9e6] and spread[0] == 0.0
    assert "1 reader(s) (25.8 MB/s over 0.200 s)" in note and disagreeing(levels) == []
    # a first level measured only over short windows keeps its longest: nothing comes before it
    short = [{"readers": 1, "bandwidth": 9.0e6, "window_s": 0.03, "elapsed_s": 0.5},
             {"readers": 1, "bandwidth": 7.0e6, "window_s": 0.01, "elapsed_s": 0.5}]
    assert combine_levels(short)[0] == [9.0e6]


class _Bar:
    def set_postfix_str(self, text: str) -> None:
        self.text = text

    def update(self, n: int) -> None:
        pass


def test_file_levels_read_the_dataset_again_with_its_pages_dropped(tmp_path, shm_root):
    """A level without a cache to fill reads the whole file source again (pages dropped), so a small
    dataset does not cut its window to a tenth of a second; a level that fills a cache reads fresh
    samples, which the jobs' calibration then meets as hits."""
    import multiprocessing

    from hpcstagger.cache import HDF5Source, ShmCache
    from hpcstagger.model.source_probe import measure_levels

    _dataset(tmp_path / "d.h5", 120)
    source = HDF5Source(str(tmp_path / "d.h5"), "samples")
    pool = SamplePool(len(source), seed=1)
    ctx = multiprocessing.get_context("fork")
    cache = ShmCache("levels-again", 1 << 20)
    try:
        first = measure_levels(source, pool, [1], 5.0, ctx, _Bar(), later_levels=2, cache=cache)
        left = pool.left
        again = measure_levels(source, pool, [1, 2], 5.0, ctx, _Bar())
    finally:
        cache.destroy(force=True)
    assert first[0]["fresh"] and first[0]["how"].startswith("fresh samples") and first[0]["reads"] + 1 == 40
    assert pool.left == left == 80                                   # reading again uses no fresh samples
    assert [m["readers"] for m in again] == [1, 2]
    for m in again:
        assert m["how"] == "the dataset read again, page cache dropped" and not m["fresh"]
        assert m["dropped_files"] == 1 and m["reads"] + m["readers"] == 120 and m["window_s"] > 0


def test_reading_again_is_bounded_and_only_where_the_fresh_share_is_small(tmp_path, monkeypatch):
    """A large dataset keeps fresh samples (no list of millions of indices sent to each reader, no
    million files' pages dropped per level); reading again takes at most REREAD_MOST samples."""
    import multiprocessing

    from hpcstagger.cache import HDF5Source
    from hpcstagger.model import source_probe

    ordered = SamplePool(1000, seed=2, in_order=True).again(2, most=100)
    flat = [i for s in ordered for i in s]
    assert [len(s) for s in ordered] == [50, 50] and flat == list(range(flat[0], flat[0] + 100))
    shuffled = SamplePool(1000, seed=2).again(4, most=100)
    assert sum(len(s) for s in shuffled) == len({i for s in shuffled for i in s}) == 100
    assert sorted(i for s in SamplePool(10, seed=2).again(3) for i in s) == list(range(10))

    _dataset(tmp_path / "d.h5", 120)
    source = HDF5Source(str(tmp_path / "d.h5"), "samples")
    ctx = multiprocessing.get_context("fork")
    monkeypatch.setattr(source_probe, "REREAD_BELOW", 30)     # a share of 60, then of 60: fresh
    pool = SamplePool(len(source), seed=1)
    fresh = source_probe.measure_levels(source, pool, [1, 2], 5.0, ctx, _Bar())
    assert [m["how"] for m in fresh] == ["fresh samples, page cache dropped"] * 2 and pool.left == 0
    monkeypatch.setattr(source_probe, "REREAD_BELOW", 4096)
    monkeypatch.setattr(source_probe, "REREAD_MOST", 50)
    again = source_probe.measure_levels(source, SamplePool(len(source), seed=1), [2], 5.0, ctx, _Bar())
    assert again[0]["how"].startswith("the dataset read again") and again[0]["reads"] + 2 == 50


def test_the_summary_line_names_the_fit_baseline_when_measured(monkeypatch, capsys):
    import argparse

    from hpcstagger.cli import cmd_calibrate as cli_calibrate
    from hpcstagger.model.calibrate import Calibration

    d = {"dataset": {"samples": 100, "sample_bytes": 4096}, "storage": {"bandwidth": [4.0e6, 6.0e6]},
         "job": [{"name": "a", "sample_time": 0.001}]}
    args = argparse.Namespace(history=False, spec="spec.toml", json=False, job=[])
    for baseline, shown in ((0.85, True), (1.0, False)):
        sc = Scenario.from_dict({**d, "storage": {**d["storage"], "fit_baseline": baseline}})
        monkeypatch.setattr(cli_calibrate, "_with_spec", lambda a, j, sc=sc: Calibration(sc, {}, "s.toml"))
        assert cli_calibrate.run(args) == 0
        line = capsys.readouterr().out.splitlines()[0]
        assert line.startswith("wrote s.toml: 100 samples of 4096 B; source 4.0, 6.0 MB/s with 1, 2, ... readers")
        assert ("(the jobs' own reads got 0.85 of it); a 1.000 ms/sample" in line) is shown, line


def test_the_summary_says_when_the_calibration_overran_its_budget(monkeypatch, capsys):
    import argparse

    from hpcstagger.cli import cmd_calibrate as cli_calibrate
    from hpcstagger.model.calibrate import Calibration

    sc = Scenario.from_dict({"dataset": {"samples": 100, "sample_bytes": 4096}, "storage": {"bandwidth": [4.0e6]},
                             "job": [{"name": "a", "sample_time": 0.001}]})
    args = argparse.Namespace(history=False, spec="spec.toml", json=False, job=[])
    for elapsed, budget, said in ((20.6, 16.0, True), (16.9, 16.0, False), (62.0, 60.0, False), (90.0, 60.0, True)):
        meas = {"elapsed_s": elapsed, "budget_s": budget}
        monkeypatch.setattr(cli_calibrate, "_with_spec", lambda a, j, m=meas: Calibration(sc, m, "s.toml"))
        assert cli_calibrate.run(args) == 0
        out = capsys.readouterr().out
        assert ("more than its budget" in out) is said, (elapsed, budget, out)
        if said:
            assert f"took {elapsed:.0f} s, more than its budget of {budget:.0f} s" in out
            assert f"--budget {math.ceil(elapsed)} or more" in out


@pytest.mark.timeout(120)
def test_readers_overlap_when_they_outnumber_the_cores():
    """More CPU-bound readers than cores, over a short window: a reader that first runs after
    another's own window would have ended still overlaps it (the windows end together, counted
    from the last reader's start); before, about a third of such levels failed."""
    import multiprocessing

    from hpcstagger.model.source_probe import measure_readers
    from support.calib_sources import BusySource

    readers = 4 * len(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("fork")
    for _ in range(6):
        m = measure_readers(BusySource(), [list(range(r * 200, r * 200 + 200)) for r in range(readers)], 0.05, ctx)
        assert m["readers"] == readers and m["window_s"] > 0 and m["bandwidth"] > 0, m


def test_readers_that_never_overlap_name_the_cause():
    from hpcstagger.model.source_probe import aggregate

    # the first reader read its 3 samples and stopped before the second started
    results = [((0.0, 0.010), [(0.0, 0.004, 10), (0.004, 0.010, 10)]),
               ((0.5, 0.700), [(0.5, 0.6, 10), (0.6, 0.7, 10)])]
    with pytest.raises(ModelError, match=r"read all of its 3 samples in 0\.010 s, before the last of the 2 "
                                         r"readers started \(0\.500 s after the first\): too few fresh samples"):
        aggregate(results)
    assert aggregate([((0.0, 1.0), [(0.0, 1.0, 100)]), ((0.5, 2.0), [(0.5, 2.0, 300)])]) == (300.0, 0.5)


def test_a_level_whose_readers_never_overlap_is_kept_untrusted_and_the_level_before_holds(monkeypatch):
    """Readers that never read at once (few fresh samples per reader, or pages the kernel kept) give
    a level with no window: kept, not trusted, and the curve holds the level before; one reader
    alone still fails (it has no level before)."""
    import multiprocessing

    from hpcstagger.model import source_probe
    from support.calib_sources import BusySource

    def no_overlap(results):  # the fault, injected: every window closed before the last one opened
        raise ModelError("a calibration reader read all of its 3 samples in 0.000 s, before the last of the "
                         f"{len(results)} readers started: too few fresh samples per reader")

    ctx = multiprocessing.get_context("fork")
    two = source_probe.measure_readers(BusySource(), [list(range(0, 200)), list(range(200, 400))], 0.2, ctx)
    monkeypatch.setattr(source_probe, "aggregate", no_overlap)
    short = source_probe.measure_readers(BusySource(), [[400, 401, 402], [403, 404], [405, 406]], 0.05, ctx)
    assert short["readers"] == 3 and short["window_s"] == 0.0 and "too few fresh samples" in short["short"]
    with pytest.raises(ModelError, match="too few fresh samples"):
        source_probe.measure_readers(BusySource(), [[407, 408, 409]], 0.05, ctx)
    one = {"readers": 1, "bandwidth": 5.0e6, "window_s": 1.0, "elapsed_s": 1.1}
    curve, _, note = source_probe.combine_levels([one, two, short])
    assert two["window_s"] > 0 and two["bandwidth"] > 0
    assert curve[2] == curve[1] and "3 reader(s) (0.0 MB/s over 0.000 s)" in note, (curve, note)


def test_a_reads_cpu_is_the_sources_for_every_job():
    # jobs calibrated one after another share the calibration cache: the first one reads, the later
    # ones hit; the read's CPU, the source's own work, is weighted by the misses that measured it
    jobs = [{"misses": 300, "read_cpu": 0.0002}, {"misses": 100, "read_cpu": 0.0006}, {"misses": 0, "read_cpu": 0.0}]
    assert S.source_read_cpu(jobs) == pytest.approx((300 * 0.0002 + 100 * 0.0006) / 400)
    assert S.source_read_cpu([{"misses": 0, "read_cpu": 0.0}]) == 0.0 and S.source_read_cpu([]) == 0.0
    m = {"route": "command", "ranks": 1, "workers": 2, "batch": 8, "prefetch": 2, "handoff": 0.001,
         "prep_time": 0.0001, "read_cpu": 0.0, "startup": 1.0, "epoch_start": 0.0, "sample_time": 0.001}
    assert S.scenario_job("mlp", m, 2, 0.0003).read_cpu == 0.0003 and S.scenario_job("mlp", m, 2).read_cpu == 0.0


def test_fresh_cache_empties_what_an_earlier_run_left(tmp_path, shm_root):
    from hpcstagger.measure.spec_calibration import fresh_cache
    from hpcstagger.spec.jobspec import Spec

    (tmp_path / "data").mkdir()
    text = ('[run]\nname = "fresh"\n[dataset]\npath = "data"\n[cache]\ncapacity = {cap}\n'
            '[[job]]\nname = "a"\ncommand = "true"\n')
    (tmp_path / "spec.toml").write_text(text.format(cap=1_000_000))
    spec = Spec.from_toml(tmp_path / "spec.toml")
    left = fresh_cache(spec)
    assert left.put("k", b"x" * 100) and left.get("k") is not None
    left.close()  # a crashed run's cache stays in /dev/shm with its entry
    again = fresh_cache(spec)
    try:
        assert again.get("k") is None and again.stats()["entries"] == 0
    finally:
        again.destroy(force=True)
    (tmp_path / "spec.toml").write_text(text.format(cap=0))
    assert fresh_cache(Spec.from_toml(tmp_path / "spec.toml")) is None


def test_a_levels_window_leaves_room_for_the_readers_start_up_it_was_told_of(monkeypatch):
    """A call measuring one level (the third round's) takes the readers' start-up the levels before it
    showed off its window, instead of learning it only after overrunning its time by as much."""
    from hpcstagger.model import source_probe

    asked: list[float] = []

    def readers(source, subsets, window, ctx, cache=None):
        asked.append(window)
        return {"readers": len(subsets), "bandwidth": 1e6, "window_s": window, "elapsed_s": window + 0.5, "reads": 9}

    monkeypatch.setattr(source_probe, "measure_readers", readers)
    source = [b"x" * 100] * 400
    source_probe.measure_levels(source, SamplePool(len(source), seed=0), [2], 2.0, None, _Bar())
    source_probe.measure_levels(source, SamplePool(len(source), seed=0), [2], 2.0, None, _Bar(), overhead=0.5)
    source_probe.measure_levels(source, SamplePool(len(source), seed=0), [1, 2], 2.0, None, _Bar(), overhead=0.3)
    told, learnt = asked[2:]
    assert asked[0] == pytest.approx(2.0, abs=0.05) and asked[1] == pytest.approx(1.5, abs=0.05)
    assert told == pytest.approx(0.7, abs=0.05) and learnt == pytest.approx(2.0 - 0.5, abs=0.05)


def test_process_started_is_when_the_interpreter_began(tmp_path):
    """What a command's budget counts from: its interpreter's start, before its imports."""
    from hpcstagger.nodeload import process_started

    code = ("import time; time.sleep(0.6); from hpcstagger.nodeload import process_started; "
            "print(time.monotonic() - process_started()); print(time.monotonic() - process_started(most=0.1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    age, capped = (float(v) for v in out.stdout.split())
    assert 0.6 <= age < 30 and capped == pytest.approx(0.1, abs=0.02)
    assert 0 <= time.monotonic() - process_started() < 3600
