"""Checks before any rank starts (colocated.preflight), through `hpcstagger launch`, `sweep`,
`calibrate --spec` and `exec`; and a run whose ranks fail anyway leaving /dev/shm as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import h5py
import numpy as np
import pytest

from hpcstagger.checkpoint.gates import GATE_PREFIX, gate_owner
from hpcstagger.colocated import preflight
from hpcstagger.spec.jobspec import Spec
from hpcstagger.errors import ConfigError, DependencyError, LaunchError
from support.cli import REPO, cli_env, run_cli

pytestmark = pytest.mark.timeout(120)


def _write(tmp_path, dataset: str = 'path = "data.h5"\nname = "samples"', backend: str = "none",
           name: str = "spec.toml") -> str:
    if not (tmp_path / "data.h5").exists():
        with h5py.File(tmp_path / "data.h5", "w") as f:
            f["samples"] = np.arange(64, dtype=np.uint8).reshape(8, 8)
            f["scalar"] = 3
            f.create_group("group")
            f.create_dataset("empty", shape=(0, 4), dtype=np.uint8)
    path = tmp_path / name
    path.write_text(textwrap.dedent("""
        [run]
        name = "pf"
        [dataset]
        {dataset}
        [[job]]
        name = "a"
        command = "python -c pass"
        backend = "{backend}"
        [[job]]
        name = "b"
        command = "python -c pass"
    """).format(dataset=dataset, backend=backend))
    return str(path)


def _messages(path: str, **kw) -> list[str]:
    return [p.message for p in preflight.problems(Spec.from_toml(path), launcher=None, **kw)]


def test_a_mistyped_directory_is_a_path_that_does_not_exist(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"x")
    spec = _write(tmp_path, 'path = "dataa"')  # no dataset.name: a directory was meant
    assert _messages(spec) == [f"jobs a, b: dataset.path {tmp_path}/dataa does not exist "
                               f"(check [dataset] path in spec.toml)"]
    assert _messages(_write(tmp_path, 'path = "data"')) == []
    # an .h5 name without dataset.name is still the spec's own error
    with pytest.raises(ConfigError, match="missing dataset.name"):
        Spec.from_toml(_write(tmp_path, 'path = "other.h5"'))


@pytest.mark.parametrize("dataset, expected", [
    ('path = "data.h5"\nname = "imgs"', "dataset.name 'imgs' is not in it ({d}/data.h5; it has empty, samples, "
                                        "scalar): set [dataset] name in spec.toml"),
    ('path = "data.h5"\nname = "group"', "dataset.name 'group' is a group, not a dataset"),
    ('path = "data.h5"\nname = "scalar"', "dataset 'scalar' in {d}/data.h5 has no sample axis (shape ())"),
    ('path = "data.h5"\nname = "empty"', "dataset 'empty' in {d}/data.h5 has 0 samples"),
    ('path = "spec.toml"\nformat = "hdf5"\nname = "samples"', "dataset.path {d}/spec.toml is not an HDF5 file"),
    ('path = "."\nformat = "hdf5"\nname = "samples"', 'is a directory but dataset.format is "hdf5"'),
    ('path = "data.h5"\nformat = "directory"', 'is a file, not a directory, but dataset.format is "directory"'),
    ('path = "."\npattern = "**/*.jpg"', "no file under {d} matches dataset.pattern '**/*.jpg'"),
])
def test_each_dataset_problem_is_one_line_naming_field_and_fix(tmp_path, dataset, expected):
    out = _messages(_write(tmp_path, dataset))
    assert len(out) == 1 and "\n" not in out[0]
    assert out[0].startswith("jobs a, b: ") and expected.format(d=tmp_path) in out[0]


def test_an_unreadable_dataset(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    spec = _write(tmp_path)
    os.chmod(tmp_path / "data.h5", 0)
    try:
        assert "is not readable by you" in _messages(spec)[0]
    finally:
        os.chmod(tmp_path / "data.h5", 0o600)


def _shadow_horovod(tmp_path, with_torch: bool = False):
    """A `horovod` package first on the path without horovod.torch (or with it but no compiled library)."""
    pkg = tmp_path / "shadow" / "horovod"
    (pkg / "torch" if with_torch else pkg).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if with_torch:
        (pkg / "torch" / "__init__.py").write_text("")
    return str(tmp_path / "shadow")


def test_backends_are_found_without_importing(tmp_path, monkeypatch):
    spec = Spec.from_toml(_write(tmp_path, backend="horovod"))
    monkeypatch.syspath_prepend(_shadow_horovod(tmp_path))
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    (problem,) = preflight.check_backends(spec)
    assert problem.field == "job[0].backend" and problem.kind == "dependency"
    assert problem.message == ("job a: backend horovod is not importable (No module named 'horovod.torch'): "
                               'run scripts/install-horovod, or set backend = "ddp" (its [[job]] in spec.toml)')
    assert "horovod" not in sys.modules  # found, not imported
    assert preflight._find_module("hpcstagger_no_such_module") == "No module named 'hpcstagger_no_such_module'"
    assert preflight._find_module("torch.distributed") is None
    ddp = Spec.from_toml(_write(tmp_path, backend="ddp", name="ddp.toml"))
    assert preflight.check_backends(ddp) == []
    assert "not importable (gone)" in preflight.check_backends(ddp, find={"torch.distributed": "gone"})[0].message
    assert preflight.check_backends(ddp, jobs=["b"], find={"torch.distributed": "gone"}) == []


def test_horovod_built_without_torch(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(_shadow_horovod(tmp_path, with_torch=True))
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    assert "has no compiled library" in preflight._find_module("horovod.torch")


def test_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (problem,) = preflight.check_launcher("mpiexec")
    assert problem.kind == "launch" and "mpiexec is not on PATH: install an MPI" in problem.message
    assert "srun is not on PATH" in preflight.check_launcher("srun")[0].message
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    assert "SLURM_JOB_ID is unset" in preflight.check_launcher("srun")[0].message
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert preflight.check_launcher("srun") == [] and preflight.check_launcher("mpiexec", "/x/mpiexec") == []


def test_check_raises_every_problem_on_one_line(tmp_path, monkeypatch):
    spec = Spec.from_toml(_write(tmp_path, 'path = "data.h5"\nname = "imgs"'))
    with pytest.raises(ConfigError) as err:
        preflight.check(spec, launcher="srun")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    text = str(err.value)
    assert "\n" not in text and "dataset.name 'imgs'" in text and "; launcher srun" in text
    with pytest.raises(LaunchError, match="launcher srun"):
        preflight.check(Spec.from_toml(_write(tmp_path)), launcher="srun")
    monkeypatch.setattr(preflight, "_find_module", lambda module: "No module named 'horovod'")
    with pytest.raises(DependencyError, match="job a: backend horovod"):
        preflight.check(Spec.from_toml(_write(tmp_path, backend="horovod")), launcher=None)


# ---------------------------------------------------------------------------- through the commands
def _gates() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if gate_owner(n) is not None}


@pytest.fixture
def shm(tmp_path):
    """An isolated shm root that does not exist yet (inside a fresh /dev/shm folder), and the
    environment that points every command at it."""
    box = tempfile.mkdtemp(prefix="hpcs-preflight-", dir="/dev/shm")
    root = os.path.join(box, "root")
    try:
        yield root, cli_env(HPCSTAGGER_SHM_ROOT=root, HPCSTAGGER_THROTTLE_DIR="")
    finally:
        shutil.rmtree(box, ignore_errors=True)


@pytest.mark.alone
@pytest.mark.parametrize("case", ["missing dataset", "missing backend", "wrong table"])
@pytest.mark.parametrize("command", [("launch",), ("sweep", "--staggers", "0,1"), ("calibrate",)])
def test_a_bad_spec_fails_in_one_line_before_any_rank(tmp_path, shm, case, command):
    root, env = shm
    dataset = {"missing dataset": 'path = "dataa"', "wrong table": 'path = "data.h5"\nname = "imgs"'}
    spec = _write(tmp_path, dataset.get(case, 'path = "data.h5"\nname = "samples"'),
                  backend="horovod" if case == "missing backend" else "none")
    if case == "missing backend":
        env["PYTHONPATH"] = _shadow_horovod(tmp_path)
    before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    out = run_cli(command[0], spec, *command[1:], env=env, cwd=tmp_path, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    expected = {"missing dataset": f"jobs a, b: dataset.path {tmp_path}/dataa does not exist",
                "missing backend": "job a: backend horovod is not importable",
                "wrong table": "jobs a, b: dataset.name 'imgs' is not in it"}[case]
    assert lines[0].startswith(f"hpcstagger {command[0]}: error: {expected}")
    assert took < 5, f"{command[0]} took {took:.1f} s to refuse"
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("hpcstagger")}
    assert not os.path.exists(root) and not (tmp_path / "hpcstagger-runs" / "pf" / "runs").exists()


def test_exec_checks_its_rank_job_before_the_command(tmp_path, shm):
    _, env = shm
    spec = _write(tmp_path, 'path = "data.h5"\nname = "imgs"')
    out = run_cli("exec", spec, env={**env, "HPCSTAGGER_JOB": "b"}, cwd=tmp_path, timeout=30)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "hpcstagger exec: error: jobs a, b: dataset.name 'imgs'" in out.stderr


def test_launch_check_only_starts_nothing(tmp_path, shm):
    root, env = shm
    out = run_cli("launch", _write(tmp_path), "--check", env=env, cwd=tmp_path, timeout=30)
    assert out.returncode == 0 and "dataset, backends and launcher (mpiexec) are ready" in out.stdout
    assert not os.path.exists(root) and not (tmp_path / "hpcstagger-runs").exists()


# ---------------------------------------------------------------------------- ranks that fail anyway
FAILING = textwrap.dedent("""
    import os, time
    import hpcstagger
    from hpcstagger.checkpoint import SharedActivityGate

    session = hpcstagger.init(wait=False)
    gate = SharedActivityGate()     # a gate file in /dev/shm
    source = session.source()
    source[0]                       # the throttled source's reader table in <root>/.throttle
    print("ready", session.job, os.getpid(), flush=True)
    time.sleep(1.0)                 # both ranks hold their gate and table (init met them together)
    if os.environ.get("FAIL") == "raise" and session.job == "a":
        raise RuntimeError("diverged right after init")
    if os.environ.get("FAIL") == "backend" and session.job == "a":
        session.start_backend()      # horovod.torch cannot be imported here
    time.sleep(60)
