"""The planner's bounded scalar minimiser (Brent's method) and its line search."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hpcstagger.model._search import line_search, minimize_bounded


def _counted(f):
    calls = []

    def g(x):
        calls.append(x)
        return f(x)

    return g, calls


@pytest.mark.parametrize("lo, hi, centre", [(0.0, 10.0, 3.7), (-5.0, 1.0, -4.2), (0.0, 1e-3, 7.5e-4),
                                            (100.0, 400.0, 399.0)])
def test_it_finds_a_parabola_s_minimum_inside_the_bounds(lo, hi, centre):
    f, calls = _counted(lambda x: (x - centre) ** 2 + 1.0)
    tol = 1e-6 * (hi - lo)
    x, fx = minimize_bounded(f, lo, hi, tol, 50)
    assert abs(x - centre) <= 10 * tol
    assert fx == pytest.approx(1.0, abs=1e-9)
    assert all(lo <= c <= hi for c in calls)
    assert len(calls) <= 50
    assert fx == (x - centre) ** 2 + 1.0  # the value returned is f at the point returned


def test_a_minimum_outside_the_bounds_ends_near_the_nearer_bound():
    x, fx = minimize_bounded(lambda x: (x - 20.0) ** 2, 0.0, 10.0, 1e-5, 60)
    assert 10.0 - 1e-3 <= x <= 10.0
    assert fx == pytest.approx(100.0, rel=1e-3)


def test_it_keeps_to_its_evaluations_and_never_reports_worse_than_it_saw():
    f, calls = _counted(lambda x: math.sin(3 * x) + 0.1 * x)
    x, fx = minimize_bounded(f, 0.0, 6.0, 1e-9, 5)
    assert len(calls) == 5
    assert fx == min(f(c) for c in calls[:5])
    assert x in calls


def test_a_step_function_and_a_flat_one_stop_without_error():
    x, fx = minimize_bounded(lambda x: 0.0 if x > 0.3 else 1.0, 0.0, 1.0, 1e-6, 40)
    assert fx == 0.0 and x > 0.3
    x, fx = minimize_bounded(lambda x: 2.0, 0.0, 1.0, 1e-6, 40)
    assert fx == 2.0 and 0.0 <= x <= 1.0


@pytest.mark.parametrize("lo, hi, evals", [(1.0, 1.0, 5), (2.0, 1.0, 5), (0.0, 1.0, 0)])
def test_bad_bounds_or_no_evaluations_are_refused(lo, hi, evals):
    with pytest.raises(ValueError, match="minimize_bounded"):
        minimize_bounded(lambda x: x, lo, hi, 1e-6, evals)


def test_line_search_refines_the_grid_s_best_point():
    x, fx, pts = line_search(lambda x: (x - 0.37) ** 2, 0.0, 1.0, 0.0, 0.37 ** 2, 4, 20)
    assert abs(x - 0.37) < 1e-3
    assert fx < min(v for _, v in pts)  # the refinement beat every grid point
    x2, fx2, _ = line_search(lambda x: (x - 0.37) ** 2, 0.0, 1.0, 0.0, 0.37 ** 2, 4, 0)
    assert fx2 == min(v for _, v in pts) and x2 in [p for p, _ in pts]  # no refinement: the grid's best


def test_planning_four_jobs_does_not_import_scipy():
    """Importing scipy.optimize costs about 0.3 s of CPU, more than the search's whole budget, on
    the cores the starting jobs use: the planner's minimiser is its own."""
    probe = ("import json, sys\n"
             f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
             "from support.model_scenarios import scenario\n"
             "from hpcstagger.model import optimal_plan\n"
             "sc = scenario(n=2000, jobs=((0.002, 1), (0.001, 2), (0.003, 1), (0.0005, 3)), capacity=0.4)\n"
             "p = optimal_plan(sc)\n"
             "print(json.dumps({'evaluations': p.evaluations, 'scipy': 'scipy' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["evaluations"] > 10  # the search ran, with Brent steps among them
    assert result["scipy"] is False
