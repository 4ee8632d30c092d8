"""A partitioned cache across nodes in the model: its fields, predict against the simulator, the
limits it must reach, and the planner.

A partitioned cache over M nodes holds M times a node's capacity; a hit is local with probability
1/M and remote (``remote_bandwidth``) otherwise. Node-local caches on M nodes, which every epoch
read a different share of the dataset, are not a scenario mode: the one test that needs them
counts their reads with a small explicit model of its own.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from hpcstagger.errors import ConfigError
from hpcstagger.model import Cache, Scenario, optimal_plan, predict, simulate

from support.model_scenarios import B, S


def scenario(n=1200, jobs=((0.0004, 3),), nodes=4, capacity=0.25, remote=5 * B, hit_bw=20 * B,
             bandwidth=(B, 0.6 * B), policy="minio", partitioned=True, job=None, cores=0, initial=0.0) -> Scenario:
    """``capacity`` per node as a fraction of the dataset; ``jobs`` as (seconds per sample, epochs);
    ``job``: loader fields every job gets; ``remote``/``hit_bw`` inf for free hits."""
    cache = {"capacity": capacity * n * S, "policy": policy, "hit_bandwidth": hit_bw, "initial": initial}
    if partitioned:
        cache.update(partitioned=True, nodes=nodes, remote_bandwidth=remote)
    d = {"dataset": {"samples": n, "sample_bytes": S}, "storage": {"bandwidth": list(bandwidth)}, "cache": cache,
         "job": [dict({"name": f"j{i}", "sample_time": t, "epochs": e}, **(job or {}))
                 for i, (t, e) in enumerate(jobs)]}
    if cores:
        d["node"] = {"cores": cores}
    return Scenario.from_dict(d)


def plain(sc: Scenario, **changes) -> Scenario:
    """``sc`` with one cache of the partitioned cache's whole capacity on one node, hits all local."""
    c = sc.cache
    fields = dict(capacity=c.capacity * c.nodes, policy=c.policy, hit_bandwidth=c.hit_bandwidth, initial=c.initial)
    fields.update(changes)
    return Scenario(sc.dataset, sc.storage, sc.jobs, cache=Cache(**fields), loader=sc.loader, node=sc.node)


def sim_makespan(sc: Scenario, delays=None, seeds=2) -> float:
    return statistics.fmean(simulate(sc, delays, seed=k).makespan for k in range(seeds))


def predicted_reads(sc: Scenario, after: float = 0.0) -> float:
    """Samples the prediction reads from the source after time ``after`` (its bandwidth series)."""
    p = predict(sc)
    t, bw = p.times, p.bandwidth
    return sum(bw[i] * (t[i + 1] - t[i]) for i in range(len(t) - 1) if t[i] >= after) / sc.dataset.sample_bytes


# ---- the scenario's fields --------------------------------------------------------------------
def test_fields_round_trip_and_derived_quantities():
    sc = scenario(n=1000, nodes=3, capacity=0.2, remote=2 * B, hit_bw=20 * B, cores=2)
    assert sc.cache.partitioned and sc.cache.nodes == 3 and sc.cache.remote_bandwidth == 2 * B
    assert sc.node_cache_samples == 200 and sc.cache_samples == 600     # the aggregate: 3 nodes
    assert sc.local_hit_time == pytest.approx(S / (20 * B)) and sc.remote_hit_time == pytest.approx(S / (2 * B))
    assert sc.hit_time == pytest.approx((S / (20 * B) + 2 * S / (2 * B)) / 3)  # local with probability 1/3
    assert sc.total_cores == 6                                           # [node] cores is per node
    text = sc.to_toml()
    assert "partitioned = true" in text and "nodes = 3" in text and "remote_bandwidth" in text
    assert Scenario.from_dict(sc.to_dict()) == sc
    # the aggregate never exceeds the dataset; infinite remote bandwidth round-trips as inf
    big = scenario(n=1000, nodes=8, capacity=0.3, remote=math.inf)
    assert big.cache_samples == 1000 and big.remote_hit_time == 0.0
    assert Scenario.from_dict(big.to_dict()) == big
    # a scenario without the fields writes none of them
    assert "partitioned" not in scenario(partitioned=False).to_toml()


