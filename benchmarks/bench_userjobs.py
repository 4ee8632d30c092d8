"""The planner on jobs written as users write them: calibrate, sweep, compare.

Results: benchmarks/RESULTS.md, section Jobs as users write them.

For each configuration it writes a job spec whose jobs run ``benchmarks/userjobs/train.py`` (a
DataLoader with workers and batches, a DistributedSampler, DDP or Horovod, SGD, no timing code),
calibrates it the documented way (``hpcstagger calibrate --spec``, no step factories), then runs
``hpcstagger sweep`` (the plan, a simultaneous start and fixed staggers in both orders, each from
a cold cache) and records the plan's gap to the best measured stagger, every prediction error and,
with ``--repeat``, the run spread: how far one point's runs lay apart ((max - min) / median, the
median over the points), the noise that a gap has to beat.

Configurations vary workers (0, 2, 4), batch (16 to 128), DDP and Horovod with 1 and 2 ranks per
job, 2 and 3 jobs, a cache of 50% and 100% of the dataset, a source whose bandwidth falls with
concurrency and one whose bandwidth rises, and the emulated source against a real file system
(an ext4 image on a loop device whose reads a cgroup v1 blkio throttle limits; root only).

    python benchmarks/bench_userjobs.py [--only NAME,...] [--staggers 0,1,2,3,4,6,8] [--repeat N] [--list]
                                        [--perturb bandwidth=1.3,jobs=0.7] [--grid] [--again DIR]

``--grid`` runs the grid of shapes instead of the named configurations (see ``grid_configs``):
workers 0/2/4 x 2 or 3 jobs x a cache of 50 or 100% x the emulated source or the kernel-throttled
file system, 24 shapes; with ``--repeat 3`` about 4 hours on a 2-core machine.

``--perturb`` scales the calibrated scenario before the sweep plans from it: ``bandwidth`` every
level of the source's curve, ``jobs`` every job's CPU costs (time per sample, prep, handoff). The
measured staggers do not depend on the scenario; the plan and the closed loop start from a model
that is off by that much, as a calibration on a noisy node can be.

``--again DIR`` sweeps a configuration that ``--keep`` left (``bench-userjobs-*/NAME``) once more
on its calibration, its ext4 image mounted and throttled again: more runs a point or other
staggers without calibrating anew, to tell a gap that the runs' noise makes from one the
calibration makes.

Writes benchmarks/out/bench_userjobs.json and prints one row per configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from hpcstagger._io import drop_cached_pages

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "userjobs" / "train.py"
FALLS = [6.0e6, 3.0e6]            # the emulated source: 6 MB/s alone, 3 MB/s aggregate for 2+
FALLS3 = [6.0e6, 4.0e6, 3.0e6]
RISES = [2.0e6, 3.5e6, 5.0e6, 6.0e6]  # a source that needs reads in flight, then saturates


def _job(name: str, model: str, *, batch: int, workers: int, ranks: int = 1, epochs: int = 2,
         backend: str = "ddp") -> dict[str, Any]:
    return {"name": name, "ranks": ranks, "epochs": epochs, "backend": backend,
            "command": f"{sys.executable} {TRAIN} --model {model} --batch {batch} --workers {workers}"}


CONFIGS: dict[str, dict[str, Any]] = {
    "pair-w2-b64": {"jobs": [_job("cnn", "cnn", batch=64, workers=2), _job("mlp", "mlp", batch=64, workers=2)],
                    "cache": 1.0, "throttle": FALLS},
    "pair-half-cache": {"jobs": [_job("cnn", "cnn", batch=64, workers=2), _job("mlp", "mlp", batch=64, workers=2)],
                        "cache": 0.5, "throttle": FALLS},
    "pair-w4-b64": {"jobs": [_job("cnn", "cnn", batch=64, workers=4), _job("mlp", "mlp", batch=64, workers=4)],
                    "cache": 1.0, "throttle": FALLS},
    "pair-w0-b64": {"jobs": [_job("cnn", "cnn", batch=64, workers=0), _job("mlp", "mlp", batch=64, workers=0)],
                    "cache": 1.0, "throttle": FALLS},
    "w0-and-w4": {"jobs": [_job("cnn", "cnn", batch=32, workers=0), _job("mlp", "mlp", batch=128, workers=4)],
                  "cache": 1.0, "throttle": FALLS},
    "three-jobs": {"jobs": [_job("cnn", "cnn", batch=64, workers=2), _job("mlp", "mlp", batch=32, workers=2),
                            _job("wide", "wide", batch=16, workers=2, epochs=1)],
                   "cache": 1.0, "throttle": FALLS3},
    "rising-source": {"jobs": [_job("cnn", "cnn", batch=64, workers=2), _job("mlp", "mlp", batch=128, workers=4)],
                      "cache": 1.0, "throttle": RISES},
    "ddp-2-ranks": {"jobs": [_job("cnn", "cnn", batch=32, workers=2, ranks=2),
                             _job("mlp", "mlp", batch=64, workers=2)], "cache": 0.5, "throttle": FALLS},
    "horovod-2-ranks": {"jobs": [_job("cnn", "cnn", batch=32, workers=2, ranks=2, backend="horovod"),
                                 _job("mlp", "mlp", batch=16, workers=2)],
                        "cache": 1.0, "throttle": FALLS},
    "real-fs": {"jobs": [_job("cnn", "cnn", batch=64, workers=2), _job("mlp", "mlp", batch=64, workers=2)],
                "cache": 1.0, "throttle": None, "real_fs": 6.0e6},
}


def grid_configs() -> dict[str, dict[str, Any]]:
    """The shapes of ``--grid``: 0, 2 and 4 DataLoader workers per job; 2 jobs (cnn, mlp) and 3
    (cnn, mlp, and a slower CNN for one epoch); a cache of 50% and 100% of the dataset; the
    emulated source and an ext4 file system throttled by the kernel (root only). 24 shapes, named
    ``grid-w<workers>-j<jobs>-c<cache %>-<emu|fs>``."""
    out: dict[str, dict[str, Any]] = {}
    for workers in (0, 2, 4):
        for njobs in (2, 3):
            for cache in (0.5, 1.0):
                for fs in (False, True):
                    jobs = [_job("cnn", "cnn", batch=64, workers=workers),
                            _job("mlp", "mlp", batch=64 if njobs == 2 else 32, workers=workers)]
                    if njobs == 3:
                        jobs.append(_job("wide", "wide", batch=16, workers=workers, epochs=1))
                    name = f"grid-w{workers}-j{njobs}-c{int(cache * 100)}-{'fs' if fs else 'emu'}"
                    throttle = None if fs else (FALLS3 if njobs == 3 else FALLS)
                    out[name] = {"jobs": jobs, "cache": cache, "throttle": throttle,
                                 **({"real_fs": 6.0e6} if fs else {})}
    return out


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def write_spec(path: Path, name: str, cfg: dict[str, Any], data: Path, dataset_bytes: int) -> None:
    lines = ["[run]", f"name = {_toml(name)}", f"workdir = {_toml(str(path.parent / 'work'))}", "timeout = 600", "",
             "[dataset]", f"path = {_toml(str(data))}", 'name = "samples"']
    if cfg.get("throttle"):
        lines.append(f"throttle = {_toml(cfg['throttle'])}")
    lines += ["", "[cache]", f"name = {_toml(name)}", f"capacity = {int(cfg['cache'] * dataset_bytes * 1.02)}", "",
              "[plan]", 'mode = "plan"', 'scenario = "scenario.toml"', ""]
    for job in cfg["jobs"]:
        lines.append("[[job]]")
        lines += [f"{k} = {_toml(v)}" for k, v in job.items()]
        lines.append("")
    path.write_text("\n".join(lines))


def cache_bytecode() -> None:
    """Let this benchmark's processes read and write cached Python bytecode where Python keeps it,
    beside the sources, even where PYTHONDONTWRITEBYTECODE is set, and compile hpcstagger now, as a
    user's install does. Without it every job would compile hpcstagger's modules again as it starts
    (0.3 to 0.4 CPU-s a process on the 2-core VM), a cost plain PyTorch, whose packages come
    compiled, never pays. A PYTHONPYCACHEPREFIX is dropped as well: under one, Python ignores the
    bytecode installed beside torch and the standard library, and the first job to start compiles
    everything it imports (7 s of one calibrated job's start-up on the 2-core VM)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.pop("PYTHONPYCACHEPREFIX", None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE.parent / "hpcstagger")], check=True,
                   stdout=subprocess.DEVNULL, env=dict(os.environ))


