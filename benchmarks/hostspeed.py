"""How steady this machine's CPU is: one thread's work per second, second after second.

    python benchmarks/hostspeed.py [--seconds 40] [--json FILE]

Counts the 256 x 256 float32 matrix products one thread of PyTorch completes in each second, for
``--seconds`` seconds, and prints the counts, their median and the ratio of the fastest second to
the slowest. Run it on an otherwise idle machine, before or between benchmarks: on a shared
virtual machine the host's other tenants can change the speed of a vCPU from one second to the
next, and a benchmark whose runs spread by more than its target resolves nothing. A ratio near 1
means a steady CPU (the 2-core VM gave 1.05 to 1.77 from hour to hour). It says nothing of the
benchmark's own jobs: runs of one point there spread by 20 to 30% at 1.1, until the jobs stopped
computing on denormal floats (see benchmarks/userjobs/train.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def rates(seconds: float, size: int = 256) -> list[int]:
    """Matrix products of ``size`` x ``size`` completed in each whole second, one thread."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(size, size)
    out: list[int] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 1.0:
            x @ x
            n += 1
        out.append(n)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=40.0, help="how long to measure (default 40)")
    p.add_argument("--json", type=Path, help="also write the counts and the summary to this file")
    args = p.parse_args()
    if args.seconds < 1:
        p.error("--seconds must be at least 1")
    counts = rates(args.seconds)
    summary = {"seconds": len(counts), "median": statistics.median(counts), "min": min(counts), "max": max(counts),
               "max_over_min": max(counts) / min(counts), "counts": counts}
    print(" ".join(map(str, counts)))
    print(f"matrix products a second: median {summary['median']:.0f}, {summary['min']} to {summary['max']} "
          f"(fastest / slowest second {summary['max_over_min']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
