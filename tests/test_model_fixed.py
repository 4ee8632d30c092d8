"""The fixed-point relaxation of the fluid model: long steps for a creeping map, short ones for an
oscillating map, and both reach the point to the model's tolerance in few iterations."""

from __future__ import annotations

import pytest

from hpcstagger.model._fixed import HIGH, LOW, Relax


def _iterate(slope: float, relax: Relax | None, tol: float = 1e-5, start: float = 2.0) -> tuple[int, float]:
    """Iterations until the relative change is below ``tol`` for g(x) = 1 + slope (x - 1)."""
    x = start
    for k in range(1, 500):
        step = (1.0 + slope * (x - 1.0) - x) / x
        change = abs(step)
        if change < tol:
            return k, x
        d = relax.update(change, [step]) if relax is not None else 1.0
        x += d * step * x
    return 500, x


@pytest.mark.parametrize("slope", [0.9, 0.97, 0.99])
def test_a_creeping_map_is_reached_in_few_iterations(slope):
    plain, _ = _iterate(slope, None)
    fast, x = _iterate(slope, Relax())
    # stopping on a change below 1e-5 leaves an error of up to 1e-5 / (1 - slope)
    assert x == pytest.approx(1.0, abs=1.5e-5 / (1 - slope))
    assert fast <= 45 and fast * 4 <= plain, (fast, plain)


@pytest.mark.parametrize("slope", [-0.5, -0.9, -1.5])
def test_an_oscillating_map_gets_shorter_steps_and_converges(slope):
    relax = Relax()
    n, x = _iterate(slope, relax)
    assert x == pytest.approx(1.0, rel=1e-4) and n < 60
    assert relax.damp < 1.0
    if slope < -1:  # full steps diverge here
        assert _iterate(slope, None)[0] == 500


def test_the_step_stays_within_its_bounds():
    relax = Relax()
    for change in (0.1, 0.099, 0.098, 0.097, 0.096):  # an extreme creep asks for a huge step
        d = relax.update(change, [change])
    assert 1.0 < d <= HIGH and d * 0.096 <= 0.5
    for k in range(10):  # alternating directions only ever halve it, down to LOW
        d = relax.update(0.01, [(-1) ** k * 0.01])
    assert d == LOW
