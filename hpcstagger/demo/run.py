"""The driver behind ``hpcstagger demo``.

0. Look at how busy the node is (other processes' CPU use, the load average against the cores)
   and warn, with the figures, when other work would slow the measured jobs.
1. Generate a synthetic image-like dataset (HDF5) unless one is already there.
2. Serve it through a ThrottledSource: a slow shared repository whose aggregate bandwidth
   degrades when two jobs read at once.
3. Calibrate the scenario from the jobs' own commands (``hpcstagger calibrate --spec``: each job
   alone, its real loop measured through ``session.loader``; the source at 1 and 2 readers; the
   cache's hit bandwidth) and plan the stagger with the performance model.
4. Run the two co-located jobs (two different small models, one rank each, under MPMD mpiexec) at
   the planned stagger, simultaneously and sequentially, each run with a cold cache and
   asynchronous checkpoints, and compare predicted with measured makespans.
5. Print a table, write ``demo.json`` and a PNG plot; both say when the node was busy and, when the
   plan is a simultaneous start, why.
"""

from __future__ import annotations

import logging
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from hpcstagger import _io, config, nodeload
from hpcstagger.stagger.delays import simultaneous_reason
from hpcstagger.errors import ConfigError, CacheError
from hpcstagger.demo.report import figure, format_table, notes, plot
from hpcstagger.cache import ShmCache
from hpcstagger.model import Scenario, optimal_plan, predict
from hpcstagger.spec.jobspec import Spec
from hpcstagger.spec.records import read_status

__all__ = ["DemoConfig", "DemoSetup", "check_node", "prepare", "run_demo", "format_table", "notes", "figure",
           "plot"]

log = logging.getLogger(__name__)

JOB_MODELS = {"convnet": "convnet", "mlp": "mlp"}

# glibc returns freed memory at the top of the heap to the kernel and serves allocations above 128 KB
# with mmap, so PyTorch's per-step activation buffers can be page-faulted afresh on every step: the
# convnet trained at 0.42 ms per sample that way and at 0.28 ms with these fixed thresholds (and
# which of the two a process got depended on its heap layout). Fixed thresholds make it steady.
_MALLOC_ENV = 'MALLOC_MMAP_THRESHOLD_ = "67108864", MALLOC_TRIM_THRESHOLD_ = "268435456"'



@dataclass(frozen=True)
class DemoConfig:
    """The demo's knobs; the defaults finish in 1 to 3 minutes on 2 cores (``cli.demo.DURATION``)."""

    workdir: str = "hpcstagger-demo"
    samples: int = 6000
    shape: tuple[int, int, int] = (3, 64, 64)
    bandwidth: tuple[float, ...] = (2.0e7, 8.0e6)   # bytes/s with 1 and 2 concurrent readers
    cache_fraction: float = 1.0                     # cache capacity as a fraction of the dataset
    epochs: Mapping[str, int] = field(default_factory=lambda: {"convnet": 3, "mlp": 3})
    checkpoint_every: int = 0                       # steps between asynchronous checkpoints; 0: twice per epoch
    calibrate_budget: float = 20.0
    modes: tuple[str, ...] = ("plan", "simultaneous", "sequential")
    sweep: tuple[float, ...] = ()                   # extra fixed delays of the later job to measure
    run_timeout: float = 600.0
    batch: int = 32
    workers: int = 1                                # DataLoader worker processes per job
    prefetch: int = 2                               # batches each worker keeps in flight (prefetch_factor)


def _progress(desc: str, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, leave=False)


def _ensure_dataset(cfg: DemoConfig, path: Path) -> int:
    """Reuse a dataset of the right shape, or generate it; return the bytes per sample."""
    import h5py

    from hpcstagger.demo.data import make_dataset

    row = 1 + cfg.shape[0] * cfg.shape[1] * cfg.shape[2]
    if path.exists():
        try:
            with h5py.File(path, "r") as f:
                if f["samples"].shape == (cfg.samples, row):
                    return row
        except (OSError, KeyError):
            pass
    print(f"demo: generating {cfg.samples} samples of {row} bytes ({cfg.samples * row / 1e6:.0f} MB) in {path}",
          file=sys.stderr)
    with _progress("dataset", cfg.samples) as bar:
        make_dataset(str(path), cfg.samples, cfg.shape, progress=bar.update)
    return row


