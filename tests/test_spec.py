"""The job spec: parsing, defaults, path resolution, and errors that name the field."""

from __future__ import annotations

import pytest

from hpcstagger import _schema as S
from hpcstagger.errors import ConfigError
from hpcstagger.spec.jobspec import Spec

FULL = """
[run]
name = "sweep"
timeout = 120

[dataset]
path = "data/train.h5"
name = "images"
throttle = [4.0e7, 2.4e7]

[cache]
capacity = "120MB"

[checkpoint]
staging_dir = "/dev/shm/ckpt-x"
every = 50

[plan]
mode = "fixed"
delays = { b = 12.5 }

[slurm]
partition = "gpu"
options = ["--exclusive"]
setup = ["module load mpi"]

[[job]]
name = "a"
command = "python train.py --model 'res net'"
ranks = 2
epochs = 3
backend = "ddp"
env = { LR = 0.1 }

[[job]]
name = "b"
command = ["python", "train.py"]
backend = "horovod"
"""


def test_full_spec_parses_with_resolved_paths(tmp_path):
    p = tmp_path / "spec.toml"
    p.write_text(FULL)
    spec = Spec.from_toml(p)
    assert spec.path == str(p.resolve())
    assert spec.run.workdir == str(tmp_path / "hpcstagger-runs" / "sweep")
    assert spec.dataset.path == str(tmp_path / "data" / "train.h5")
    assert spec.dataset.format == "hdf5" and spec.dataset.throttle == (4.0e7, 2.4e7)
    assert spec.cache.capacity == 120_000_000 and spec.cache.name == "sweep"
    assert spec.checkpoint.directory == str(tmp_path / "hpcstagger-runs" / "sweep" / "checkpoints")
    assert spec.checkpoint.keep == 3 and spec.checkpoint.every == 50
    assert spec.plan.delays == {"b": 12.5}
    a, b = spec.jobs
    assert a.command == ("python", "train.py", "--model", "res net")
    assert a.env == {"LR": "0.1"} and a.ranks == 2 and b.ranks == 1 and b.epochs == 1
    assert spec.total_ranks == 3
    assert [(j.name, first) for j, first in spec.layout()] == [("a", 0), ("b", 2)]
    assert spec.slurm.options == ("--exclusive",) and spec.slurm.setup == ("module load mpi",)


def test_minimal_spec_defaults(tmp_path):
    spec = Spec.from_dict({"job": [{"name": "only", "command": "true"}]}, base_dir=tmp_path)
    assert spec.run.name == "hpcstagger" and spec.cache.capacity == 0 and spec.plan.mode == "plan"
    assert spec.dataset.path == "" and spec.slurm.launcher == "srun"


