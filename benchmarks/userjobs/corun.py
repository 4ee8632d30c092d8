"""Each job's CPU cost per sample measured alone and while the other jobs train beside it.

    python benchmarks/userjobs/corun.py DIR [--rounds 2] [--seconds 20]   (root for an ext4 shape)

``DIR`` is a configuration directory that ``bench_userjobs.py --keep`` left (``bench-userjobs-*/NAME``:
its spec.toml and, for the ext4 shapes, fs.img, mounted and throttled again here). Each round
measures every job twice, in calibration mode (the measurement ``hpcstagger calibrate`` takes:
``session.loader`` records each batch's wall and CPU seconds, the workers' CPU per sample):

- **alone**: the job's own command, nothing else running;
- **beside the others**: the same, started at the same moment as ``hpcstagger launch --mode
  simultaneous`` of a copy of the spec without that job: the others train their full epochs (ranks,
  DataLoader workers, start-up) while it is measured.

Per job it prints the step's CPU and wall milliseconds per sample, the workers' CPU per sample, the
job's ``prep_time`` as calibration derives it (that CPU less the cache lookups and the reads' CPU),
the CPU of a source read (``read_cpu``), the share of the workers' samples that missed the cache, the
handoff, the start-up and the batches measured, alone and beside the others, and their ratio; the rounds go to
benchmarks/out/corun.json. The calibrated scenario models the cores as processor-shared among the
tasks at their costs measured alone; a CPU ratio near 1 with a wall ratio well above it says that
sharing, not costlier work, is what the jobs meet together.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

from bench_userjobs import (cache_bytecode, cgroup_joiner, drop_dataset, grid_configs, private_shm,  # noqa: E402
                            throttled_mount, CONFIGS)
from hpcstagger.colocated.jobmeter import calibration_spec  # noqa: E402
from hpcstagger.colocated.launch import mpmd_command  # noqa: E402
from hpcstagger.measure.spec_calibration import fresh_cache  # noqa: E402
from hpcstagger.spec import runenv  # noqa: E402
from hpcstagger.spec.jobspec import Spec  # noqa: E402
from hpcstagger.stagger.jobfields import job_fields, read_reports  # noqa: E402

KEYS = ("step_cpu_ms", "step_wall_ms", "worker_cpu_ms", "prep_ms", "read_cpu_ms", "miss_pct", "handoff_ms",
        "startup_s", "batches")


def without_job(text: str, name: str) -> str:
    """The spec's TOML text with the ``[[job]]`` table named ``name`` and the ``[plan]`` table left out
    (the copy is launched with ``--mode simultaneous``)."""
    blocks = re.split(r"(?m)^(?=\[)", text)
    return "".join(b for b in blocks if not b.startswith("[plan]") and not (
        b.startswith("[[job]]") and re.search(rf'(?m)^name\s*=\s*"{re.escape(name)}"', b)))


def costs(directory: Path, name: str) -> dict[str, float]:
    """One measured job's costs per sample from its calibration reports."""
    rep = read_reports(str(directory))
    rows = [r for lp in rep["loops"] for r in lp["records"] if not r[3]]  # after the warm-up
    n = sum(r[2] for r in rows)
    workers = [s for s in rep["samples"] if s.get("worker")]
    done = sum(s.get("hits", 0) + s.get("misses", 0) for s in workers)
    misses = sum(s.get("misses", 0) for s in workers)
    fields = job_fields(name, rep["job"], rep["loops"], rep["samples"])
    return {"step_cpu_ms": 1e3 * sum(r[6] for r in rows) / n, "step_wall_ms": 1e3 * sum(r[1] for r in rows) / n,
            "worker_cpu_ms": 1e3 * fields["worker_cpu_per_sample"],
            "prep_ms": 1e3 * fields["prep_time"], "read_cpu_ms": 1e3 * fields["read_cpu"],
            "miss_pct": 100.0 * misses / done if done else 0.0,
            "handoff_ms": 1e3 * fields["handoff"], "startup_s": fields["startup"], "batches": len(rows)}