""")


@pytest.mark.parametrize("fail", ["raise", "backend"])
def test_failed_ranks_leave_dev_shm_as_found(tmp_path, shm, fail):
    root, env = shm
    (tmp_path / "fail.py").write_text(FAILING)
    spec = _write(tmp_path, 'path = "data.h5"\nname = "samples"\nthrottle = [1e9]',
                  backend="horovod" if fail == "backend" else "none")
    spec_text = open(spec).read().replace('python -c pass', 'python fail.py') + '[plan]\nmode = "simultaneous"\n'
    open(spec, "w").write(spec_text)
    env = {**env, "FAIL": fail, "PYTHONPATH": os.pathsep.join([_shadow_horovod(tmp_path), env.get("PYTHONPATH", "")])}
    gates_before = _gates()
    if fail == "backend":  # the check would refuse it: start it as a run whose backend breaks later
        code = ("import sys; from hpcstagger.colocated.launch import launch; from hpcstagger.spec.jobspec import "
                f"Spec; r = launch(Spec.from_toml({spec!r}), check=False); print(r.failures()); "
                "sys.exit(0 if r.ok else 1)")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=100)
        assert "DependencyError: horovod.torch cannot be imported" in out.stdout + out.stderr, out.stderr
    else:
        out = run_cli("launch", spec, env=env, cwd=tmp_path, timeout=100)
        assert "diverged right after init" in out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("ready") == 2  # every rank made its gate and table before the failure
    new = _gates() - gates_before
    assert not new, f"gate files left: {new}"
    assert not os.path.exists(root), f"left in the shm root: {list(os.walk(root))}"


def test_a_dead_owners_gate_goes_when_the_next_gate_is_made(tmp_path):
    code = ("import os; from hpcstagger.checkpoint import SharedActivityGate; g = SharedActivityGate(); "
            "print(g.path, flush=True); os._exit(0)")
    path = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    assert os.path.basename(path).startswith(f"{GATE_PREFIX}{os.getuid()}-") and os.path.exists(path)
    from hpcstagger.checkpoint import SharedActivityGate

    with SharedActivityGate():
        assert not os.path.exists(path)


# ---------------------------------------------------------------------------- the README's example
EXAMPLES = REPO / "examples"


def test_the_readme_launches_an_example_a_fresh_install_can_run():
    lines = [ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith("hpcstagger launch examples/")]
    first = Spec.from_toml(REPO / lines[0].split()[2])
    assert {j.backend for j in first.jobs} <= {"ddp", "none"}, lines[0]  # scripts/install brings torch, not Horovod
    for line in lines:
        needs_horovod = any(j.backend == "horovod" for j in Spec.from_toml(REPO / line.split()[2]).jobs)
        assert not needs_horovod or "scripts/install-horovod" in line, line
    assert "scripts/install-horovod" in lines[0]  # and it says what the Horovod example needs


@pytest.fixture
def examples(tmp_path, shm):
    """The examples and their dataset in a fresh directory; Horovod hidden as on a fresh install."""
    for f in ("make_dataset.py", "train_ddp.py", "train_horovod.py", "colocated.toml", "colocated-ddp.toml"):
        shutil.copy(EXAMPLES / f, tmp_path / f)
    subprocess.run([sys.executable, "make_dataset.py", "data.h5", "--samples", "128"], cwd=tmp_path, check=True,
                   timeout=60, capture_output=True)
    root, env = shm
    return tmp_path, root, {**env, "PYTHONPATH": _shadow_horovod(tmp_path)}


@pytest.mark.alone
def test_the_horovod_example_without_horovod_says_what_to_run(examples):
    cwd, root, env = examples
    before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    out = run_cli("launch", "colocated.toml", env=env, cwd=cwd, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("hpcstagger launch: error: job mlp: backend horovod is not importable "
                                 "(No module named 'horovod.torch'): run scripts/install-horovod")
    assert took < 5 and not os.path.exists(root)
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("hpcstagger")}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_ddp_example_runs_without_horovod(examples):
    cwd, root, env = examples
    gates = _gates()
    out = run_cli("launch", "colocated-ddp.toml", "--json", env=env, cwd=cwd, timeout=380)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {n: j["state"] for n, j in result["jobs"].items()} == {"cnn": "done", "cnn-lr": "done"}
    assert _gates() - gates == set()  # the examples' gates went with their processes
    run_cli("cache", "clear", "examples", env=env)
    assert not os.path.exists(root)
