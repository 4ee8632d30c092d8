"""Scenario: the documented TOML format, validation by dotted field path, round trips."""

from __future__ import annotations

import math
import textwrap

import pytest

from hpcstagger.errors import ConfigError
from hpcstagger.model import Scenario

DOC_TOML = """
[dataset]
samples = 10000            # n
sample_bytes = 131072      # mean bytes per sample
[storage]
bandwidth = [2.0e8, 1.2e8] # aggregate bytes/s of the shared source with 1, 2, ... concurrent readers
[cache]
capacity = 6.0e8           # bytes; 0 = no cache
policy = "minio"           # minio | lru | none
hit_bandwidth = 5.0e9      # bytes/s per reader; optional, default unlimited
[[job]]
name = "resnet"
sample_time = 0.002        # seconds per sample with data in memory (whole job)
epochs = 3
[[job]]
name = "vit"
sample_time = 0.004
epochs = 2
"""


def base() -> dict:
    return {"dataset": {"samples": 100, "sample_bytes": 1000.0}, "storage": {"bandwidth": [1e6, 8e5]},
            "cache": {"capacity": 5e4, "policy": "lru"},
            "job": [{"name": "a", "sample_time": 0.01, "epochs": 2}, {"name": "b", "sample_time": 0.02}]}


def test_reads_the_documented_format(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(DOC_TOML)
    sc = Scenario.from_toml(path)
    assert sc.dataset.samples == 10000 and sc.dataset.sample_bytes == 131072
    assert sc.storage.bandwidth == (2.0e8, 1.2e8)
    assert sc.cache.capacity == 6.0e8 and sc.cache.policy == "minio" and sc.cache.hit_bandwidth == 5.0e9
    assert sc.job_names == ("resnet", "vit")
    assert [j.epochs for j in sc.jobs] == [3, 2]
    assert sc.loader.prefetch == 2                     # the documented default
    assert sc.cache_samples == 4577                    # floor(6e8 / 131072)
    assert sc.storage.per_reader(1) == 2.0e8 and sc.storage.per_reader(2) == 6.0e7
    assert sc.storage.per_reader(5) == 1.2e8 / 5       # the last value holds beyond the list


def test_defaults_no_cache_section_and_unlimited_hits():
    d = base()
    del d["cache"]
    d["job"][1].pop("epochs", None)
    sc = Scenario.from_dict(d)
    assert sc.cache_samples == 0 and sc.hit_time == 0.0 and math.isinf(sc.cache.hit_bandwidth)
    assert sc.jobs[1].epochs == 1
    # capacity beyond the dataset holds the dataset, policy none holds nothing
    d["cache"] = {"capacity": 1e9}
    assert Scenario.from_dict(d).cache_samples == 100
    d["cache"]["policy"] = "none"
    assert Scenario.from_dict(d).cache_samples == 0


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["job"][1].__setitem__("sample_time", 0), r"job\[1\]\.sample_time must be > 0"),
    (lambda d: d["job"][0].__setitem__("sample_time", -1.5), r"job\[0\]\.sample_time must be > 0"),
    (lambda d: d["job"][0].__setitem__("epochs", 0), r"job\[0\]\.epochs must be an integer >= 1"),
    (lambda d: d["job"][0].__setitem__("epochs", 1.5), r"job\[0\]\.epochs must be an integer"),
    (lambda d: d["job"][1].pop("name"), r"missing job\[1\]\.name \(required\)"),
    (lambda d: d["job"][1].__setitem__("name", "a"), r"job\[1\]\.name 'a' is used twice"),
    (lambda d: d["dataset"].pop("samples"), r"missing dataset\.samples"),
    (lambda d: d["dataset"].__setitem__("samples", "many"), r"dataset\.samples must be an integer"),
    (lambda d: d["dataset"].__setitem__("sample_bytes", float("nan")), r"dataset\.sample_bytes must be a finite"),
    (lambda d: d["storage"].__setitem__("bandwidth", []), r"storage\.bandwidth must be a non-empty list"),
    (lambda d: d["storage"].__setitem__("bandwidth", [1e6, -1]), r"storage\.bandwidth\[1\] must be > 0"),
    (lambda d: d["storage"].__setitem__("fit_baseline", 0), r"storage\.fit_baseline must be > 0"),
    (lambda d: d["storage"].__setitem__("fit_baseline", math.inf), r"storage\.fit_baseline must be a finite"),
    (lambda d: d["cache"].__setitem__("policy", "fifo"), r"cache\.policy must be one of 'minio', 'lru', 'none'"),
    (lambda d: d["cache"].__setitem__("capacity", -1), r"cache\.capacity must be >= 0"),
    (lambda d: d["cache"].__setitem__("hit_bandwidth", 0), r"cache\.hit_bandwidth must be > 0"),
    (lambda d: d.__setitem__("loader", {"prefetch": 0}), r"loader\.prefetch must be an integer >= 1"),
    (lambda d: d.pop("job"), r"missing \[\[job\]\]"),
    (lambda d: d.__setitem__("job", []), r"\[\[job\]\] must be a non-empty list"),
    (lambda d: d.__setitem__("storage", 5), r"\[storage\] must be a table"),
    # infinities and NaN, in integer and number fields alike (once a traceback from `plan`)
    (lambda d: d["dataset"].__setitem__("samples", -math.inf), r"dataset\.samples must be an integer, got -inf"),
    (lambda d: d["dataset"].__setitem__("samples", math.inf), r"dataset\.samples must be an integer, got inf"),
    (lambda d: d["dataset"].__setitem__("samples", math.nan), r"dataset\.samples must be an integer, got nan"),
    (lambda d: d["job"][1].__setitem__("epochs", math.inf), r"job\[1\]\.epochs must be an integer, got inf"),
    (lambda d: d.__setitem__("loader", {"prefetch": -math.inf}), r"loader\.prefetch must be an integer"),
    (lambda d: d["job"][0].__setitem__("sample_time", math.inf), r"job\[0\]\.sample_time must be a finite"),
    (lambda d: d["storage"].__setitem__("bandwidth", [math.nan]), r"storage\.bandwidth\[0\] must be a finite"),
    (lambda d: d["cache"].__setitem__("capacity", math.inf), r"cache\.capacity must be a finite"),
    (lambda d: d["cache"].__setitem__("hit_bandwidth", math.nan), r"cache\.hit_bandwidth must be a finite"),
    (lambda d: d["job"][0].__setitem__("name", "  "), r"job\[0\]\.name must not be blank"),
    # values fine alone whose products overflow
    (lambda d: d["storage"].__setitem__("bandwidth", [5e-324]), r"storage\.bandwidth\[0\] = 5e-324 is too small"),
    # ... also when only a reader's share underflows to 0 (5e-324 / 2 rounds to 0.0)
    (lambda d: d["storage"].__setitem__("bandwidth", [1e6, 5e-324]), r"storage\.bandwidth\[1\] = 5e-324 is too small"),
    (lambda d: d["job"][0].__setitem__("sample_time", 1e308), r"run time overflows"),
])
def test_bad_fields_are_named_by_path(mutate, message):
    d = base()
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        Scenario.from_dict(d)