def _write_spec(cfg: DemoConfig, work: Path, data: Path, scenario: Path, capacity: int) -> Path:
    loader = f"--workers {cfg.workers} --prefetch {cfg.prefetch}"
    jobs = "".join(textwrap.dedent(f"""
        [[job]]
        name = "{name}"
        command = "python -m hpcstagger.demo.job --model {model} --batch {cfg.batch} {loader}"
        epochs = {cfg.epochs[name]}
        env = {{ HPCSTAGGER_DEMO_SHAPE = "{','.join(map(str, cfg.shape))}", {_MALLOC_ENV} }}
        """) for name, model in JOB_MODELS.items())
    text = textwrap.dedent(f"""\
        # Written by `hpcstagger demo`: two co-located jobs on an emulated slow shared source.
        [run]
        name = "hpcstagger-demo"
        workdir = "."
        timeout = {cfg.run_timeout}
        [dataset]
        path = "{data.name}"
        name = "samples"
        throttle = [{", ".join(f"{b:.6g}" for b in cfg.bandwidth)}]
        [cache]
        capacity = {capacity}
        [checkpoint]
        directory = "checkpoints"
        every = {cfg.checkpoint_every or max(1, -(-cfg.samples // cfg.batch) // 2)}
        keep = 2
        [plan]
        mode = "plan"
        scenario = "{scenario.name}"
        """) + jobs
    path = work / "spec.toml"
    _io.atomic_write(path, text.encode(), durable=False)
    return path


def _calibrate(cfg: DemoConfig, spec: Any, scenario_path: Path) -> Any:
    """``hpcstagger calibrate --spec``: the scenario measured from the two jobs' own commands."""
    from hpcstagger.measure.spec_calibration import calibrate_spec

    return calibrate_spec(spec, budget=cfg.calibrate_budget, out=str(scenario_path))


def _reset_shared_state() -> None:
    """Every run starts with a cold cache: remove the run's cache (and idle throttle state)."""
    try:
        ShmCache("hpcstagger-demo", None).destroy(force=True)
    except CacheError:
        pass


@dataclass(frozen=True)
class DemoSetup:
    """What :func:`prepare` made: the work directory, the spec of the two jobs, the calibrated
    scenario, its plan and the calibration's measurements."""

    work: Path
    spec: Any
    scenario: Any
    plan: Any
    calibration: Any
    reason: str | None = None  # why the plan is a simultaneous start (None when some job waits)


def check_node(window_s: float = 1.0) -> dict[str, Any]:
    """How busy the node is before the demo measures anything (:func:`hpcstagger.nodeload.sample`
    over ``window_s`` seconds), as demo.json records it: the usable ``cores``, other processes' CPU
    use (``others_cores``), the 1-minute load average (``load1``), ``busy``, and the ``warning``
    line with the figures (None on a quiet node). It prints the figures, or the warning. Never raises."""
    load = nodeload.sample(window_s)
    warning = nodeload.busy_warning(load, "the demo")
    if warning:
        print(f"demo: warning: {warning}", file=sys.stderr, flush=True)
    else:
        others = "-" if load.others_cores is None else f"{load.others_cores:.2f}"
        load1 = "-" if load.load1 is None else f"{load.load1:.2f}"
        print(f"demo: the node is quiet (other processes used {others} of {load.cores} usable cores over "
              f"{load.window_s:.1f} s; load average {load1})", file=sys.stderr, flush=True)
    return {"cores": load.cores, "others_cores": load.others_cores, "load1": load.load1,
            "window_s": load.window_s, "busy": load.busy, "warning": warning}


