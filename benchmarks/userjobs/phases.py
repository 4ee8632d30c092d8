"""Where a prediction parts from a run: per job and per phase, what ``predict`` says against what ran.

    python benchmarks/userjobs/phases.py DIR [--runs LABEL,...]

DIR is one configuration's directory kept by ``bench_userjobs.py --keep`` (it holds
``scenario.toml``, ``sweep.json`` and ``work/runs/``). For every run of the sweep it prints, per
job, when the job reached the end of each epoch (seconds from the run's time zero) as the fluid
model predicts it for the run's measured starts and as the job's progress record shows it. The
first epoch reads from the source; the later ones mostly hit the cache; the last row is the
finish. A column of differences that grows in one phase and not the others names the term of the
model that is off.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from hpcstagger.model import Scenario, predict


def measured_epochs(progress: dict[str, Any], status_t0: float, epochs: int) -> list[float]:
    """Seconds from time zero at which a job's loop ended each epoch (linear between records)."""
    hist, per = progress.get("history") or [], progress.get("per_epoch")
    start = float(progress["loop_start"]) - status_t0
    out = []
    for e in range(1, epochs + 1):
        want = e * per
        t = next((t0 + (t1 - t0) * (want - b0) / max(b1 - b0, 1e-9)
                  for (t0, b0), (t1, b1) in zip(hist, hist[1:], strict=False) if b0 <= want <= b1), math.nan)
        out.append(start + t)
    return out


def predicted_epochs(pred: Any, job: str, epochs: int) -> list[float]:
    """Seconds from time zero at which the model's job reaches each epoch's share of its samples."""
    times, prog = pred.times, pred.progress[job]
    out = []
    for e in range(1, epochs + 1):
        want = e / epochs - 1e-9
        out.append(next((t for t, p in zip(times, prog, strict=False) if p >= want), pred.finish[job]))
    out[-1] = pred.finish[job]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--runs", default="", help="comma-separated run labels (default: every run)")
    args = p.parse_args()
    scenario = Scenario.from_toml(args.dir / "scenario.toml")
    sweep = json.loads((args.dir / "sweep.json").read_text())
    wanted = set(filter(None, args.runs.split(",")))
    epochs = {j.name: j.epochs for j in scenario.jobs}
    print("| run | job | epoch | predicted | measured | difference |\n|---|---|---|---|---|---|")
    for run in sweep["runs"]:
        if wanted and run["label"] not in wanted or not run.get("run_dir"):
            continue
        starts = {n: float(t["start"] or 0.0) for n, t in run["jobs"].items()}
        pred = predict(scenario, starts, series=True)
        for job in scenario.job_names:
            run_dir = Path(run["run_dir"])
            status = json.loads((run_dir / f"{job}.0.json").read_text())
            progress = json.loads((run_dir / f"{job}.progress.json").read_text())
            got = measured_epochs(progress, float(status["t0"]), epochs[job])
            for e, (a, b) in enumerate(zip(predicted_epochs(pred, job, epochs[job]), got, strict=True), 1):
                print(f"| {run['label']} | {job} | {e} | {a:.2f} s | {b:.2f} s | {b - a:+.2f} s |")


if __name__ == "__main__":
    main()
