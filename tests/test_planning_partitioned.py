"""A run whose cache is partitioned across nodes, planned as one: the planner's scenario
(``scenario_for``, ``plan_run``), where its nodes and remote-hit bandwidth come from, the
coordinator's node count (``run_partition``), what calibration writes, and ``hpcstagger plan``'s
header for a partitioned scenario. No MPI: one process is one node."""

from __future__ import annotations

import textwrap

import pytest

from hpcstagger import config
from hpcstagger.colocated.startcache import run_partition
from hpcstagger.measure.spec_calibration import scenario_cache
from hpcstagger.stagger.delays import plan_run, scenario_for
from hpcstagger.stagger.runplan import PlanInputs
from hpcstagger.spec.jobspec import Spec
from hpcstagger.comm import Comm
from hpcstagger.model import Scenario, optimal_plan

SCENARIO = textwrap.dedent("""
    [dataset]
    samples = 400
    sample_bytes = 1000
    [storage]
    bandwidth = [1.0e6, 1.2e6]
    [cache]
    capacity = 2.0e5
    hit_bandwidth = 1.0e9
    {extra}
    [[job]]
    name = "a"
    sample_time = 0.0005
    [[job]]
    name = "b"
    sample_time = 0.0004
""")


def _spec(tmp_path, *, partitioned=True, extra="", capacity="1MB"):
    (tmp_path / "s.toml").write_text(SCENARIO.format(extra=extra))
    return Spec.from_dict({
        "run": {"name": "p"},
        "cache": {"capacity": capacity, "partitioned": partitioned},
        "plan": {"mode": "plan", "scenario": "s.toml"},
        "job": [{"name": "a", "command": "python a.py", "epochs": 3},
                {"name": "b", "command": "python b.py", "epochs": 3}],
    }, base_dir=tmp_path)


RUN = {"nodes": 3, "remote_bandwidth": 4.0e8}  # what the coordinator passes: the nodes found, the knob


def test_a_partitioned_spec_is_planned_partitioned_over_the_runs_nodes(tmp_path):
    sc = scenario_for(_spec(tmp_path), ["a", "b"], {}, partition=RUN)
    assert sc.cache.partitioned and sc.cache.nodes == 3 and sc.cache.remote_bandwidth == 4.0e8
    assert sc.cache.capacity == 2.0e5  # still per node: 3 times that in all
    assert sc.node_cache_samples == 200 and sc.cache_samples == 400  # 3 x 200, at most the dataset
    plain = scenario_for(_spec(tmp_path, partitioned=False), ["a", "b"], {})
    assert not plain.cache.partitioned and plain.cache.nodes == 1 and plain.cache_samples == 200


def test_the_runs_nodes_win_over_the_file_and_a_measurement_over_the_files_bandwidth(tmp_path):
    extra = "partitioned = true\nnodes = 2\nremote_bandwidth = 5.0e8"
    spec = _spec(tmp_path, extra=extra)
    sc = scenario_for(spec, ["a", "b"], {}, partition=RUN)
    assert sc.cache.nodes == 3  # the run spans 3 nodes, whatever the file says
    assert sc.cache.remote_bandwidth == 5.0e8  # the file's value wins over the knob's default
    measured = {"a": {"sample_time": 0.0005, "remote_bandwidth": 7.0e8},
                "b": {"sample_time": 0.0004, "remote_bandwidth": 6.0e8}}
    assert scenario_for(spec, ["a", "b"], measured, partition=RUN).cache.remote_bandwidth == 6.0e8  # the lowest
    # nothing from the run (a caller that did not look): the file's nodes
    assert scenario_for(spec, ["a", "b"], {}).cache.nodes == 2


def test_a_partition_passed_for_the_knob_partitions_a_plain_spec(tmp_path):
    """The cache_partitioned knob partitions a spec without [cache] partitioned: the coordinator
    passes the partition, and the planner follows it."""
    sc = scenario_for(_spec(tmp_path, partitioned=False), ["a", "b"], {}, partition=RUN)
    assert sc.cache.partitioned and sc.cache.nodes == 3


def test_one_nodes_cache_counts_for_its_share_of_the_partition(tmp_path):
    spec = _spec(tmp_path)
    # the coordinator looked at its own node's cache: 100 entries there are about 300 over 3 nodes
    sc = scenario_for(spec, ["a", "b"], {}, cache_state={"entries": 100}, partition=RUN)
    assert sc.cache.initial == pytest.approx(300 / 400)
    plain = scenario_for(_spec(tmp_path, partitioned=False), ["a", "b"], {}, cache_state={"entries": 100})
    assert plain.cache.initial == pytest.approx(100 / 400)