def prepare(cfg: DemoConfig) -> DemoSetup:
    """Steps 1-3 of the demo: the dataset (reused when it has the right shape), the calibrated
    scenario, the plan, and the job spec (``<workdir>/spec.toml``) that runs the two jobs on them."""
    work = Path(cfg.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.h5"
    row = _ensure_dataset(cfg, data)
    capacity = int(cfg.cache_fraction * cfg.samples * row)
    scenario_path = work / "scenario.toml"
    spec = Spec.from_toml(_write_spec(cfg, work, data, scenario_path, capacity))
    print("demo: calibrating from the jobs' own commands (each job alone, its loop measured; the source at "
          "1 and 2 readers; cache hits)", file=sys.stderr)
    calibration = _calibrate(cfg, spec, scenario_path)
    scenario = Scenario.from_toml(scenario_path)
    min_gain = float(config.get("plan_min_gain"))
    plan = optimal_plan(scenario, max_delay=spec.plan.max_delay, min_gain=min_gain, jitter=spec.plan.jitter)
    reason = simultaneous_reason(plan.delays, {"simultaneous": plan.simultaneous}, plan.to_dict()["curve"],
                                 min_gain=min_gain, max_delay=spec.plan.max_delay, jitter=plan.jitter,
                                 simulated=plan.simulated)
    print(f"demo: plan {', '.join(f'{n} +{d:.1f}s' for n, d in plan.delays.items())}: predicted makespan "
          f"{plan.makespan:.1f} s (simultaneous {plan.simultaneous:.1f} s, sequential {plan.sequential:.1f} s)"
          + (f"; {reason}" if reason else ""), file=sys.stderr)
    return DemoSetup(work=work, spec=spec, scenario=scenario, plan=plan, calibration=calibration, reason=reason)


def _plan_reason(result: Any, spec: Any) -> str | None:
    """Why the coordinator's plan for a run started every job at once (its leaders' plan record)."""
    for job in spec.jobs:
        record = read_status(result.run_dir, job.name) or {}
        reason = (record.get("plan") or {}).get("simultaneous_reason")
        if reason:
            return str(reason)
    return None


def _run_one(spec: Any, scenario: Any, plan: Any, runs: list[dict[str, Any]], mode: str,
             delays: dict[str, float] | None, label: str) -> dict[str, Any]:
    """Launch one run of the demo's jobs with a cold cache; its record for demo.json."""
    from hpcstagger.colocated.launch import launch

    _reset_shared_state()
    result = launch(spec, mode=mode, delays=delays, run_name=f"{len(runs) + 1:02d}-{label.replace(' ', '-')}")
    if not result.ok:
        problems = "; ".join(result.failures()) or f"mpiexec exited with {result.returncode}"
        raise ConfigError(f"demo run '{label}' failed: {problems} (see {result.run_dir})")
    # The coordinator predicts each run from the calibrated scenario and the cache as it finds it;
    # sequential runs launch one job at a time, so theirs comes from the planned run's scenario.
    predicted = result.predicted.get(mode)
    if mode == "sequential":
        planned = next((r for r in runs if r["mode"] == "plan"), None)
        predicted = planned["predicted_all"].get("sequential") if planned else plan.sequential
    if predicted is None:
        predicted = predict(scenario, delays).makespan if delays else plan.makespan
    measured = float(result.makespan or 0.0)
    record = {"mode": mode, "label": label, "delays": result.delays, "predicted": predicted,
              "predicted_all": result.predicted, "calibrations": result.calibrations, "curve": result.curve,
              "measured": measured, "error": (predicted - measured) / measured if measured else None,
              "jobs": {n: {"start": j.start, "finish": j.finish, "metrics": j.metrics}
                       for n, j in result.jobs.items()},
              "overhead": result.overhead, "run_dir": result.run_dir}
    if mode == "plan":
        record["simultaneous_reason"] = _plan_reason(result, spec)
    return record


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the whole demo; return its results (also written to ``<workdir>/demo.json``)."""
    started = time.monotonic()
    node_load = check_node()
    setup = prepare(cfg)
    work, spec, scenario, plan = setup.work, setup.spec, setup.scenario, setup.plan
    runs: list[dict[str, Any]] = []
    # the job the sweep delays: the plan's later one, else the second (the curve's positive side)
    later = max(plan.delays, key=lambda n: plan.delays[n]) if any(plan.delays.values()) else spec.jobs[-1].name
    todo: list[tuple[str, dict[str, float] | None]] = [(m, None) for m in cfg.modes]
    todo += [("fixed", {later: float(d)}) for d in cfg.sweep]
    for mode, delays in todo:
        label = mode if delays is None else f"stagger {delays[later]:.1f}s"
        print(f"demo: run {len(runs) + 1}/{len(todo)}: {label}", file=sys.stderr, flush=True)
        runs.append(_run_one(spec, scenario, plan, runs, mode, delays, label))
    _reset_shared_state()
    out = {"config": {k: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v)
                      for k, v in vars(cfg).items()},
           "node_load": node_load, "scenario": scenario.to_dict(), "calibration": setup.calibration.measurements,
           "plan": {**plan.to_dict(), "simultaneous_reason": setup.reason}, "runs": runs,
           "seconds": time.monotonic() - started}
    _io.atomic_write_json(work / "demo.json", out, durable=False)
    out["plot"] = str(plot(out, work / "demo.png"))
    return out

