"""What ``hpcstagger sweep`` reports: the predicted-versus-measured table and the plot.

:func:`draw_timelines` is shared with the demo's figure (:mod:`hpcstagger.demo.report`).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from hpcstagger._io import atomic_write
from hpcstagger.measure.tables import table

__all__ = ["format_sweep", "plot_sweep", "draw_timelines"]


def _s(x: float | None, unit: str = " s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def format_sweep(result: Mapping[str, Any]) -> str:
    """The predicted-versus-measured table of a sweep and its summary lines."""
    summary = result["summary"]
    rows = [("RUN", "STAGGER", "RUNS", "PREDICTED", "MEASURED", "ERROR")]
    for p in summary["points"]:
        pred, meas = p["predicted_median"], p["measured_median"]
        err = "-" if pred is None or not meas else f"{100 * (pred - meas) / meas:+.1f}%"
        stagger = "-" if p["stagger"] is None else f"{p['stagger']:+.3g}s"
        rows.append((p["label"], stagger, str(len(p["measured"])), _s(pred), _s(meas), err))
    lines = [table(rows), ""]
    if result.get("repeat", 1) > 1:
        lines.insert(1, f"(medians over {result['repeat']} repetitions)")
    best = summary.get("best")
    if best:
        lines.append(f"best measured stagger: {best['label']}, {best['measured']:.2f} s")
    if summary.get("plan_vs_best") is not None:
        gap = summary["plan_vs_best"]
        lines.append(f"plan (steered while the run went on): {summary['plan']:.2f} s, {100 * abs(gap):.1f}% "
                     f"{'above' if gap > 0 else 'below'} the best measured stagger")
    if summary.get("open_vs_best") is not None:
        gap = summary["open_vs_best"]
        lines.append(f"open-loop plan (the plan's delays, not steered): {summary['open']:.2f} s, "
                     f"{100 * abs(gap):.1f}% {'above' if gap > 0 else 'below'} the best measured stagger")
    if summary.get("plan_vs_best") is None and not result.get("scenario"):
        lines.append("no plan run: the spec has no [plan] scenario (run 'hpcstagger calibrate' and set it)")
    if summary.get("spread") is not None:
        lines.append(f"run-to-run noise: the runs of one point lay {100 * summary['spread']:.1f}% apart (median; "
                     f"max {100 * summary['spread_max']:.1f}%); a gap smaller than that is within it")
    if summary.get("error_median") is not None:
        lines.append(f"prediction error: median {100 * summary['error_median']:.1f}%, "
                     f"max {100 * summary['error_max']:.1f}% (each run)")
    if summary.get("point_error_median") is not None:
        lines.append(f"prediction error against each point's median run: median "
                     f"{100 * summary['point_error_median']:.1f}%, max {100 * summary['point_error_max']:.1f}%")
    return "\n".join(lines)


def plot_sweep(result: Mapping[str, Any], out: str) -> None:
    """Write a PNG: the predicted makespan versus stagger with the measured points, and every run's
    measured job timelines (start to finish)."""
    import matplotlib  # matplotlib loads only where a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, max(4.5, 0.3 * len(runs) + 1.5)))
    curve = result.get("curve") or {}
    if curve.get("stagger"):
        ax1.plot(curve["stagger"], curve["makespan"], color="C0", lw=1.2, label="predicted makespan")
    _measured_points(ax1, runs)
    jobs = result["jobs"]
    ax1.set_xlabel(f"stagger (s): > 0 {', '.join(jobs)} in spec order, job k delayed by k*s; < 0 reverse order"
                   if len(jobs) > 2 else f"stagger (s): {jobs[1]} starts s after {jobs[0]}; < 0: {jobs[0]} later")
    ax1.set_ylabel("makespan (s)")
    ax1.set_title("Makespan versus stagger")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="best")
    labels = [r["label"] + (f" (r{r['repetition']})" if result.get("repeat", 1) > 1 else "") for r in runs]
    draw_timelines(ax2, runs, labels, tick_size=7)
    fig.tight_layout()
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def draw_timelines(ax: Any, runs: Sequence[Mapping[str, Any]], labels: Sequence[str], *,
                   tick_size: float | None = None) -> None:
    """Each run's measured job timelines (``run["jobs"][name]`` with ``start`` and ``finish``), one
    row per run labelled ``labels``, one bar colour per job."""
    for i, r in enumerate(runs):
        count = len(r["jobs"])
        for j, (name, t) in enumerate(r["jobs"].items()):
            if t["start"] is not None and t["finish"] is not None:
                ax.barh(i + 0.8 * (j + 0.5) / count - 0.4, t["finish"] - t["start"], left=t["start"],
                        height=0.8 / count, color=f"C{j}", label=name if i == 0 else None)
    ax.set_yticks(range(len(labels)), labels, fontsize=tick_size)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the run's start")
    ax.set_title("Measured job timelines")
    ax.legend(fontsize=8, loc="best")


def _measured_points(ax: Any, runs: list[Mapping[str, Any]]) -> None:
    seen: set[str] = set()
    for r in runs:
        if r["measured"] is None:
            continue
        kind = r["mode"] if r["mode"] != "fixed" else "fixed staggers"
        label = None if kind in seen else f"measured, {kind}"
        seen.add(kind)
        if r["stagger"] is None:  # sequential, or a plan off the sweep's axis
            ax.axhline(r["measured"], color="0.4" if r["mode"] == "sequential" else "C3", ls="--", lw=0.8,
                       label=label)
            continue
        marker = {"plan": "*", "open": "^", "simultaneous": "o"}.get(r["mode"], "x")
        ax.scatter([r["stagger"]], [r["measured"]], marker=marker, s=110 if marker == "*" else 36, zorder=3,
                   color={"plan": "C3", "open": "C1"}.get(r["mode"], "k"), label=label)
