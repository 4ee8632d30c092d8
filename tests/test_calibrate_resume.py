"""`hpcstagger calibrate --spec`: measurements kept as they are taken and reused by the same command
after an interrupt, the output path checked before measuring, a job that never calls
session.loader named, and a scenario whose comments state the values it holds."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hpcstagger.measure.saved_parts import SavedParts, partial_dir
from hpcstagger.spec.jobspec import Spec
from hpcstagger.model import Scenario
from support.calib_checks import comment_mismatches
from support.cli import cli_env, interruptible, run_cli

JOB = Path(__file__).resolve().parent / "support" / "calib_job.py"
ROW = 4097
# what the calibration and its jobs read from the environment: never inherited from the caller
SCRUB = ("HPCSTAGGER_SPEC", "HPCSTAGGER_JOB", "HPCSTAGGER_CALIBRATE", "HPCSTAGGER_CALIBRATE_UNTIL",
         "HPCSTAGGER_RUN_DIR", "HPCSTAGGER_ONLY_JOBS", "HPCSTAGGER_PLAN_MODE", "HPCSTAGGER_DELAYS",
         "HPCSTAGGER_CALIBRATE_BUDGET", "HPCSTAGGER_NO_HISTORY")


@pytest.fixture
def shm_dir(monkeypatch):
    for name in SCRUB:
        monkeypatch.delenv(name, raising=False)
    root = tempfile.mkdtemp(prefix="hpcs-calres-", dir="/dev/shm")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _env(shm: str) -> dict[str, str]:
    env = cli_env(HPCSTAGGER_SHM_ROOT=shm)
    for name in SCRUB:
        env.pop(name, None)
    return env


def _spec(tmp_path: Path, a_args: str = "", b_args: str = "", samples: int = 2000) -> Path:
    import h5py

    rows = np.random.default_rng(0).integers(0, 255, size=(samples, ROW), dtype=np.uint8)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("samples", data=rows, chunks=(1, ROW))
    shutil.copy(JOB, tmp_path / "calib_job.py")
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "calres"
        workdir = "work"
        [dataset]
        path = "data.h5"
        name = "samples"
        throttle = [8.0e6, 6.0e6]
        [cache]
        capacity = "32MB"
        [[job]]
        name = "a"
        command = "python calib_job.py --workers 0 --batch 8 --count a.count {a_args}"
        [[job]]
        name = "b"
        command = "python calib_job.py --workers 0 --batch 8 --count b.count {b_args}"
    """))
    return path


def _launches(tmp_path: Path, job: str) -> int:
    path = tmp_path / f"{job}.count"
    return len(path.read_text().split()) if path.exists() else 0


