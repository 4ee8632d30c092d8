"""Prefetching in the wait (hpcstagger.colocated.prefetch): a real ShmCache and a real source; the
prefetcher reads only while the others' counters show the source idle, skips what is cached,
counts no lookup, and never fails the job."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest

from hpcstagger.cache import ShmCache
from hpcstagger.colocated.prefetch import Prefetcher


class Source:
    """``n`` samples of ``size`` bytes; counts the reads of each index."""

    def __init__(self, n: int, size: int = 1000, fail_at: int | None = None):
        self.n, self.size, self.fail_at = n, size, fail_at
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def key(self, i: int) -> str:
        return f"s{i}"

    def __getitem__(self, i: int) -> bytes:
        if i == self.fail_at:
            raise OSError("the file system went away")
        self.reads.append(i)
        return bytes([i % 256]) * self.size


@pytest.fixture
def cache(shm_root):
    c = ShmCache("prefetch-test", 2_000_000, root=shm_root)
    yield c
    c.destroy(force=True)


def _drain(p: Prefetcher, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and p(end - time.monotonic()):
        pass


def test_an_idle_source_is_read_into_the_cache_skipping_what_it_holds(cache):
    src = Source(50)
    for i in range(0, 50, 2):
        cache.put(src.key(i), src[i])
    src.reads.clear()
    p = Prefetcher(src, cache, look_s=0.005)
    _drain(p, 5.0)
    assert p.done and not p(1.0)
    assert sorted(src.reads) == list(range(1, 50, 2))  # only what nobody had read
    assert p.samples == 25 and p.fraction() == pytest.approx(0.5) and p.bytes == 25 * 1000
    assert all(cache.contains(src.key(i)) for i in range(50))
    s = cache.stats()
    assert s["lookups"] == 0 and s["read_bytes"] == 0  # neither its lookups nor its reads count as the jobs'
    assert p.stats()["prefetch_samples"] == 25


def test_it_holds_back_while_the_others_read(cache):
    src = Source(200)
    stop = threading.Event()

    def busy_job() -> None:  # another job's misses: two reads in flight all the time, as the counters say
        while not stop.is_set():
            time.sleep(0.01)
            cache.count_read(1000, 0.02)

    t = threading.Thread(target=busy_job)
    t.start()
    try:
        p = Prefetcher(src, cache, look_s=0.01)
        _drain(p, 0.5)
        assert p.samples == 0 and p.busy_s > 0.3
    finally:
        stop.set()
        t.join()
    _drain(p, 5.0)  # the others are done: it goes on
    assert p.samples == 200


def test_a_failing_source_stops_prefetching_not_the_job(cache):
    p = Prefetcher(Source(20, fail_at=5), cache, look_s=0.005)
    _drain(p, 2.0)
    assert p.done and p.samples == 5 and not p(1.0)


def test_a_call_is_bounded_by_the_time_left(cache):
    p = Prefetcher(Source(10_000, size=100), cache, look_s=0.005)
    t = time.monotonic()
    assert p(0.05)
    assert time.monotonic() - t < 0.2 and 0 < p.samples < 10_000


# ------------------------------------------------------------------------------------ in a real launch
LAUNCH_JOB = textwrap.dedent("""
    import time
    import torch
    import hpcstagger
    from hpcstagger.cache import CachedDataset

    session = hpcstagger.init()
    data = CachedDataset(session.source(), session.cache(), transform=lambda b: len(bytes(b)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=0)
    total = 0
    for batch in session.loader(loader):
        total += int(batch.sum())
        time.sleep(0.15 if session.job == "a" else 0.0)  # a is compute-bound: the source idles between batches
    session.finish(total=total)
""")


@pytest.mark.timeout(240)
def test_the_waiting_job_prefetches_in_a_launch(tmp_path, shm_root):
    import json

    from support.cli import cli_env, run_cli
    from support.userjob import SAMPLE_BYTES, SAMPLES, write_run

    spec = Path(write_run(tmp_path, shm_root, name="pf", plan='mode = "fixed"\ndelays = { b = 3.0 }\nprefetch = true'))
    (tmp_path / "job.py").write_text(LAUNCH_JOB)
    spec.write_text(spec.read_text().replace("epochs = 2", "epochs = 1"))
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm_root)
    out = run_cli("launch", str(spec), "--cold-cache", "--json", cwd=tmp_path, env=env, timeout=200)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {n: j["metrics"]["total"] for n, j in result["jobs"].items()} == {"a": SAMPLES * SAMPLE_BYTES,
                                                                            "b": SAMPLES * SAMPLE_BYTES}
    status = json.loads(next((tmp_path / "hpcstagger-runs" / "pf" / "runs").glob("*/b.0.json")).read_text())
    t = status["timings"]
    # a's reads leave the source idle about half the time: b's leader reads into the cache then, and holds back
    assert 20 <= t["prefetch_samples"] <= SAMPLES and t["prefetch_bytes"] == t["prefetch_samples"] * SAMPLE_BYTES
    assert t["prefetch_busy_s"] > 0
    status_a = json.loads(next((tmp_path / "hpcstagger-runs" / "pf" / "runs").glob("*/a.0.json")).read_text())
    assert "prefetch_samples" not in status_a["timings"]  # only the job that waits prefetches
