"""``hpcstagger sweep``: check the planner on your own jobs against measured start staggers.

:func:`run_sweep` launches a spec (with :func:`~hpcstagger.colocated.launch.launch`) once with the
plan (mode plan; when the spec has a ``[plan] scenario``, or with ``history`` a learned plan),
once with a simultaneous start and once per fixed stagger, each from a cold cache
(``launch(cold_cache=True)``), all of it ``repeat`` times, and compares the measured makespans
with what the coordinator predicted for each run. Odd repetitions run in that order, even ones in
the reverse order (:func:`repetition_order`).

Staggers. A stagger ``s`` seconds is run in both orders: in spec order (job ``k`` of the spec,
counting from 0, is delayed by ``k * s``) and in reverse order (job ``k`` of ``N`` is delayed by
``(N - 1 - k) * s``). With 2 jobs that is job B delayed by ``s`` and job A delayed by ``s``. The
reverse order is written as a negative stagger (``-s``), which matches the planner's signed
stagger for 2 jobs. Stagger 0 is the simultaneous start, run once. Without ``staggers`` the sweep
takes :data:`DEFAULT_COUNT` of them from 0 up to the range where the plan's predicted curve is
within 10% of a simultaneous start (at least twice the planned stagger), or up to
:data:`DEFAULT_MAX_STAGGER` without a scenario, in round steps (:func:`default_staggers`).

Everything here but :func:`run_sweep` is pure and tested as plain functions.
"""

from __future__ import annotations

import logging
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from hpcstagger.errors import ConfigError, LaunchError, ModelError
from hpcstagger.spec import runenv
from hpcstagger.colocated import preflight
from hpcstagger.spec.jobspec import Spec
from hpcstagger.model import Scenario, predict
from hpcstagger.stagger.learning import observed_runs
from hpcstagger import _io
from hpcstagger.colocated.startcache import describe_start

__all__ = ["SweepRun", "DEFAULT_COUNT", "DEFAULT_MAX_STAGGER", "parse_staggers", "stagger_delays",
           "stagger_label", "default_staggers", "sweep_runs", "repetition_order", "predicted_curve", "summarize",
           "run_sweep"]

log = logging.getLogger(__name__)

DEFAULT_COUNT = 7            # staggers, 0 included, when none are given
DEFAULT_MAX_STAGGER = 10.0   # seconds: the largest default stagger when there is no scenario to plan from
_WITHIN = 1.10               # default range: staggers predicted within 10% of a simultaneous start


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its ``label``, launch ``mode``, signed ``stagger`` (None for the plan and
    sequential runs) and fixed ``delays`` (None unless mode is fixed)."""

    label: str
    mode: str
    stagger: float | None = None
    delays: dict[str, float] | None = None


def parse_staggers(text: str) -> tuple[float, ...]:
    """``"0,2,4,8"`` -> (0.0, 2.0, 4.0, 8.0): seconds, sorted, repeats removed.

    Raises ConfigError for an empty list, a value that is no number, or a negative or infinite one.
    """
    values = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            v = float(part.rstrip("s"))
        except ValueError:
            raise ConfigError(f"--staggers: cannot read {part!r}; write seconds separated by commas, "
                              f"e.g. 0,2,4,8") from None
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"--staggers: {part!r} is not a finite number of seconds >= 0")
        values.append(v)
    if not values:
        raise ConfigError(f"--staggers: no stagger in {text!r}; write seconds separated by commas, e.g. 0,2,4,8")
    return tuple(sorted(set(values)))


def stagger_delays(order: Sequence[str], stagger: float) -> dict[str, float]:
    """The delays of signed ``stagger``: ``s >= 0`` delays job ``k`` by ``k * s`` in ``order``;
    ``s < 0`` delays it by ``(N - 1 - k) * |s|`` (the reverse order)."""
    n = len(order)
    s = abs(float(stagger))
    return {name: float((k if stagger >= 0 else n - 1 - k) * s) for k, name in enumerate(order)}


def stagger_label(order: Sequence[str], stagger: float) -> str:
    """``"b +2s"`` (2 jobs: the later job and its delay), ``"+2s each, c first"`` (more jobs)."""
    s = abs(stagger)
    if stagger == 0:
        return "simultaneous"
    if len(order) == 2:
        return f"{order[1] if stagger > 0 else order[0]} +{s:g}s"
    return f"+{s:g}s each, {order[0] if stagger > 0 else order[-1]} first"


def _nice_step(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= ``x`` (> 0)."""
    e = 10.0 ** math.floor(math.log10(x))
    return next(m * e for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * e >= x * (1 - 1e-9))


