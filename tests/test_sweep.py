"""`hpcstagger sweep`: stagger parsing and ordering (pure), the summary, and a real small sweep of
two tiny jobs under mpiexec with its JSON and plot."""

from __future__ import annotations

import json

import pytest

from hpcstagger.cache import list_caches
from hpcstagger.measure.sweep import (DEFAULT_COUNT, DEFAULT_MAX_STAGGER, default_staggers, parse_staggers,
                                        planned_stagger, repetition_order, stagger_delays, stagger_label, summarize,
                                        sweep_runs)
from hpcstagger.errors import ConfigError
from hpcstagger.measure.sweep_report import format_sweep
from support.cli import run_cli
from support.spec_util import fill, write_spec

pytestmark = pytest.mark.timeout(180)


def test_parse_staggers():
    assert parse_staggers("0,2,4,8") == (0.0, 2.0, 4.0, 8.0)
    assert parse_staggers(" 4, 0.5s,4,") == (0.5, 4.0)  # sorted, repeats dropped, a trailing 's' allowed
    for bad, why in [("", "no stagger"), ("1,x", "cannot read 'x'"), ("-1", "not a finite number"),
                     ("inf", "not a finite number"), ("1;2", "cannot read")]:
        with pytest.raises(ConfigError, match=why):
            parse_staggers(bad)


def test_repetitions_alternate_their_order():
    runs = sweep_runs(["a", "b"], [1.0], sequential=True)
    labels = [r.label for r in runs]
    assert labels == ["plan", "open", "simultaneous", "b +1s", "a +1s", "sequential"]
    assert [r.label for r in repetition_order(runs, 1)] == labels == [r.label for r in repetition_order(runs, 3)]
    assert [r.label for r in repetition_order(runs, 2)] == labels[::-1]  # open before plan, sequential first
    assert [r.label for r in runs] == labels  # the list itself is left alone


def test_stagger_orders():
    assert stagger_delays(["a", "b"], 2.0) == {"a": 0.0, "b": 2.0}     # B delayed by s
    assert stagger_delays(["a", "b"], -2.0) == {"a": 2.0, "b": 0.0}    # A delayed by s
    assert stagger_delays(["a", "b", "c"], 1.5) == {"a": 0.0, "b": 1.5, "c": 3.0}   # job k by k*s
    assert stagger_delays(["a", "b", "c"], -1.5) == {"a": 3.0, "b": 1.5, "c": 0.0}  # reverse order
    assert stagger_label(["a", "b"], 2.0) == "b +2s" and stagger_label(["a", "b"], -0.5) == "a +0.5s"
    assert stagger_label(["a", "b", "c"], -1.5) == "+1.5s each, c first"
    assert planned_stagger(["a", "b"], {"a": 3.0, "b": 0.0}) == -3.0
    assert planned_stagger(["a", "b", "c"], {"a": 0.0, "b": 2.0, "c": 4.0}) == 2.0
    assert planned_stagger(["a", "b", "c"], {"a": 4.0, "b": 2.0, "c": 0.0}) == -2.0
    assert planned_stagger(["a", "b", "c"], {"a": 0.0, "b": 5.0, "c": 1.0}) is None  # off the sweep's axis

    runs = sweep_runs(["a", "b"], [0.0, 2.0, 1.0])
    assert [r.label for r in runs] == ["plan", "open", "simultaneous", "b +1s", "a +1s", "b +2s", "a +2s"]
    assert [r.mode for r in runs[:2]] == ["plan", "open"]  # the plan steered, and the same plan open-loop
    assert [r.stagger for r in runs] == [None, None, 0.0, 1.0, -1.0, 2.0, -2.0]
    assert runs[6].mode == "fixed" and runs[6].delays == {"a": 2.0, "b": 0.0}
    runs = sweep_runs(["a", "b", "c"], [3.0], plan=False, sequential=True)
    assert [r.mode for r in runs] == ["simultaneous", "fixed", "fixed", "sequential"]
    assert runs[2].delays == {"a": 6.0, "b": 3.0, "c": 0.0}