def test_plan_run_plans_the_partitioned_scenario_and_returns_the_partition(tmp_path):
    spec = _spec(tmp_path)
    out = plan_run(spec, ["a", "b"], {}, "plan", PlanInputs(partition=RUN)).to_dict()
    assert out["partition"] == RUN
    sc = Scenario.from_dict(out["scenario"])
    assert sc.cache.partitioned and sc.cache.nodes == 3
    assert out["predicted"]["plan"] == pytest.approx(optimal_plan(sc, jitter=spec.plan.jitter).makespan)
    local = plan_run(_spec(tmp_path, partitioned=False), ["a", "b"], {}, "plan").to_dict()
    assert "partition" not in local and not Scenario.from_dict(local["scenario"]).cache.partitioned
    # three nodes' caches hold more of the data than one: the prediction says so
    assert out["predicted"]["simultaneous"] < local["predicted"]["simultaneous"]


def test_run_partition_counts_the_nodes_only_for_a_partitioned_cache(tmp_path):
    world = Comm.single()
    assert run_partition(world, _spec(tmp_path), 5.0) == {
        "nodes": 1, "remote_bandwidth": float(config.get("cache_remote_bandwidth"))}
    assert run_partition(world, _spec(tmp_path, partitioned=False), 5.0) is None
    assert run_partition(world, _spec(tmp_path, capacity=0), 5.0) is None  # no cache
    assert run_partition(world, None, 5.0) is None
    with config.override(cache_partitioned=True, cache_remote_bandwidth=3.0e8):
        assert run_partition(world, _spec(tmp_path, partitioned=False), 5.0) == {"nodes": 1,
                                                                                   "remote_bandwidth": 3.0e8}


def test_calibration_writes_a_partitioned_cache_with_the_default_it_did_not_measure(tmp_path):
    meas = {"samples": 400, "sample_bytes": 1000.0, "hits": {"hit_bandwidth": 1.0e9, "how": "64 reads"},
            "page_cache": {"holds": False, "source": "other", "emulated": False}}
    with config.override(cache_remote_bandwidth=1.5e9):
        cache, notes = scenario_cache(meas, _spec(tmp_path), None, None)
    assert cache.partitioned and cache.nodes == 1 and cache.remote_bandwidth == 1.5e9
    assert "NOT MEASURED" in notes["cache.remote_bandwidth"]
    assert not cache.coalesce  # each node reads its own misses
    cache, notes = scenario_cache(meas, _spec(tmp_path, partitioned=False), None, None)
    assert not cache.partitioned and "cache.remote_bandwidth" not in notes


@pytest.mark.parametrize("shm", [True, False])
def test_a_coalescing_cache_is_the_page_cache_only_without_shm(tmp_path, shm):
    """A ShmCache that reads each sample once (coalesce, shm) is partitioned when the run's spec is,
    and reads its misses on each node; the page cache (coalesce alone) stays node-local."""
    sc = scenario_for(_spec(tmp_path, extra="coalesce = true" + ("\nshm = true" if shm else "")), ["a", "b"], {},
                      partition=RUN)
    assert sc.cache.partitioned is shm and sc.cache.coalesce is not shm and sc.cache.page_cache is not shm
    sc = scenario_for(_spec(tmp_path, partitioned=False, extra="coalesce = true" + ("\nshm = true" if shm else "")),
                      ["a", "b"], {})
    assert (sc.cache.coalesce, sc.cache.shm, sc.cache.page_cache) == (True, shm, not shm)
    assert Scenario.from_dict(sc.to_dict()) == sc


def test_calibration_says_a_shm_cache_reads_a_sample_once_where_it_holds_the_dataset(tmp_path):
    meas = {"samples": 100, "sample_bytes": 5000.0, "hits": {"hit_bandwidth": 1.0e9, "how": "64 reads"},
            "page_cache": {"holds": False, "source": "other", "emulated": False}}
    cache, notes = scenario_cache(meas, _spec(tmp_path, partitioned=False), None, None)  # 1 MB: all 500 kB
    assert cache.coalesce and cache.shm and not cache.page_cache and "waits for that read" in notes["cache.coalesce"]
    cache, notes = scenario_cache(meas, _spec(tmp_path, partitioned=False, capacity="250kB"), None, None)
    assert cache.capacity == 250e3 and not cache.coalesce and "cache.coalesce" not in notes  # half of it
    cache, _ = scenario_cache(meas, _spec(tmp_path, partitioned=False), None, "none")
    assert not cache.coalesce


def test_plan_header_gives_a_partitioned_cache_per_node_and_in_all(tmp_path):
    from hpcstagger.cli.cmd_plan import format_plan

    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(extra="partitioned = true\nnodes = 2\nremote_bandwidth = 5.0e8"))
    sc = Scenario.from_toml(path)
    head = format_plan(str(path), sc, optimal_plan(sc)).splitlines()[0]
    assert "partitioned over 2 nodes" in head and "195.3 KiB per node" in head and "390.6 KiB in all" in head
    assert "100% of the data" in head and "remote hits 500 MB/s" in head
    path.write_text(SCENARIO.format(extra=""))
    sc = Scenario.from_toml(path)
    head = format_plan(str(path), sc, optimal_plan(sc)).splitlines()[0]
    assert "cache 195.3 KiB minio (50% of the data)" in head and "per node" not in head