def planned_stagger(order: Sequence[str], delays: Mapping[str, float]) -> float | None:
    """The signed stagger of a plan's delays: 2 jobs, B's delay minus A's; more jobs, the largest
    delay over N - 1, positive (None when the plan is not on the spec-order or reverse family)."""
    d = [float(delays.get(n, 0.0)) for n in order]
    if len(order) == 2:
        return d[1] - d[0]
    s = max(d) / (len(order) - 1) if len(order) > 1 else 0.0
    for sign in (1.0, -1.0):
        if all(abs(a - b) < 1e-6 * (1 + s) for a, b in zip(d, stagger_delays(order, sign * s).values(), strict=True)):
            return sign * s
    return None


def default_staggers(curve: Mapping[str, Any] | None, planned: Mapping[str, float] | None,
                     order: Sequence[str], *, count: int = DEFAULT_COUNT,
                     max_stagger: float | None = None) -> tuple[float, ...]:
    """``count`` staggers from 0 in round steps (see the module docstring).

    ``curve`` is the coordinator's predicted makespan-versus-stagger curve (``{"stagger": [...],
    "makespan": [...]}``; for more than 2 jobs its axis is the largest delay), ``planned`` the
    plan's delays, ``max_stagger`` an explicit upper end.
    """
    n = len(order)
    upper = max_stagger
    if upper is None and curve and len(curve.get("stagger") or ()) >= 3:
        xs, ys = list(curve["stagger"]), list(curve["makespan"])
        scale = 1.0 if n <= 2 else 1.0 / (n - 1)
        sim = ys[min(range(len(xs)), key=lambda i: abs(xs[i]))]
        within = max((abs(x) for x, y in zip(xs, ys, strict=True) if y <= _WITHIN * sim), default=0.0)
        p = abs(planned_stagger(order, planned) or 0.0) if planned else 0.0
        upper = min(max(within * scale, 2.0 * p), max(abs(x) for x in xs) * scale)
    if upper is None or not upper > 0:
        upper = DEFAULT_MAX_STAGGER
    step = _nice_step(upper / max(1, count - 1))
    return tuple(round(i * step, 6) for i in range(count))


def sweep_runs(order: Sequence[str], staggers: Sequence[float], *, plan: bool = True,
               sequential: bool = False) -> list[SweepRun]:
    """The runs of one repetition: the plan, steered (mode ``plan``) and open-loop (mode ``open``),
    when ``plan``; a simultaneous start, each stagger above 0 in spec order and in reverse order,
    and sequential runs (when ``sequential``)."""
    runs = [SweepRun("plan", "plan"), SweepRun("open", "open")] if plan else []
    runs.append(SweepRun("simultaneous", "simultaneous", 0.0))
    for s in sorted(set(float(x) for x in staggers)):
        if s > 0:
            runs += [SweepRun(stagger_label(order, x), "fixed", x, stagger_delays(order, x)) for x in (s, -s)]
    if sequential:
        runs.append(SweepRun("sequential", "sequential"))
    return runs


