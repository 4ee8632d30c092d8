"""Co-located jobs that share a loader through the spec: ``[loader] share = true`` and
``session.data_loader``. Real ``hpcstagger launch`` under mpiexec: a data-parallel job of two
ranks and a single-rank job that starts 2 s late (while the first still runs) take their batches
from one producer; each rank writes what it saw to its own JSON file."""

from __future__ import annotations

import json
import os
import textwrap
import time

import pytest

from support.cli import cli_env, run_cli

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

JOB = textwrap.dedent("""
    import json, os, time
    import torch
    from torch.utils.data import Dataset
    from hpcstagger import init

    class Squares(Dataset):
        def __len__(self):
            return 96
        def __getitem__(self, i):
            return torch.full((4,), float(i * i)), i

    s = init()
    s.wait()
    loader = s.data_loader(Squares(), 8, num_workers=1)
    epochs = []
    for epoch in range(2):
        seen = []
        for x, i in loader:
            assert torch.equal(x[:, 0], (i * i).float())
            seen += i.tolist()
            time.sleep(float(os.environ.get("STEP", "0")))
        epochs.append(seen)
    with open(f"out-{s.job}-{s.rank}.json", "w") as f:
        json.dump({"epochs": epochs, "len": len(loader), "producer": loader.producer_pid,
                   "kind": type(loader).__name__, "stats": loader.stats(),
                   "workers": loader.producer_workers}, f)
    loader.close()
    s.finish()
""")


def _spec(tmp_path, share):
    return textwrap.dedent(f"""
        [run]
        name = "shr"
        timeout = 180
        [loader]
        share = {str(share).lower()}
        segments = 4
        [plan]
        mode = "fixed"
        delays = {{ late = 2.0 }}
        [[job]]
        name = "dp"
        command = "python job.py"
        ranks = 2
        env = {{ STEP = "0.3" }}
        [[job]]
        name = "late"
        command = "python job.py"
    """)


def test_jobs_of_a_spec_share_one_producer(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "spec.toml").write_text(_spec(tmp_path, True))
    root = tmp_path / "shm"
    env = cli_env(HPCSTAGGER_SHM_ROOT=str(root), HPCSTAGGER_LOADER_LINGER="0.5")
    out = run_cli("launch", "spec.toml", "--json", cwd=tmp_path, timeout=200, env=env)
    assert out.returncode == 0, out.stderr
    r0, r1, late = (json.loads((tmp_path / f"out-{n}.json").read_text()) for n in ("dp-0", "dp-1", "late-0"))
    assert {r0["kind"], r1["kind"], late["kind"]} == {"SharedLoader"}
    assert r0["producer"] == r1["producer"] == late["producer"] > 0, (r0, r1, late)  # one producer for the three ranks
    # its DataLoader workers: the three ranks' one each, as far as the CPUs go
    assert r0["workers"] == late["workers"] == max(1, min(3, len(os.sched_getaffinity(0)))), (r0, late)
    assert r0["len"] == r1["len"] == 6 and late["len"] == 12
    for e in range(2):
        both = r0["epochs"][e] + r1["epochs"][e]
        assert sorted(both) == list(range(96))  # the ranks' shares: disjoint, together the epoch
        assert sorted(late["epochs"][e]) == list(range(96))  # the late joiner: whole epochs
    def rings() -> list[str]:  # the launch removes the emptied folder too
        return os.listdir(root / ".loader") if (root / ".loader").exists() else []

    deadline = time.monotonic() + 10
    while rings() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rings() == []  # the producer stopped and removed its files


def test_without_sharing_each_job_gets_a_plain_dataloader(tmp_path):
    (tmp_path / "job.py").write_text(JOB.replace("loader.producer_pid", "0").replace("loader.stats()", "{}")
                                     .replace("loader.producer_workers", "0")
                                     .replace("loader.close()", ""))
    (tmp_path / "spec.toml").write_text(_spec(tmp_path, False).replace('delays = { late = 2.0 }',
                                                                       'delays = { late = 0.0 }'))
    env = cli_env(HPCSTAGGER_SHM_ROOT=str(tmp_path / "shm"))
    out = run_cli("launch", "spec.toml", "--json", cwd=tmp_path, timeout=200, env=env)
    assert out.returncode == 0, out.stderr
    r0, r1 = (json.loads((tmp_path / f"out-dp-{r}.json").read_text()) for r in (0, 1))
    assert r0["kind"] == "DataLoader" and r0["len"] == 6
    assert sorted(r0["epochs"][0] + r1["epochs"][0]) == list(range(96))  # DistributedSampler shares
    assert not (tmp_path / "shm" / ".loader").exists()


KILLED = JOB.split("loader = s.data_loader")[0] + textwrap.dedent("""
    import signal
    loader = s.data_loader(Squares(), 8)
    for x, i in loader:
        if not os.path.exists(f"producer-{s.rank}"):
            with open(f"producer-{s.rank}.tmp", "w") as f:
                f.write(str(loader.producer_pid))
            os.rename(f"producer-{s.rank}.tmp", f"producer-{s.rank}")
        if s.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a rank
        time.sleep(0.2)
""")



def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}


@pytest.mark.alone
def test_a_killed_rank_leaves_no_mpi_segment_behind_a_lingering_producer(tmp_path):
    """The producer is forked from a rank, so it inherits the rank's MPI shared-memory segment. It
    outlives the ranks by loader_linger; the failed launch must still remove the segment's file."""
    (tmp_path / "job.py").write_text(KILLED)
    (tmp_path / "spec.toml").write_text(textwrap.dedent("""
        [run]
        name = "killed"
        timeout = 120
        [loader]
        share = true
        [[job]]
        name = "dp"
        command = "python job.py"
        ranks = 2
    """))
    before = _segments()
    env = cli_env(HPCSTAGGER_SHM_ROOT=str(tmp_path / "shm"), HPCSTAGGER_LOADER_LINGER="6")
    out = run_cli("launch", "spec.toml", cwd=tmp_path, timeout=150, env=env)
    assert out.returncode != 0
    pid = int((tmp_path / "producer-1").read_text())
    assert pid > 0 and os.path.exists(f"/proc/{pid}"), "the producer should still linger"
    left = _segments() - before
    assert left == set(), out.stderr
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}")