def measure(spec: Spec, job: str, out: Path, seconds: float, others: Path | None, cgroup: str | None) -> dict:
    """``job`` in calibration mode for up to ``seconds``; with ``others`` (a spec) that spec's jobs
    launched at the same moment."""
    out.mkdir(parents=True)
    env = {**os.environ, runenv.SPEC: spec.path, runenv.CALIBRATE: str(out), runenv.ONLY: job,
           runenv.CALIBRATE_UNTIL: f"{time.time() + seconds:.3f}", runenv.RUN_DIR: str(out / "status")}
    for name in (runenv.DELAYS, runenv.MODE, "MPIR_CVAR_PMI_VERSION"):
        env.pop(name, None)
    pre = cgroup_joiner(cgroup) if cgroup else None
    procs = []
    with open(out / "output.log", "wb") as log:
        if others is not None:
            procs.append(subprocess.Popen([sys.executable, "-m", "hpcstagger", "launch", str(others), "--mode",
                                           "simultaneous", "--json"], stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(os.environ),
                                          preexec_fn=pre, cwd=others.parent, start_new_session=True))
        procs.insert(0, subprocess.Popen(mpmd_command(spec, mpiexec="mpiexec", jobs=[job]), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=pre, cwd=os.path.dirname(spec.path),
                                         start_new_session=True))
        try:
            rcs = [p.wait(timeout=seconds + 300) for p in procs]
        finally:  # a timeout or Ctrl-C: no rank is left running
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    if any(rcs):
        raise SystemExit(f"job {job}: exit statuses {rcs}; see {out / 'output.log'}")
    return costs(out, job)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="a configuration directory that bench_userjobs.py --keep left")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each every job alone and beside the others")
    p.add_argument("--seconds", type=float, default=20.0,
                   help="each measurement's share of time, seconds (default 20: 64 batches of each grid job "
                        "beside the others; a shorter share stops a job after 16)")
    p.add_argument("--out", type=Path, default=HERE.parent / "out" / "corun.json")
    args = p.parse_args()
    kept = args.dir.resolve()
    cfg = {**CONFIGS, **grid_configs()}.get(kept.name) or {}
    image = kept / "fs.img"
    if not (kept / "spec.toml").exists():
        raise SystemExit(f"{kept}: no spec.toml; give a directory that bench_userjobs.py --keep left")
    if image.exists() and os.geteuid() != 0:
        raise SystemExit("an ext4 shape needs root (a loop device, a blkio cgroup, mount)")
    if image.exists() and not cfg.get("real_fs"):
        raise SystemExit(f"{kept}: an ext4 image, but {kept.name!r} is no configuration of a real file system "
                         "(bench_userjobs.py --list --grid names them); keep the directory's name")
    spec = Spec.from_toml(str(kept / "spec.toml"))
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        stack.enter_context(private_shm("corun"))  # caches and MPI segments under a root removed afterwards
        cache_bytecode()  # the jobs' start-ups as a user's, from compiled modules
        cg = stack.enter_context(throttled_mount(image, kept / "mnt", cfg["real_fs"])) if image.exists() else None
        base = kept / "corun" / time.strftime("%Y%m%d-%H%M%S")
        for rnd in range(args.rounds):
            for beside in ((False, True) if rnd % 2 == 0 else (True, False)):
                for job in (j.name for j in spec.jobs):
                    if cg is not None:
                        drop_dataset(kept / "mnt")
                    others = None
                    if beside:
                        others = base / f"without-{job}.toml"
                        others.parent.mkdir(parents=True, exist_ok=True)
                        text = without_job((kept / "spec.toml").read_text(), job)  # its runs kept apart:
                        others.write_text(re.sub(r'(?m)^workdir\s*=.*$', f'workdir = "{base / "others"}"', text))
                    where = base / f"{rnd}-{'beside' if beside else 'alone'}-{job}"
                    caches = [c for c in (fresh_cache(spec), fresh_cache(calibration_spec(spec, str(where))))
                              if c is not None]  # both empty: the launch's and the calibration's
                    try:
                        row = {"round": rnd, "job": job, "beside": beside,
                               **measure(spec, job, where, args.seconds, others, cg)}
                    finally:
                        for cache in caches:
                            cache.destroy(force=True)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dir": str(kept), "rows": rows}, indent=1))
    print(f"| job | {' | '.join(f'{k} alone / beside (ratio)' for k in KEYS)} |")
    print("|---|" + "---|" * len(KEYS))
    for job in (j.name for j in spec.jobs):
        cells = []
        for k in KEYS:
            a = statistics.median(r[k] for r in rows if r["job"] == job and not r["beside"])
            b = statistics.median(r[k] for r in rows if r["job"] == job and r["beside"])
            cells.append(f"{a:.3g} / {b:.3g} ({b / a:.2f})" if a else f"{a:.3g} / {b:.3g}")
        print(f"| {job} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