def predicted_curve(scenario: Mapping[str, Any] | None, order: Sequence[str], upper: float,
                    points: int = 41) -> dict[str, Any]:
    """The model's makespan at signed staggers from ``-upper`` to ``upper`` (``{"stagger",
    "makespan"}``); {} without a scenario, or when the model cannot answer (logged)."""
    if not scenario or not upper > 0:
        return {}

    try:
        sc = Scenario.from_dict(scenario)
        xs = [upper * (2 * i / (points - 1) - 1) for i in range(points)]
        ys = [predict(sc, stagger_delays(order, x), series=False).makespan for x in xs]
    except (ConfigError, ModelError) as exc:
        log.warning("no predicted curve for the sweep: %s", exc)
        return {}
    return {"stagger": xs, "makespan": ys}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per run label (in first-seen order) the measured and predicted makespans and their medians;
    the best measured stagger (simultaneous included), the plan's gap to it (``plan_vs_best``:
    plan / best - 1, on medians), the prediction errors (|predicted - measured| / measured:
    median and max), overall and per repetition, and the noise: each point's ``spread`` ((max -
    min) / median of its runs, with 2 or more) and their median, ``spread``. With 2 or more runs a
    point, ``point_error_median`` and ``point_error_max`` compare each point's median prediction
    with its median run: the model against the point as measured, with one run's noise left out."""
    points: dict[str, dict[str, Any]] = {}
    for r in runs:
        p = points.setdefault(r["label"], {"label": r["label"], "mode": r["mode"], "stagger": r.get("stagger"),
                                           "measured": [], "predicted": []})
        if r.get("measured") is not None:
            p["measured"].append(r["measured"])
        if r.get("predicted") is not None:
            p["predicted"].append(r["predicted"])
    for p in points.values():
        p["measured_median"] = _median(p["measured"])
        p["predicted_median"] = _median(p["predicted"])
        m = p["measured"]
        p["spread"] = (max(m) - min(m)) / p["measured_median"] if len(m) >= 2 and p["measured_median"] else None
    spreads = [p["spread"] for p in points.values() if p["spread"] is not None]
    out: dict[str, Any] = {"points": list(points.values()), "spread": _median(spreads),
                           "spread_max": max(spreads) if spreads else None}
    out.update(_best_and_errors(list(points.values()), runs))
    by_point = [abs(p["predicted_median"] / p["measured_median"] - 1) for p in points.values()
                if len(p["measured"]) >= 2 and p["predicted_median"] and p["measured_median"]]
    out.update(point_error_median=_median(by_point), point_error_max=max(by_point) if by_point else None)
    reps = sorted({r["repetition"] for r in runs})
    out["per_repetition"] = [{"repetition": k, **_repetition(
        [r for r in runs if r["repetition"] == k])} for k in reps]
    return out


def repetition_order(runs: Sequence[SweepRun], repetition: int) -> list[SweepRun]:
    """The order of repetition ``repetition`` (from 1): ``runs`` as given in odd repetitions,
    reversed in even ones, so that with two or more repetitions no mode always runs first or
    always after the same run. A run's place in the sequence moves its makespan: with the plan
    always first, steered runs lost to open-loop runs by 13 to 17% on a 2-core machine, and won by
    2% with the open run first (benchmarks/RESULTS.md, section Closed loop)."""
    return list(runs) if repetition % 2 else list(runs)[::-1]


