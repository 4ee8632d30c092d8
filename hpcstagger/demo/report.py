"""What ``hpcstagger demo`` reports: the predicted-versus-measured table, its notes and the plot.

The notes say what a reader of the figures must know to trust them: that the node was busy when
the demo started (other processes' CPU use, the load average; measured makespans are then slower
than on a quiet node), and, when the plan is a simultaneous start, that it is one and why (the
coordinator's reason: :func:`hpcstagger.stagger.delays.simultaneous_reason`). The table's
notes and the plot's text are the same lines.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from hpcstagger.measure.tables import table
from hpcstagger.measure.sweep_report import draw_timelines

__all__ = ["format_table", "notes", "figure", "plot"]


def notes(result: Mapping[str, Any]) -> list[str]:
    """The lines that qualify a demo result: a busy node's warning, and why a plan that starts
    every job at once does so (the planned run's reason, else the demo's own plan's)."""
    out = []
    warning = (result.get("node_load") or {}).get("warning")
    if warning:
        out.append(f"warning: {warning}")
    planned = next((r for r in result.get("runs", ()) if r.get("mode") == "plan"), None)
    reason = planned.get("simultaneous_reason") if planned else (result.get("plan") or {}).get("simultaneous_reason")
    if reason:
        out.append(f"plan: {reason}")
    return out


def format_table(result: Mapping[str, Any]) -> str:
    """The predicted-versus-measured table of a demo result, then its :func:`notes`."""
    rows = [("RUN", "DELAYS", "PREDICTED", "MEASURED", "ERROR")]
    for r in result["runs"]:
        delays = ", ".join(f"{n} +{d:.1f}s" for n, d in r["delays"].items())
        err = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        rows.append((r["label"], delays, f"{r['predicted']:.1f} s", f"{r['measured']:.1f} s", err))
    return "\n".join([table(rows), *notes(result)])


def _later(delays: Mapping[str, float]) -> str:
    """The job whose delay is the curve's x axis: the later one, else the second (its positive side)."""
    names = list(delays)
    return max(names, key=lambda n: delays[n]) if any(delays.values()) else names[-1]


def _makespans(ax: Any, result: Mapping[str, Any]) -> None:
    """Left panel: the predicted makespan versus stagger with each run's measured makespan."""
    plan = result["plan"]
    planned = next((r for r in result["runs"] if r["mode"] == "plan" and r.get("curve")), None)
    curve = planned["curve"] if planned else plan["curve"]  # the coordinator's, with the jobs' calibration
    if curve["stagger"]:
        ax.plot(curve["stagger"], curve["makespan"], label="predicted makespan", color="tab:blue")
    later = _later(planned["delays"] if planned else plan["delays"])
    for r in result["runs"]:
        if r["mode"] == "sequential":
            ax.axhline(r["measured"], color="tab:gray", ls="--", label="measured, sequential")
            ax.axhline(r["predicted"], color="tab:gray", ls=":", label="predicted, sequential")
            continue
        x = r["delays"].get(later, 0.0)
        marker = {"plan": "*", "simultaneous": "o"}.get(r["mode"], "x")
        label = f"measured, {r['label']}" if r["mode"] != "fixed" else None
        if r["mode"] == "plan" and not any(r["delays"].values()):
            label = "measured, plan (a simultaneous start)"
        ax.scatter([x], [r["measured"]], marker=marker, s=90 if marker == "*" else 40, color="tab:red", zorder=3,
                   label=label)
    ax.set_xlabel(curve.get("label") or f"delay of {later} (s)")
    ax.set_ylabel("makespan (s)")
    ax.set_title("Makespan versus stagger")
    ax.legend(fontsize=8)


def figure(result: Mapping[str, Any]) -> Any:
    """The demo's matplotlib figure: makespan versus stagger, each run's job timelines, and the
    :func:`notes` (wrapped) beneath them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [part for line in notes(result) for part in textwrap.wrap(line, 180)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5 + 0.18 * len(lines)))
    _makespans(ax1, result)
    draw_timelines(ax2, result["runs"], [r["label"] for r in result["runs"]])
    bottom = (0.03 + 0.035 * len(lines)) if lines else 0.0
    if lines:
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=8, va="bottom", ha="left",
                 color="tab:red" if (result.get("node_load") or {}).get("busy") else "black")
    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))
    return fig


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """Write :func:`figure` to ``path`` (PNG); return the path."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
