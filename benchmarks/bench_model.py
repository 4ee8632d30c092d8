"""Benchmark of the makespan model against its targets (benchmarks/RESULTS.md, section Makespan model).

    python benchmarks/bench_model.py [--quick] [--scenarios N] [--workers W] [--out PATH]

Random scenarios come from a fixed generator and a fixed seed list (scenario i uses
``numpy.random.default_rng([20260521, i])``); the simulator runs each point with seeds 0 and 1 and
averages them. The generator was written before the figures were looked at and is not tuned:

- 2 to 4 jobs; 2000 samples of 128 KiB; the source gives 200 MB/s to one reader and loses a
  uniform 0 to 60% of its aggregate bandwidth at the highest concurrency listed (2 to J readers,
  linear in between, the last value holding beyond);
- policy minio (50%), lru (35%) or none (15%); capacity uniform in 0 to 150% of the dataset;
  hit bandwidth 10 to 50 times the source's;
- each job's sample time log-uniform in 1/6 to 6 times the single-reader miss time (compute-bound
  to I/O-bound), 1 to 4 epochs; prefetch depth 2 (the default);
- each job's loader shape (workers, batches, ranks), drawn from a second stream (``[SEED_BASE, i, 7]``) so the
  rest of scenario i does not change with it: workers 0, 1, 2 or 4; batch 1, 8, 16, 32, 64 or
  128; 1 or 2 ranks; prefetch 1, 2 or 4 batches per worker; a hand-off of 0 to 30% of the step's
  compute; and for half the jobs a worker-side prep time of up to half a miss. ``--legacy-loaders``
  gives every job the one-sample prefetching reader (the scenarios before loader shapes were modelled) instead;
- with ``--contention``, from a third stream (``[SEED_BASE, i, 11]``): the node's cores, 1, 2 or
  4 (``[node] cores``), shared by the jobs' steps, worker preps and start-ups; each job's start-up,
  0 to 0.5 s; and each job's order, shared with the others that draw it (probability 1/2) or its
  own.

Sections:
1. accuracy: predict vs simulate at simultaneous start and at the plan's delays;
2. plan quality: the plan's delays in the simulator vs the simulator's best over a grid (2 jobs:
   41 signed staggers plus the plan's; N jobs: every job first with the others at a common delay
   (12 values each), and the plan's delays scaled by 0.25 to 2);
3. speed: predict (median of 3 per scenario) and optimal_plan for every 4-job scenario;
4. ablations (accuracy at simultaneous start with one model component replaced) and prefetch
   depths 1, 4 and 8 (accuracy at simultaneous start).

Writes JSON to benchmarks/out/bench_model.json and prints a table. Figures go to RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from multiprocessing import get_context
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpcstagger.model import Scenario, optimal_plan, predict, simulate
from hpcstagger.model import _engine

SEED_BASE = 20260521
SIM_SEEDS = (0, 1)


LEGACY_LOADERS = False
CONTENTION = False


def _loader_fields(i: int, J: int, sample_times: list[float], miss: float) -> list[dict[str, Any]]:
    """Random loader shapes for the J jobs of scenario i (see the module docstring)."""
    import numpy as np

    rng = np.random.default_rng([SEED_BASE, i, 7])
    out = []
    for j in range(J):
        workers = int(rng.choice([0, 1, 2, 4]))
        batch = int(rng.choice([1, 8, 16, 32, 64, 128]))
        ranks = int(rng.choice([1, 2], p=[0.7, 0.3]))
        prefetch = int(rng.choice([1, 2, 4]))
        handoff = float(rng.uniform(0.0, 0.3)) * ranks * batch * sample_times[j]
        prep = float(rng.uniform(0.0, 0.5)) * miss if rng.random() < 0.5 else 0.0
        out.append({"workers": workers, "batch": batch, "ranks": ranks, "prefetch": prefetch,
                    "handoff": handoff, "prep_time": prep})
    return out


def make_scenario(i: int, prefetch: int = 2, legacy: bool | None = None) -> Scenario:
    import numpy as np

    rng = np.random.default_rng([SEED_BASE, i])
    J = int(rng.integers(2, 5))
    n, s, b0 = 2000, 131072, 2.0e8
    loss = float(rng.uniform(0.0, 0.6))
    K = int(rng.integers(2, J + 1))
    bw = [b0 * (1.0 - loss * (k - 1) / (K - 1)) for k in range(1, K + 1)]
    policy = str(rng.choice(["minio", "lru", "none"], p=[0.5, 0.35, 0.15]))
    capacity = float(rng.uniform(0.0, 1.5)) * n * s
    hit_bw = b0 * float(rng.uniform(10, 50))
    miss = s / b0
    jobs = [{"name": f"job{j}", "sample_time": miss * math.exp(float(rng.uniform(math.log(1 / 6), math.log(6)))),
             "epochs": int(rng.integers(1, 5))} for j in range(J)]
    if not (LEGACY_LOADERS if legacy is None else legacy):
        for job, extra in zip(jobs, _loader_fields(i, J, [jb["sample_time"] for jb in jobs], miss), strict=True):
            job.update(extra)
    node = {}
    if CONTENTION:
        crng = np.random.default_rng([SEED_BASE, i, 11])
        node = {"cores": int(crng.choice([1, 2, 4]))}
        for job in jobs:
            job["startup"] = float(crng.uniform(0.0, 0.5))
            job["order"] = "shared" if crng.random() < 0.5 else ""
    return Scenario.from_dict({
        "dataset": {"samples": n, "sample_bytes": s}, "storage": {"bandwidth": bw},
        "cache": {"capacity": capacity, "policy": policy, "hit_bandwidth": hit_bw},
        "loader": {"prefetch": prefetch}, "job": jobs, **({"node": node} if node else {})})


def _sim_task(args: tuple) -> float:
    i, prefetch, legacy, delays = args
    sc = make_scenario(i, prefetch, legacy=legacy)
    return statistics.fmean(simulate(sc, delays, seed=k).makespan for k in SIM_SEEDS)


def _plan_task(i: int) -> dict[str, Any]:
    sc = make_scenario(i)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = optimal_plan(sc)
    return {"i": i, "plan": plan.to_dict(), "seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}


def _grid_for(sc: Scenario, plan: dict[str, Any]) -> list[list[float]]:
    """The simulator's search grid for a scenario (see the module docstring)."""
    names = sc.job_names
    J = len(names)
    solo = []
    for job in sc.jobs:
        from dataclasses import replace

        solo.append(predict(replace(sc, jobs=(job,)), series=False).makespan)
    pts: list[list[float]] = []
    if J == 2:
        for k in range(0, 21):
            frac = (k / 20) ** 1.5
            pts.append([0.0, frac * solo[0]])
            if k:
                pts.append([frac * solo[1], 0.0])
    else:
        for first in range(J):
            upper = max(solo[j] for j in range(J) if j != first)
            for k in range(1, 13):
                d = [upper * (k / 12) ** 1.5] * J
                d[first] = 0.0
                pts.append(d)
        pd = [plan["delays"][nm] for nm in names]
        for lam in (0.25, 0.5, 0.75, 1.25, 1.5, 2.0):
            pts.append([lam * x for x in pd])
        pts.append([0.0] * J)
    return pts


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return math.nan
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _summ(errs: list[float]) -> dict[str, float]:
    a = [abs(e) for e in errs]
    return {"count": len(a), "median_abs": statistics.median(a) if a else math.nan,
            "p90_abs": _pct(a, 0.9), "max_abs": max(a) if a else math.nan,
            "mean_signed": statistics.fmean(errs) if errs else math.nan}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 scenarios, no ablations (a smoke run)")
    ap.add_argument("--scenarios", type=int, default=None, help="number of scenarios (default 60; quick 20)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="simulator processes")
    ap.add_argument("--contention", action="store_true",
                    help="also random node cores, start-ups and shared sample orders (see the docstring)")
    ap.add_argument("--legacy-loaders", action="store_true",
                    help="every job a one-sample prefetching reader (the scenarios before loader shapes were modelled)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                                  "bench_model.json"))
    args = ap.parse_args(argv)
    global LEGACY_LOADERS, CONTENTION
    LEGACY_LOADERS = args.legacy_loaders
    CONTENTION = args.contention
    N = args.scenarios or (20 if args.quick else 60)
    ids = list(range(N))
    t_start = time.perf_counter()
    ctx = get_context("fork")
    out: dict[str, Any] = {"scenarios": N, "seed_base": SEED_BASE, "sim_seeds": list(SIM_SEEDS),
                           "loaders": "legacy (one-sample reader)" if LEGACY_LOADERS else "random shapes",
                           "contention": CONTENTION,
                           "workers": args.workers, "date": time.strftime("%Y-%m-%d %H:%M"),
                           "load_before": os.getloadavg()}

    # ---- speed (first, before the pool loads the machine) --------------------------------------
    pred_times: dict[str, list[float]] = {}
    pred_cpu: list[float] = []
    for i in ids:
        sc = make_scenario(i)
        reps, cpus = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            predict(sc, series=False)
            reps.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        pred_times.setdefault(sc.cache.policy, []).append(statistics.median(reps))
        pred_cpu.append(statistics.median(cpus))
    all_pred = [t for v in pred_times.values() for t in v]
    plans: dict[int, dict[str, Any]] = {}
    plan_times4: list[float] = []
    plan_cpu4: list[float] = []
    for i in ids:
        res = _plan_task(i)
        plans[i] = res["plan"]
        if len(make_scenario(i).jobs) == 4:
            plan_times4.append(res["seconds"])
            plan_cpu4.append(res["cpu"])
    out["speed"] = {
        "predict_ms": {"median": 1e3 * statistics.median(all_pred), "p90": 1e3 * _pct(all_pred, 0.9),
                       "max": 1e3 * max(all_pred),
                       "by_policy": {k: {"median": 1e3 * statistics.median(v), "max": 1e3 * max(v), "count": len(v)}
                                     for k, v in pred_times.items()}},
        "optimal_plan_4_jobs_s": {"count": len(plan_times4),
                                  "median": statistics.median(plan_times4) if plan_times4 else None,
                                  "max": max(plan_times4) if plan_times4 else None},
        # CPU time of this process: what the wall time would be on an idle machine
        "predict_cpu_ms": {"median": 1e3 * statistics.median(pred_cpu), "p90": 1e3 * _pct(pred_cpu, 0.9),
                           "max": 1e3 * max(pred_cpu)},
        "optimal_plan_4_jobs_cpu_s": {"median": statistics.median(plan_cpu4) if plan_cpu4 else None,
                                      "max": max(plan_cpu4) if plan_cpu4 else None},
    }
    print(f"speed done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)

    # ---- accuracy -----------------------------------------------------------------------------
    tasks = []
    for i in ids:
        sc = make_scenario(i)
        tasks.append((i, 2, None, [0.0] * len(sc.jobs)))
        tasks.append((i, 2, None, [plans[i]["delays"][nm] for nm in sc.job_names]))
    # plan quality grids
    grid_index: list[tuple[int, int]] = []
    for i in ids:
        sc = make_scenario(i)
        for k, d in enumerate(_grid_for(sc, plans[i])):
            tasks.append((i, 2, None, d))
            grid_index.append((i, k))
    extra = []
    if not args.quick:
        for i in ids:
            for P in (1, 4, 8):
                sc = make_scenario(i, P, legacy=True)
                extra.append((i, P, True, [0.0] * len(sc.jobs)))
    with ctx.Pool(args.workers) as pool:
        sims = pool.map(_sim_task, tasks + extra, chunksize=1)
    print(f"simulations done ({time.perf_counter() - t_start:.0f} s, {len(sims)} points)", file=sys.stderr, flush=True)
    pos = 0
    rows = []
    err_zero, err_plan, by_policy = [], [], {}
    for i in ids:
        sc = make_scenario(i)
        J = len(sc.jobs)
        d_plan = [plans[i]["delays"][nm] for nm in sc.job_names]
        s_zero, s_plan = sims[pos], sims[pos + 1]
        pos += 2
        p_zero = predict(sc, series=False).makespan
        p_plan = predict(sc, d_plan, series=False).makespan
        e0, e1 = p_zero / s_zero - 1, p_plan / s_plan - 1
        err_zero.append(e0)
        err_plan.append(e1)
        by_policy.setdefault(sc.cache.policy, []).extend([e0, e1])
        rows.append({"i": i, "jobs": J, "policy": sc.cache.policy,
                     "capacity_frac": sc.cache.capacity / (sc.dataset.samples * sc.dataset.sample_bytes),
                     "loss": 1 - sc.storage.bandwidth[-1] / sc.storage.bandwidth[0],
                     "sim_simultaneous": s_zero, "pred_simultaneous": p_zero, "err_simultaneous": e0,
                     "plan_delays": d_plan, "sim_plan": s_plan, "pred_plan": p_plan, "err_plan": e1})
    grid_sims: dict[int, list[tuple[list[float], float]]] = {}
    for (i, _k), task in zip(grid_index, tasks[2 * N:], strict=True):
        grid_sims.setdefault(i, []).append((task[3], sims[pos]))
        pos += 1
    ratios, ratios2, ratiosN = [], [], []
    for r in rows:
        i = r["i"]
        best_grid = min(v for _, v in grid_sims[i])
        best = min(best_grid, r["sim_plan"])
        ratio = r["sim_plan"] / best
        r.update({"sim_grid_best": best_grid, "plan_vs_best": ratio - 1,
                  "sim_gain_vs_simultaneous": 1 - r["sim_plan"] / r["sim_simultaneous"]})
        ratios.append(ratio - 1)
        (ratios2 if r["jobs"] == 2 else ratiosN).append(ratio - 1)
    out["accuracy"] = {"simultaneous": _summ(err_zero), "plan": _summ(err_plan),
                       "all": _summ(err_zero + err_plan),
                       "by_policy": {k: _summ(v) for k, v in by_policy.items()}}
    out["plan_quality"] = {"all": {"count": len(ratios), "median": statistics.median(ratios), "max": max(ratios),
                                   "within_3pct": sum(1 for x in ratios if x <= 0.03)},
                           "two_jobs": {"count": len(ratios2), "max": max(ratios2) if ratios2 else None},
                           "n_jobs": {"count": len(ratiosN), "max": max(ratiosN) if ratiosN else None}}
    out["rows"] = rows

    # ---- ablations and prefetch depths ----------------------------------------------------------
    if not args.quick:
        abl: dict[str, Any] = {}
        variants = {"independent readers (no product form)": ("SHARING", "independent"),
                    "no prefetch-buffer loss (plain min rule)": ("PIPE", _engine.pipe_fluid),
                    "no miss-time variance from sharing": ("MISS_VARIANCE", False)}
        for label, (attr, value) in variants.items():
            saved = getattr(_engine, attr)
            setattr(_engine, attr, value)
            try:
                errs = [predict(make_scenario(r["i"]), series=False).makespan / r["sim_simultaneous"] - 1 for r in rows]
            finally:
                setattr(_engine, attr, saved)
            abl[label] = _summ(errs)
        out["ablations"] = abl
        depth_errs: dict[int, list[float]] = {1: [], 4: [], 8: []}
        for i in ids:  # the same order as the tasks
            for P in (1, 4, 8):
                sc = make_scenario(i, P, legacy=True)
                depth_errs[P].append(predict(sc, series=False).makespan / sims[pos] - 1)
                pos += 1
        depth = {str(P): _summ(e) for P, e in depth_errs.items()}
        out["prefetch_depths"] = depth

    out["seconds"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    def pc(x: float) -> str:
        return f"{100 * x:.2f}%"

    acc = out["accuracy"]
    print(f"\nmakespan model benchmark: {out['scenarios']} scenarios (seed base {out['seed_base']}, "
          f"simulator seeds {out['sim_seeds']}), {out['seconds']:.0f} s, load before {out['load_before'][0]:.1f}")
    print("\n| target | measured | goal | met |\n|---|---|---|---|")
    a = acc["all"]
    print(f"| accuracy: median abs makespan error | {pc(a['median_abs'])} ({a['count']} points) | <= 3% | "
          f"{'yes' if a['median_abs'] <= 0.03 else 'NO'} |")
    print(f"| accuracy: max abs makespan error | {pc(a['max_abs'])} | <= 8% | "
          f"{'yes' if a['max_abs'] <= 0.08 else 'NO'} |")
    pq = out["plan_quality"]["all"]
    print(f"| plan quality: plan in simulator vs simulator's grid best | median {pc(pq['median'])}, max "
          f"{pc(pq['max'])} ({pq['within_3pct']}/{pq['count']} within 3%) | <= 3% | "
          f"{'yes' if pq['max'] <= 0.03 else 'NO'} |")
    sp = out["speed"]
    pm = sp["predict_ms"]
    print(f"| speed: predict | median {pm['median']:.1f} ms, p90 {pm['p90']:.1f} ms, "
          f"max {pm['max']:.1f} ms | <= 20 ms | "
          f"{'yes' if pm['max'] <= 20 else 'median yes, max NO' if pm['median'] <= 20 else 'NO'} |")
    p4 = sp["optimal_plan_4_jobs_s"]
    if p4["count"]:
        print(f"| speed: optimal_plan, 4 jobs | median {p4['median']:.2f} s, max {p4['max']:.2f} s "
              f"({p4['count']} scenarios) "
              f"| <= 1 s | {'yes' if p4['max'] <= 1 else 'median yes, max NO' if p4['median'] <= 1 else 'NO'} |")
    pc_, p4c = sp["predict_cpu_ms"], sp["optimal_plan_4_jobs_cpu_s"]
    print(f"\nCPU time of the process (wall time on an idle machine): predict median {pc_['median']:.1f} ms, "
          f"p90 {pc_['p90']:.1f} ms, max {pc_['max']:.1f} ms; optimal_plan 4 jobs median "
          f"{p4c['median'] or 0:.2f} s, max {p4c['max'] or 0:.2f} s")
    print("\naccuracy detail (abs error): median / p90 / max, mean signed")
    for k, v in [("simultaneous", acc["simultaneous"]), ("plan delays", acc["plan"])] + \
            [(f"policy {p}", s) for p, s in acc["by_policy"].items()]:
        print(f"  {k:<28} {pc(v['median_abs'])} / {pc(v['p90_abs'])} / {pc(v['max_abs'])}, "
              f"{pc(v['mean_signed'])} (n={v['count']})")
    print("  predict by policy (ms): " + ", ".join(f"{k} median {v['median']:.1f} max {v['max']:.1f}"
                                                  for k, v in sp["predict_ms"]["by_policy"].items()))
    for key, title in (("ablations", "ablations (simultaneous start)"),
                       ("prefetch_depths", "prefetch depth (simultaneous start)")):
        if key in out:
            print(f"\n{title}: median / p90 / max abs error")
            for k, v in out[key].items():
                print(f"  {k:<42} {pc(v['median_abs'])} / {pc(v['p90_abs'])} / {pc(v['max_abs'])}")


if __name__ == "__main__":
    raise SystemExit(main())
