"""hpcstagger.init on real MPMD launches: identity, split, delays, status files, and failures."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from hpcstagger.colocated.coordinator import resolve_job
from hpcstagger.errors import ConfigError
from support.cli import BIN, cli_env
from support.shm import remove_stale_mpich_segments

pytestmark = pytest.mark.timeout(180)

PROBE = textwrap.dedent("""
    import json, os, sys, time
    from mpi4py import MPI  # MPI_Init waits for every rank, so a stall is modelled after it
    time.sleep(float(os.environ.get("PAUSE_BEFORE_INIT", "0")))
    import hpcstagger
    from hpcstagger import init
    s = init(timeout=float(os.environ.get("INIT_TIMEOUT", "60")), backend="none",
             calibration=lambda: {"sample_time": 0.001})
    started = s.elapsed()
    total = s.comm.allreduce(1)
    s.finish(total=total)
    # one file per rank: the launcher may interleave the ranks' stdout lines
    row = json.dumps({"job": s.job, "rank": s.rank, "world": s.world.rank, "size": s.comm.size,
                      "jobs": s.jobs, "delays": s.delays, "started": started, "total": total,
                      "overhead": s.overhead, "mode": s.mode})
    out = os.path.join(os.environ["PROBE_DIR"], f"{s.world.rank}.json")
    with open(out + ".tmp", "w") as f:
        f.write(row)
    os.replace(out + ".tmp", out)
""")


def _spec(tmp_path, mode="fixed", delays='{ b = 1.5 }', ranks_b=2):
    (tmp_path / "probe.py").write_text(PROBE)
    spec = tmp_path / "spec.toml"
    spec.write_text(textwrap.dedent(f"""
        [run]
        name = "coord"
        [plan]
        mode = "{mode}"
        delays = {delays}
        [[job]]
        name = "a"
        command = "python probe.py"
        [[job]]
        name = "b"
        command = "python probe.py"
        ranks = {ranks_b}
    """))
    return spec


def _mpmd(tmp_path, spec, parts, timeout=120, extra_env=None):
    cmd = [str(BIN / "mpiexec")]
    for i, (n, env) in enumerate(parts):
        if i:
            cmd.append(":")
        cmd += ["-n", str(n), "env", *[f"{k}={v}" for k, v in env.items()], sys.executable, str(tmp_path / "probe.py")]
    probe_dir = tempfile.mkdtemp(prefix="probe-", dir=tmp_path)
    env = cli_env(HPCSTAGGER_SPEC=str(spec), PROBE_DIR=probe_dir, **(extra_env or {}))
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    out.rows = _rows(probe_dir)
    return out, time.monotonic() - start


def _rows(probe_dir):
    """Each rank's report, from its own file, in world-rank order."""
    rows = [json.loads(p.read_text()) for p in Path(probe_dir).glob("*.json")]
    return sorted(rows, key=lambda r: r["world"])


def test_mpmd_jobs_split_wait_and_report(tmp_path):
    spec = _spec(tmp_path)
    out, _ = _mpmd(tmp_path, spec, [(1, {}), (2, {})])
    assert out.returncode == 0, out.stderr
    rows = out.rows
    assert [(r["job"], r["rank"], r["size"], r["total"]) for r in rows] == [("a", 0, 1, 1), ("b", 0, 2, 2),
                                                                               ("b", 1, 2, 2)]
    assert all(r["jobs"] == {"a": [0], "b": [1, 2]} for r in rows)
    assert all(r["delays"] == {"a": 0.0, "b": 1.5} and r["mode"] == "fixed" for r in rows)
    # a starts at once, b after its 1.5 s delay (upper bounds leave room for a loaded machine)
    assert rows[0]["started"] < 1.0 and all(1.5 <= r["started"] < 4.0 for r in rows[1:])
    assert all(r["overhead"] < 5 for r in rows)  # behaviour, not a benchmark: it is reported, and small
    status = {p.name: json.loads(p.read_text()) for p in (tmp_path / "hpcstagger-runs" / "coord" / "status").iterdir()}
    assert sorted(status) == ["a.0.json", "b.0.json", "b.1.json"]
    assert all(s["state"] == "done" for s in status.values())
    assert status["b.0.json"]["metrics"] == {"total": 2}
    assert "waiting 1.5 s" in out.stderr  # the planned delay is in the job's log


