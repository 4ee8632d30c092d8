"""Ranks' reports: a job script for co-located runs in which every rank reports its job, rank and
arguments in a file of its own (ranks/<array task or "run">/<job>.<rank>.txt beside the script).
Tests read those files, not the launcher's stdout, where the ranks' lines can interleave."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

RANK_PROBE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from hpcstagger import init
    s = init()
    line = f"{s.job} rank {s.rank}/{s.comm.size} argv={sys.argv[1:]}"
    print(line, flush=True)
    out = Path(__file__).resolve().parent / "ranks" / os.environ.get("SLURM_ARRAY_TASK_ID", "run")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{s.job}.{s.rank}.tmp").write_text(line)
    (out / f"{s.job}.{s.rank}.tmp").rename(out / f"{s.job}.{s.rank}.txt")
    time.sleep(0.3)
    s.finish()
""")


def rank_reports(script_dir: str | os.PathLike, task: str = "run") -> dict[str, str]:
    """What each rank of a RANK_PROBE run reported: {"<job>.<rank>": line}."""
    return {p.stem: p.read_text() for p in (Path(script_dir) / "ranks" / task).glob("*.txt")}