# ------------------------------------------------------------------------------- kept and resumed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_interrupted_calibration_goes_on_without_measuring_a_job_again(tmp_path, shm_dir):
    _spec(tmp_path, b_args="--step-sleep 0.05")  # job b runs for seconds: the interrupt lands while it runs
    argv = [sys.executable, "-m", "hpcstagger", "calibrate", "--spec", "spec.toml", "--budget", "16",
            "-o", "scenario.toml"]
    kept = tmp_path / "scenario.toml.partial"
    proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(shm_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 120
        while _launches(tmp_path, "b") == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (kept / "job.a.json").exists(), "job a's measurement was not kept as it was taken"
        assert _launches(tmp_path, "b") == 1 and proc.poll() is None, "job b did not start"
        proc.send_signal(signal.SIGINT)  # Ctrl-C while job b runs
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert f"what was measured is kept in {kept}" in err and not (tmp_path / "scenario.toml").exists()
    assert _launches(tmp_path, "a") == 1
    part = json.loads((kept / "job.a.json").read_text())
    assert part["fields"]["route"] == "command" and part["fields"]["batches"] > 0

    res = run_cli(*argv[3:], env=_env(shm_dir), cwd=tmp_path, timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _launches(tmp_path, "a") == 1, "job a was measured again"   # launched once in both runs
    assert _launches(tmp_path, "b") >= 1
    assert f"calibrate: job a: reusing its measurement kept in {kept}" in res.stderr
    assert "calibrate: job b: reusing" not in res.stderr
    assert re.search(r"^reused from the kept measurements: .*job a", res.stdout, re.M), res.stdout
    sc = Scenario.from_toml(tmp_path / "scenario.toml")
    assert [j.name for j in sc.jobs] == ["a", "b"] and sc.jobs[0].sample_time == part["fields"]["sample_time"]
    assert len(sc.storage.spread) == len(sc.storage.bandwidth) == 2   # two jobs, one fetcher each
    assert not kept.exists()                                            # dropped once the scenario is written
    assert "the node before measuring:" in res.stdout


def test_kept_parts_follow_the_spec(tmp_path):
    """A job's part is reused while its command, its files and the dataset stay the same; the
    source's while the dataset does; --fresh drops every part."""
    _spec(tmp_path, samples=10)
    said: list[str] = []
    spec = Spec.from_toml(tmp_path / "spec.toml")
    kept = partial_dir(tmp_path / "scenario.toml")
    assert kept == tmp_path / "scenario.toml.partial"
    parts = SavedParts(kept, spec, fresh=False, say=said.append)
    a, b = spec.jobs
    parts.save_job(a, {"route": "command", "sample_time": 0.001})
    parts.save_job(b, {"route": "command", "sample_time": 0.002})
    parts.save_levels([{"readers": 1, "bandwidth": 5e6}])
    again = SavedParts(kept, spec, fresh=False, say=said.append)
    assert again.job(a) == {"route": "command", "sample_time": 0.001} and again.levels()[0]["bandwidth"] == 5e6
    assert again.reused == ["job a", "1 source measurement(s)"]
    # job b's command changes: only b is measured again
    _spec_text = (tmp_path / "spec.toml").read_text().replace("--count b.count", "--count b.count --epochs 2")
    (tmp_path / "spec.toml").write_text(_spec_text)
    changed = SavedParts(kept, Spec.from_toml(tmp_path / "spec.toml"), fresh=False, say=said.append)
    a2, b2 = changed.spec.jobs
    assert changed.job(a2) is not None and changed.job(b2) is None
    assert "calibrate: job b: its command, its files or the dataset changed" in said[-1]
    # the job's script changes: measured again
    (tmp_path / "calib_job.py").write_text((tmp_path / "calib_job.py").read_text() + "\n# changed\n")
    assert SavedParts(kept, changed.spec, fresh=False, say=said.append).job(a2) is None
    # the dataset changes: every part is measured again
    changed.save_job(a2, {"route": "command"})
    (tmp_path / "data.h5").write_bytes((tmp_path / "data.h5").read_bytes() + b"\0" * 16)
    stale = SavedParts(kept, changed.spec, fresh=False, say=said.append)
    assert stale.levels() == [] and stale.job(a2) is None and "the dataset changed" in " ".join(said)
    # --fresh
    SavedParts(kept, changed.spec, fresh=True, say=said.append)
    assert list(kept.iterdir()) == [] and "--fresh: dropped" in said[-1]


# ------------------------------------------------------------------------------- before measuring
def test_a_bad_output_path_fails_before_measuring(tmp_path, shm_dir):
    _spec(tmp_path, samples=10)
    (tmp_path / "adir").mkdir()
    for out, expected in (("adir", "is a directory; give a file path, e.g. -o adir/scenario.toml"),
                          ("no/such/scenario.toml", "does not exist; create it (mkdir -p")):
        t0 = time.monotonic()
        res = run_cli("calibrate", "--spec", "spec.toml", "--budget", "10", "-o", out, env=_env(shm_dir),
                      cwd=tmp_path, timeout=60)
        assert res.returncode == 1 and expected in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
        assert time.monotonic() - t0 < 8 and _launches(tmp_path, "a") == 0
        assert not (tmp_path / "work" / "calibrate").exists()   # nothing measured, no reports


def test_a_job_that_never_calls_session_loader_is_named(tmp_path, shm_dir):
    _spec(tmp_path, b_args="--no-loader --epochs 1", samples=300)
    res = run_cli("calibrate", "--spec", "spec.toml", "--budget", "8", "-o", "scenario.toml", env=_env(shm_dir),
                  cwd=tmp_path, timeout=120)
    assert res.returncode == 1, res.stderr[-3000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "job(s) b never called session.loader(...)" in line and \
        "'for batch in session.loader(loader):'" in line, line
    assert "calibrate: job b ended without calling session.loader(...)" in res.stderr
    # job a was measured and is kept: fixing b and running again measures b alone
    assert (tmp_path / "scenario.toml.partial" / "job.a.json").exists()
    assert "other measurements are kept in" in line


# ------------------------------------------------------------------------------- the scenario's comments
def _meas(overhead: float) -> dict:
    job = {"route": "command", "ranks": 1, "workers": 0, "batch": 8, "prefetch": None, "handoff": 0.0012,
           "prep_time": 0.0003, "startup": 1.25, "epoch_start": 0.0, "order": "", "batches": 20,
           "sample_time": 0.00042, "miss_overhead": overhead, "hits": 10, "misses": 90, "stopped": "enough",
           "samples_seen": True}
    levels = [{"readers": 1, "bandwidth": 14.3e6, "window_s": 1.0, "elapsed_s": 1.2},
              {"readers": 1, "bandwidth": 13.9e6, "window_s": 1.0, "elapsed_s": 1.2},
              {"readers": 2, "bandwidth": 20.0e6, "window_s": 1.0, "elapsed_s": 1.2},
              {"readers": 2, "bandwidth": 26.0e6, "window_s": 1.0, "elapsed_s": 1.2},
              {"readers": 2, "bandwidth": 21.0e6, "window_s": 1.0, "elapsed_s": 1.2}]
    return {"sample_bytes": 65536.0, "samples": 1000, "preloaded": 64, "source": levels, "jobs": {"a": job},
            "page_cache": {"holds": False, "source": "hdf5", "emulated": True}, "hits": {"hit_bandwidth": 1e9,
            "how": "ShmCache.get"}, "cores": 2, "cores_how": "the CPUs", "fetchers": 2}


@pytest.mark.parametrize("overhead", [0.0, 0.004])
def test_every_figure_in_a_comment_is_the_value_the_file_holds(tmp_path, overhead):
    """The source's comment once said 14.3 MB/s (one reader, measured) where the file held 7.9 (the
    curve with a miss's cost in the jobs folded in): a comment states what the file holds."""
    from hpcstagger.stagger.scenario_build import build_scenario
    from hpcstagger.stagger.scenario_build import fold_miss_overhead
    from hpcstagger.model.calibrate import write_scenario

    _spec(tmp_path, samples=10)
    spec = Spec.from_toml(tmp_path / "spec.toml")
    spec = dataclasses.replace(spec, jobs=spec.jobs[:1])
    meas = _meas(overhead)
    sc, comments = build_scenario(meas, spec, None, None, None)
    assert sc.storage.bandwidth == pytest.approx(fold_miss_overhead([14.1e6, 21.0e6], 65536.0, overhead))
    assert (sc.storage.bandwidth[0] < 8e6) is bool(overhead)
    assert sc.storage.spread == pytest.approx((0.4 / 14.1, 6.0 / 21.0))
    path = write_scenario(tmp_path / "s.toml", sc, comments, 1.0, notes=["a note"])
    text = Path(path).read_text()
    back = Scenario.from_toml(path)
    assert back.storage.spread == sc.storage.spread and back.storage.bandwidth == sc.storage.bandwidth
    assert comment_mismatches(text, back) == []
    assert "14.3" not in text and "# a note\n" in text
    assert "with 2 reader(s) they still disagree after measuring again" in comments["storage.spread"]
    # the check itself fails on the old comment
    old = re.sub(r"holds [\d.]+", "holds 14.3", text, count=1)
    assert comment_mismatches(old, back), old


def test_levels_the_budget_left_unchecked_are_said_to_be_measured_twice():
    from hpcstagger.stagger.scenario_build import source_note

    meas = _meas(0.0)
    meas["source"] = [m for m in meas["source"] if m["bandwidth"] != 21.0e6]  # 2 readers: two measurements
    comment = source_note(meas)[2]
    assert "with 2 reader(s) they still disagree in their two measurements (the budget had no time left" in comment
    meas["source"] += [{"readers": 1, "bandwidth": 9.0e6, "window_s": 1.0}, {"readers": 1, "bandwidth": 9.0e6,
                                                                             "window_s": 1.0}]
    comment = source_note(meas)[2]  # 1 reader: four measurements, still apart; 2 readers: two
    assert "with 1, 2 reader(s) they still disagree after measuring again (2 reader(s) measured twice only" in comment


def test_combine_levels_takes_each_levels_median_and_spread():
    from hpcstagger.model.source_probe import combine_levels, disagreeing

    levels = [{"readers": 1, "bandwidth": 10.0, "window_s": 1.0}, {"readers": 2, "bandwidth": 16.0, "window_s": 1.0},
              {"readers": 1, "bandwidth": 11.0, "window_s": 1.0}, {"readers": 2, "bandwidth": 18.0, "window_s": 1.0},
              {"readers": 3, "bandwidth": 99.0, "window_s": 0.001, "elapsed_s": 1.0}]
    curve, spread, note = combine_levels(levels)
    assert curve == [10.5, 17.0, 17.0] and spread == pytest.approx([1 / 10.5, 2 / 17.0, 2 / 17.0])
    assert "3 reader(s) (0.0 MB/s over 0.001 s)" in note
    assert disagreeing(levels) == [2, 3] and disagreeing(levels, limit=0.2) == []


# ------------------------------------------------------------------------------- the batch template
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_calibrate_template_ignores_a_callers_generic_variables(tmp_path, shm_dir):
    """slurm/calibrate.sbatch run as a plain script (its #SBATCH lines are comments) from a shell
    whose OUT names a directory and whose SPEC and BUDGET mean something else: it reads only its
    argument and HPCSTAGGER_* variables, writes the scenario beside the spec and prints the plan."""
    from support.cli import REPO

    _spec(tmp_path, samples=600)
    (tmp_path / "elsewhere").mkdir()
    env = _env(shm_dir)
    env.update(OUT=str(tmp_path / "elsewhere"), SPEC="/no/such/spec.toml", BUDGET="not-a-number",
               JOBS="x=no.such:module", HPCSTAGGER_CALIBRATE_BUDGET="10")
    res = subprocess.run(["bash", str(REPO / "slurm" / "calibrate.sbatch"), str(tmp_path / "spec.toml")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    sc = Scenario.from_toml(tmp_path / "scenario.toml")
    assert [j.name for j in sc.jobs] == ["a", "b"] and list((tmp_path / "elsewhere").iterdir()) == []
    assert "predicted makespan" in res.stdout
    # a bad output path fails at once, in one line, before measuring
    env["HPCSTAGGER_SCENARIO"] = str(tmp_path / "elsewhere")
    res = subprocess.run(["bash", str(REPO / "slurm" / "calibrate.sbatch"), str(tmp_path / "spec.toml")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "is a directory; give a file path" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and _launches(tmp_path, "a") == 1


def test_a_busy_node_is_warned_about_with_its_figures():
    """Before measuring, calibrate samples the node: with other processes spinning on every usable
    core it warns with the figures, and the summary line says busy."""
    import os

    from hpcstagger.measure.spec_calibration import _node_load, load_line

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(len(os.sched_getaffinity(0)))]
    try:
        time.sleep(0.3)
        said: list[str] = []
        load = _node_load(said.append)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert load["busy"] and load["others_cores"] > 0.5, load
    assert len(said) == 1 and said[0].startswith("calibrate: the node is busy (other processes used "), said
    assert f"of {load['cores']} usable cores" in said[0] and "expect its figures to be off" in said[0]
    line = load_line(load)
    assert line.startswith("the node before measuring: other processes used ") and line.endswith("(busy: the figures "
                                                                                                "may be slow)")


def test_a_command_is_stopped_once_stop_when_says_so(tmp_path):
    """How calibrate stops a job that never reaches session.loader before its share and grace end:
    run_group asks stop_when every half second and stops the whole process group (status 124)."""
    import os

    from hpcstagger.colocated.procgroup import run_group

    t0 = time.monotonic()
    rc = run_group(["bash", "-c", "sleep 60 & echo $! > child; wait"], dict(os.environ), str(tmp_path), 120,
                   stop_when=lambda: time.monotonic() - t0 > 1.0)
    assert rc == 124 and time.monotonic() - t0 < 10
    child = int((tmp_path / "child").read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert run_group(["true"], dict(os.environ), str(tmp_path), 10, stop_when=lambda: False) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_third_round_that_cannot_be_measured_leaves_the_two_rounds_standing(tmp_path, shm_dir, monkeypatch):
    """The third measurement of a reader count (where the first two disagree) is a check: when it
    cannot be taken (the fresh samples ran out, as with 8 readers on a dataset the jobs mostly
    read), the calibration says so and writes its scenario from the two rounds it has."""
    from hpcstagger.errors import ModelError
    from hpcstagger.measure import spec_calibration as sc_mod
    from hpcstagger.spec.jobspec import Spec

    spec_path = _spec(tmp_path)
    real = sc_mod.measure_levels
    rounds = []

    def levels(*args, **kwargs):
        rounds.append(list(args[2]))
        if len(rounds) == 3:  # the third round: the readers' samples ran out (the fault, injected)
            raise ModelError("a calibration reader read all of its 14 samples in 0.004 s: too few fresh samples")
        return real(*args, **kwargs)

    monkeypatch.setattr(sc_mod, "measure_levels", levels)
    monkeypatch.setattr(sc_mod, "disagreeing", lambda found, limit=0.1: [1])
    monkeypatch.chdir(tmp_path)
    for name, value in _env(shm_dir).items():
        monkeypatch.setenv(name, value)
    # 30 s: the jobs' launches take 3 to 7 s each on a 2-core machine, and the third round needs room
    cal = sc_mod.calibrate_spec(Spec.from_toml(spec_path), budget=30, out=tmp_path / "scenario.toml", progress=False)
    assert len(rounds) == 3 and rounds[2] == [1]
    assert cal.measurements["measured_again"] == []
    assert (tmp_path / "scenario.toml").exists() and len(cal.scenario.storage.bandwidth) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_third_round_fits_in_what_the_budget_has_left(tmp_path, shm_dir, monkeypatch):
    """With every level's two measurements apart (forced), the third round measures only the levels
    the budget has time left for, and says which it left: a 3-job spec of 4 workers each was 6 s
    over its 60 s budget when the third round took every such level at its shortest window."""
    from hpcstagger.measure import spec_calibration as sc_mod
    from hpcstagger.spec.jobspec import Spec

    spec_path = _spec(tmp_path)
    monkeypatch.setattr(sc_mod, "disagreeing", lambda found, limit=0.1: sorted({int(m["readers"]) for m in found}))
    monkeypatch.chdir(tmp_path)
    for name, value in _env(shm_dir).items():
        monkeypatch.setenv(name, value)
    said: list[str] = []
    decided: list[float] = []  # when the third round was planned: the first two rounds' end

    def say(self, message: str) -> None:
        if "measure them once more" in message or "measuring them once more" in message:
            decided.append(time.monotonic() - t0)
        said.append(message)

    monkeypatch.setattr(sc_mod._Run, "say", say)
    t0 = time.monotonic()
    cal = sc_mod.calibrate_spec(Spec.from_toml(spec_path), budget=16, readers=8, out=tmp_path / "scenario.toml",
                                progress=False)
    took = time.monotonic() - t0
    again = cal.measurements["measured_again"]
    counts = {k: sum(1 for m in cal.measurements["source"] if int(m["readers"]) == k) for k in range(1, 9)}
    # The third round fits in what the budget has left. (The jobs' launches and the two rounds' shortest
    # windows can take longer than 16 s on a slow machine: then the third round must add nothing.)
    assert decided and took < max(16, decided[0]) + 1.5, (took, decided, counts, said)
    assert [k for k in range(1, 9) if counts[k] >= 3] == again
    skipped = [k for k in range(1, 9) if counts[k] == 2]
    assert skipped, (counts, said)  # eight levels cannot all be measured a third time in what 16 s leave
    assert any("no time left to measure them once more" in m and ", ".join(map(str, skipped)) in m for m in said)