def cgroup_joiner(cgroup: str) -> Callable[[], None]:
    """A ``preexec_fn`` that puts the child (and so its children) into ``cgroup``: only the command
    reads through the throttle, never this process, which real_fs's cleanup would kill with it."""
    def join() -> None:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return join


def _run(argv: list[str], log: Path, *, cgroup: str | None = None, timeout: float = 1800) -> int:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    pre = cgroup_joiner(cgroup) if cgroup else None
    with open(log, "ab") as out:
        out.write(("\n$ " + " ".join(argv) + "\n").encode())
        out.flush()
        # a session of its own: on a timeout or when this benchmark is stopped, the whole tree goes
        # (the command's mpiexec and ranks too), not the command alone, which would orphan its jobs
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent),
                                preexec_fn=pre, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``'s process group (it leads a session of its own), so that the command can
    stop its own processes; after it exits, or 10 s, SIGKILL whatever of the group is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def calibrate(spec: Path, work: Path, log: Path, budget: float, *, cgroup: str | None = None) -> int:
    """``hpcstagger calibrate --spec`` into ``work/scenario.toml``; its exit status."""
    return _run([sys.executable, "-m", "hpcstagger", "calibrate", "--spec", str(spec), "-o",
                 str(work / "scenario.toml"), "--budget", str(budget)], log, cgroup=cgroup)


