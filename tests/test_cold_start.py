"""A run starts from the shared cache as it is: the coordinator plans from what the cache holds
(cold or warm) and says so; ``hpcstagger launch --cold-cache`` empties the cache first (with the
cache's own safety checks) and drops the dataset from the page cache."""

from __future__ import annotations

import json
import os

import pytest

from hpcstagger import config
from hpcstagger.cache import ShmCache, list_caches
from hpcstagger.colocated.startcache import (describe_cold, describe_start, drop_page_cache, make_cold,
                                             observe_cache)
from hpcstagger.spec.jobspec import Spec
from hpcstagger.errors import CacheError
from support.cli import run_cli
from support.spec_util import CAPACITY, fill, fill_dataset, write_spec

pytestmark = pytest.mark.timeout(180)


def test_a_partitioned_cache_on_emulated_nodes_is_seen_on_node_0_and_cleared_on_every_node(tmp_path, shm_root):
    path = write_spec(tmp_path, shm_root, files=30, size=1000)
    spec = Spec.from_toml(path)
    fill_dataset(os.path.join(shm_root, "node0"), path, range(20))
    fill_dataset(os.path.join(shm_root, "node1"), path, range(20, 27))
    assert observe_cache(spec)["entries"] == 0  # node-local: the root's own cache, which is empty
    with config.override(cache_partitioned=True, cache_nodes=2):
        seen = observe_cache(spec)
        assert seen["exists"] and seen["entries"] == 20  # node 0's share, where world rank 0 is
        cold = make_cold(spec)
        assert cold["cache"]["entries"] == 27 and cold["cache"]["nodes"] == 2
        assert observe_cache(spec)["entries"] == 0
    assert list_caches(os.path.join(shm_root, "node0")) == list_caches(os.path.join(shm_root, "node1")) == []


def test_observe_and_make_cold_on_a_real_cache(tmp_path, shm_root):
    path = write_spec(tmp_path, shm_root, files=200, size=1000)
    spec = Spec.from_toml(path)
    assert observe_cache(spec) == {"name": "warm", "exists": False, "entries": 0, "bytes": 0}
    assert list_caches(shm_root) == []  # looking created nothing
    fill_dataset(shm_root, path, range(30))
    seen = observe_cache(spec)
    assert seen["exists"] and seen["entries"] == 30 and seen["bytes"] == 30_000 and seen["other_entries"] == 0
    assert describe_start({**seen, "fraction": 0.15}) == "warm cache: 30 samples (30.0 kB, 15% of the dataset)"

    cold = make_cold(spec)
    assert cold["cache"]["action"] == "removed" and cold["cache"]["entries"] == 30
    assert cold["page_cache"]["files"] == 200 and cold["page_cache"]["bytes"] == 200 * 1000
    assert list_caches(shm_root) == []
    assert "removed cache 'warm' (30 entries" in describe_cold(cold)
    assert "dropped 200 dataset file(s)" in describe_cold(cold)
    assert make_cold(spec)["cache"]["action"] == "absent"  # nothing there: nothing to do

    # a cache in use by a live process is emptied, not removed under it
    user = ShmCache("warm", CAPACITY, root=shm_root)
    try:
        user.put(1, b"x" * 10)
        user.get(1)  # takes a process slot: this process is a live user
        cold = make_cold(spec)
        assert cold["cache"]["action"] == "cleared" and user.stats()["entries"] == 0
    finally:
        user.destroy(force=True)
    # page-cache failures are reported, not raised
    assert drop_page_cache([str(tmp_path / "missing")]) == {"files": 0, "bytes": 0, "failed": 1, "note": ""}


def test_cold_cache_refuses_a_cache_it_may_not_touch(tmp_path, shm_root):
    """The cache's safety rules hold: a symlink where the cache should be is not followed or deleted."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, os.path.join(shm_root, "warm"))
    spec = Spec.from_toml(write_spec(tmp_path, shm_root))
    with pytest.raises(CacheError, match="--cold-cache: cannot clear the shared cache 'warm'"):
        make_cold(spec)
    assert target.is_dir() and os.path.islink(os.path.join(shm_root, "warm"))


def test_a_warm_cache_reaches_the_plan_and_cold_cache_clears_it(tmp_path, shm_root):
    spec = write_spec(tmp_path, shm_root, files=200, size=1000)
    fill_dataset(shm_root, spec, range(50))
    out = run_cli("launch", spec, "--json", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    warm = json.loads(out.stdout)
    assert warm["cache"]["entries"] == 50 and warm["cache"]["fraction"] == pytest.approx(0.25)
    assert warm["scenario"]["cache"]["initial"] == pytest.approx(0.25)  # the plan started from it
    assert warm["cold_cache"] == {}
    assert "warm cache: 50 samples" in out.stderr  # the coordinator's announcement

    text = run_cli("status", spec, cwd=tmp_path)
    assert text.returncode == 0 and "start: warm cache: 50 samples (50.0 kB, 25% of the dataset)" in text.stdout

    out = run_cli("launch", spec, "--cold-cache", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("cold cache: removed cache 'warm' (50 entries, 50.0 kB); dropped 200 dataset file(s) (200.0 kB)"
            in out.stdout)
    assert "start: cold cache" in out.stdout
    assert list_caches(shm_root) == []
    status = json.loads(run_cli("status", spec, "--json", cwd=tmp_path).stdout)
    assert status["cache"]["entries"] == 0 and status["cold_cache"]["cache"]["action"] == "removed"
    assert status["scenario"]["cache"].get("initial", 0.0) == 0.0


def test_a_cache_of_other_data_is_cold_for_this_dataset(tmp_path, shm_root):
    """Entries of other data, or of an older version of the files, are not counted as warm."""
    path = write_spec(tmp_path, shm_root, files=40, size=1000)
    spec = Spec.from_toml(path)
    fill(shm_root, 25)  # 25 entries under keys of no file of this dataset
    seen = observe_cache(spec)
    assert seen["exists"] and seen["entries"] == 0 and seen["other_entries"] == 25
    line = describe_start(seen)
    assert line.startswith("cold cache; 25 entries of other data") and "hpcstagger cache clear warm" in line

    fill_dataset(shm_root, path, range(10))
    assert observe_cache(spec)["entries"] == 10
    for f in sorted((tmp_path / "data").iterdir())[:4]:  # four of the cached files regenerated
        f.write_bytes(os.urandom(1000))
    seen = observe_cache(spec)
    assert seen["entries"] == 6 and seen["other_entries"] == 29


def test_a_dataset_that_cannot_be_read_counts_as_cold(tmp_path, shm_root):
    path = write_spec(tmp_path, shm_root, files=10, size=1000)
    fill_dataset(shm_root, path, range(10))
    spec = Spec.from_toml(path)
    import shutil

    shutil.rmtree(tmp_path / "data")
    seen = observe_cache(spec)
    assert seen["entries"] == 0 and seen["other_entries"] == 10 and "does not exist" in seen["note"]


def test_counting_a_large_dataset_probes_evenly(tmp_path, shm_root, monkeypatch):
    from hpcstagger.colocated import startcache as cachestate

    monkeypatch.setattr(cachestate, "PROBES", 20)
    path = write_spec(tmp_path, shm_root, files=100, size=100)
    fill_dataset(shm_root, path, range(0, 100, 2))  # every other sample
    assert observe_cache(Spec.from_toml(path))["entries"] == 50