@pytest.mark.parametrize("cache, message", [
    ({"nodes": 4}, r"cache\.nodes = 4 needs cache\.partitioned = true"),
    ({"remote_bandwidth": 1e9}, r"cache\.remote_bandwidth is only for a partitioned cache"),
    ({"partitioned": True, "nodes": 4}, r"cache\.remote_bandwidth is required with cache\.partitioned = true"),
    ({"partitioned": True, "nodes": 2, "remote_bandwidth": 1e9, "coalesce": True},
     r"cache\.coalesce \(the page cache, which is node-local\) cannot be partitioned"),
    ({"partitioned": True, "nodes": 0, "remote_bandwidth": 1e9}, r"cache\.nodes must be an integer >= 1"),
    ({"partitioned": True, "nodes": 2, "remote_bandwidth": 0}, r"cache\.remote_bandwidth must be > 0"),
    ({"partitioned": "yes", "nodes": 2}, r"cache\.partitioned must be true or false"),
    ({"partitioned": True, "nodes": 2, "remote_bandwidth": 5e-324}, r"cache\.remote_bandwidth = 5e-324 is too small"),
    ({"partitioned": True, "nodes": 2, "remote_bandwidth": 1e-304}, r"run time overflows"),
])
def test_bad_fields_name_the_field_and_the_fix(cache, message):
    d = {"dataset": {"samples": 100, "sample_bytes": 1000.0}, "storage": {"bandwidth": [1e6]},
         "cache": dict({"capacity": 5e4}, **cache), "job": [{"name": "a", "sample_time": 0.01}]}
    with pytest.raises(ConfigError, match=message):
        Scenario.from_dict(d)


def test_unknown_keys_list_the_new_ones_and_direct_construction_is_validated():
    d = {"dataset": {"samples": 100, "sample_bytes": 1000.0}, "storage": {"bandwidth": [1e6]},
         "cache": {"partition": True}, "job": [{"name": "a", "sample_time": 0.01}]}
    with pytest.raises(ConfigError) as err:
        Scenario.from_dict(d)
    assert "partitioned (default false), nodes (default 1), remote_bandwidth (default unset" in str(err.value)
    sc = scenario(partitioned=False)
    with pytest.raises(ConfigError, match="cache.nodes = 2 needs"):
        Scenario(sc.dataset, sc.storage, sc.jobs, cache=Cache(capacity=1e6, nodes=2))


# ---- defaults: exactly the model before partitioning -------------------------------------------
# Recorded from the model and simulator before the partitioned cache existed (commit 7840684).
# They pin that a scenario without the new fields predicts exactly as before; a deliberate change
# to the model moves them too: re-record them with this module's _golden_cases(). The third
# prediction moved by 3e-5 when a racing follower with coalescing reads was first allowed to pass
# its leader (its hold is now judged at the midpoint's leads), and by 2e-6 when a passed leader that
# keeps up on hits became one convoy with its passer.
GOLDEN = [(3.210970467527058, 3.212129724594936), (4.924555726833078, 6.2636086491274625),
          (2.16080331022072, 2.160599999999873)]


