"""Jobs written without ``session.loader``: what a user meets, and the plan against a simultaneous start.

The jobs are ``benchmarks/userjobs/train.py`` (a DataLoader with workers and batches, a
DistributedSampler, DDP, SGD) run with ``--no-wrapper``: the loop iterates the DataLoader itself, as
many users first write it. For 0, 2 and 4 DataLoader workers per job it

1. runs ``hpcstagger calibrate SPEC`` as documented, which cannot measure such a loop, and records
   its exit status, its time and whether its error names the missing wrapper;
2. calibrates the same spec by the route left to such a user, the jobs as step factories
   (``--job cnn=benchmarks.userjobs.steps:cnn``), which cannot see the loader, and plans it;
3. runs ``hpcstagger sweep`` (the plan, a simultaneous start and fixed staggers in both orders, each
   from a cold cache, ``--repeat`` runs per point) and records the plan against the simultaneous
   start and the best measured stagger, and whether the runs' output names the missing wrapper.

    python benchmarks/bench_blind.py [--workers 0,2,4] [--staggers 0,3,6] [--repeat 2] [--samples N]

Writes benchmarks/out/bench_blind.json and prints one row per shape.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_userjobs as U  # noqa: E402  (beside this file)

HINT = "session.loader(loader)"


def _hs(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcstagger", *args]


def _output(argv: list[str], log: Path, timeout: float = 1800) -> tuple[int, str]:
    """Run ``argv`` from the repository root, its output appended to ``log`` and returned."""
    env = dict(U.os.environ, PYTHONPATH=str(HERE.parent))
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(HERE.parent), timeout=timeout)
    with open(log, "a") as f:
        f.write("\n$ " + " ".join(argv) + "\n" + p.stdout + p.stderr)
    return p.returncode, p.stdout + p.stderr


def run_shape(workers: int, data: Path, work: Path, staggers: str, repeat: int, budget: float) -> dict[str, Any]:
    work.mkdir(parents=True)
    log, spec = work / "log.txt", work / "spec.toml"
    jobs = [U._job("cnn", "cnn", batch=64, workers=workers), U._job("mlp", "mlp", batch=64, workers=workers)]
    for j in jobs:
        j["command"] += " --no-wrapper"
    U.write_spec(spec, f"blind-w{workers}", {"jobs": jobs, "cache": 1.0, "throttle": U.FALLS}, data,
                 data.stat().st_size)
    out: dict[str, Any] = {"workers": workers, "log": str(log)}
    t0 = time.monotonic()
    rc, text = _output(_hs("calibrate", str(spec), "-o", str(work / "scenario.toml"), "--budget", str(budget)), log)
    out["calibrate"] = {"rc": rc, "seconds": time.monotonic() - t0, "names_wrapper": HINT in text,
                        "last_line": text.strip().splitlines()[-1] if text.strip() else ""}
    rc, text = _output(_hs("calibrate", str(spec), "-o", str(work / "scenario.toml"), "--budget", str(budget),
                           "--fresh", "--job", "cnn=benchmarks.userjobs.steps:cnn",
                           "--job", "mlp=benchmarks.userjobs.steps:mlp"), log)
    out["factory_calibrate_rc"] = rc
    if rc != 0:
        out["error"] = f"factory calibration exited {rc}; see {log}"
        return out
    rc, text = _output(_hs("plan", str(work / "scenario.toml"), "--json"), log)
    plan = json.loads(text[text.index("{"):]) if rc == 0 and "{" in text else {}
    out["plan"] = {"rc": rc, "delays": plan.get("delays"), "label": (plan.get("curve") or {}).get("label")}
    rc, text = _output(_hs("sweep", str(spec), "--staggers", staggers, "--repeat", str(repeat), "--json",
                           str(work / "sweep.json")), log)
    out["sweep_rc"] = rc
    out["sweep_names_wrapper"] = "never called session.loader" in text or HINT in text
    if rc != 0 or not (work / "sweep.json").exists():
        out["error"] = f"sweep exited {rc}; see {log}"
        return out
    sw = json.loads((work / "sweep.json").read_text())
    out["sweep"] = sw
    summary = sw.get("summary") or {}
    sim = next((p["measured_median"] for p in summary.get("points", []) if p["mode"] == "simultaneous"), None)
    out["result"] = {"plan": summary.get("plan"), "best": (summary.get("best") or {}).get("measured"),
                     "best_at": (summary.get("best") or {}).get("label"), "simultaneous": sim,
                     "plan_vs_simultaneous": summary["plan"] / sim - 1 if summary.get("plan") and sim else None}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--workers", default="0,2,4", help="DataLoader workers per job, one shape each (default 0,2,4)")
    p.add_argument("--staggers", default="0,3,6", help="fixed staggers for the sweep, seconds, both orders")
    p.add_argument("--repeat", type=int, default=2, help="runs per point of the sweep (default 2)")
    p.add_argument("--samples", type=int, default=3072, help="dataset samples of 3 KiB (default 3072)")
    p.add_argument("--budget", type=float, default=40.0, help="calibration budget, seconds (default 40)")
    p.add_argument("--out", default=str(HERE / "out" / "bench_blind.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    results = []
    with U.workspace("bench-blind", args.samples, args.keep) as (root, data):
        for w in (int(x) for x in args.workers.split(",")):
            print(f"[bench_blind] workers {w} ...", file=sys.stderr, flush=True)
            res = run_shape(w, data, root / f"w{w}", args.staggers, args.repeat, args.budget)
            results.append(res)
            U.os.makedirs(U.os.path.dirname(args.out), exist_ok=True)
            Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "results": results},
                                                 indent=1))
    print("\n| workers | calibrate SPEC | names the wrapper | plan delays | plan | simultaneous | best stagger |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        c, pl, m = r["calibrate"], r.get("plan") or {}, r.get("result") or {}

        def s(x: Any) -> str:
            return f"{x:.2f} s" if isinstance(x, (int, float)) else "-"

        print(f"| {r['workers']} | exit {c['rc']} after {c['seconds']:.0f} s | calibrate {c['names_wrapper']}, "
              f"runs {r.get('sweep_names_wrapper')} | {pl.get('delays')} | {s(m.get('plan'))} | "
              f"{s(m.get('simultaneous'))} | {s(m.get('best'))} ({m.get('best_at')}) |" + (
                  f" {r['error']}" if r.get("error") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
