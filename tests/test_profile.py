"""StallProfiler on a real torch training loop, and `hpcstagger profile`."""

from __future__ import annotations

import json
import time

import pytest

from hpcstagger.errors import ConfigError
from hpcstagger.profile import StallProfiler
from support.cli import run_cli

SCENARIO = """
[dataset]
samples = 2000
sample_bytes = 131072
[storage]
bandwidth = [1.31072e8, 0.8e8]
[cache]
capacity = 2.7e8
policy = "minio"
[[job]]
name = "slowdata"
sample_time = 0.0004
epochs = 2
[[job]]
name = "other"
sample_time = 0.0005
epochs = 2
"""


class SlowLoader:
    """Yields (x, y) batches of 8 after sleeping ``delay`` seconds: a loader that stalls."""

    def __init__(self, batches: int, delay: float):
        self.batches, self.delay = batches, delay

    def __iter__(self):
        import torch

        for _ in range(self.batches):
            if self.delay:  # sleep(0) gives the core away: on a busy machine that is a stall of its own
                time.sleep(self.delay)
            yield torch.randn(8, 16), torch.randn(8, 1)


def train(prof: StallProfiler, loader, prep: float = 0.0, work: float = 0.0) -> None:
    import torch

    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in prof.wrap(loader):
        if prep:
            with prof.prep():
                time.sleep(prep)
                x = x * 1.0
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if work:
            time.sleep(work)


def test_io_bound_loop_is_recognised_and_round_trips(tmp_path):
    prof = StallProfiler("slowdata")
    train(prof, SlowLoader(12, 0.02))
    s = prof.summary()
    assert s["iterations"] == 11 and s["warmup_left_out"] == 1 and s["samples"] == 88
    assert s["verdict"] == "I/O-bound" and s["wait_share"] > 0.6
    assert s["wait_s"] == pytest.approx(11 * 0.02, rel=0.3)
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = StallProfiler.load(str(path))
    assert back.summary() == s


def test_compute_and_prep_bound_loops():
    cpu = StallProfiler("c")
    train(cpu, SlowLoader(10, 0.0), work=0.05)  # a wait share of 10% would take 5 ms a batch
    assert cpu.summary()["verdict"] == "compute-bound"
    prep = StallProfiler("p")
    train(prep, SlowLoader(10, 0.001), prep=0.02)
    s = prep.summary()
    assert s["verdict"] == "prep-bound" and s["prep_s"] == pytest.approx(9 * 0.02, rel=0.3)
    assert s["compute_s"] < s["prep_s"]  # marked prep is taken out of compute


def test_manual_records_and_bad_input(tmp_path):
    prof = StallProfiler("m", warmup=0)
    prof.record(wait=0.0, compute=0.1, samples=32)
    assert prof.summary()["compute_per_sample_s"] == pytest.approx(0.1 / 32)
    with pytest.raises(ConfigError, match="wait must be a finite number"):
        prof.record(wait=-1, compute=0.1)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="not a stall profile"):
        StallProfiler.load(str(bad))
    with pytest.raises(ConfigError, match="cannot read stall profile"):
        StallProfiler.load(str(tmp_path / "missing.json"))


def test_profile_cli_with_and_without_scenario(tmp_path):
    prof = StallProfiler("slowdata")
    for _ in range(20):
        prof.record(wait=0.006, compute=0.004, samples=8)
    path = tmp_path / "p.json"
    prof.save(str(path))
    out = run_cli("profile", str(path))
    assert out.returncode == 0, out.stderr
    assert "verdict: I/O-bound" in out.stdout and "up to 60.0% less time" in out.stdout
    assert "give --scenario" in out.stdout
    sc = tmp_path / "s.toml"
    sc.write_text(SCENARIO)
    out = run_cli("profile", str(path), "--scenario", str(sc), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    g = d["gains"]
    assert g["sample_time"] == pytest.approx(0.004 / 8)
    assert g["cache"] < g["no_cache"] and g["planned"] <= g["cache"]
    assert 0 < g["caching_gain"] < 1 and d["summary"]["verdict"] == "I/O-bound"
    out = run_cli("profile", str(path), "--scenario", str(sc), "--job", "nosuch")
    assert out.returncode == 1 and "job 'nosuch' is not in the scenario" in out.stderr


def test_profile_recommends_the_shared_loader_for_prep_bound_jobs(tmp_path):
    prof = StallProfiler("prepbound")
    for _ in range(20):
        prof.record(wait=0.001, compute=0.002, prep=0.008, samples=8)
    path = tmp_path / "p.json"
    prof.save(str(path))
    out = run_cli("profile", str(path), "--jobs", "3")
    assert out.returncode == 0, out.stderr
    assert "shared loader: recommended" in out.stdout
    out = run_cli("profile", str(path), "--jobs", "3", "--json")
    sl = json.loads(out.stdout)["gains"]["shared_loader"]
    # 11 ms per iteration, of which 9 ms are stall shared by 3: 2 + 3 = 5 ms
    assert sl["speedup"] == pytest.approx(11 / 5) and sl["recommended"] and sl["jobs"] == 3
    out = run_cli("profile", str(path), "--jobs", "0")
    assert out.returncode == 2 and "--jobs must be >= 1" in out.stderr
    compute_bound = StallProfiler("fast")
    for _ in range(20):
        compute_bound.record(wait=0.0001, compute=0.01, samples=8)
    compute_bound.save(str(path))
    out = run_cli("profile", str(path))
    assert "shared loader: little to gain" in out.stdout
