"""`hpcstagger demo`, end to end on a small dataset (the full demo is the README's main command);
its busy-node check against a real spinning process, and its notes in the table and on the plot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile

import pytest

from hpcstagger.demo.run import check_node, figure, format_table, notes, plot
from support.cli import cli_env, run_cli

pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_runs_plans_and_reports(tmp_path):
    root = tempfile.mkdtemp(prefix="hpcs-demo-", dir="/dev/shm")
    try:
        out = run_cli("demo", "--workdir", str(tmp_path / "demo"), "--samples", "800", "--epochs", "2",
                      "--calibrate-budget", "6", env=cli_env(HPCSTAGGER_SHM_ROOT=root), timeout=380)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["RUN", "DELAYS", "PREDICTED", "MEASURED", "ERROR"]
    assert [ln.split()[0] for ln in lines[1:4]] == ["plan", "simultaneous", "sequential"]
    result = json.loads((tmp_path / "demo" / "demo.json").read_text())
    runs = {r["mode"]: r for r in result["runs"]}
    for r in runs.values():
        assert r["measured"] > 0 and r["predicted"] > 0
        assert all(j["metrics"]["samples"] == 1600 for j in r["jobs"].values())  # 2 epochs of 800
        assert all(j["metrics"]["checkpoints"] >= 1 for j in r["jobs"].values())
    seq = runs["sequential"]["jobs"]
    assert seq["mlp"]["start"] >= seq["convnet"]["finish"]
    assert (tmp_path / "demo" / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "scenario" in result and result["plan"]["delays"]
    # the node was looked at before measuring, and the figures are in demo.json
    node = result["node_load"]
    assert node["cores"] >= 1 and node["window_s"] > 0 and isinstance(node["busy"], bool)
    assert (node["warning"] is not None) == node["busy"]
    assert ("demo: warning: the node is busy" in out.stderr) == node["busy"]
    # the sequential run is labelled sequential in its jobs' lines, as in the JSON and the table
    seq_lines = out.stderr.split("demo: run 3/3: sequential", 1)[1].splitlines()
    announced = [ln for ln in seq_lines if "] mode " in ln]
    assert len(announced) == 2 and all("] mode sequential: delays" in ln for ln in announced), announced
    # a plan that starts both jobs at once says so, and why, in the output and demo.json
    planned = runs["plan"]
    if any(planned["delays"].values()):
        assert planned["simultaneous_reason"] is None and "plan: a simultaneous start" not in out.stdout
    else:
        assert planned["simultaneous_reason"].startswith("a simultaneous start: ")
        assert f"plan: {planned['simultaneous_reason']}" in out.stdout.splitlines()


def _result(*, busy: bool, plan_delays: dict[str, float], reason: str | None) -> dict:
    """A demo result as run_demo writes it, with made-up figures."""
    def run(mode, label, delays, measured, jobs):
        return {"mode": mode, "label": label, "delays": delays, "predicted": 15.9, "measured": measured,
                "error": (15.9 - measured) / measured, "curve": {"label": "", "stagger": [-4.0, 0.0, 4.0],
                                                                  "makespan": [16.5, 15.9, 16.2]},
                "jobs": {n: {"start": s, "finish": f} for n, (s, f) in jobs.items()},
                **({"simultaneous_reason": reason} if mode == "plan" else {})}

    warning = "the node is busy (other processes used 1.90 of 2 usable cores over 1.0 s; load average 3.00): ..."
    return {"node_load": {"cores": 2, "others_cores": 1.9 if busy else 0.02, "load1": 3.0 if busy else 0.1,
                          "window_s": 1.0, "busy": busy, "warning": warning if busy else None},
            "plan": {"delays": plan_delays, "curve": {"label": "", "stagger": [], "makespan": []},
                     "simultaneous_reason": reason},
            "runs": [run("plan", "plan", plan_delays, 28.3, {"convnet": (0, 28.3), "mlp": (0, 20.0)}),
                     run("simultaneous", "simultaneous", {"convnet": 0.0, "mlp": 0.0}, 22.5,
                         {"convnet": (0, 22.5), "mlp": (0, 18.0)}),
                     run("sequential", "sequential", {"convnet": 0.0, "mlp": 12.0}, 25.0,
                         {"convnet": (0, 12.0), "mlp": (12.0, 25.0)})]}


def _texts(fig) -> str:
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [t.get_text() for t in ax.get_yticklabels()]
        legend = ax.get_legend()
        out += [t.get_text() for t in legend.get_texts()] if legend else []
    return "\n".join(out)


def test_busy_node_and_simultaneous_plan_are_in_the_table_and_on_the_plot(tmp_path):
    import matplotlib.pyplot as plt

    reason = ("a simultaneous start: the model predicts no stagger gains more than 1% (best stagger mlp +4.0 s: "
              "predicted makespan 15.8 s against 15.9 s simultaneous: a gain of 0.6%)")
    result = _result(busy=True, plan_delays={"convnet": 0.0, "mlp": 0.0}, reason=reason)
    assert notes(result) == [f"warning: {result['node_load']['warning']}", f"plan: {reason}"]
    lines = format_table(result).splitlines()
    assert [ln.split()[0] for ln in lines[1:4]] == ["plan", "simultaneous", "sequential"]
    assert lines[4:] == notes(result)
    fig = figure(result)
    try:
        text = _texts(fig)
    finally:
        plt.close(fig)
    flat = " ".join(text.split())
    assert "warning: the node is busy (other processes used 1.90 of 2 usable cores" in flat
    assert "plan: a simultaneous start: the model predicts no stagger gains more than 1%" in flat
    assert "measured, plan (a simultaneous start)" in text and "measured, sequential" in text
    assert "sequential" in text.splitlines()  # the sequential run's row in the timelines
    assert plot(result, tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a quiet node and a staggered plan: no notes, nothing beneath the plot
    quiet = _result(busy=False, plan_delays={"convnet": 0.0, "mlp": 4.0}, reason=None)
    assert notes(quiet) == [] and len(format_table(quiet).splitlines()) == 4
    fig = figure(quiet)
    try:
        assert fig.texts == [] and "measured, plan" in _texts(fig)
    finally:
        plt.close(fig)


def test_check_node_warns_with_the_figures_while_another_process_spins(capfd):
    """A real busy loop in a child process: the demo's check reads it as other processes' CPU use
    and warns with the figures; demo.json gets the same record."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)  # the child is up and spinning
        node = check_node(1.0)
    finally:
        spin.kill()
        spin.wait()
    # one spinning process is a whole core of other work: far above the quarter core that counts as busy
    assert node["busy"] and node["others_cores"] >= 0.6
    assert node["warning"].startswith("the node is busy (other processes used ")
    assert f"of {node['cores']} usable cores" in node["warning"] and "the demo measures slower jobs" in node["warning"]
    assert f"demo: warning: {node['warning']}" in capfd.readouterr().err
    json.dumps(node)  # as demo.json records it


