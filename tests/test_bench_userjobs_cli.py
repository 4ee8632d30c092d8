"""bench_userjobs.py's command line refuses what --again would ignore; userjobs/corun.py's spec copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_userjobs.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, named", [(["--perturb", "jobs=1.3"], "--perturb"),
                                          (["--only", "pair-w2-b64", "--grid"], "--only, --grid"),
                                          (["--samples", "1024", "--keep"], "--samples, --keep")])
def test_again_refuses_what_it_would_ignore(tmp_path, extra, named):
    run = subprocess.run([sys.executable, str(SCRIPT), "--again", str(tmp_path), *extra], capture_output=True,
                         text=True, timeout=100, cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert f"so {named} would be ignored" in run.stderr and "without --again" in run.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was made


def test_corun_spec_without_one_job(tmp_path):
    """benchmarks/userjobs/corun.py launches a copy of the spec without the measured job and its plan."""
    saved = list(sys.path)
    sys.path.insert(0, str(SCRIPT.parent / "userjobs"))
    try:
        from corun import without_job  # it puts the repository and benchmarks/ on sys.path as well
    finally:
        sys.path[:] = saved
    from hpcstagger.spec.jobspec import Spec

    text = ('[run]\nname = "r"\n\n[dataset]\npath = "data.h5"\nname = "samples"\n\n[plan]\nmode = "plan"\n'
            'scenario = "scenario.toml"\n\n'
            + "".join(f'[[job]]\nname = "{n}"\ncommand = "python train.py --model {n}"\n\n'
                      for n in ("cnn", "mlp", "wide")))
    (tmp_path / "spec.toml").write_text(without_job(text, "mlp"))
    spec = Spec.from_toml(str(tmp_path / "spec.toml"))
    assert [j.name for j in spec.jobs] == ["cnn", "wide"]
    assert spec.plan.scenario in ("", None) and "[plan]" not in (tmp_path / "spec.toml").read_text()
