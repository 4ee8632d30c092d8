"""Under mpiexec the CLI never strands ranks: a one-rank failure aborts the job, a shared one exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from support.cli import BIN, cli_env
from support.shm import remove_stale_mpich_segments

SCRIPT = textwrap.dedent("""
    import sys
    import hpcstagger.cli.cmd_info as info
    from hpcstagger import cli
    from hpcstagger.comm import Comm
    from hpcstagger.errors import ConfigError
    c = Comm.world()
    mode = sys.argv[1]

    def run(args):
        if mode == "one-rank":
            if c.rank == 1:
                raise ConfigError("bad spec on rank 1")
            c.barrier(timeout=None)  # without the abort, rank 0 would wait here forever
        else:
            with c.guard("shared step"):
                if c.rank == 1:
                    raise ConfigError("bad spec on rank 1")
        return 0

    info.run = run
    sys.exit(cli.main(["info"]))
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["one-rank", "collective"])
def test_failure_on_one_rank_ends_every_rank(tmp_path, mode):
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    wall = time.time()
    # Each rank's stderr to a file of its own (Hydra's -errfile-pattern): interleaving cannot split a line.
    out = subprocess.run([str(BIN / "mpiexec"), "-n", "2", "-errfile-pattern", str(tmp_path / "err.%r"),
                          sys.executable, str(script), mode],
                         capture_output=True, text=True, timeout=100, env=cli_env())
    if mode == "one-rank":
        remove_stale_mpich_segments(wall)  # MPI_Abort skips MPICH's own /dev/shm cleanup (before any assert)
    errs = [(tmp_path / f"err.{r}").read_text() if (tmp_path / f"err.{r}").exists() else "" for r in (0, 1)]
    everything = out.stderr + "".join(errs)  # the launcher's own messages stay on its stderr
    assert out.returncode != 0
    assert time.monotonic() - start < 60
    assert "bad spec on rank 1" in errs[1], (errs, out.stderr[-2000:])
    if mode == "one-rank":
        assert "MPI_Abort" in everything
    else:
        # Both ranks raised the same CollectiveError and exited 1 on their own: no abort needed.
        assert [e.count("shared step failed on 1 of 2 rank(s): 1") for e in errs] == [1, 1], errs
        assert "MPI_Abort" not in everything and "application called" not in everything