def _golden_cases() -> list[Scenario]:
    def sc(jobs, cache, node=None):
        d = {"dataset": {"samples": 1200, "sample_bytes": S}, "storage": {"bandwidth": [B, 0.6 * B]},
             "cache": cache, "job": jobs}
        if node:
            d["node"] = node
        return Scenario.from_dict(d)

    return [
        sc([{"name": "a", "sample_time": 0.0006, "epochs": 2}, {"name": "b", "sample_time": 0.001, "epochs": 1}],
           {"capacity": 0.6 * 1200 * S, "hit_bandwidth": 20 * B}),
        sc([{"name": "a", "sample_time": 0.0003, "epochs": 2, "ranks": 2, "workers": 2, "batch": 8,
             "prep_time": 0.0002, "startup": 0.5},
            {"name": "b", "sample_time": 0.0005, "epochs": 2, "workers": 3, "batch": 4, "order": "x"},
            {"name": "c", "sample_time": 0.0004, "epochs": 1, "order": "x"}],
           {"capacity": 0.5 * 1200 * S, "policy": "lru", "hit_bandwidth": 30 * B, "initial": 0.2}, {"cores": 3}),
        sc([{"name": "a", "sample_time": 0.0004, "epochs": 3, "order": "o"},
            {"name": "b", "sample_time": 0.0004, "epochs": 3, "order": "o"}],
           {"capacity": 1200 * S, "coalesce": True, "hit_bandwidth": 10 * B}),
    ]


def test_defaults_reproduce_the_earlier_predictions_bit_for_bit():
    for sc, (pred, sim) in zip(_golden_cases(), GOLDEN, strict=True):
        delays = [0.0] + [0.3] * (len(sc.jobs) - 1)
        assert predict(sc, delays, series=False).makespan == pytest.approx(pred, rel=1e-12, abs=0)
        assert simulate(sc, delays, seed=1).makespan == pytest.approx(sim, rel=1e-12, abs=0)


def test_partitioned_over_one_node_is_the_plain_cache_exactly():
    for k, base in enumerate(_golden_cases()[:2]):
        one = Scenario(base.dataset, base.storage, base.jobs, loader=base.loader, node=base.node,
                       cache=Cache(capacity=base.cache.capacity, policy=base.cache.policy, initial=base.cache.initial,
                                   hit_bandwidth=base.cache.hit_bandwidth, partitioned=True, nodes=1))
        delays = [0.0] + [0.3] * (len(base.jobs) - 1)
        assert predict(one, delays).makespan == predict(base, delays).makespan
        if k == 0:  # (the other simulates for seconds)
            assert simulate(one, delays, seed=2).finish == simulate(base, delays, seed=2).finish