def test_default_staggers():
    # no scenario: 7 round steps up to the default maximum
    plain = default_staggers(None, None, ["a", "b"])
    assert len(plain) == DEFAULT_COUNT == 7 and plain[0] == 0.0 and plain[-1] >= DEFAULT_MAX_STAGGER
    assert plain == (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0)
    assert default_staggers(None, None, ["a", "b"], max_stagger=3.0) == (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
    # a curve with a minimum at +4 s: the range is where it stays within 10% of a simultaneous start
    xs = [-20.0, -10.0, -5.0, 0.0, 2.0, 4.0, 6.0, 9.0, 12.0, 20.0]
    ys = [40.0, 20.0, 11.5, 12.0, 9.0, 7.5, 9.0, 13.0, 16.0, 30.0]
    got = default_staggers({"stagger": xs, "makespan": ys}, {"a": 0.0, "b": 4.0}, ["a", "b"])
    assert got == (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0)  # up to 9 s (13.0 <= 1.1 * 12.0), in steps of 2
    # at least twice the planned stagger where the curve rises at once ...
    steep = {"stagger": [-10.0, 0.0, 1.0, 10.0], "makespan": [30.0, 10.0, 20.0, 30.0]}
    assert default_staggers(steep, {"a": 3.0, "b": 0.0}, ["a", "b"]) == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    # ... but not past the curve's own range (the planner's largest delay)
    flat = {"stagger": [-1.0, 0.0, 1.0], "makespan": [20.0, 10.0, 20.0]}
    assert default_staggers(flat, {"a": 0.0, "b": 3.0}, ["a", "b"])[-1] == pytest.approx(1.2)
    # more jobs: the curve's axis is the largest delay, (N - 1) staggers
    three = {"stagger": [0.0, 3.0, 6.0, 12.0], "makespan": [10.0, 8.0, 10.5, 20.0]}
    assert default_staggers(three, {"a": 0.0, "b": 1.5, "c": 3.0}, ["a", "b", "c"])[-1] == pytest.approx(3.0)


def test_summary_of_runs():
    def run(rep, label, mode, measured, predicted, stagger=None):
        return {"repetition": rep, "label": label, "mode": mode, "stagger": stagger, "measured": measured,
                "predicted": predicted, "error": (predicted - measured) / measured, "overhead": 0.1,
                "delays": {"a": 0.0, "b": 1.0}}

    runs = [run(1, "plan", "plan", 10.0, 10.5), run(1, "simultaneous", "simultaneous", 12.0, 12.0, 0.0),
            run(1, "b +1s", "fixed", 9.5, 9.5, 1.0), run(2, "plan", "plan", 10.4, 10.4),
            run(2, "simultaneous", "simultaneous", 12.2, 12.2, 0.0), run(2, "b +1s", "fixed", 9.7, 9.5, 1.0)]
    s = summarize(runs)
    assert [p["label"] for p in s["points"]] == ["plan", "simultaneous", "b +1s"]
    assert s["points"][0]["measured"] == [10.0, 10.4] and s["points"][0]["measured_median"] == pytest.approx(10.2)
    assert s["best"] == {"label": "b +1s", "measured": pytest.approx(9.6)}
    assert s["plan_vs_best"] == pytest.approx(10.2 / 9.6 - 1)
    assert s["error_max"] == pytest.approx(0.05) and s["error_median"] == pytest.approx(0.0)
    # against each point's median run: plan 10.45 / 10.2, simultaneous 12.1 / 12.1, b 9.5 / 9.6
    assert s["point_error_max"] == pytest.approx(10.45 / 10.2 - 1)
    assert s["point_error_median"] == pytest.approx(1 - 9.5 / 9.6)
    assert [r["plan_vs_best"] for r in s["per_repetition"]] == [pytest.approx(10 / 9.5 - 1),
                                                                 pytest.approx(10.4 / 9.7 - 1)]
    assert s["per_repetition"][0]["simultaneous"] == 12.0 and s["per_repetition"][1]["overhead_max"] == 0.1
    # the noise: each point's runs lay (max - min) / median apart; the summary takes the median
    assert [p["spread"] for p in s["points"]] == [pytest.approx(0.4 / 10.2), pytest.approx(0.2 / 12.1),
                                                  pytest.approx(0.2 / 9.6)]
    assert s["spread"] == pytest.approx(0.2 / 9.6) and s["spread_max"] == pytest.approx(0.4 / 10.2)
    text = format_sweep({"summary": s, "repeat": 2})
    assert "the runs of one point lay 2.1% apart (median; max 3.9%)" in text
    assert "prediction error: median 0.0%, max 5.0% (each run)" in text
    assert "against each point's median run: median 1.0%, max 2.5%" in text
    once = summarize([r for r in runs if r["repetition"] == 1])
    assert once["spread"] is None and all(p["spread"] is None for p in once["points"])
    assert "run-to-run noise" not in format_sweep({"summary": once, "repeat": 1})
    assert once["point_error_max"] is None and "median run" not in format_sweep({"summary": once, "repeat": 1})


def test_bad_input_is_one_line_and_exit_1(tmp_path, shm_root):
    spec = write_spec(tmp_path, shm_root)
    out = run_cli("sweep", spec, "--staggers", "1,soon")
    assert out.returncode == 1 and "cannot read 'soon'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = run_cli("sweep", spec, "--repeat", "0")
    assert out.returncode == 1 and "--repeat must be an integer >= 1" in out.stderr
    single = tmp_path / "one"
    single.mkdir()
    out = run_cli("sweep", write_spec(single, shm_root, jobs=("a",)))
    assert out.returncode == 1 and "the spec has one job ('a')" in out.stderr


def test_a_real_sweep_writes_json_and_plot(tmp_path, shm_root):
    """Two tiny jobs: the plan, a simultaneous start and one stagger in both orders, each from a
    cold cache (a cache left warm before the sweep is emptied first)."""
    spec = write_spec(tmp_path, shm_root)
    fill(shm_root, 40)
    out_json, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    out = run_cli("sweep", spec, "--staggers", "0,0.6", "--json", str(out_json), "--plot", str(png),
                  cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr
    progress = [line for line in out.stderr.splitlines() if line.startswith("sweep: run ")]
    assert len(progress) == 5 and progress[-1].startswith("sweep: run 5/5 (repetition 1/1) a +0.6s: measured")
    assert all("cold cache" in line for line in progress)

    result = json.loads(out_json.read_text())
    runs = {r["label"]: r for r in result["runs"]}
    assert list(runs) == ["plan", "open", "simultaneous", "b +0.6s", "a +0.6s"] and result["staggers"] == [0.0, 0.6]
    # the open-loop run keeps the plan's delays as fixed sleeps; the steered one records its releases
    assert runs["open"]["delays"] == runs["plan"]["delays"] and runs["open"]["steer"] == []
    assert runs["open"]["released"] == runs["open"]["delays"]
    assert set(runs["plan"]["released"]) == {"a", "b"}
    assert runs["b +0.6s"]["delays"] == {"a": 0.0, "b": 0.6} and runs["a +0.6s"]["delays"] == {"a": 0.6, "b": 0.0}
    assert runs["a +0.6s"]["stagger"] == -0.6 and runs["a +0.6s"]["jobs"]["a"]["start"] >= 0.6
    assert runs["plan"]["cold_cache"]["cache"]["action"] == "removed"  # the warm cache was emptied
    assert runs["plan"]["cache"]["entries"] == 0
    for r in result["runs"]:
        assert r["ok"] and r["measured"] > 0.3 and r["predicted"] > 0 and r["error"] is not None
        assert {n: j["state"] for n, j in r["jobs"].items()} == {"a": "done", "b": "done"}
    s = result["summary"]
    assert s["best"]["label"] in ("simultaneous", "b +0.6s", "a +0.6s")
    assert s["plan_vs_best"] == pytest.approx(s["plan"] / s["best"]["measured"] - 1)
    assert s["open_vs_best"] == pytest.approx(s["open"] / s["best"]["measured"] - 1)
    assert s["error_max"] >= s["error_median"] >= 0
    # the curve covers the staggers and every run's actual stagger (a steered release may lie beyond them)
    upper = max([0.6] + [abs(r["stagger"]) for r in result["runs"] if r["stagger"] is not None])
    assert result["curve"]["upper"] == pytest.approx(upper) and len(result["curve"]["stagger"]) == 41
    assert result["scenario"]["job"][0]["name"] == "a"

    for needle in ("RUN", "PREDICTED", "MEASURED", "b +0.6s", "best measured stagger", "prediction error: median",
                   "open-loop plan"):
        assert needle in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert list_caches(shm_root) == []  # the jobs use no cache; the sweep left none behind
