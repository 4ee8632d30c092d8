"""benchmarks/hostspeed.py: one thread's matrix products counted second by second."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "hostspeed.py"


@pytest.mark.timeout(60)
def test_counts_each_second_and_reports_the_spread(tmp_path):
    out = tmp_path / "speed.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "2", "--json", str(out)], capture_output=True,
                         text=True, timeout=50)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert data["seconds"] == 2 and len(data["counts"]) == 2 and min(data["counts"]) > 0
    assert data["max_over_min"] == pytest.approx(max(data["counts"]) / min(data["counts"]))
    assert "fastest / slowest second" in run.stdout


def test_refuses_less_than_a_second():
    run = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "0.5"], capture_output=True, text=True, timeout=50)
    assert run.returncode == 2 and "--seconds must be at least 1" in run.stderr
