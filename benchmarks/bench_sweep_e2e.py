"""A hyper-parameter sweep on one node, end to end: four trials with plain PyTorch against the same
four with hpcstagger, on a kernel-throttled file system, inside a memory limit. Root only.

Results: benchmarks/RESULTS.md, section The whole tool against plain PyTorch.

The trials are ``benchmarks/sweep/trial.py``: a torchvision ImageFolder of JPEG files, PIL decode
and a random resized crop and flip in DataLoader workers, a small CNN, SGD (the trials differ in
learning rate), a checkpoint every ``--ckpt-every`` steps. The node is made real, not emulated:

- the JPEG tree lives on an ext4 image on a loop device whose reads a cgroup v1 ``blkio``
  throttle (``io.max`` where the node has cgroup v2 alone) holds to ``--mbps``;
- every process of a run lives in one fresh ``memory`` cgroup whose limit is the node's RAM
  (``--mem-mb``); the page cache and /dev/shm are charged to it, as on a node;
- the dataset's pages are dropped before every run.

Rows, each a run of the four trials started at once, interleaved over ``--repeat`` rounds:

- ``plain``: the trials as users run them (``--mode plain``: its own DataLoader, torch.save to
  the same file system), all four started together as a job array would;
- ``dcp``: the same with torch.distributed.checkpoint.async_save;
- then hpcstagger, one part added at a time, each through ``hpcstagger launch`` with the
  documented lines (``--mode hpcstagger``): ``cache`` (the node's /dev/shm cache, ``capacity =
  "auto"``: sized by the launch to what the limit leaves beside the trials' memory, as
  ``hpcstagger calibrate --spec`` measured it; a simultaneous start), ``plan`` (+ the planner's
  stagger from that calibration, the closed loop on), ``shared`` (+ one shared loader for the four
  trials, calibrated with it), ``hpcstagger`` (+ AsyncCheckpointer: the whole tool);
- ``slurm`` (asked for with ``--rows``): row ``hpcstagger``'s spec submitted with ``hpcstagger
  slurm submit --wait`` to a fresh single-node test cluster (``tests/support/local_slurm.py``)
  whose slurmd runs in the run's cgroups; compared with row ``hpcstagger`` (makespan from
  submission, and the last trial's end), and from the batch script's first line (the job's own
  time, without the submitting command and the test cluster's scheduling, which took 0.1 to
  0.9 s from sbatch to the script's start on an idle 2-core VM).

Two sizes: ``fits`` (the dataset fits in the page cache under the limit, so plain PyTorch already
shares it) and ``nofit`` (about twice what the page cache can hold under the limit). Every row
reports the makespan (first process started to last process ended), each trial's finish time,
total CPU seconds (the cgroup's ``cpuacct.usage`` or ``cpu.stat``), peak memory (the cgroup's
``memory.max_usage_in_bytes`` or ``memory.peak``: RSS, page cache and /dev/shm; and the sampled peak of the
processes' PSS plus the run's /dev/shm), and OOM kills.

    python benchmarks/bench_sweep_e2e.py [--sizes fits,nofit] [--rows plain,dcp,...] [--repeat 3]
                                         [--mem-mb 1536] [--mbps 20] [--fits-mb 150] [--nofit-mb 900]
                                         [--epochs 2] [--device cuda:0] [--quick]

With ``--device cuda:N`` the four trials train on that GPU, each its own process (and CUDA context)
sharing it, the DataLoader's batches pinned and copied to it.

Writes benchmarks/out/bench_sweep_e2e.json and prints a table per size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests" / "support"))
from bench_userjobs import cache_bytecode, cgroup_v2, drop_dataset, kill_members, real_fs  # noqa: E402  (benchmarks/bench_userjobs.py)
from local_slurm import LocalSlurm  # noqa: E402  (tests/support/local_slurm.py: the test cluster)

TRIAL = HERE / "sweep" / "trial.py"
LRS = (0.02, 0.05, 0.1, 0.2)
ROWS = ("plain", "dcp", "cache", "plan", "shared", "hpcstagger", "slurm")
DEFAULT_ROWS = ROWS[:-1]  # row slurm (the hpcstagger row through sbatch on a local test cluster) when asked for
CG = "/sys/fs/cgroup"


# ---------------------------------------------------------------------------------------- the dataset
def make_images(root: Path, megabytes: float, *, px: int = 128, classes: int = 10, seed: int = 0) -> int:
    """An ImageFolder tree of JPEG files of about ``megabytes`` in all (noisy images, so that JPEG
    keeps them large: about 30 KB at 128 x 128, quality 100); returns the number of files."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    total, n = 0, 0
    base = rng.integers(0, 255, size=(classes, px, px, 3), dtype=np.uint8)
    while total < megabytes * 1e6:
        c = n % classes
        img = (base[c] // 2 + rng.integers(0, 128, size=(px, px, 3), dtype=np.uint8)).astype(np.uint8)
        path = root / f"class{c:02d}" / f"img{n:07d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(path, quality=100)
        total += path.stat().st_size
        n += 1
    return n


# ---------------------------------------------------------------------------------------- the node
class RunGroup:
    """A fresh memory and cpuacct cgroup for one run (its limit the node's RAM), joined with the
    node's blkio group by every process the run starts (never by this process). On a node with
    cgroup v2 alone it is one group under the throttled group of ``real_fs`` (``blkio``), whose
    ``io.max`` applies to it: ``memory.max`` the limit, ``memory.peak``, ``memory.events`` and
    ``cpu.stat`` the figures."""

    def __init__(self, tag: str, mem_bytes: int, blkio: str):
        self.v2 = cgroup_v2()
        if self.v2:
            for parent in (CG, blkio):  # the memory controller for the run's group (a v2 parent holds no process)
                with open(f"{parent}/cgroup.subtree_control", "w") as f:
                    f.write("+memory")
            self.mem = self.cpu = f"{blkio}/{tag}"
            self.paths: tuple[str, ...] = (self.mem,)
        else:
            self.mem, self.cpu, self.blkio = f"{CG}/memory/{tag}", f"{CG}/cpuacct/{tag}", blkio
            self.paths = (self.mem, self.cpu, self.blkio)
        for path in dict.fromkeys((self.mem, self.cpu)):
            os.makedirs(path)
        with open(f"{self.mem}/{'memory.max' if self.v2 else 'memory.limit_in_bytes'}", "w") as f:
            f.write(str(mem_bytes))

    def join(self) -> None:
        """A ``preexec_fn``: the child (and so its children) into the run's groups."""
        for path in self.paths:
            with open(f"{path}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def pids(self) -> list[int]:
        with open(f"{self.mem}/cgroup.procs") as f:
            return [int(x) for x in f.read().split()]

    def anon_shm(self) -> int:
        """What the group's processes hold apart from the page cache: anonymous memory and /dev/shm."""
        with open(f"{self.mem}/memory.stat") as f:
            stat = dict(line.split() for line in f)
        if self.v2:
            return int(stat.get("anon", 0)) + int(stat.get("shmem", 0))
        return int(stat.get("total_rss", 0)) + int(stat.get("total_shmem", 0))

    def stats(self) -> dict[str, Any]:
        def read(path: str) -> str:
            with open(path) as f:
                return f.read()
        if self.v2:
            events = dict(line.split() for line in read(f"{self.mem}/memory.events").splitlines())
            cpu = dict(line.split() for line in read(f"{self.mem}/cpu.stat").splitlines())
            return {"cgroup_peak_bytes": int(read(f"{self.mem}/memory.peak")),
                    "oom_kills": int(events.get("oom_kill", 0)), "failcnt": int(events.get("max", 0)),
                    "cpu_s": int(cpu["usage_usec"]) / 1e6}
        oom = dict(line.split() for line in read(f"{self.mem}/memory.oom_control").splitlines())
        return {"cgroup_peak_bytes": int(read(f"{self.mem}/memory.max_usage_in_bytes")),
                "oom_kills": int(oom.get("oom_kill", 0)), "failcnt": int(read(f"{self.mem}/memory.failcnt")),
                "cpu_s": int(read(f"{self.cpu}/cpuacct.usage")) / 1e9}

    def close(self) -> None:
        kill_members(self.mem)
        for path in dict.fromkeys((self.mem, self.cpu)):
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except OSError:
                    time.sleep(0.1)


class MemorySampler(threading.Thread):
    """Every ``every`` seconds: the sum of the group's processes' PSS plus the bytes under the run's
    shm root; keeps the peak."""

    def __init__(self, group: RunGroup, shm: Path, every: float = 0.5):
        super().__init__(daemon=True)
        self.group, self.shm, self.every = group, shm, every
        self.peak, self.anon_peak, self.stop = 0, 0, threading.Event()

    def _pss(self, pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def run(self) -> None:
        while not self.stop.wait(self.every):
            shm = sum(f.stat().st_size for f in self.shm.rglob("*") if f.is_file()) if self.shm.exists() else 0
            self.peak = max(self.peak, sum(self._pss(p) for p in self.group.pids()) + shm)
            try:
                self.anon_peak = max(self.anon_peak, self.group.anon_shm())
            except OSError:
                pass


# ---------------------------------------------------------------------------------------- the rows
def trial_args(row: str, lr: float, ckpt_dir: Path, report: Path, args: argparse.Namespace) -> list[str]:
    ckpt = {"plain": "torch", "dcp": "dcp", "hpcstagger": "async"}.get(row, "torch")
    mode = "plain" if row in ("plain", "dcp") else "hpcstagger"
    return [sys.executable, str(TRIAL), "--mode", mode, "--lr", str(lr), "--epochs", str(args.epochs),
            "--batch", str(args.batch), "--workers", str(args.workers), "--ckpt", ckpt, "--ckpt-dir", str(ckpt_dir),
            "--ckpt-every", str(args.ckpt_every), "--device", args.device, "--report", str(report)]


def write_spec(path: Path, row: str, data: Path, work: Path, shm: Path, cache_bytes: int | None,
               scenario: Path | None, args: argparse.Namespace) -> None:
    """The job spec of an hpcstagger row: four trials, the cache ("auto" without ``cache_bytes``: sized
    by the launch from the jobs' memory in the calibrated scenario), the plan mode, the shared loader.
    Row ``slurm`` is row ``hpcstagger``'s spec with a ``[slurm]`` table for the test cluster."""
    slurm, row = row == "slurm", "hpcstagger" if row == "slurm" else row
    mode = "plan" if row in ("plan", "shared", "hpcstagger") and scenario is not None else "simultaneous"
    capacity = '"auto"' if cache_bytes is None else str(cache_bytes)
    lines = ["[run]", 'name = "sweep"', f'workdir = "{work / "runs"}"', "timeout = 3600", "",
             "[dataset]", f'path = "{data}"', 'pattern = "**/*.jpg"', "",
             "[cache]", f"capacity = {capacity}", f'root = "{shm}"', "",
             "[checkpoint]", f'directory = "{work / "ckpt"}"', f"every = {args.ckpt_every}", "",
             "[plan]", f'mode = "{mode}"'] + ([f'scenario = "{scenario}"'] if scenario is not None else []) + [""]
    if row in ("shared", "hpcstagger"):
        lines += ["[loader]", "share = true", ""]
    if slurm:  # the batch script's first line stamps the job's start (the time from sbatch is the cluster's)
        lines += ["[slurm]", 'partition = "debug"', 'time = "02:00:00"',
                  f'setup = ["date +%s.%N > {work / "batch-start"}"]', ""]
    for lr in LRS:
        argv = trial_args(row, lr, work / "ckpt" / f"lr{lr}", work / "reports" / f"lr{lr}.json", args)
        lines += ["[[job]]", f'name = "lr{lr}"', f'command = "{" ".join(argv)}"', f"epochs = {args.epochs}",
                  'backend = "none"', ""]
    path.write_text("\n".join(lines))


def run_row(row: str, size: str, rep: int, node: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One run of the four trials; its makespan, trials, CPU and memory."""
    work = Path(tempfile.mkdtemp(prefix=f"{row}-", dir=node["ckpt_root"]))
    (work / "reports").mkdir()
    shm = Path(tempfile.mkdtemp(prefix="hpcstagger-sweep-", dir="/dev/shm"))
    log = node["root"] / f"{size}-{row}-{rep}.log"
    dropped = drop_dataset(node["data"])
    group = RunGroup(f"hpcstagger-sweep-{os.getpid()}-{size}-{row}-{rep}", node["mem_bytes"], node["blkio"])
    sampler = MemorySampler(group, shm)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), HPCSTAGGER_SHM_ROOT=str(shm))
    cluster = None
    try:
        if row == "slurm":  # a fresh test cluster whose slurmd, and so every job step, lives in the run's groups
            cluster = LocalSlurm().start()
            for path in group.paths:
                with open(f"{path}/cgroup.procs", "w") as f:
                    f.write(str(cluster.procs[f"slurmd-{cluster.node}"].pid))
            env.update(cluster.env, PYTHONPATH=str(HERE.parent), HPCSTAGGER_SHM_ROOT=str(shm),
                       HPCSTAGGER_NO_HISTORY="1")
        with open(log, "wb") as out:
            if row in ("plain", "dcp"):
                argvs = [trial_args(row, lr, work / "ckpt" / f"lr{lr}", work / "reports" / f"lr{lr}.json", args)
                         + ["--data", str(node["data"])] for lr in LRS]
            else:
                spec = work / "spec.toml"
                write_spec(spec, row, node["data"], work, shm, node["cache_bytes"], node["scenarios"][row], args)
                argvs = [[sys.executable, "-m", "hpcstagger", "slurm", "submit", str(spec), "--wait", "--timeout",
                          str(args.timeout)] if row == "slurm" else
                         # no --cold-cache: the dataset's pages were dropped above, for every row alike, and the
                         # cache's root is new; inside the launch the drop would count in this row's makespan alone
                         [sys.executable, "-m", "hpcstagger", "launch", str(spec), "--no-history"]]
            sampler.start()
            t0 = time.time()
            procs = [subprocess.Popen(a, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                      preexec_fn=group.join) for a in argvs]
            codes = [p.wait(timeout=args.timeout) for p in procs]
            t1 = time.time()
        sampler.stop.set()
        sampler.join()
        stats = group.stats()
    finally:
        sampler.stop.set()
        if cluster is not None:
            cluster.stop()
        group.close()
        shutil.rmtree(shm, ignore_errors=True)
    trials = {}
    for lr in LRS:
        path = work / "reports" / f"lr{lr}.json"
        if path.exists():
            r = json.loads(path.read_text())
            trials[f"lr{lr}"] = {"start": r["start"] - t0, "imported": r["imported"] - t0, "loop": r["loop"] - t0,
                                 "end": r["end"] - t0,
                                 "steps": r["steps"],
                                 "loss": r["loss"], "cpu_s": r["cpu_s"]}
            if "t0" in r:  # hpcstagger rows: when init returned, and its steps' seconds
                trials[f"lr{lr}"].update(t0=r["t0"] - t0, import_s=r.get("import_s"), init_timings=r["init_timings"])
    stamp = work / "batch-start"
    batch_start = float(stamp.read_text()) - t0 if stamp.exists() else None
    shutil.rmtree(work, ignore_errors=True)
    ok = all(c == 0 for c in codes) and len(trials) == len(LRS)
    sized = [line.split("auto: ", 1)[1] for line in log.read_text(errors="replace").splitlines()
             if "[cache] capacity auto: " in line]
    return {"row": row, "size": size, "rep": rep, "ok": ok, "exit": codes, "makespan": t1 - t0, "trials": trials,
            "cache_sized": sized[0] if sized else None, "sampled_peak_bytes": sampler.peak,
            "trials_end": max((t["end"] for t in trials.values()), default=None), "batch_start": batch_start,
            "anon_shm_peak_bytes": sampler.anon_peak, "dropped_files": dropped,
            "log": str(log), **stats}


SHARED_ROWS = ("shared", "hpcstagger", "slurm")  # the rows whose spec shares one loader (and is calibrated so)


def calibrate(node: dict[str, Any], args: argparse.Namespace, row: str) -> dict[str, Any]:
    """``hpcstagger calibrate --spec`` of ``row``'s spec (``plan``: each trial its own loader;
    ``hpcstagger``: one shared loader), once per size, inside the node's limits."""
    work = Path(tempfile.mkdtemp(prefix="calibrate-", dir=node["ckpt_root"]))
    (work / "reports").mkdir()
    shm = Path(tempfile.mkdtemp(prefix="hpcstagger-sweep-", dir="/dev/shm"))
    tag = f"{node['size']}-{'shared' if row in SHARED_ROWS else 'own'}"
    spec, scenario = work / "spec.toml", node["root"] / f"{tag}-scenario.toml"
    write_spec(spec, row, node["data"], work, shm, node["cache_bytes"], scenario, args)
    drop_dataset(node["data"])
    group = RunGroup(f"hpcstagger-sweep-{os.getpid()}-{tag}-calibrate", node["mem_bytes"], node["blkio"])
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), HPCSTAGGER_SHM_ROOT=str(shm))
    t0 = time.monotonic()
    try:
        with open(node["root"] / f"{tag}-calibrate.log", "wb") as out:
            rc = subprocess.run([sys.executable, "-m", "hpcstagger", "calibrate", "--spec", str(spec), "-o",
                                 str(scenario), "--budget", str(args.budget)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=str(work), preexec_fn=group.join, timeout=600).returncode
    finally:
        group.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if rc != 0:
        raise SystemExit(f"calibration failed (exit {rc}): see {node['root'] / (tag + '-calibrate.log')}")
    text = scenario.read_text()
    said = [line for line in (node["root"] / f"{tag}-calibrate.log").read_text(errors="replace").splitlines()
            if 'capacity "auto"' in line]
    return {"seconds": time.monotonic() - t0, "scenario": text, "path": str(scenario), "cache": said}


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: the median makespan, CPU and peaks over its runs, and its gain against plain."""
    out: dict[str, dict[str, Any]] = {}
    for row in ROWS:
        every = [r for r in runs if r["row"] == row]
        mine = [r for r in every if r["ok"]]
        if not every:
            continue
        out[row] = {"runs": len(mine), "failed": len(every) - len(mine),
                    "oom_kills": sum(r["oom_kills"] for r in every),
                    "cgroup_peak_bytes": max(r["cgroup_peak_bytes"] for r in every),
                    "sampled_peak_bytes": max(r["sampled_peak_bytes"] for r in every),
                    "anon_shm_peak_bytes": max(r.get("anon_shm_peak_bytes", 0) for r in every)}
        if mine:
            out[row].update(makespan=statistics.median(r["makespan"] for r in mine),
                            makespans=[round(r["makespan"], 2) for r in mine],
                            cpu_s=statistics.median(r["cpu_s"] for r in mine))
    if "makespan" in out.get("plain", {}):
        for row in out:
            if "makespan" in out[row]:
                out[row]["vs_plain"] = out[row]["makespan"] / out["plain"]["makespan"] - 1
    if "makespan" in out.get("slurm", {}) and "makespan" in out.get("hpcstagger", {}):
        ends = {row: statistics.median(r["trials_end"] for r in runs if r["row"] == row and r["ok"])
                for row in ("slurm", "hpcstagger")}
        out["slurm"].update(vs_launch=out["slurm"]["makespan"] / out["hpcstagger"]["makespan"] - 1,
                            trials_end_vs_launch=ends["slurm"] / ends["hpcstagger"] - 1)
        own = [r["makespan"] - r["batch_start"] for r in runs
               if r["row"] == "slurm" and r["ok"] and r.get("batch_start") is not None]
        if own:  # the job's own time, from its batch script's first line
            out["slurm"].update(batch_start=statistics.median(r["batch_start"] for r in runs
                                                              if r["row"] == "slurm" and r.get("batch_start")),
                                job_makespan=statistics.median(own),
                                job_vs_launch=statistics.median(own) / out["hpcstagger"]["makespan"] - 1)
    return out


def report(results: dict[str, Any]) -> None:
    """One table per size: each row's median makespan, CPU, peaks, failed runs and OOM kills."""
    args = results["args"]
    for size, entry in results["sizes"].items():
        entry["summary"] = summarise(entry["runs"])
        print(f"\n{size}: {entry['files']} files, {entry['dataset_mb']:.0f} MB, limit {args['mem_mb']} MiB, "
              f"{args['mbps']:g} MB/s, trials on {args.get('device', 'cpu')}, /dev/shm cache {_cache_said(entry)}\n"
              "| row | makespan | vs plain | CPU s | peak (cgroup) | peak (anon + shm) | runs failed | OOM kills |\n"
              "|---|---|---|---|---|---|---|---|")
        for row, s in entry["summary"].items():
            span = (f"{s['makespan']:.1f} s | {100 * s.get('vs_plain', 0):+.1f}% | {s['cpu_s']:.0f}"
                    if "makespan" in s else "every run failed | | ")
            print(f"| {row} | {span} | {s['cgroup_peak_bytes'] / 2**20:.0f} MiB | "
                  f"{s['anon_shm_peak_bytes'] / 2**20:.0f} MiB | {s['failed']} of {s['failed'] + s['runs']} | "
                  f"{s['oom_kills']} |")
        sl = entry["summary"].get("slurm", {})
        if "vs_launch" in sl:
            print(f"\nslurm (sbatch) against hpcstagger (launch): makespan {100 * sl['vs_launch']:+.1f}%, the last "
                  f"trial's end {100 * sl['trials_end_vs_launch']:+.1f}%")
            if "job_vs_launch" in sl:
                print(f"from the batch script's start ({sl['batch_start']:.2f} s after the submission, median): "
                      f"{sl['job_makespan']:.1f} s, {100 * sl['job_vs_launch']:+.1f}% against the launch")


def _cache_said(entry: dict[str, Any]) -> str:
    """The cache's size: the one given, or what "auto" became in the runs (each distinct line once)."""
    if entry["cache_mb"] != "auto":
        return f"{float(entry['cache_mb']):.0f} MB"
    said = sorted({r["cache_sized"] for r in entry["runs"] if r.get("cache_sized")})
    return '"auto": ' + (" | ".join(said) if said else "not run")


def plot(results: dict[str, Any], path: str) -> None:
    """Bars of each row's median makespan per size, plain PyTorch first, with each run as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        entry = results["sizes"][size]
        rows = [r for r in ROWS if "makespan" in entry.get("summary", {}).get(r, {})]
        med = [entry["summary"][r]["makespan"] for r in rows]
        ax.bar(range(len(rows)), med, color=["#999999" if r in ("plain", "dcp") else "#2b7bba" for r in rows])
        for i, r in enumerate(rows):
            ax.plot([i] * len(entry["summary"][r]["makespans"]), entry["summary"][r]["makespans"], "k.", ms=4)
            ax.text(i, med[i], f"{100 * entry['summary'][r].get('vs_plain', 0):+.0f}%", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(range(len(rows)), ["+" + r if r in ("cache", "plan", "shared") else r for r in rows],
                      rotation=20, fontsize=8)
        ax.set_ylabel("makespan of 4 trials (s)")
        ax.set_title(f"{size}: {entry['dataset_mb']:.0f} MB of JPEGs, limit {results['args']['mem_mb']} MiB, "
                     f"{results['args']['mbps']:g} MB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="fits,nofit", help="fits, nofit or both (comma-separated)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"rows to run, of {', '.join(ROWS)} (default: all but slurm)")
    p.add_argument("--repeat", type=int, default=3, help="runs per row (medians); rows interleave")
    p.add_argument("--mem-mb", type=int, default=1536, help="the node's RAM: the memory cgroup's limit, MB")
    p.add_argument("--mbps", type=float, default=20.0, help="the file system's read bandwidth, MB/s")
    p.add_argument("--fits-mb", type=float, default=150.0, help="dataset size that fits the page cache, MB")
    p.add_argument("--nofit-mb", type=float, default=900.0, help="dataset size about twice the page cache's room")
    p.add_argument("--cache-mb", type=float, default=0.0,
                   help='the /dev/shm cache\'s capacity, MB (default: "auto", sized by the launch to what the '
                        "limit leaves beside the jobs' memory measured in calibration)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--device", default="cpu",
                   help="where the trials train: cpu (default) or cuda:N, the four trials sharing that GPU, "
                        "each its own process")
    p.add_argument("--budget", type=float, default=60.0, help="calibration budget, seconds")
    p.add_argument("--timeout", type=float, default=1800.0, help="a run's limit, seconds")
    p.add_argument("--quick", action="store_true", help="a small check of the harness: 20 and 60 MB, one run each")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, scenarios)")
    p.add_argument("--out", default=str(HERE / "out" / "bench_sweep_e2e.json"))
    p.add_argument("--plot", help="also draw the makespans to this PNG")
    p.add_argument("--replot", action="store_true",
                   help="only print the tables (and draw --plot) from the results in --out, and exit")
    args = p.parse_args()
    if args.replot:  # the tables (and --plot) again from --out's results
        with open(args.out) as f:
            done = json.load(f)
        report(done)
        if args.plot:
            plot(done, args.plot)
        return 0
    if args.quick:
        args.fits_mb, args.nofit_mb, args.repeat, args.mem_mb = 20.0, 60.0, 1, max(args.mem_mb, 1536)
    if os.geteuid() != 0:
        raise SystemExit("bench_sweep_e2e needs root: a loop device, mount, and blkio, memory and cpuacct cgroups")
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS] + [s for s in args.sizes.split(",") if s not in ("fits", "nofit")]
    if unknown:
        raise SystemExit(f"unknown row or size {', '.join(unknown)}: rows {', '.join(ROWS)}; sizes fits, nofit")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "sizes": {}}
    root = Path(tempfile.mkdtemp(prefix="bench-sweep-e2e-"))
    try:
        cache_bytecode()  # hpcstagger compiled once, as installed, not in every trial
        for size in args.sizes.split(","):
            mb = args.fits_mb if size == "fits" else args.nofit_mb
            src = root / f"{size}-src" / "images"
            files = make_images(src, mb)
            print(f"[bench_sweep_e2e] {size}: {files} JPEG files, {mb:.0f} MB", file=sys.stderr, flush=True)
            fsdir = root / f"{size}-fs"
            fsdir.mkdir()
            with real_fs(src, args.mbps * 1e6, fsdir) as (data, blkio):
                shutil.rmtree(src.parent)
                node = {"size": size, "root": root, "data": data, "blkio": blkio, "mem_bytes": args.mem_mb << 20,
                        "cache_bytes": int(args.cache_mb * 1e6) if args.cache_mb else None, "ckpt_root": data.parent}
                entry: dict[str, Any] = {"files": files, "dataset_mb": mb, "cache_mb": args.cache_mb or "auto",
                                         "runs": []}
                entry["calibration"] = {}
                for first, group in (("plan", ("cache", "plan")), ("hpcstagger", SHARED_ROWS)):
                    if any(r in rows for r in group):  # one calibration per loader layout the rows use
                        entry["calibration"][first] = calibrate(node, args, first)
                node["scenarios"] = {row: Path(entry["calibration"]["hpcstagger" if row in SHARED_ROWS else "plan"]
                                               ["path"]) for row in rows if row not in ("plain", "dcp")}
                order = list(rows)
                for rep in range(args.repeat):
                    random.Random(rep).shuffle(order)
                    for row in order:
                        res = run_row(row, size, rep, node, args)
                        entry["runs"].append(res)
                        print(f"[bench_sweep_e2e] {size} {row} #{rep}: {res['makespan']:.1f} s "
                              f"{'ok' if res['ok'] else 'FAILED ' + str(res['exit'])}, cpu {res['cpu_s']:.0f} s, "
                              f"peak {res['cgroup_peak_bytes'] / 2**20:.0f} MiB (anon + shm "
                              f"{res['anon_shm_peak_bytes'] / 2**20:.0f} MiB), oom {res['oom_kills']}",
                              file=sys.stderr, flush=True)
                        entry["summary"] = summarise(entry["runs"])
                        results["sizes"][size] = entry
                        os.makedirs(os.path.dirname(args.out), exist_ok=True)
                        with open(args.out, "w") as f:
                            json.dump(results, f, indent=1)
    finally:
        if args.keep:
            print(f"[bench_sweep_e2e] kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    report(results)
    if args.plot and results["sizes"]:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