def test_unknown_keys_list_the_valid_ones_with_defaults():
    d = base()
    d["cache"]["polcy"] = "lru"
    with pytest.raises(ConfigError) as err:
        Scenario.from_dict(d)
    msg = str(err.value)
    assert "unknown key cache.polcy" in msg
    assert 'capacity (default 0), policy (default "minio"), hit_bandwidth (default unlimited)' in msg
    d = base()
    d["job"][0]["gpus"] = 4
    with pytest.raises(ConfigError, match=r"unknown key job\[0\]\.gpus; valid keys of \[job\]: name \(required\)"):
        Scenario.from_dict(d)
    d = base()
    d["network"] = {}
    with pytest.raises(ConfigError, match=r"unknown table \[network\]; valid tables: \[dataset\]"):
        Scenario.from_dict(d)


def test_toml_round_trip_and_comments(tmp_path):
    d = base()
    d["cache"]["hit_bandwidth"] = 3e9
    d["loader"] = {"prefetch": 4}
    sc = Scenario.from_dict(d)
    text = sc.to_toml(comments={"storage.bandwidth": "measured with 1 and 2 readers", "job.a": "calibrated"})
    assert "# measured with 1 and 2 readers" in text and "# calibrated" in text
    path = tmp_path / "s.toml"
    path.write_text(text)
    back = Scenario.from_toml(path)
    assert back == sc
    assert Scenario.from_dict(sc.to_dict()) == sc
    # unlimited hit bandwidth is left out and comes back unlimited
    sc2 = Scenario.from_dict(base())
    assert "hit_bandwidth" not in sc2.to_toml()
    path.write_text(sc2.to_toml())
    assert Scenario.from_toml(path) == sc2
    # the watcher's fit baseline: written only when measured (not 1), and read back
    assert "fit_baseline" not in sc2.to_toml() and sc2.storage.fit_baseline == 1.0
    d = base()
    d["storage"]["fit_baseline"] = 0.85
    sc4 = Scenario.from_dict(d)
    path.write_text(sc4.to_toml({"storage.fit_baseline": "the jobs' reads"}))
    assert Scenario.from_toml(path).storage.fit_baseline == 0.85 and "# the jobs' reads" in path.read_text()
    # names that need escaping survive
    d = base()
    d["job"][0]["name"] = 'res"net\\50'
    sc3 = Scenario.from_dict(d)
    path.write_text(sc3.to_toml())
    assert Scenario.from_toml(path).jobs[0].name == 'res"net\\50'


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"scenario file .*missing\.toml does not exist"):
        Scenario.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read scenario file"):
        Scenario.from_toml(tmp_path)  # a directory
    bad = tmp_path / "bad.toml"
    bad.write_text("[dataset\nsamples = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        Scenario.from_toml(bad)
    bad.write_text(textwrap.dedent(DOC_TOML).replace("sample_time = 0.004", "sample_time = -0.004"))
    with pytest.raises(ConfigError, match=r"bad.toml: job\[1\]\.sample_time must be > 0"):
        Scenario.from_toml(bad)


def test_delays_by_name_or_sequence():
    sc = Scenario.from_dict(base())
    assert sc.delay_vector(None) == [0.0, 0.0]
    assert sc.delay_vector({"b": 2.5}) == [0.0, 2.5]
    assert sc.delay_vector([1, 2]) == [1.0, 2.0]
    with pytest.raises(ConfigError, match="unknown job 'c'; jobs in this scenario: a, b"):
        sc.delay_vector({"c": 1})
    with pytest.raises(ConfigError, match="got 3 delays for 2 jobs"):
        sc.delay_vector([0, 1, 2])
    with pytest.raises(ConfigError, match="delay of job 'b' must be >= 0"):
        sc.delay_vector([0, -1])


def test_direct_construction_is_validated_too():
    from hpcstagger.model import Dataset, Job, Storage

    with pytest.raises(ConfigError, match=r"job\[0\]\.sample_time must be > 0"):
        Scenario(dataset=Dataset(10, 1.0), storage=Storage((1.0,)), jobs=(Job("a", 0.0),))
    sc = Scenario(dataset=Dataset(10, 1.0), storage=Storage([1.0]), jobs=[Job("a", 1.0)])
    assert isinstance(sc.jobs, tuple) and isinstance(sc.storage.bandwidth, tuple)
