"""``hpcstagger profile``: read a stall profile, say what bounds the job and what would help."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "profile", help="read a data-stall profile: I/O-, prep- or compute-bound, and what caching, "
                        "staggering and a shared loader would gain",
        description="Read a profile written by hpcstagger.profile.StallProfiler.save and print the "
                    "time spent waiting for data, preparing it and computing, whether the job is "
                    "I/O-bound, prep-bound or compute-bound, and what caching, staggering and a shared "
                    "loader (hpcstagger.loader) would gain. With --scenario the job's measured time per "
                    "sample is put into the scenario and the makespan model gives the gains.")
    p.add_argument("profile", help="profile JSON file")
    p.add_argument("--scenario", help="scenario file (TOML) with this job and the jobs beside it")
    p.add_argument("--job", help="the scenario job this profile belongs to (default: the profile's name)")
    p.add_argument("--jobs", type=int, default=None,
                   help="co-located jobs that would share one loader, for the shared loader's estimate "
                        "(default: the scenario's jobs, else 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def format_report(path: str, s: dict[str, Any], gains: dict[str, Any]) -> str:
    lines = [f"{path}: job {s['name']!r}, {s['iterations']} iterations ({s['warmup_left_out']} warm-up left out), "
             f"{s['samples']} samples, {s['seconds']:.2f} s"]
    per = s["samples"] or 1
    lines.append(f"  waiting for data  {s['wait_s']:10.3f} s  {s['wait_share']:6.1%}")
    prep_note = "" if s["prep_marked"] else "  (not marked)"
    lines.append(f"  preparing data    {s['prep_s']:10.3f} s  {s['prep_share']:6.1%}{prep_note}")
    lines.append(f"  computing         {s['compute_s']:10.3f} s  {s['compute_share']:6.1%}  "
                 f"({1e3 * s['compute_s'] / per:.3f} ms/sample)")
    verdict = s["verdict"]
    why = {"I/O-bound": f"it waits for data {s['wait_share']:.1%} of the time",
           "prep-bound": f"preparing data takes {s['prep_share']:.1%} of the time",
           "compute-bound": f"it stalls only {s['wait_share'] + s['prep_share']:.1%} of the time",
           "no data": "the profile has no iterations"}[verdict]
    lines.append(f"verdict: {verdict}: {why}")
    lines.append(f"caching: if every sample were a cache hit the job would take up to "
                 f"{gains['caching_upper_bound']:.1%} less time (upper bound: all waiting removed)")
    sl = gains.get("shared_loader")
    if sl and sl["jobs"] > 1:
        head = ("shared loader: recommended" if sl["recommended"] else
                "shared loader: worth trying if the waiting is the loader's workers, not storage"
                if sl["worth_trying"] else "shared loader: little to gain")
        lines.append(f"{head}: {sl['jobs']} jobs sharing one producer (hpcstagger.loader.SharedLoader) would "
                     f"each run about {sl['speedup']:.2f}x as fast (estimate: the stall shared by {sl['jobs']})")
    if "planned" in gains:
        d = ", ".join(f"{k} {v:.2f} s" for k, v in gains["delays"].items())
        lines.append(f"model, with the scenario and {gains['job']} at {1e3 * gains['sample_time']:.3f} ms/sample:")
        lines.append(f"  no cache, started together      makespan {gains['no_cache']:10.2f} s")
        lines.append(f"  cache, started together         makespan {gains['cache']:10.2f} s   "
                     f"(caching saves {gains['caching_gain']:.1%})")
        lines.append(f"  cache, planned delays           makespan {gains['planned']:10.2f} s   "
                     f"(staggering saves {gains['staggering_gain']:.1%} more; delays {d})")
    else:
        lines.append("staggering: give --scenario with the co-located jobs to estimate it with the model")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from hpcstagger._io import json_safe
    from hpcstagger.model import Scenario
    from hpcstagger.profile import StallProfiler, estimate_gains

    prof = StallProfiler.load(args.profile)
    summary = prof.summary()
    scenario = Scenario.from_toml(args.scenario) if args.scenario else None
    if args.jobs is not None and args.jobs < 1:
        print(f"hpcstagger profile: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    gains = estimate_gains(summary, scenario, args.job, args.jobs)
    if args.json:
        json.dump(json_safe({"summary": summary, "gains": gains}), sys.stdout, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print(format_report(args.profile, summary, gains))
    return 0
