"""``[cache] capacity = "auto"``: the /dev/shm cache sized to what the memory leaves beside the jobs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from hpcstagger.cache.store import ShmCache
from hpcstagger.colocated.batch import render_batch
from hpcstagger.errors import ConfigError
from hpcstagger.model import Scenario
from hpcstagger.spec import cachesize as C
from hpcstagger.spec.jobspec import Spec
from hpcstagger.stagger.delays import scenario_for
from hpcstagger.stagger.scenario_build import jobs_memory, scenario_cache
from support.cgroups import memory_group, v1_memory
from support.cli import cli_env, run_cli

MB = 1_000_000


@pytest.fixture(autouse=True)
def _no_launcher_size(monkeypatch):
    monkeypatch.delenv("HPCSTAGGER_CACHE_CAPACITY", raising=False)


# ----------------------------------------------------------------------------------- the rule (pure)
def test_what_is_left_beside_the_jobs_is_the_cache():
    s = C.size_cache(2000 * MB, 1000 * MB, 4000 * MB, file_source=True)
    reserve = max(C.RESERVE_MIN, int(C.RESERVE_SHARE * 2000 * MB))
    assert s.capacity == s.room == 2000 * MB - 1100 * MB - reserve
    assert "of the 4000 MB dataset" in s.why and "measured 1000 MB" in s.why


def test_a_dataset_the_page_cache_keeps_beside_the_jobs_gets_no_cache():
    s = C.size_cache(2000 * MB, 1000 * MB, 300 * MB, file_source=True)
    assert s.capacity == 0 and s.room > 300 * MB and "page cache keeps it" in s.why
    # an emulated source has no page cache: the whole dataset, with room for the arena's rounding
    e = C.size_cache(2000 * MB, 1000 * MB, 300 * MB, file_source=False)
    assert 300 * MB < e.capacity <= 300 * MB * 1.01 + (1 << 20) and "which fits" in e.why


@pytest.mark.parametrize("memory, jobs, what", [(1500 * MB, 1400 * MB, "nothing is left"),
                                                (2000 * MB, 1700 * MB, "too little to pay")])
def test_no_cache_where_too_little_is_left(memory, jobs, what):
    s = C.size_cache(memory, jobs, 4000 * MB, file_source=True)
    assert s.capacity == 0 and what in s.why


def test_unmeasured_jobs_leave_the_cache_a_share_and_unknown_memory_no_cache():
    s = C.size_cache(2000 * MB, 0.0, None, file_source=True)
    assert s.capacity == int(C.UNMEASURED_SHARE * 2000 * MB) and "not measured" in s.why
    assert C.size_cache(None, 1000 * MB, 4000 * MB, file_source=True).capacity == 0


def test_jobs_memory_adds_the_jobs_up_and_counts_a_shared_loaders_workers_once():
    jobs = {"a": {"memory": 300 * MB, "memory_workers": 200 * MB, "memory_file": 100 * MB},
            "b": {"memory": 250 * MB, "memory_workers": 150 * MB, "memory_file": 90 * MB},
            "c": {"memory": 120 * MB, "memory_workers": 0, "memory_file": 80 * MB}}
    total, note = jobs_memory(jobs)
    assert total == (300 + 250 + 120 + 100) * MB and note.startswith("770 MB: ")
    total, note = jobs_memory(jobs, {"sweep": ["a", "b"]})  # one loader's workers: the larger, 200 MB
    assert total == (770 - 150) * MB and "less 150 MB of DataLoader workers" in note
    assert jobs_memory({**jobs, "d": {"sample_time": 1.0}})[0] == 0.0


def test_jobs_memory_counts_a_shared_loaders_producer_once():
    # calibration runs each job alone, so each started (and was measured with) a producer of its own;
    # co-located, the jobs of one shared loader take their batches from one producer
    jobs = {"a": {"memory": 500 * MB, "memory_workers": 0, "memory_producer": 220 * MB, "memory_file": 100 * MB},
            "b": {"memory": 480 * MB, "memory_workers": 0, "memory_producer": 200 * MB, "memory_file": 90 * MB},
            "c": {"memory": 260 * MB, "memory_workers": 0, "memory_file": 80 * MB}}
    assert jobs_memory(jobs)[0] == (500 + 480 + 260 + 100) * MB  # separate loaders: every producer
    total, note = jobs_memory(jobs, {"sweep": ["a", "b"]})
    assert total == (1340 - 200) * MB and "less 200 MB of DataLoader workers and producers" in note


def test_a_page_cache_too_small_beside_the_jobs_is_planned_as_what_it_keeps(tmp_path):
    """The page-cache rule saw the dataset fit in the free memory before the jobs started; measured,
    the jobs leave the page cache 250 MB of a 600 MB dataset and no /dev/shm cache fits: the plan's
    cache is the page cache of 250 MB, least recently used first, readers of one page sharing a read."""
    spec = _spec(tmp_path)
    pc = {"source": "directory", "emulated": False, "dataset_bytes": 600 * MB, "mem_available": 1500 * MB,
          "holds": True, "hit_bandwidth": 2e9, "how": "measured"}
    meas = {"samples": 20000, "sample_bytes": 30000.0, "page_cache": pc, "hits": {"hit_bandwidth": 5e9, "how": "x"},
            "jobs": {"a": {"memory": 1150 * MB, "memory_workers": 0, "memory_file": 100 * MB}}}
    memory, _ = jobs_memory(meas["jobs"])
    sized = C.size_cache(pc["mem_available"], memory, pc["dataset_bytes"], file_source=True)
    assert sized.capacity == 0 and sized.page_room == 250 * MB
    pc.update(holds=False, beside_jobs=sized.page_room)
    cache, notes = scenario_cache({**meas, "cache_sizing": sized}, spec, None, None)
    assert (cache.capacity, cache.policy, cache.coalesce, cache.hit_bandwidth) == (250 * MB, "lru", True, 2e9)
    assert "250 MB the memory leaves beside the jobs" in notes["cache.capacity"]


# ------------------------------------------------------------------------------------ the spec
SPEC = """
[run]
name = "autocache"
[dataset]
path = "data"
[cache]
capacity = "{capacity}"
[plan]
mode = "plan"
scenario = "scenario.toml"
[[job]]
name = "a"
command = "true"
"""


def _scenario(path, *, jobs_memory: float, samples: int = 4000, sample_bytes: float = 1e6, coalesce=False):
    text = (f"[dataset]\nsamples = {samples}\nsample_bytes = {sample_bytes}\n[storage]\nbandwidth = [1e8]\n"
            f"[cache]\ncapacity = 2e9\ncoalesce = {str(coalesce).lower()}\n"
            f"[node]\ncores = 2\njobs_memory = {jobs_memory}\n[[job]]\nname = \"a\"\nsample_time = 0.001\n")
    path.write_text(text)


def _spec(tmp_path, capacity="auto"):
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "spec.toml").write_text(SPEC.format(capacity=capacity))
    return Spec.from_toml(tmp_path / "spec.toml")


def test_auto_takes_the_launchers_size_and_rejects_a_bad_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCSTAGGER_CACHE_CAPACITY", "123456789")
    spec = _spec(tmp_path, "AUTO")
    assert spec.cache.auto and spec.cache.capacity == 123456789 and "launcher" in spec.cache.sized
    monkeypatch.setenv("HPCSTAGGER_CACHE_CAPACITY", "-5")
    with pytest.raises(ConfigError, match="HPCSTAGGER_CACHE_CAPACITY"):
        _spec(tmp_path)
    monkeypatch.delenv("HPCSTAGGER_CACHE_CAPACITY")
    assert not _spec(tmp_path, "64MB").cache.auto and _spec(tmp_path, "64MB").cache.capacity == 64 * MB


def test_auto_without_a_launcher_sizes_from_the_nodes_total_memory_and_the_scenario(tmp_path):
    """Every process of a node computes the same size: the memory its processes may hold in all."""
    total = C.memory_total()
    assert total
    spec = _spec(tmp_path)  # no scenario file yet: the jobs' memory is not known
    assert spec.cache.capacity == int(C.UNMEASURED_SHARE * total) and "not measured" in spec.cache.sized
    _scenario(tmp_path / "scenario.toml", jobs_memory=2 * total)  # the jobs take it all
    assert _spec(tmp_path).cache.capacity == 0
    _scenario(tmp_path / "scenario.toml", jobs_memory=total / 4, samples=1000)  # a small dataset: page cache
    spec = _spec(tmp_path)
    assert spec.cache.capacity == 0 and "page cache keeps it" in spec.cache.sized


def test_the_plan_uses_the_runs_smaller_size_but_not_for_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCSTAGGER_CACHE_CAPACITY", str(300 * MB))
    _scenario(tmp_path / "scenario.toml", jobs_memory=1e9)
    assert scenario_for(_spec(tmp_path), ["a"], {}).cache.capacity == 300 * MB
    assert Scenario.from_toml(tmp_path / "scenario.toml").cache.capacity == 2e9  # the file is left as it is
    _scenario(tmp_path / "scenario.toml", jobs_memory=1e9, coalesce=True)
    assert scenario_for(_spec(tmp_path), ["a"], {}).cache.capacity == 2e9
    monkeypatch.delenv("HPCSTAGGER_CACHE_CAPACITY")
    assert scenario_for(_spec(tmp_path, "3GB"), ["a"], {}).cache.capacity == 2e9  # a given size: the file's


def test_the_batch_script_sizes_an_auto_cache_once_with_hpcstagger_slurm_prepare(tmp_path, shm_root):
    """Under sbatch no launcher sizes the cache: the script exports what ``hpcstagger slurm prepare``
    prints (the launch's sizing, from the memory free when the job starts) to every process, and
    ``hpcstagger cache size`` prints the same size."""
    _scenario(tmp_path / "scenario.toml", jobs_memory=1e9, samples=2000)
    script = render_batch(_spec(tmp_path))
    assert 'prepared="$(hpcstagger slurm prepare "$HPCSTAGGER_SPEC" "$run_dir")"\neval "$prepared"' in script
    assert script.index('mkdir -p "$run_dir"') < script.index("slurm prepare") < script.index("srun ")
    expected = C.size_cache(C.mem_available(), 1e9, 2e9, file_source=True).capacity
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    res = run_cli("slurm", "prepare", str(tmp_path / "spec.toml"), str(run_dir),
                  env=cli_env(HPCSTAGGER_SHM_ROOT=shm_root))
    assert res.returncode == 0, res.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in res.stdout.splitlines())
    assert abs(int(exports["HPCSTAGGER_CACHE_CAPACITY"]) - expected) <= max(64 << 20, 0.1 * expected)
    assert "jobs' measured 1000 MB" in res.stderr
    given = run_cli("slurm", "prepare", str(_spec(tmp_path, "64MB").path), str(run_dir),
                    env=cli_env(HPCSTAGGER_SHM_ROOT=shm_root))
    assert given.returncode == 0 and "HPCSTAGGER_CACHE_CAPACITY" not in given.stdout  # a size given: nothing to do
    _spec(tmp_path)  # capacity "auto" again
    missing = run_cli("slurm", "prepare", str(tmp_path / "spec.toml"), str(tmp_path / "nowhere"))
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    res = run_cli("cache", "size", str(tmp_path / "spec.toml"), env=cli_env(HPCSTAGGER_SHM_ROOT=shm_root))
    assert res.returncode == 0, res.stderr
    expected = C.size_cache(C.mem_available(), 1e9, 2e9, file_source=True).capacity
    assert abs(int(res.stdout) - expected) <= max(64 << 20, 0.1 * expected)  # the free memory moves a little
    assert "jobs' measured 1000 MB" in res.stderr
    res = run_cli("cache", "size", str(tmp_path / "spec.toml"), env=cli_env(HPCSTAGGER_SHM_ROOT=shm_root,
                                                                          HPCSTAGGER_CACHE_CAPACITY="5"))
    assert res.returncode == 0 and int(res.stdout) != 5  # it sizes anew: the variable is what it sets


def test_a_launch_keeps_an_existing_caches_size(tmp_path, shm_root):
    spec = _spec(tmp_path)
    cache = ShmCache(spec.cache.name, 8 << 20)
    try:
        cache.put("k", b"x" * 100)
        sized = C.for_launch(spec, {})
        assert sized is not None and sized.capacity == 8 << 20 and "keeps its" in sized.why
        assert C.for_launch(spec, {"HPCSTAGGER_CACHE_CAPACITY": "5"}) is None
        assert C.for_launch(_spec(tmp_path, "1MB"), {}) is None
    finally:
        cache.destroy(force=True)


@pytest.mark.skipif(v1_memory() is None, reason="needs a writable cgroup v1 memory hierarchy (root)")
def test_a_launch_in_a_real_memory_cgroup_sizes_the_cache_to_its_room(tmp_path, shm_root):
    """In a 768 MiB memory cgroup with jobs measured at 300 MB: the cache is what the group leaves
    beside them, far less than the node's free memory would give, and the launch hands every
    process that one size."""
    _scenario(tmp_path / "scenario.toml", jobs_memory=300e6, samples=2000)  # a 2 GB dataset
    _spec(tmp_path)
    code = ("import json, sys; from hpcstagger.spec.jobspec import Spec; from hpcstagger.spec import cachesize; "
            "from hpcstagger.model.source_probe import mem_available; "
            f"spec = Spec.from_toml({str(tmp_path / 'spec.toml')!r}); s = cachesize.for_launch(spec, {{}}); "
            "print(json.dumps([s.capacity, s.room, mem_available()]))")
    with memory_group(768 << 20, "size") as (_, join):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=join,
                             env={**os.environ, "HPCSTAGGER_SHM_ROOT": shm_root})
    assert out.returncode == 0, out.stderr
    capacity, room, available = json.loads(out.stdout)
    assert available <= 768 << 20
    assert capacity == room and 0 < capacity <= (768 << 20) - 330e6 - C.RESERVE_MIN


FILL = """
import json, sys
from hpcstagger.cache.store import ShmCache
cache = ShmCache("fill", 2 << 30)
blob, stored = b"x" * (1 << 20), 0
for i in range(1200):
    if not cache.put(i, blob):
        break
    stored += 1
json.dump({"stored": stored, "reserve": cache._guard.reserve if cache._guard else None}, sys.stdout)
"""


@pytest.mark.skipif(v1_memory() is None, reason="needs a writable cgroup v1 memory hierarchy (root)")
@pytest.mark.parametrize("guard", [True, False])
def test_a_cache_filling_a_real_memory_cgroup_stops_at_the_reserve_instead_of_being_killed(tmp_path, guard):
    """A process in a 384 MiB memory cgroup fills a 2 GiB cache with 1 MiB samples: with the guard
    (the default) inserts are refused once the reserve is reached and the process lives on; without
    it the kernel's out-of-memory killer ends the process, since /dev/shm pages cannot be dropped."""
    root = tempfile.mkdtemp(prefix="hpcs-fill-", dir="/dev/shm")
    env = {**os.environ, "HPCSTAGGER_SHM_ROOT": root, "HPCSTAGGER_CACHE_MEMORY_GUARD": "1" if guard else "0"}
    try:
        with memory_group(384 << 20, "fill") as (group, join):
            out = subprocess.run([sys.executable, "-c", FILL], capture_output=True, text=True, timeout=120,
                                 preexec_fn=join, env=env)
            with open(os.path.join(group, "memory.oom_control")) as f:
                kills = int(dict(line.split() for line in f).get("oom_kill", 0))
            shutil.rmtree(root, ignore_errors=True)  # its pages are the group's until they go
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if guard:
        assert out.returncode == 0 and kills == 0, (out.returncode, out.stderr[-2000:])
        got = json.loads(out.stdout)
        assert got["reserve"] == 96 << 20                       # 5% of 384 MiB is less than the least reserve
        assert 150 < got["stored"] < 384 - 96, got              # what the group leaves beside the interpreter
    else:
        assert out.returncode == -9 and kills >= 1, (out.returncode, out.stdout, out.stderr[-2000:])
