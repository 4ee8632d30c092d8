"""``hpcstagger plan``: the start delays that minimise the predicted makespan of a scenario."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hpcstagger.measure.tables import human_bytes


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="choose each job's start delay from a scenario file (the makespan model)",
        description="Read a scenario (TOML: dataset, storage bandwidth, cache, jobs), choose each "
                    "job's start delay to minimise the predicted makespan, and print the delays "
                    "with the predicted makespan of the plan, of a simultaneous start and of "
                    "sequential runs. A bad scenario exits 1 naming the field.")
    p.add_argument("scenario", help="scenario file (TOML), e.g. from 'hpcstagger calibrate'")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object: {"delays": {job: s}, "makespan": s, "simultaneous": s, '
                        '"sequential": s, ...}')
    p.add_argument("--plot", metavar="PNG", help="write the predicted makespan versus stagger and per-job "
                                                 "timelines to this PNG")
    p.add_argument("--max-delay", type=float, default=None, metavar="S",
                   help="longest delay to consider, seconds (default: enough to run the others first)")
    p.add_argument("--min-gain", type=float, default=None, metavar="F",
                   help="recommend a stagger only if it saves more than this fraction of the makespan "
                        "(default: the plan_min_gain knob, 0.01)")
    p.add_argument("--jitter", type=float, default=None, metavar="S",
                   help="seconds a job's real start may stray from its planned delay; the plan "
                        "minimises the mean makespan over that spread (default: the plan_jitter "
                        "knob, 0.25, times the jobs' mean start-up; 0: exact starts)")
    p.set_defaults(func=run)


def _seconds(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 60:
        return f"{x / 60:.2f} min"
    return f"{x:.3f} s"


def _cache(sc: Any) -> str:
    """The scenario's cache in a few words; a partitioned one's capacity per node and in all."""
    c = sc.cache
    if sc.cache_samples == 0:
        return "no cache"
    held = f"{sc.cache_samples / sc.dataset.samples:.0%} of the data"
    if c.nodes <= 1:
        return f"cache {human_bytes(c.capacity)} {c.policy} ({held})"
    remote = "free" if c.remote_bandwidth == float("inf") else f"{c.remote_bandwidth / 1e6:.0f} MB/s"
    return (f"cache partitioned over {c.nodes} nodes, {human_bytes(c.capacity)} per node "
            f"({human_bytes(c.capacity * c.nodes)} in all) {c.policy} ({held}; remote hits {remote} per reader); "
            "jobs and source over all nodes")


def format_plan(path: str, sc: Any, plan: Any) -> str:
    """The human-readable plan table."""
    bw = "/".join(f"{b / 1e6:.0f}" for b in sc.storage.bandwidth)
    lines = [f"{path}: {len(sc.jobs)} job(s), {sc.dataset.samples} samples of {human_bytes(sc.dataset.sample_bytes)}, "
             f"source {bw} MB/s with 1, 2, ... readers, {_cache(sc)}", ""]
    width = max(len("job"), *(len(n) for n in sc.job_names))
    lines.append(f"{'job'.ljust(width)}  {'start delay':>12}  {'predicted finish':>16}")
    for name in plan.order:
        lines.append(f"{name.ljust(width)}  {_seconds(plan.delays[name]):>12}  {_seconds(plan.finish[name]):>16}")
    lines.append("")
    lines.append("predicted makespan")
    lines.append(f"  plan          {_seconds(plan.makespan):>12}")
    spread = ""
    if plan.spread_simultaneous > 0:  # a stagger kept for its mean over the start-time spread
        spread = (f"over starts within {plan.jitter:.2g} s its mean, {_seconds(plan.spread_makespan)}, is "
                  f"{1.0 - plan.spread_makespan / plan.spread_simultaneous:.1%} below a simultaneous start's, "
                  f"{_seconds(plan.spread_simultaneous)}")
    if not any(plan.delays.values()):
        saved = "   (start together)"
    elif plan.simulated.get("picked"):
        saved = "   (the model finds no stagger faster; the simulator's replay, below, does)"
    elif plan.gain > 0:
        saved = f"   (the plan saves {plan.gain:.1%}" + (f"; {spread})" if spread else ")")
    else:
        saved = f"   (no gain if starts were exact; {spread or 'the stagger pays over the start-time spread'})"
    lines.append(f"  simultaneous  {_seconds(plan.simultaneous):>12}{saved}")
    lines.append(f"  sequential    {_seconds(plan.sequential):>12}")
    if plan.jitter > 0:
        how = ("the least mean makespan over that spread" if len(sc.jobs) == 2 else
               "a stagger only if its mean makespan over that spread beats a simultaneous start's")
        lines.append(f"(planned for starts within {plan.jitter:.2g} s of their delays: {how})")
    if plan.simulated:
        sim_plan, sim_together = plan.simulated["plan"], plan.simulated["simultaneous"]
        verdict = ("confirmed" if any(plan.delays.values()) else
                   "not confirmed, so the jobs start together (the models disagree by more than the simulator's "
                   "gain)")
        scale = plan.simulated.get("scale", 1.0)
        at = f", on 1/{scale:g} of the dataset, times {scale:g}" if scale > 1 else ""
        refined = int(plan.simulated.get("refined", 0))
        if plan.simulated.get("picked"):
            verdict += ("; the model could not tell a simultaneous start from the staggers around it: the simulator "
                        f"replayed {refined} of them and chose this one")
        elif refined:
            verdict += (f"; where the model's curve was flat, the simulator chose it among {refined + 1} "
                        "staggers the model could not tell apart")
        lines.append(f"(the model's stagger replayed by the sample-level simulator{at}: {_seconds(sim_plan)} against "
                     f"{_seconds(sim_together)} simultaneous; {verdict})")
    return "\n".join(lines)


def plot_plan(sc: Any, plan: Any, out: str) -> None:
    """Write a PNG: predicted makespan versus stagger, and each job's timeline (plan vs together)."""
    from hpcstagger._io import atomic_write
    from hpcstagger.model import predict

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), gridspec_kw={"height_ratios": [3, 2]})
    ax1.plot(plan.curve_stagger, plan.curve_makespan, marker=".", lw=1.2)
    if len(sc.jobs) == 2:
        names = sc.job_names
        x = plan.delays[names[1]] - plan.delays[names[0]]
    else:
        x = max(plan.delays.values())
    ax1.plot([x], [plan.makespan], "o", color="C3", label=f"plan: {plan.makespan:.1f} s")
    ax1.axhline(plan.simultaneous, color="0.5", ls="--", lw=0.8, label=f"simultaneous: {plan.simultaneous:.1f} s")
    ax1.set_xlabel(plan.curve_label or "stagger (s)")
    ax1.set_ylabel("predicted makespan (s)")
    ax1.legend(loc="best", fontsize=8)
    ax1.grid(alpha=0.3)
    together = predict(sc, None, series=False)
    for k, name in enumerate(sc.job_names):
        ax2.barh(k + 0.2, plan.finish[name] - plan.delays[name], left=plan.delays[name], height=0.35,
                 color="C0", label="plan" if k == 0 else None)
        ax2.barh(k - 0.2, together.finish[name], left=0.0, height=0.35, color="0.7",
                 label="simultaneous" if k == 0 else None)
    ax2.set_yticks(range(len(sc.jobs)))
    ax2.set_yticklabels(sc.job_names)
    ax2.set_xlabel("time (s)")
    ax2.set_title("predicted job timelines", fontsize=9)
    ax2.legend(loc="best", fontsize=8)
    fig.tight_layout()
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from hpcstagger.model import Scenario, optimal_plan

    sc = Scenario.from_toml(args.scenario)
    plan = optimal_plan(sc, max_delay=args.max_delay, min_gain=args.min_gain, jitter=args.jitter)
    if args.plot:
        plot_plan(sc, plan, args.plot)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print(format_plan(args.scenario, sc, plan))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0