def _best_and_errors(points: list[dict[str, Any]], runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    staggered = [p for p in points if p["mode"] in ("simultaneous", "fixed") and p["measured_median"] is not None]
    best = min(staggered, key=lambda p: p["measured_median"], default=None)
    plan = next((p for p in points if p["mode"] == "plan" and p["measured_median"] is not None), None)
    open_ = next((p for p in points if p["mode"] == "open" and p["measured_median"] is not None), None)
    errors = [abs(r["error"]) for r in runs if r.get("error") is not None]
    return {"best": None if best is None else {"label": best["label"], "measured": best["measured_median"]},
            "plan": None if plan is None else plan["measured_median"],
            "plan_vs_best": (plan["measured_median"] / best["measured_median"] - 1) if plan and best else None,
            "open": None if open_ is None else open_["measured_median"],
            "open_vs_best": (open_["measured_median"] / best["measured_median"] - 1) if open_ and best else None,
            "error_median": _median(errors), "error_max": max(errors) if errors else None}


def _repetition(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    by = {r["label"]: r for r in runs}
    points = [{"label": r["label"], "mode": r["mode"], "measured_median": r.get("measured")} for r in runs]
    out = _best_and_errors(points, runs)
    overheads = [r["overhead"] for r in runs if r.get("overhead") is not None]
    out.update(simultaneous=(by.get("simultaneous") or {}).get("measured"),
               sequential=(by.get("sequential") or {}).get("measured"),
               planned_delays=(by.get("plan") or {}).get("delays"),
               overhead_max=max(overheads) if overheads else None)
    return out


# ------------------------------------------------------------------------------- running a sweep
def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+_-]+", "-", label).strip("-")


def _record(run: SweepRun, result: Any, repetition: int, order: Sequence[str],
            plan_result: Any | None) -> dict[str, Any]:
    """One run's entry in the sweep's results, from its RunResult."""
    predicted = result.predicted.get(run.mode)
    if run.mode == "sequential" and plan_result is not None:
        predicted = plan_result.predicted.get("sequential")
    measured = result.makespan
    released = {n: j.release.at if j.release else j.delay for n, j in result.jobs.items()}
    stagger = run.stagger if run.mode not in ("plan", "open") else planned_stagger(order, released)
    return {"repetition": repetition, "label": run.label, "mode": run.mode, "stagger": stagger,
            "delays": result.delays, "released": released,
            "steer": [{k: d.get(k) for k in ("jobs", "at", "planned", "reason")}
                      for d in (result.steer or {}).get("decisions", [])], "predicted": predicted, "measured": measured,
            "error": (predicted - measured) / measured if predicted is not None and measured else None,
            "ok": result.ok, "overhead": result.overhead, "run_dir": result.run_dir, "cache": result.cache,
            "cold_cache": result.cold_cache, "predicted_all": result.predicted, "calibrations": result.calibrations,
            "scenario": result.scenario if run.mode == "plan" else {},
            "jobs": {n: {"delay": j.delay, "start": j.start, "finish": j.finish, "state": j.state,
                         "release": j.release.to_dict() if j.release else None} for n, j in result.jobs.items()}}


def _check(spec: Spec, repeat: int, staggers: Sequence[float] | None, max_stagger: float | None) -> None:
    if len(spec.jobs) < 2:
        raise ConfigError(f"hpcstagger sweep compares start staggers of co-located jobs, but the spec has one job "
                          f"({spec.jobs[0].name!r}); add a second [[job]]")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"--repeat must be an integer >= 1, got {repeat!r}")
    if staggers is not None and (not staggers or any(not math.isfinite(s) or s < 0 for s in staggers)):
        raise ConfigError(f"staggers must be seconds >= 0, got {list(staggers)!r}")
    if max_stagger is not None and not (math.isfinite(max_stagger) and max_stagger > 0):
        raise ConfigError(f"--max-stagger must be a number of seconds > 0, got {max_stagger!r}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _learns(spec: Spec) -> bool:
    """Whether a spec without a scenario has a learned plan: history on and an observed run."""
    return spec.plan.history and spec.plan.mode == "plan" and bool(observed_runs(spec.run.workdir))


def run_sweep(spec: Spec, *, staggers: Sequence[float] | None = None, repeat: int = 1,
              max_stagger: float | None = None, sequential: bool = False, timeout: float | None = None,
              launcher: str = "mpiexec", json_path: str | os.PathLike[str] | None = None,
              progress: Callable[[str], None] | None = _stderr, history: bool = False) -> dict[str, Any]:
    """Run the sweep (see the module docstring) and return its results, also written as JSON to
    ``json_path`` (default ``<workdir>/sweep/sweep-<timestamp>.json``) after every run.

    Every run plans from the calibration alone, so that the runs compare: the spec's run history
    (what earlier runs measured, :mod:`~hpcstagger.stagger.history`) is still recorded but not used, unless ``history``.
    With ``history``, a spec without a scenario that has observed runs (:mod:`~hpcstagger.stagger.learning`) also runs
    its learned plan (steered and open), which goes on learning from each of those runs.

    ``progress`` gets one line per run (default: stderr). Raises ConfigError for bad input (one
    job, ``repeat`` < 1, a negative stagger), LaunchError naming the run when a run fails (the
    results so far are in the JSON), and what :func:`launch` raises.
    """
    from hpcstagger.colocated.launch import launch

    _check(spec, repeat, staggers, max_stagger)
    preflight.check(spec, launcher=launcher)  # before the first run: its dataset, backends, launcher
    say = progress or (lambda line: None)
    order = list(spec.job_names)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(json_path) if json_path else Path(spec.run.workdir) / "sweep" / f"sweep-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    has_plan = bool(spec.plan.scenario) or (history and _learns(spec))
    out: dict[str, Any] = {"spec": spec.path, "jobs": order, "repeat": repeat, "staggers": None,
                           "ordering": "stagger s > 0: job k (spec order, from 0) delayed by k*s; "
                                       "s < 0: the reverse order, job k delayed by (N-1-k)*|s|",
                           "runs": [], "json": str(path), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "command": " ".join(sys.argv)}
    t0 = time.monotonic()
    chosen = tuple(staggers) if staggers is not None else None
    plans: dict[int, Any] = {}
    todo = sweep_runs(order, chosen or (), plan=has_plan, sequential=sequential)
    total = None
    done = 0
    for rep in range(1, repeat + 1):
        k = 0
        while k < len(todo):
            run = repetition_order(todo, rep)[k]
            k += 1
            name = f"sweep-{stamp}-{rep}-{done + 1:02d}-{_slug(run.label)}"
            result = launch(spec, mode=run.mode, delays=run.delays, timeout=timeout, run_name=name,
                            launcher=launcher, cold_cache=True, env=None if history else {runenv.NO_HISTORY: "1"})
            done += 1
            if run.mode == "plan":
                plans[rep] = result
            rec = _record(run, result, rep, order, plans.get(rep) or plans.get(rep - 1))
            out["runs"].append(rec)
            if chosen is None and result.ok:  # the first run settles the staggers (from the plan's curve)
                chosen = default_staggers(result.curve, result.delays if run.mode == "plan" else None, order,
                                          max_stagger=max_stagger)
                todo = sweep_runs(order, chosen, plan=has_plan, sequential=sequential)  # same first runs
            if total is None and chosen is not None:
                total = len(todo) * repeat
            out["staggers"] = list(chosen) if chosen is not None else None
            _finish(out, order, plans, t0)
            _io.atomic_write_json(path, out, durable=False)
            say(_progress_line(done, total, rep, repeat, rec))
            if not result.ok:
                problems = "; ".join(result.failures()) or f"the launcher exited with status {result.returncode}"
                raise LaunchError(f"sweep run {run.label!r} (repetition {rep}) failed: {problems} (status files in "
                                  f"{result.run_dir}; results so far in {path})")
    return out


def _finish(out: dict[str, Any], order: Sequence[str], plans: Mapping[int, Any], t0: float) -> None:
    """Fill in the summary, the predicted curve and the scenario from the runs so far."""
    out["summary"] = summarize(out["runs"])
    first = plans.get(min(plans)) if plans else None
    out["scenario"] = first.scenario if first is not None else {}
    upper = max([abs(s) for s in (out["staggers"] or [])] +
                [abs(r["stagger"]) for r in out["runs"] if r.get("stagger") is not None] + [0.0])
    if out.get("curve", {}).get("upper") != upper:
        curve = predicted_curve(out["scenario"], order, upper)
        out["curve"] = {**curve, "upper": upper} if curve else {}
    out["seconds"] = time.monotonic() - t0


def _progress_line(done: int, total: int | None, rep: int, repeat: int, rec: Mapping[str, Any]) -> str:
    of = f"/{total}" if total else ""
    head = f"sweep: run {done}{of} (repetition {rep}/{repeat}) {rec['label']}: "
    if not rec["ok"]:
        return head + "FAILED"
    text = head + f"measured {rec['measured']:.2f} s"
    if rec.get("predicted") is not None:
        text += f", predicted {rec['predicted']:.2f} s ({100 * rec['error']:+.1f}%)"
    start = describe_start(rec.get("cache"))
    return text + (f"; {start}" if start else "")