# ---- predict against the simulator -------------------------------------------------------------
CASES = [
    # (jobs, nodes, capacity per node, remote, hit_bw, policy, job fields, cores)
    (((0.0004, 3),), 4, 0.25, 5 * B, 20 * B, "minio", None, 0),
    (((0.0006, 2), (0.0011, 2)), 3, 0.2, 2 * B, 20 * B, "minio", None, 0),
    (((0.0009, 3), (0.0005, 2)), 2, 0.2, 3 * B, math.inf, "lru", None, 0),
    (((0.001, 3),), 4, 0.3, 0.5 * B, math.inf, "minio", {"prefetch": 1}, 0),  # remote hits slower than compute
    (((0.00003, 2), (0.00005, 2)), 4, 0.1, 2 * B, 20 * B, "minio", {"ranks": 4, "workers": 2, "batch": 8}, 0),
    (((0.0002, 2), (0.0003, 2)), 2, 0.35, 3 * B, 20 * B, "minio",
     {"ranks": 2, "workers": 2, "batch": 4, "prep_time": 0.0003}, 2),
    (((0.0004, 2), (0.0004, 2)), 4, 0.25, 4 * B, 20 * B, "minio", {"order": "DistributedSampler(seed=0)"}, 0),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_predict_agrees_with_the_simulator(case):
    jobs, nodes, cap, remote, hit_bw, policy, job, cores = CASES[case]
    sc = scenario(jobs=jobs, nodes=nodes, capacity=cap, remote=remote, hit_bw=hit_bw, policy=policy, job=job,
                  cores=cores)
    for delays in ([0.0] * len(jobs), [0.0] + [0.4 * (k + 1) for k in range(len(jobs) - 1)]):
        assert predict(sc, delays, series=False).makespan == pytest.approx(sim_makespan(sc, delays), rel=0.04)


# ---- the limits --------------------------------------------------------------------------------
def test_more_nodes_of_the_same_capacity_read_less_from_the_source():
    n, epochs = 1000, 3
    reads, spans, sims = [], [], []
    for nodes in (1, 2, 3, 5):
        sc = scenario(n=n, jobs=((0.0003, epochs),), nodes=nodes, capacity=0.2, remote=8 * B,
                      partitioned=nodes > 1)
        # minio: the first epoch reads everything, the later ones what the aggregate cannot hold
        miss = simulate(sc).misses["j0"]
        assert miss == n + (epochs - 1) * (n - min(n, nodes * 200))
        sims.append(miss)
        reads.append(predicted_reads(sc))
        spans.append(predict(sc, series=False).makespan)
    assert sims == sorted(sims, reverse=True) and len(set(sims)) == len(sims)
    assert reads == pytest.approx(sims, rel=0.02)
    assert all(b < a for a, b in zip(spans, spans[1:], strict=False))


def test_remote_bandwidth_sweep_is_monotone_and_its_limits_are_the_all_local_cache():
    remotes = (B / 8, B / 2, B, 2 * B, 8 * B, 20 * B, 100 * B, math.inf)
    for jobs, slack in ((((0.0004, 3),), 1e-9), (((0.0004, 3), (0.0006, 2)), 2e-3)):
        spans = [predict(scenario(jobs=jobs, remote=r), [0] * len(jobs), series=False).makespan for r in remotes]
        # one job: faster remote hits never slow it. Two: once remote hits are cheap, the job
        # they speed up also competes harder for the source with the other (the model drifts up
        # by 0.2% here, within the simulator's noise), so a little slack
        assert all(b <= a * (1 + slack) for a, b in zip(spans, spans[1:], strict=False)), spans
        assert spans[0] > 4 * spans[-1]
    sc = scenario(jobs=((0.0004, 3), (0.0006, 2)), nodes=4, capacity=0.25, hit_bw=20 * B)
    # remote hits as fast as local ones: one cache of the whole capacity, exactly
    same = scenario(jobs=((0.0004, 3), (0.0006, 2)), remote=20 * B)
    assert predict(same, [0, 0.3]).makespan == predict(plain(sc), [0, 0.3]).makespan
    assert sim_makespan(same, [0, 0.3]) == pytest.approx(sim_makespan(plain(sc), [0, 0.3]), rel=0.01)
    # every hit free, locally and remotely: the remote bandwidth growing without bound approaches it
    free = plain(sc, hit_bandwidth=math.inf)
    fast = scenario(jobs=((0.0004, 3), (0.0006, 2)), remote=1e6 * B, hit_bw=math.inf)
    assert predict(fast, [0, 0.3]).makespan == pytest.approx(predict(free, [0, 0.3]).makespan, rel=1e-5)
    assert predict(scenario(jobs=((0.0004, 3), (0.0006, 2)), remote=math.inf, hit_bw=math.inf),
                   [0, 0.3]).makespan == predict(free, [0, 0.3]).makespan


def test_a_remote_hit_slower_than_the_source_makes_partitioning_a_loss():
    # One reader, an I/O-bound job, a partitioned cache that holds the dataset. A hit is local
    # with probability 1/2; remote hits that take longer than a read from the source make the
    # cache slower than no cache at all, and the makespan grows without bound as they slow down.
    # Fast remote hits make it a gain. The simulator agrees in every case.
    def job(remote):
        return scenario(n=1000, jobs=((0.0001, 3),), nodes=2, capacity=0.5, remote=remote, hit_bw=math.inf,
                        bandwidth=(B,))

    none = plain(job(B), policy="none")
    base_p, base_s = predict(none).makespan, sim_makespan(none)
    assert base_p == pytest.approx(base_s, rel=1e-3)
    for remote, worse in ((B / 4, True), (B / 16, True), (4 * B, False)):
        sc = job(remote)
        p, s = predict(sc).makespan, sim_makespan(sc)
        assert p == pytest.approx(s, rel=0.04)
        assert (p > 1.2 * base_p) == worse and (s > 1.2 * base_s) == worse
        assert (p < 0.8 * base_p) != worse
    # remote hits at 1/16 of the source's bandwidth: 2 epochs of hits, half of them 16 ms each
    assert predict(job(B / 16)).makespan == pytest.approx(1000 * S / B + 2 * 500 * 16 * S / B, rel=0.01)


def node_local_reads(n: int, nodes: int, per_node: int, epochs: int, seed: int = 0) -> list[int]:
    """Source reads per epoch of one data-parallel job over ``nodes`` nodes with node-local minio
    caches (not a scenario mode): every epoch a fresh permutation, node k reading its share
    ``perm[k::nodes]`` (DistributedSampler's) through its own cache."""
    rng = random.Random(seed)
    caches: list[set[int]] = [set() for _ in range(nodes)]
    out = []
    for _ in range(epochs):
        perm = list(range(n))
        rng.shuffle(perm)
        reads = 0
        for k in range(nodes):
            for x in perm[k::nodes]:
                if x not in caches[k]:
                    reads += 1
                    if len(caches[k]) < per_node:
                        caches[k].add(x)
        out.append(reads)
    return out


def test_after_warm_up_a_partitioned_cache_reads_nothing_where_node_local_ones_read_most():
    # 4 nodes, each caching a quarter of the dataset: together they hold all of it
    n, M, epochs = 1200, 4, 3
    local = node_local_reads(n, M, n // M, epochs)
    assert local[0] == n
    for reads in local[1:]:  # each node holds what it read in the first epoch: a 1/M share of its next one
        assert reads == pytest.approx((1 - 1 / M) * n, rel=0.05)
    job = {"ranks": 4, "workers": 2, "batch": 8}  # a data-parallel job, one rank per node
    one = scenario(n=n, jobs=((0.0001, 1),), nodes=M, capacity=1 / M, job=job)
    sc = scenario(n=n, jobs=((0.0001, epochs),), nodes=M, capacity=1 / M, job=job)
    for seed in range(2):
        assert simulate(sc, seed=seed).misses["j0"] - simulate(one, seed=seed).misses["j0"] == 0
    warm = predict(one, series=False).makespan  # the first epoch's end
    assert predicted_reads(sc, after=warm) < 1e-6 * n
    assert predicted_reads(sc) == pytest.approx(n, rel=0.01)


# ---- the planner -------------------------------------------------------------------------------
def test_the_planner_staggers_for_the_aggregate_and_the_simulator_confirms_it():
    # the HiPC 2023 setting, but no node holds the data alone: four nodes together do
    jobs, bw = ((0.0004, 3), (0.0004, 3)), (B, 0.55 * B)
    sc = scenario(jobs=jobs, bandwidth=bw, nodes=4, capacity=0.25, remote=5 * B)
    plan = optimal_plan(sc)
    delays = [plan.delays[j] for j in sc.job_names]
    assert max(delays) > 0 and plan.makespan < 0.9 * plan.simultaneous
    planned, together = sim_makespan(sc, delays), sim_makespan(sc, [0.0, 0.0])
    assert planned < 0.9 * together
    assert plan.makespan == pytest.approx(planned, rel=0.04)
    # remote hits as fast as local ones: the plan of one cache of the whole capacity
    same = scenario(jobs=jobs, bandwidth=bw, nodes=4, capacity=0.25, remote=20 * B)
    a, b = optimal_plan(same), optimal_plan(plain(same))
    assert a.delays == b.delays and a.makespan == b.makespan
