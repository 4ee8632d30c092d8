"""A co-located run with ``[checkpoint] flush = "queue"``: the waiting job flushes the running job's
staged checkpoints, and once nobody waits the running job flushes them itself again.

Real ``hpcstagger launch`` under mpiexec, real torch tensors saved through AsyncCheckpointer; each
rank writes what it saw to its own JSON file.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from hpcstagger.checkpoint import verify_checkpoint
from hpcstagger.checkpoint.flushq import queue_path
from hpcstagger.spec.jobspec import Spec
from support.cli import run_cli

pytestmark = pytest.mark.timeout(240)

JOB = textwrap.dedent("""
    import json, os, time
    import torch
    from hpcstagger import AsyncCheckpointer, init

    s = init()
    ck = AsyncCheckpointer(**s.checkpoint_options(), comm=s.comm, gate=None)
    state = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)), "step": 0}
    by = []
    saves = int(os.environ.get("SAVES", "0"))
    for step in range(saves):
        state["step"] = step
        h = ck.save(step, state)
        while not h.done():  # not h.wait() at once: it would hurry the writer into flushing itself
            time.sleep(0.01)
        h.wait()
        by.append(h.stats.get("flush", {}).get("by", "self"))
        time.sleep(0.3)
    ck.close()
    with open(f"out-{s.job}-{s.rank}.json", "w") as f:
        json.dump({"by": by, "timings": s.timings}, f)
    s.finish(steps=saves)
""")


def test_the_waiting_job_flushes_the_running_jobs_checkpoints(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    spec = tmp_path / "spec.toml"
    spec.write_text(textwrap.dedent(f"""
        [run]
        name = "fq"
        timeout = 180
        [checkpoint]
        directory = "ckpt"
        staging_dir = "{tmp_path / 'stage'}"
        flush = "queue"
        keep = 2
        [plan]
        mode = "fixed"
        delays = {{ b = 6.0 }}
        [[job]]
        name = "a"
        command = "python job.py"
        env = {{ SAVES = "14" }}
        [[job]]
        name = "b"
        command = "python job.py"
    """))
    out = run_cli("launch", str(spec), "--json", cwd=tmp_path, timeout=200)
    assert out.returncode == 0, out.stderr
    a = json.loads((tmp_path / "out-a-0.json").read_text())
    b = json.loads((tmp_path / "out-b-0.json").read_text())
    # while b waited (6 s) it flushed a's saves; after b started, a flushed its own at once
    assert a["by"].count("queue") >= 2, a
    assert a["by"][-1] == "self", a
    assert b["timings"]["flushed_for_others"] == a["by"].count("queue"), (a, b)
    assert b["timings"]["flush_failed"] == 0
    newest = max((Path(Spec.from_toml(spec).checkpoint.directory) / "a").glob("step-*"))
    assert newest.name == "step-000000013" and verify_checkpoint(str(newest)) == []
    assert os.listdir(queue_path(tmp_path / "stage" / "fq")) == []  # no task, claim or registration left


def test_flush_queue_needs_a_staging_level(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('[checkpoint]\nflush = "queue"\n[[job]]\nname = "a"\ncommand = "python x.py"\n')
    out = run_cli("launch", str(spec), "--dry-run", cwd=tmp_path)
    assert out.returncode != 0 and "needs checkpoint.staging_dir" in out.stderr