@pytest.mark.parametrize("data, message", [
    ({"job": [{"name": "a", "command": "x", "rank": 2}]},
     r"unknown key job\[0\]\.rank; valid keys of \[job\]: name \(required\), command \(required\), "
     r"ranks \(default 1\)"),
    ({"job": [{"name": "a", "command": "x"}, {"name": "b", "command": "y", "ranks": 0}]},
     r"job\[1\]\.ranks must be an integer >= 1, got 0"),
    ({"job": [{"name": "a"}]}, r"missing job\[0\]\.command \(required\)"),
    ({}, r"missing \[\[job\]\]"),
    ({"job": {"name": "a", "command": "x"}}, r"write each job as \[\[job\]\]"),
    ({"job": [{"name": "a", "command": "x"}, {"name": "a", "command": "y"}]}, "repeated: a"),
    ({"job": [{"name": "a/b", "command": "x"}]}, r"job\[0\]\.name = 'a/b' is not valid"),
    ({"jobs": [], "job": [{"name": "a", "command": "x"}]}, r"unknown table \[jobs\]; valid tables: \[run\]"),
    ({"job": [{"name": "a", "command": "x"}], "plan": {"mode": "fixed"}}, "needs plan.delays"),
    ({"job": [{"name": "a", "command": "x"}], "plan": {"delays": {"z": 1}}}, "plan.delays.z: no job named 'z'"),
    ({"job": [{"name": "a", "command": "x"}], "plan": {"mode": "later"}}, "plan.mode must be one of 'plan'"),
    ({"job": [{"name": "a", "command": "x"}], "cache": {"capacity": "12 parsecs"}},
     "cache.capacity = '12 parsecs' is not a size"),
    ({"job": [{"name": "a", "command": "x"}], "dataset": {"path": "d.h5"}}, "missing dataset.name"),
    ({"job": [{"name": "a", "command": "x", "backend": "mpi"}]},
     r"job\[0\]\.backend must be one of 'ddp', 'horovod', 'none'"),
    ({"job": [{"name": "a", "command": ""}]}, r"job\[0\]\.command must not be empty"),
    ({"job": [{"name": "a", "command": "x"}], "slurm": {"time": "soon"}},
     r"slurm\.time = 'soon' is not valid: use \[D-\]HH:MM:SS"),
])
def test_bad_specs_name_the_field(tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        Spec.from_dict(data, base_dir=tmp_path)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Spec.from_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname = 1")
    with pytest.raises(ConfigError, match=r"bad\.toml is not valid TOML"):
        Spec.from_toml(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[[job]]\nname = "a"\ncommand = "x"\nranks = "two"\n')
    with pytest.raises(ConfigError, match=r"wrong\.toml: job\[0\]\.ranks must be an integer"):
        Spec.from_toml(wrong)


def test_job_lookup_lists_names(tmp_path):
    spec = Spec.from_dict({"job": [{"name": "a", "command": "x"}]}, base_dir=tmp_path)
    assert spec.job("a").name == "a"
    with pytest.raises(ConfigError, match="no job named 'q' in the spec; jobs: a"):
        spec.job("q")


@pytest.mark.parametrize("text, value", [(0, 0), (1e9, 10**9), ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29),
                                         ("2 kB", 2000), ("7", 7)])
def test_sizes(text, value):
    assert S.size("x", text) == value


def test_integer_accepts_integral_floats_only():
    assert S.integer(minimum=1)("x", 1e4) == 10000
    with pytest.raises(ConfigError, match="must be an integer"):
        S.integer()("x", 2.5)
    with pytest.raises(ConfigError, match="must be an integer"):
        S.integer()("x", True)


def _small_spec(tmp_path, cache_extra=""):
    import h5py
    import numpy as np

    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("x", data=np.zeros((1000, 100), dtype=np.uint8))  # 1000 samples of 100 bytes
    (tmp_path / "spec.toml").write_text(f"""
[dataset]
path = "d.h5"
name = "x"
[cache]
capacity = 100000
{cache_extra}
[[job]]
name = "a"
command = "true"
""")
    return Spec.from_toml(tmp_path / "spec.toml")


def test_cache_index_holds_the_whole_dataset_by_default(tmp_path, shm_root):
    # 100 kB at the default 4 KiB per entry would index 24 samples of a 1000-sample dataset
    spec = _small_spec(tmp_path)
    assert spec.dataset_samples() == 1000
    assert spec.cache_entries() == 1000
    cache = spec.make_cache()
    try:
        assert cache.stats()["max_entries"] == 1000
        stored = sum(cache.put(i, bytes(100)) for i in range(1000))
        assert stored == 1000  # every sample fits: 100 kB of payload, 1000 index entries
    finally:
        cache.close()


def test_cache_max_entries_is_explicit_or_from_the_capacity(tmp_path):
    assert _small_spec(tmp_path, "max_entries = 50").cache_entries() == 50
    with pytest.raises(ConfigError, match=r"cache\.max_entries"):
        _small_spec(tmp_path, "max_entries = -1")
    (tmp_path / "nodata.toml").write_text('[cache]\ncapacity = "1MB"\n[[job]]\nname = "a"\ncommand = "true"\n')
    spec = Spec.from_toml(tmp_path / "nodata.toml")
    assert spec.dataset_samples() is None
    assert spec.cache_entries() == 1_000_000 // 4096