@contextmanager
def private_shm(tag: str) -> Iterator[str]:
    """A shm root of the benchmark's own (``HPCSTAGGER_SHM_ROOT``), removed afterwards."""
    shm = tempfile.mkdtemp(prefix=f"{tag}-", dir="/dev/shm")
    os.environ["HPCSTAGGER_SHM_ROOT"] = shm
    try:
        yield shm
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@contextmanager
def workspace(tag: str, samples: int, keep: bool) -> Iterator[tuple[Path, Path]]:
    """A work directory with the dataset (``samples`` samples of 3 KiB) and a private shm root for
    the run (``HPCSTAGGER_SHM_ROOT``); yields ``(root, dataset)``. Both go afterwards, the work
    directory unless ``keep``."""
    from hpcstagger.demo.data import make_dataset

    root = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
    try:
        with private_shm(tag):
            cache_bytecode()
            data = root / "data.h5"
            make_dataset(str(data), samples, (3, 32, 32))
            yield root, data
    finally:
        if keep:
            print(f"[{tag}] kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def drop_dataset(path: Path) -> int:
    """Drop the page-cache pages of ``path``, a file or every file under a directory; how many files."""
    if path.is_file():
        drop_cached_pages(path)
        return 1
    n = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            drop_cached_pages(os.path.join(dirpath, name))
            n += 1
    return n


@contextmanager
def real_fs(data: Path, bps: float, work: Path) -> Iterator[tuple[Path, str]]:
    """The dataset (a file or a directory) copied onto an ext4 image on a loop device, its reads
    throttled to ``bps`` for the processes of a cgroup (v1 ``blkio``, or v2 ``io.max``); yields (the
    copy, that cgroup). The image has room for 3 more copies (checkpoints, logs)."""
    image, mnt = work / "fs.img", work / "mnt"
    mnt.mkdir()
    size = data.stat().st_size if data.is_file() else sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    size_mb = max(64, 4 * size // 2**20)
    subprocess.run(["truncate", "-s", f"{size_mb}M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    with throttled_mount(image, mnt, bps) as cg:
        if data.is_dir():
            shutil.copytree(data, mnt / data.name)
        else:
            shutil.copy(data, mnt / data.name)
        os.sync()
        # Only the dataset's pages go: a global drop_caches would also evict the Python and torch
        # libraries, and calibration would then measure the first job's start-up cold (its first
        # step faulting libtorch in from disk), which no later run repeats. Each run drops the
        # dataset's pages again at its start.
        drop_dataset(mnt / data.name)
        yield mnt / data.name, cg


@contextmanager
def throttled_mount(image: Path, mnt: Path, bps: float) -> Iterator[str]:
    """``image`` (ext4) mounted at ``mnt`` through a loop device whose reads a cgroup throttles to
    ``bps`` (v1 ``blkio``, or v2 ``io.max``; writes are not throttled); yields that cgroup. Unmounted,
    its loop device and cgroup removed, afterwards, once the cgroup's processes are killed."""
    dev = subprocess.run(["losetup", "--find", "--show", str(image)], check=True, capture_output=True,
                         text=True).stdout.strip()
    v2 = cgroup_v2()
    cg = f"/sys/fs/cgroup/{'' if v2 else 'blkio/'}hpcstagger-bench-{os.getpid()}"
    try:
        subprocess.run(["mount", dev, str(mnt)], check=True)
        rdev = os.stat(dev).st_rdev
        if v2:  # the io controller for the group, then its limit (cgroup v2 has one hierarchy)
            with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
                f.write("+io")
        os.makedirs(cg, exist_ok=True)
        with open(os.path.join(cg, "io.max" if v2 else "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{os.major(rdev)}:{os.minor(rdev)} {'rbps=' if v2 else ''}{int(bps)}")
        yield cg
    finally:
        kill_members(cg)  # a run cut short leaves its jobs reading from the mount
        subprocess.run(["umount", str(mnt)], check=False)
        subprocess.run(["losetup", "-d", dev], check=False)
        if os.path.isdir(cg):
            os.rmdir(cg)


def cgroup_v2() -> bool:
    """Whether this node mounts the unified cgroup hierarchy (v2) alone, with no v1 controllers."""
    return os.path.exists("/sys/fs/cgroup/cgroup.controllers") and not os.path.isdir("/sys/fs/cgroup/blkio")


def kill_members(cg: str) -> None:
    """SIGKILL every process left in the cgroup ``cg`` and wait (up to 10 s) until it is empty."""
    procs = os.path.join(cg, "cgroup.procs")
    deadline = time.monotonic() + 10
    while os.path.exists(procs) and time.monotonic() < deadline:
        with open(procs) as f:
            pids = [int(x) for x in f.read().split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def perturb(path: Path, factors: dict[str, float]) -> None:
    """Scale the scenario at ``path``: the source's curve by ``factors["bandwidth"]``, every job's
    CPU costs by ``factors["jobs"]`` (see ``--perturb``)."""
    from dataclasses import replace

    from hpcstagger.model import Scenario

    sc = Scenario.from_toml(path)
    b, j = factors.get("bandwidth", 1.0), factors.get("jobs", 1.0)
    sc = replace(sc, storage=replace(sc.storage, bandwidth=tuple(b * x for x in sc.storage.bandwidth)),
                 jobs=tuple(replace(job, sample_time=j * job.sample_time, prep_time=j * job.prep_time,
                                    read_cpu=j * job.read_cpu, handoff=j * job.handoff) for job in sc.jobs))
    note = f"perturbed for the benchmark: source bandwidth x{b:g}, job CPU costs x{j:g}"
    path.write_text(f"# {note}\n" + sc.to_toml())


def parse_perturb(text: str) -> dict[str, float]:
    """``bandwidth=1.3,jobs=0.7`` as factors; SystemExit naming the problem otherwise."""
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if key not in ("bandwidth", "jobs") or not factor > 0:
            raise SystemExit(f"--perturb: {part!r} is not bandwidth=F or jobs=F with a factor F > 0")
        out[key] = factor
    return out


def sweep_into(out: dict[str, Any], spec: Path, staggers: str, repeat: int, dest: Path, log: Path,
               cgroup: str | None) -> None:
    """``hpcstagger sweep`` of ``spec`` into ``dest`` (in ``cgroup``, if any); puts its time and its
    results, or why there are none, into ``out``."""
    t0 = time.monotonic()
    rc = _run([sys.executable, "-m", "hpcstagger", "sweep", str(spec), "--staggers", staggers, "--repeat",
               str(repeat), "--json", str(dest)], log, cgroup=cgroup)
    out["sweep_s"] = time.monotonic() - t0
    if rc != 0 or not dest.exists():
        out["error"] = f"sweep exited {rc}; see {log}"
    else:
        out["sweep"] = json.loads(dest.read_text())


def run_config(name: str, cfg: dict[str, Any], data: Path, work: Path, staggers: str, budget: float,
               repeat: int = 1, factors: dict[str, float] | None = None) -> dict[str, Any]:
    work.mkdir(parents=True)
    log = work / "log.txt"
    spec = work / "spec.toml"
    out: dict[str, Any] = {"name": name, "config": cfg, "log": str(log)}
    fs = real_fs(data, cfg["real_fs"], work) if cfg.get("real_fs") else None
    cg = None
    if fs is not None:
        data, cg = fs.__enter__()
    try:
        write_spec(spec, name, cfg, data, data.stat().st_size)
        t0 = time.monotonic()
        rc = calibrate(spec, work, log, budget, cgroup=cg)
        out["calibrate_s"] = time.monotonic() - t0
        if rc != 0:
            out["error"] = f"calibrate exited {rc}; see {log}"
            return out
        if factors:
            perturb(work / "scenario.toml", factors)
            out["perturb"] = factors
        out["scenario"] = (work / "scenario.toml").read_text()
        sweep_into(out, spec, staggers, repeat, work / "sweep.json", log, cg)
        return out
    finally:
        if fs is not None:
            fs.__exit__(None, None, None)


def resweep(kept: Path, staggers: str, repeat: int) -> dict[str, Any]:
    """Sweep again a configuration directory that ``--keep`` left (its spec, its calibrated scenario
    and, for the ext4 shapes, the file system's image, mounted and throttled again), without
    calibrating: more runs a point, or other staggers, on the same calibration, which tells the
    runs' noise from the calibration's. The sweep goes to ``kept/resweep.json``."""
    name = kept.name
    cfg = {**CONFIGS, **grid_configs()}.get(name)
    spec, image = kept / "spec.toml", kept / "fs.img"
    if not spec.exists() or not (kept / "scenario.toml").exists():
        raise SystemExit(f"{kept}: no spec.toml and scenario.toml; give a configuration's directory under "
                         "what --keep left (bench-userjobs-*/NAME)")
    if image.exists() and (cfg is None or not cfg.get("real_fs")):
        raise SystemExit(f"{kept}: an ext4 image, but {name!r} is no configuration of a real file system here")
    if image.exists() and os.geteuid() != 0:
        raise SystemExit("sweeping an ext4 shape again needs root (a loop device, a blkio cgroup, mount)")
    out: dict[str, Any] = {"name": f"{name} (again)", "config": cfg, "log": str(kept / "log.txt"),
                           "again": str(kept), "scenario": (kept / "scenario.toml").read_text()}
    with ExitStack() as stack:
        cg = stack.enter_context(throttled_mount(image, kept / "mnt", cfg["real_fs"])) if image.exists() else None
        if cg is not None:
            drop_dataset(kept / "mnt")
        sweep_into(out, spec, staggers, repeat, kept / "resweep.json", kept / "log.txt", cg)
    return out


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Plan gap and prediction errors, from the sweep's own summary (each point the median of its
    runs). The best counts the plan too, so the gap is never negative: plan / min(best, plan) - 1.
    ``errors`` lists every run's signed error; ``point_median_err`` and ``point_max_err`` compare
    each point's median prediction with its median run (with ``--repeat`` 2 or more)."""
    sw = res.get("sweep") or {}
    summary = sw.get("summary") or {}
    runs = [r for r in sw.get("runs", []) if r.get("measured")]
    errs = [r["predicted"] / r["measured"] - 1 for r in runs if r.get("predicted")]
    plan = summary.get("plan")
    candidates = [x for x in ((summary.get("best") or {}).get("measured"), plan) if x is not None]
    best = min(candidates) if candidates else None
    return {"runs": len(runs), "plan": plan, "best": best,
            "plan_gap": plan / best - 1 if plan and best else None,
            "errors": errs, "median_abs_err": summary.get("error_median"), "max_abs_err": summary.get("error_max"),
            "point_median_err": summary.get("point_error_median"), "point_max_err": summary.get("point_error_max"),
            "spread": summary.get("spread")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated configuration names")
    p.add_argument("--grid", action="store_true",
                   help="the grid of shapes instead (workers 0/2/4, 2 or 3 jobs, cache 50/100%%, emulated "
                        "source or kernel-throttled ext4); --only picks among them")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    p.add_argument("--staggers", default="0,1,2,3,4,6,8", help="fixed staggers, seconds, run in both orders")
    p.add_argument("--samples", type=int, default=3072, help="dataset samples of 3 KiB (default 3072, ~9.4 MB)")
    p.add_argument("--budget", type=float, default=60.0, help="calibration budget per spec, seconds")
    p.add_argument("--out", default=str(HERE / "out" / "bench_userjobs.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory (specs, scenarios, logs)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per point (sweep --repeat); points are then medians (default 1)")
    p.add_argument("--perturb", default="", help="scale the calibrated scenario before planning: "
                   "bandwidth=F (the source's curve), jobs=F (every job's CPU costs), comma-separated")
    p.add_argument("--again", metavar="DIR", action="append", default=[],
                   help="sweep again a configuration directory that --keep left (bench-userjobs-*/NAME), "
                        "on its calibration, with --staggers and --repeat; repeatable")
    args = p.parse_args()
    # SIGTERM (a kill, a batch system's time limit) unwinds like Ctrl-C: the file system is unmounted,
    # its loop device and cgroup removed, the work directory deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ignored = [f"--{k}" for k in ("perturb", "only", "grid", "samples", "budget", "keep", "list")
               if getattr(args, k) != p.get_default(k)]
    if args.again and ignored:
        raise SystemExit(f"--again sweeps a kept configuration as it was calibrated (its perturbation, dataset and "
                         f"budget included), so {', '.join(ignored)} would be ignored: leave them out, or run "
                         "without --again to calibrate anew")
    factors = parse_perturb(args.perturb)
    configs = grid_configs() if args.grid else CONFIGS
    if args.list:
        for name, cfg in configs.items():
            print(name, json.dumps(cfg))
        return 0
    names = args.only.split(",") if args.only else list(configs)
    unknown = [n for n in names if n not in configs]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {', '.join(unknown)}; --list{' --grid' if args.grid else ''} "
                         "names them")
    if any(configs[n].get("real_fs") for n in names) and os.geteuid() != 0:
        raise SystemExit("the real file-system shapes need root (a loop device, a blkio cgroup, mount); "
                         "run as root or pick the emulated ones with --only")
    results = []
    with ExitStack() as stack:
        if args.again:  # the kept directories hold the rest
            stack.enter_context(private_shm("bench-userjobs"))
            cache_bytecode()
        else:
            root, data = stack.enter_context(workspace("bench-userjobs", args.samples, args.keep))
        for name in args.again or names:
            print(f"[bench_userjobs] {name} ...", file=sys.stderr, flush=True)
            res = (resweep(Path(name).resolve(), args.staggers, args.repeat) if args.again else
                   run_config(name, configs[name], data, root / name, args.staggers, args.budget, args.repeat,
                              factors))
            res["summary"] = summarise(res)
            results.append(res)
            s = res["summary"]
            print(f"[bench_userjobs] {name}: {res.get('error') or ''} plan gap "
                  f"{s['plan_gap'] if s['plan_gap'] is None else round(100 * s['plan_gap'], 1)}%, errors median "
                  f"{s['median_abs_err'] and round(100 * s['median_abs_err'], 1)}% max "
                  f"{s['max_abs_err'] and round(100 * s['max_abs_err'], 1)}% (each run); against each point's "
                  f"median run: median {s['point_median_err'] and round(100 * s['point_median_err'], 1)}% max "
                  f"{s['point_max_err'] and round(100 * s['point_max_err'], 1)}%", file=sys.stderr, flush=True)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, f, indent=1)
    all_errs = [e for r in results for e in r["summary"]["errors"]]
    print("\n| configuration | plan | best stagger | plan gap | run spread | median error | max error "
          "| point median / max |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["summary"]
        if r.get("error"):
            print(f"| {r['name']} | {r['error']} | | | | | | |")
            continue
        spread = "-" if s.get("spread") is None else f"{100 * s['spread']:.1f}%"
        point = ("-" if s.get("point_max_err") is None
                 else f"{100 * s['point_median_err']:.1f}% / {100 * s['point_max_err']:.1f}%")
        print(f"| {r['name']} | {s['plan']:.2f} s | {s['best']:.2f} s | {100 * s['plan_gap']:+.1f}% | {spread} | "
              f"{100 * s['median_abs_err']:.1f}% | {100 * s['max_abs_err']:.1f}% | {point} |")
    if all_errs:
        med = statistics.median(abs(e) for e in all_errs)
        print(f"\nall runs: {len(all_errs)} predictions, median abs error {100 * med:.1f}%, "
              f"max {100 * max(abs(e) for e in all_errs):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