def test_env_job_identity_and_simultaneous_mode(tmp_path):
    spec = _spec(tmp_path, mode="simultaneous", delays="{}")
    out, _ = _mpmd(tmp_path, spec, [(3, {})], extra_env={"PAUSE_BEFORE_INIT": "0"})
    # one MPMD part of 3 ranks: without HPCSTAGGER_JOB every rank is job 'a', which the spec sizes at 1
    assert out.returncode != 0
    assert "job 'a' has 3 rank(s), the spec says 1" in out.stderr
    assert "job 'b' has 0 rank(s), the spec says 2" in out.stderr
    out, _ = _mpmd(tmp_path, spec, [(1, {"HPCSTAGGER_JOB": "a"}), (2, {"HPCSTAGGER_JOB": "b"})])
    assert out.returncode == 0, out.stderr
    assert [(r["job"], r["rank"]) for r in out.rows] == [("a", 0), ("b", 0), ("b", 1)]
    assert all(r["delays"] == {"a": 0.0, "b": 0.0} for r in out.rows)


def test_a_job_that_stalls_before_init_is_named_and_nothing_hangs(tmp_path):
    spec = _spec(tmp_path, mode="simultaneous", delays="{}")
    wall = time.time()
    out, took = _mpmd(tmp_path, spec, [(1, {"INIT_TIMEOUT": "2"}), (2, {"PAUSE_BEFORE_INIT": "60"})])
    remove_stale_mpich_segments(wall)  # the run was aborted on purpose
    assert out.returncode != 0
    assert took < 20
    assert "aborting the run" in out.stderr
    assert "job(s) 'b' by the spec's layout) did not reach the coordinator within 2 s" in out.stderr


@pytest.mark.parametrize("kwargs, index", [
    ({"explicit": "b"}, 1), ({"environ": {"HPCSTAGGER_JOB": "1"}}, 1), ({"environ": {"HPCSTAGGER_JOB": "a"}}, 0),
    ({"environ": {}, "appnum": 1}, 1), ({"environ": {}, "het_component": 0}, 0),
])
def test_resolve_job(kwargs, index):
    assert resolve_job(["a", "b"], **kwargs) == index


def test_resolve_job_errors():
    with pytest.raises(ConfigError, match="HPCSTAGGER_JOB = 'zz' names no job; jobs: a, b"):
        resolve_job(["a", "b"], environ={"HPCSTAGGER_JOB": "zz"})
    with pytest.raises(ConfigError, match="MPMD application number is 2 but the spec has 2 job"):
        resolve_job(["a", "b"], environ={}, appnum=2)
    with pytest.raises(ConfigError, match="cannot tell which job"):
        resolve_job(["a", "b"], environ={})
    assert resolve_job(["only"], environ={}) == 0


def test_plan_mode_releases_a_waiting_job_of_two_ranks_by_message(tmp_path):
    """Mode plan with a scenario that staggers: the waiting job's two ranks (the watcher is its
    leader, the other rank a follower) start on the watcher's message, both with its reason."""
    (tmp_path / "s.toml").write_text(textwrap.dedent("""
        [dataset]
        samples = 400
        sample_bytes = 1000
        [storage]
        bandwidth = [2.0e5, 1.0e5]
        [cache]
        capacity = 4.0e5
        [[job]]
        name = "a"
        sample_time = 0.0005
        [[job]]
        name = "b"
        sample_time = 0.0005
        ranks = 2
    """))
    spec = _spec(tmp_path, mode="plan", delays="{}")
    spec.write_text(spec.read_text().replace('[plan]', '[plan]\nscenario = "s.toml"'))
    out, _ = _mpmd(tmp_path, spec, [(1, {}), (2, {})], extra_env={"HPCSTAGGER_RUN_DIR": str(tmp_path / "run")})
    assert out.returncode == 0, out.stderr
    rows = out.rows
    planned = rows[0]["delays"]
    waiting = [n for n, d in planned.items() if d > 0]
    assert waiting, planned  # the scenario's lossy source makes the plan stagger
    status = {p.name: json.loads(p.read_text()) for p in (tmp_path / "run").glob("*.[0-9].json")}
    late = [s for s in status.values() if s["job"] in waiting]
    assert len(late) == (2 if waiting == ["b"] else 1)
    releases = [s["release"] for s in late]
    assert all(r and r["reason"] and r["jobs"] == waiting for r in releases)
    assert len({r["at"] for r in releases}) == 1  # one decision, sent to every rank of the job
    steer = json.loads((tmp_path / "run" / "steer.json").read_text())
    assert steer["decisions"][0]["jobs"] == waiting and steer["failed"] is None
    assert "waiting for release" in out.stderr
