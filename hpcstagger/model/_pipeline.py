"""Throughput of one job's loader and compute joined by a prefetch buffer of P samples.

The loader fetches samples one at a time; fetch i takes ``lo`` with probability ``1 - m`` and
``hi`` with probability ``m`` (a hit or a miss), independently. It may start fetch i once fetch
i-1 is done and compute has started sample i-P. Compute takes ``t`` per sample. In the fluid
limit the pair would run at one sample per ``max(tau, t)`` (``tau`` the mean fetch time), but
with a small buffer it loses time near balance and whenever fetch times vary: runs of hits fill
the buffer and block the loader, runs of misses drain it and stall compute. For P = 1 the time
per sample is exactly ``E[max(X, t)]``; for P -> infinity it tends to ``max(tau, t)``.

The loss has no closed form for P > 1, so it is tabulated: :func:`build_table` runs the exact
max-plus recursion of the pipeline (the same rule as the simulator's loader) for every grid point
at once, with common random numbers and the realised mean fetch time as a control variate, and
stores the excess ``E = T / max(tau, t) - 1``. ``python -m hpcstagger.model._pipeline`` rebuilds
``_pipeline_table.npz`` (a few minutes). :func:`sample_time` interpolates it: linearly in the
miss fraction, in log2(t / tau) and in lo / hi, and in 1 / P between tabulated depths; beyond
the last depth the excess is scaled by 1 / P, its diffusion limit.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_right
from typing import Any
from hpcstagger.errors import ModelError
from hpcstagger._io import atomic_write

__all__ = ["sample_time", "build_table", "P_VALUES", "M_GRID", "LOG2_RHO", "ALPHA_GRID"]

P_VALUES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
M_GRID = (0.0, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8,
          0.9, 0.95, 1.0)
_LR_MIN, _LR_STEP, _LR_N = -8.0, 0.25, 65
LOG2_RHO = tuple(_LR_MIN + i * _LR_STEP for i in range(_LR_N))
ALPHA_GRID = (0.0, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0)
_TABLE_FILE = os.path.join(os.path.dirname(__file__), "_pipeline_table.npz")

_tables: list[list[float]] | None = None
_INV_P = [1.0 / p for p in P_VALUES]
_P_INDEX = {p: q for q, p in enumerate(P_VALUES)}
_NA = len(ALPHA_GRID)
_M_STEPS = tuple(M_GRID[i + 1] - M_GRID[i] for i in range(len(M_GRID) - 1))
_ALPHA_STEPS = tuple(ALPHA_GRID[i + 1] - ALPHA_GRID[i] for i in range(len(ALPHA_GRID) - 1))


def _load() -> list[list[float]]:
    global _tables
    if _tables is None:
        import numpy as np

        with np.load(_TABLE_FILE, allow_pickle=False) as data:  # never unpickle from disk
            grids = (tuple(data["p"].tolist()), tuple(data["m"].tolist()), tuple(data["lr"].tolist()),
                     tuple(data["alpha"].tolist()))
            if grids != (P_VALUES, M_GRID, LOG2_RHO, ALPHA_GRID):
                raise ModelError(f"{_TABLE_FILE} does not match this version's grid; rebuild it with "
                                 "'python -m hpcstagger.model._pipeline'")
            excess = data["excess"].astype(float)
        _tables = [excess[i].ravel().tolist() for i in range(len(P_VALUES))]
    return _tables


def _excess(table: list[float], i: int, fi: float, j: int, fj: float, k: int, fk: float) -> float:
    """Trilinear interpolation of one table: cell (i, j, k), fractions (fi, fj, fk) across it
    (corners of weight 0 skipped)."""
    gk = 1.0 - fk
    wi, wj = 1.0 - fi, 1.0 - fj
    out = 0.0
    for w, base in ((wi, (i * _LR_N + j) * _NA + k), (fi, ((i + 1) * _LR_N + j) * _NA + k)):
        if w == 0.0:
            continue
        if wj != 0.0:
            out += w * wj * (gk * table[base] + (fk * table[base + 1] if fk else 0.0))
        if fj != 0.0:
            base += _NA
            out += w * fj * (gk * table[base] + (fk * table[base + 1] if fk else 0.0))
    return out


def sample_time(P: int, h: float, a: float, b: float, t: float) -> float:
    """Mean seconds per sample of the pipeline: hit fraction h, hit time a, miss time b, compute t."""
    tau = h * a + (1.0 - h) * b
    base = tau if tau > t else t
    if a <= b:
        lo, hi, m = a, b, 1.0 - h
    else:
        lo, hi, m = b, a, h
    if hi <= 0.0 or tau <= 0.0 or m <= 0.0 or m >= 1.0 or lo >= hi or t <= 0.0:
        return base  # fetch time does not vary (or compute is free): no loss
    tables = _tables if _tables is not None else _load()
    # m and lo / hi (times are >= 0) lie in (0, 1) and [0, 1), within the grids: no clamping
    i = bisect_right(M_GRID, m) - 1
    fi = (m - M_GRID[i]) / _M_STEPS[i]
    alpha = lo / hi
    k = bisect_right(ALPHA_GRID, alpha) - 1
    fk = (alpha - ALPHA_GRID[k]) / _ALPHA_STEPS[k]
    lr = math.log2(t / tau)
    pos = (lr - _LR_MIN) / _LR_STEP
    scale = 1.0
    if pos <= 0.0:
        j, fj = 0, 0.0
        scale = 2.0 ** (lr - _LR_MIN)        # the loss vanishes linearly as compute gets free
    elif pos >= _LR_N - 1:
        j, fj = _LR_N - 2, 1.0
        scale = 2.0 ** (LOG2_RHO[-1] - lr)   # ... and as compute dominates
    else:
        j = int(pos)
        fj = pos - j
    q = _P_INDEX.get(P)
    if q is not None:
        e = _excess(tables[q], i, fi, j, fj, k, fk)
    elif P > P_VALUES[-1]:
        e = _excess(tables[-1], i, fi, j, fj, k, fk) * P_VALUES[-1] / P
    else:
        q = bisect_right(P_VALUES, P) - 1
        w = (1.0 / P - _INV_P[q + 1]) / (_INV_P[q] - _INV_P[q + 1])
        e = (w * _excess(tables[q], i, fi, j, fj, k, fk)
             + (1.0 - w) * _excess(tables[q + 1], i, fi, j, fj, k, fk))
    return base * (1.0 + e * scale)


def simulate_pipeline(P: int, m: Any, lo: Any, hi: Any, t: Any, *, samples: int = 200_000,
                      seed: int = 0) -> Any:
    """Mean seconds per sample by the exact recursion, for arrays of parameters (broadcast).

    Fetch times are ``hi`` with probability ``m`` else ``lo``; one random stream is shared by
    every parameter set (common random numbers). Returns the excess over ``max(mean fetch, t)``
    measured against the realised mean fetch time, which cancels most sampling noise.
    """
    import numpy as np

    m, lo, hi, t = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (m, lo, hi, t)))
    shape = m.shape
    m, lo, hi, t = (v.ravel() for v in (m, lo, hi, t))
    rng = np.random.default_rng(seed)
    size = m.size
    ring = np.zeros((P, size))
    F = np.zeros(size)
    C = np.zeros(size)
    warm = samples // 20
    sum_x = np.zeros(size)
    S0 = np.zeros(size)
    S = np.zeros(size)
    uniform = rng.random(samples)
    for i in range(samples):
        X = np.where(uniform[i] < m, hi, lo)
        r = ring[i % P]
        np.maximum(F, r, out=F)
        F += X
        S = np.maximum(F, C)
        C = S + t
        ring[i % P] = S
        if i == warm:
            S0 = S.copy()
        elif i > warm:
            sum_x += X
    count = samples - 1 - warm
    per_sample = (S - S0) / count
    realised = np.maximum(sum_x / count, t)
    with np.errstate(invalid="ignore", divide="ignore"):
        excess = np.where(realised > 0, per_sample / realised - 1.0, 0.0)
    return np.maximum(excess, 0.0).reshape(shape)


def build_table(P: int, *, samples: int = 200_000, seed: int = 12345) -> Any:
    """The excess table for prefetch depth P on the (M_GRID, LOG2_RHO, ALPHA_GRID) grid (hi = 1)."""
    import numpy as np

    M, LR, AL = np.meshgrid(np.array(M_GRID), np.array(LOG2_RHO), np.array(ALPHA_GRID), indexing="ij")
    tau = M + (1.0 - M) * AL
    t = (2.0 ** LR) * tau
    excess = simulate_pipeline(P, M, AL, 1.0, t, samples=samples, seed=seed)
    excess[(M == 0.0) | (M == 1.0) | (AL == 1.0)] = 0.0  # fetch time does not vary: no loss
    return excess


def main(argv: list[str] | None = None) -> int:
    """Rebuild the table file: ``python -m hpcstagger.model._pipeline [--samples N] [--out PATH]``."""
    import argparse
    import time

    import numpy as np

    parser = argparse.ArgumentParser(description="Rebuild the prefetch-pipeline loss table.")
    parser.add_argument("--samples", type=int, default=200_000, help="samples simulated per grid point")
    parser.add_argument("--out", default=_TABLE_FILE, help="output .npz (default: the packaged table)")
    args = parser.parse_args(argv)
    tables = []
    for P in P_VALUES:
        t0 = time.perf_counter()
        tables.append(build_table(P, samples=args.samples).astype(np.float32))
        print(f"P={P}: {time.perf_counter() - t0:.1f} s, max excess {float(tables[-1].max()):.3f}", flush=True)

    def write(f: Any) -> None:
        np.savez_compressed(f, excess=np.stack(tables), p=np.array(P_VALUES), m=np.array(M_GRID),
                            lr=np.array(LOG2_RHO), alpha=np.array(ALPHA_GRID), samples=args.samples)

    atomic_write(args.out, write)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