def test_every_stated_duration_of_the_demo_is_the_measured_one():
    """The README's Quick start, docs/demo.md, ``hpcstagger --help`` and ``hpcstagger demo --help``
    state one duration: cli.demo.DURATION, the range measured on 2 cores."""
    import argparse
    from pathlib import Path

    from hpcstagger.cli import build_parser
    from hpcstagger.cli.cmd_demo import DURATION

    repo = Path(__file__).resolve().parents[1]

    def flat(text: str) -> str:
        return " ".join(text.split())

    quick = (repo / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    demo_page = (repo / "docs" / "demo.md").read_text().split("## Examples", 1)[0]
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    stated = {"README Quick start": (flat(quick), f"The demo takes {DURATION} on 2 cores"),
              "docs/demo.md": (flat(demo_page), f"It takes {DURATION} on 2 cores"),
              "hpcstagger --help": (flat(parser.format_help()), f"run the end-to-end demo ({DURATION} on 2 cores)"),
              "hpcstagger demo --help": (flat(sub.choices["demo"].format_help()), f"It takes {DURATION} on 2 cores")}
    for where, (text, sentence) in stated.items():
        assert sentence in text, f"{where} does not say {sentence!r}"
    # and no other figure for the demo's whole run
    assert "a minute and a half" not in flat(quick)
    assert "a few minutes" not in flat(parser.format_help()) + flat(demo_page)
