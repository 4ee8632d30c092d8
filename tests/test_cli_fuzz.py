"""Bad input across every subcommand, never a traceback.

Seeded (deterministic) random and mutated command lines over both TOML schemas (the job spec of
spec/jobspec.py and the scenario of model/scenario.py), stall profiles, checkpoint and run
directories and a run history with damaged files: unknown flags, missing values, bad numbers, paths
that are directories or missing, empty files, binary junk, values of the wrong type, unknown tables
and keys, negative, NaN and huge numbers.
Each runs through ``hpcstagger.cli.main(argv)`` in this process (a handful through the console
script in a subprocess) and must end with exit status 0, 1 or 2, no exception but SystemExit, no
"Traceback", and an error of one line. Commands that would start long work when given valid
input (launch, sweep, demo, calibrate, exec, slurm submit) get only input that fails validation,
launch always with --dry-run; clean only on the fuzz's own shm root and gate directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from hpcstagger.cli import main
from hpcstagger.spec.jobspec import Spec
from hpcstagger.errors import HpcstaggerError
from hpcstagger.model import Scenario
from support.cli import BIN, cli_env
from support.spec_util import fill, write_spec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SEED = 20261126
CASES = 4000  # command lines drawn (repeats and unsafe ones skipped); about 20 s on 2 busy cores
CALL_LIMIT = 60  # seconds one command may take before it counts as hung (SIGALRM; pytest-timeout uses a thread)
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


# ------------------------------------------------------------------------------ TOML, written back
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def to_toml(data: dict[str, Any]) -> str:
    """A dict of tables (and arrays of tables) as TOML; a scalar at the top is written first."""
    head, body = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            body.append(f"[{key}]")
            body += [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()]
        elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            for item in value:
                body.append(f"[[{key}]]")
                body += [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in item.items()]
        else:
            head.append(f"{json.dumps(str(key))} = {_toml_value(value)}")
    return "\n".join(head + body) + "\n"


BAD_VALUES: list[Any] = [-1, -1e9, 0, 0.0, float("nan"), float("inf"), float("-inf"), 1e308, 2**62, 1e-300,
                         "x", "", "12 parsecs", True, [], [1, "a"], {"a": 1}, [float("nan")], "\u00e9\u00e9",
                         "-5", "1e999", 3.5]


def _leaves(data: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _leaves(v, (*path, k))] or [path]
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        return [p for i, v in enumerate(data) for p in _leaves(v, (*path, i))]
    return [path]


def _set(data: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


def _drop(data: Any, path: tuple) -> None:
    for key in path[:-1]:
        data = data[key]
    del data[path[-1]]


def mutate(rng: random.Random, data: dict[str, Any]) -> str:
    """A copy of ``data`` with one to three faults, as TOML text."""
    d = json.loads(json.dumps(data))
    for _ in range(rng.randint(1, 3)):
        leaves = [p for p in _leaves(d) if p]
        kind = rng.random()
        if kind < 0.55 and leaves:
            _set(d, rng.choice(leaves), rng.choice(BAD_VALUES))
        elif kind < 0.7 and leaves:
            _drop(d, rng.choice(leaves))
        elif kind < 0.8:
            tables = [k for k, v in d.items() if isinstance(v, dict)]
            if tables:
                d[rng.choice(tables)][rng.choice(["bogus", "sample_time", "command", "epochs", "name"])] = 1
        elif kind < 0.88:
            d[rng.choice(["bogus", "storage", "run", "node", "plan"])] = {"x": 1}
        elif kind < 0.94 and d.get("job"):
            d["job"] = rng.choice([[], {}, "a", [1, 2], d["job"] * 2, d["job"][:1]])
        else:
            d.pop(rng.choice(list(d)), None)
    return to_toml(d)


def mutate_json(rng: random.Random, data: dict[str, Any]) -> str:
    """A copy of ``data`` with one or two values of a wrong type, as JSON (NaN and Infinity too)."""
    d = json.loads(json.dumps(data))
    for _ in range(rng.randint(1, 2)):
        _set(d, rng.choice([p for p in _leaves(d) if p]), rng.choice(BAD_VALUES))
    return json.dumps(d)


def junk(rng: random.Random, valid: str) -> bytes:
    """Text that is no valid TOML of either kind, or not text at all."""
    choice = rng.randrange(7)
    if choice == 0:
        return rng.randbytes(rng.randint(1, 300))
    if choice == 1:
        return b""
    if choice == 2:
        return valid.encode()[: rng.randint(1, max(1, len(valid) - 1))]  # cut short
    if choice == 3:
        return b"[[job]]\n"
    if choice == 4:
        return b"\xff\xfe" + valid.encode("utf-16-le")
    if choice == 5:
        return valid.replace("=", "==", 1).encode()
    return b"job = 3\nrun = \"x\"\n"


# ------------------------------------------------------------------------------------ the world
# Every table and most keys of both schemas, so that each can be broken (valid as written).
SCENARIO = """
[dataset]
samples = 300
sample_bytes = 2000
[storage]
bandwidth = [2.0e6, 3.0e6, 3.5e6]
fit_baseline = 0.9
spread = [0.01, 0.02, 0.02]
[cache]
capacity = 3.0e5
policy = "minio"
hit_bandwidth = 1.0e9
initial = 0.1
coalesce = false
[loader]
prefetch = 2
[node]
cores = 2
[[job]]
name = "a"
sample_time = 0.0004
epochs = 2
ranks = 1
workers = 1
batch = 4
startup = 0.2
epoch_start = 0.01
order = "shuffle"
[[job]]
name = "b"
sample_time = 0.0002
epochs = 1
handoff = 0.0001
prep_time = 0.0001
prefetch = 3
"""
SPEC_TABLES = """
[checkpoint]
every = 5
keep = 2
flush = "self"
[loader]
share = false
pace = "wait"
window = 0
[slurm]
partition = "debug"
time = "00:10:00"
cpus_per_task = 1
launcher = "srun"
options = ["--exclusive"]
setup = ["module load mpi"]
"""
class World:
    """The files the command lines use, under ``tmp``: valid and broken specs and scenarios, a
    profile, checkpoint directories, junk; and for each file whether it is a loadable spec."""

    def __init__(self, tmp: Path, shm_root: str, rng: random.Random):
        self.tmp, self.root, self.rng = tmp, shm_root, rng
        self.spec = write_spec(tmp, shm_root)
        self.scenario = str(tmp / "s.toml")
        Path(self.scenario).write_text(SCENARIO)
        text = Path(self.spec).read_text().replace("[plan]\n", "[plan]\nmax_delay = 5.0\njitter = 0.1\n")
        Path(self.spec).write_text(text.replace("[[job]]", SPEC_TABLES + "[[job]]", 1)
                                   .replace('command = "python work.py"\n', 'command = "python work.py"\nranks = 1\n'
                                            'epochs = 2\nsample_time = 0.001\nenv = {X = "1"}\n', 1))
        assert Spec.from_toml(self.spec) and Scenario.from_toml(self.scenario)
        spec_data = tomllib.loads(Path(self.spec).read_text())
        scen_data = tomllib.loads(Path(self.scenario).read_text())
        self.specs: list[str] = []
        self.scenarios: list[str] = []
        for i in range(60):
            self.specs.append(self._write(f"spec-{i}.toml", mutate(rng, spec_data)))
            self.scenarios.append(self._write(f"scen-{i}.toml", mutate(rng, scen_data)))
        self.junk = [self._write(f"junk-{i}.toml", junk(rng, Path(self.spec).read_text())) for i in range(15)]
        self.dir = str(tmp / "adir")
        os.mkdir(self.dir)
        self.gates = str(tmp / "gates")  # never the real gate directory: others' gates live there
        os.mkdir(self.gates)
        self.missing = str(tmp / "missing.toml")
        self.profile = self._profile()
        profile = json.loads(Path(self.profile).read_text())
        self.profiles = [self._write(f"prof-{i}.json", mutate_json(rng, profile)) for i in range(20)]
        self.ckpt = self._ckpts()
        self.runs = [self._run_dir(i) for i in range(8)]
        self.unplanned = self._write("unplanned.toml", Path(self.spec).read_text().replace('scenario = "s.toml"', ""))
        self._history()
        fill(shm_root, 2)  # cache "warm", for cache stats/clear
        self.loadable = {p for p in [self.spec, *self.specs, *self.scenarios, *self.junk] if _loads(p)}

    def _write(self, name: str, text: str | bytes) -> str:
        path = self.tmp / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(path)

    def _profile(self) -> str:
        from hpcstagger.profile import StallProfiler

        prof = StallProfiler("a")
        for _ in range(6):
            prof.record(0.002, 0.004, samples=4)
        path = str(self.tmp / "prof.json")
        prof.save(path)
        return path

    def _run_dir(self, i: int) -> str:
        """A run directory with status files of jobs a and b, one of them broken as a fault would."""
        good = {"job": "a", "rank": 0, "state": "done", "delay": 0.0, "mode": "plan", "metrics": {},
                "timings": {"started_at": 1.0, "finished_at": 2.0}, "release": {"at": 0.5, "planned": 0.4},
                "plan": {"predicted": {"plan": 2.0}, "scenario": {}, "learn": {"why": "x"}}}
        path = self.tmp / "runs" / f"r{i}"
        path.mkdir(parents=True)
        for job in ("a", "b"):
            rec = json.loads(json.dumps(good))
            rec["job"] = job
            text = json.dumps(rec)
            if job == "a":
                text = mutate_json(self.rng, rec)
            (path / f"{job}.0.json").write_text(text)
        (path / "steer.json").write_text(self.rng.choice(["[1]", "{}", "x", '{"decisions": 3}']))
        (path / "cold-cache.json").write_text(self.rng.choice(["[1]", "{}", "x", '{"cache": 3}', '{"cache": {}}']))
        return str(path)

    def _history(self) -> None:
        """The spec's run history with damaged records and observed runs, as the watcher writes them."""
        from hpcstagger.stagger import history as H

        spec = Spec.from_toml(self.spec)
        node = H.node_identity()
        record = {"version": 1, "time": 4e9, "date": "2096-01-01 00:00:00", "source": 0.9, "jobs": {"a": 1.1},
                  "startup": {"a": 0.5}, "node": node, "run_jobs": ["a", "b"], "run_dir": self.runs[0], "seen": {},
                  "scenario": {"sha256": H.scenario_digest(spec.plan.scenario)}}
        meta = {"time": 1.0, "node": node, "mode": "plan", "planned_from": None}
        top = Path(H.history_dir(spec.run.workdir))
        for i in range(6):
            obs = top / f"obs-{i}"
            (obs / "a").mkdir(parents=True)
            (obs / "a" / "job.json").write_text("{}")
            (obs / "source.a.json").write_text("{}")
            (obs / "meta.json").write_text(mutate_json(self.rng, meta))
            (top / f"rec-{i}.json").write_text(mutate_json(self.rng, record))

    def _ckpts(self) -> str:
        top = self.tmp / "ckpt"
        (top / "step-3").mkdir(parents=True)  # no manifest: an interrupted save
        (top / "step-7").mkdir()
        (top / "step-7" / "manifest.json").write_bytes(self.rng.randbytes(64))  # a damaged one
        (top / "step-x").mkdir()
        return str(top)

    def any_file(self) -> str:
        r = self.rng.random()
        if r < 0.12:
            return self.rng.choice([self.dir, self.missing, self.profile, "", "-", "/dev/null"])
        if r < 0.25:
            return self.rng.choice(self.junk)
        return self.rng.choice(self.specs + self.scenarios)


def _loads(path: str) -> bool:
    """Whether ``path`` is a job spec that loads (and so could start work)."""
    try:
        Spec.from_toml(path)
        return True
    except HpcstaggerError:
        return False
    except Exception:
        return True  # its traceback is found by the commands that read it; keep away from the long ones


BAD_NUMBERS = ["abc", "-1", "0", "nan", "inf", "-inf", "1e999", "1e308", "1.5", "", "1,2", "0x10", "-0"]
UNKNOWN_FLAGS = ["--bogus", "--spec-file", "--cold", "--clea", "-x", "--json=1", "--", "---"]


def command_line(w: World) -> tuple[list[str], bool]:
    """A random command line, and whether it may run work that takes long were its input valid."""
    r = w.rng
    spec, scen, anyf, num = (r.choice(w.specs + w.junk + [w.dir, w.missing]), r.choice(w.scenarios + w.junk),
                             w.any_file(), r.choice(BAD_NUMBERS))
    root = ["--root", r.choice([w.root, w.dir, w.missing, w.spec])]
    templates: list[tuple[list[str], bool]] = [
        (["plan", scen], False),
        (["plan", scen, "--jitter", num], False),
        (["plan", scen, "--max-delay", num], False),
        (["plan", scen, "--min-gain", num, "--json"], False),
        (["plan", anyf], False),
        (["launch", spec, "--dry-run"], False),
        (["launch", anyf, "--dry-run", "--mode", r.choice(["plan", "x"])], False),
        (["launch", spec, "--dry-run", "--delays", r.choice(["a=x", "a", "=1", "a=-1", "zz=1", "a=nan"])], False),
        (["launch", w.spec, "--dry-run", "--timeout", num], False),
        (["status", anyf], False),
        (["status", spec, r.choice([w.dir, w.missing, w.spec])], False),
        (["status", w.spec, r.choice([w.dir, w.missing, w.spec])], False),
        (["status", w.spec, r.choice(w.runs), *r.choice([[], ["--json"]])], False),
        (["exec", spec], True),
        (["sweep", spec], True),
        (["sweep", spec, "--staggers", "1,x"], True),
        (["history", anyf], False),
        (["history", r.choice([w.spec, w.unplanned]), *r.choice([[], ["--json"]])], False),
        (["history", r.choice(w.specs), "--json"], False),
        (["calibrate", spec], True),
        (["calibrate", "--spec", anyf, "--budget", num], True),
        (["calibrate", "--source", r.choice(["nomodule:f", "x", "os", ":", "os:nosuch"]), "--job", "a=b:c"], False),
        (["calibrate", "--source", "nomodule:f", "--job", r.choice(["a", "=x:y", "a=nomod:f"])], False),
        (["calibrate", "--history"], False),
        (["calibrate", "--epochs", num], False),
        (["slurm", "render", anyf], False),
        (["slurm", "run-dir", spec, "--job-id", num], False),
        (["slurm", "submit", spec], True),
        (["profile", anyf], False),
        (["profile", w.profile, "--scenario", scen], False),
        (["profile", r.choice(w.profiles), *r.choice([[], ["--json"], ["--scenario", w.scenario]])], False),
        (["profile", w.profile, "--jobs", num], False),
        (["profile", w.profile, "--scenario", w.scenario, "--job", "zz"], False),
        (["cache", "ls", *root], False),
        (["cache", "stats", r.choice(["warm", "nope", ".", "..", "a/b", "-x"]), *root], False),
        (["cache", "clear", r.choice(["nope", ".", "..", "a/b", "x" * 200, "warm/.."]), *root], False),
        (["ckpt", "ls", r.choice([w.ckpt, w.dir, w.missing, w.spec, w.ckpt + "/step-7"])], False),
        (["ckpt", "verify", r.choice([w.ckpt, w.dir, w.missing]), "--step", num], False),
        (["ckpt", "export", r.choice([w.ckpt, w.missing, w.dir]), "--out", r.choice([w.dir, str(w.tmp / "o.pt")])],
         False),
        (["demo", "--samples", num], True),
        (["demo", "--epochs", num], True),
        (["demo", "--calibrate-budget", r.choice(["nan", "inf", "-1", "0", "x"])], True),
        (["demo", "--sweep", r.choice(["nan", "1,x", "-1", "inf", "1,,nan"])], True),
        (["clean", "--root", r.choice([w.root, w.dir, w.missing, w.spec]), "--gate-dir",
          r.choice([w.gates, w.missing, w.spec]), *r.sample(["--dry-run", "--force", "--unused", "--json"], 2)], False),
        (["clean", "--root", w.root, "--gate-dir", w.gates, r.choice(["--forc", "--dry", "--un", "--root"])], False),
        (["info", "--bogus"], False),
        ([r.choice(["nosuch", "plan ", "", "-v"])], False),
        ([], False),
    ]
    argv, long_work = r.choice(templates)
    argv = list(argv)
    roll = r.random()  # one more fault in the command line itself
    if roll < 0.12:
        argv.insert(r.randint(0, len(argv)), r.choice(UNKNOWN_FLAGS))
    elif roll < 0.2 and len(argv) > 1 and argv[-1].startswith("--") is False:
        argv = argv[:-1]  # an option left without its value, or a positional argument missing
    elif roll < 0.25:
        argv = [*argv, "--spec", anyf]
    return argv, long_work


def safe(argv: list[str], long_work: bool, w: World) -> bool:
    """Whether running ``argv`` here is sure not to start long work (or replace this process)."""
    if argv[:1] == ["launch"]:
        return "--dry-run" in argv
    if argv[:1] == ["clean"]:  # only the fuzz's own root and gate directory, whatever else is wrong
        return "--root" in argv and "--gate-dir" in argv and argv[argv.index("--gate-dir") + 1:][:1] != []
    if not long_work:
        return True
    if argv[:1] == ["demo"]:
        return any(a in argv for a in ("nan", "inf", "-inf", "-1", "0", "x", "1,x", "1,,nan", *BAD_NUMBERS))
    return not any(a in w.loadable for a in argv) and not (argv[:1] == ["calibrate"] and "--source" in argv
                                                          and ":" in argv[argv.index("--source") + 1].strip(":")
                                                          and "nomodule" not in argv[argv.index("--source") + 1])


class Hung(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hung(f"ran past {CALL_LIMIT} s")


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` here: (exit status, stdout, stderr). An exception other than SystemExit escapes."""
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CALL_LIMIT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code: Any = main(argv)
            except SystemExit as exc:
                code = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    code = 0 if code is None else code if isinstance(code, int) else 1
    return code, out.getvalue(), err.getvalue()


def problems_of(argv: list[str], code: int, out: str, err: str) -> list[str]:
    """What is wrong with one command's ending: a traceback, an odd exit status, a long error."""
    found = []
    if not [a for a in argv if a not in ("-v", "-vv")] and err.startswith("usage: hpcstagger"):
        return []  # no command: the help, on stderr, exit 2
    if "Traceback" in err or "Traceback" in out:
        found.append("a traceback")
    if code not in (0, 1, 2):
        found.append(f"exit status {code}")
    lines = [ln for ln in err.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    if code != 0 and not out.strip() and len(lines) != 1:
        found.append(f"{len(lines)} lines of error")
    if code == 0 and any("error" in ln for ln in lines):
        found.append("an error with exit status 0")
    elif len(lines) > 1:
        found.append(f"{len(lines)} lines on stderr")
    return [f"{argv}: {p}: {err.strip()[-600:]}" for p in found]


@pytest.fixture
def world(tmp_path, shm_root, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("HPCSTAGGER_", "SLURM_", "OMPI_", "PMI_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HPCSTAGGER_SHM_ROOT", shm_root)
    monkeypatch.chdir(tmp_path)
    return World(tmp_path, shm_root, random.Random(SEED))


def test_bad_command_lines_end_in_one_line_never_a_traceback(world):
    found: list[str] = []
    ran = skipped = 0
    seen: set[tuple[str, ...]] = set()
    for _ in range(CASES):
        argv, long_work = command_line(world)
        if not safe(argv, long_work, world) or tuple(argv) in seen:
            skipped += 1
            continue
        seen.add(tuple(argv))
        ran += 1
        try:
            code, out, err = run_main(argv)
        except Exception:  # the finding: what escaped main
            found.append(f"{argv}: escaped main: {traceback.format_exc(limit=-4)}")
            continue
        found += problems_of(argv, code, out, err)
    assert ran > CASES // 2, (ran, skipped)
    assert not found, f"{len(found)} of {ran} command lines went wrong:\n" + "\n".join(found[:30])


def test_every_subcommand_is_fuzzed(world):
    from hpcstagger.cli import SUBCOMMANDS

    seen = set()
    for _ in range(CASES):
        argv, _ = command_line(world)
        if argv:
            seen.add(argv[0])
    assert set(SUBCOMMANDS) <= seen, set(SUBCOMMANDS) - seen


def test_both_schemas_are_fuzzed_into_their_validators(world):
    """The mutated files reach the validators: most fail them, each with a ConfigError."""
    for paths, load in ((world.specs, Spec.from_toml), (world.scenarios, Scenario.from_toml)):
        failed = 0
        for p in paths:
            try:
                load(p)
            except HpcstaggerError:
                failed += 1
        assert failed > len(paths) // 2, (load, failed)


SUBPROCESS_CASES = [
    ["plan", "{junk}"], ["launch", "{scen}", "--dry-run"], ["calibrate", "{spec}", "--spec", "{spec}"],
    ["history", "{dir}"], ["cache", "stats", "..", "--root", "{root}"], ["ckpt", "verify", "{missing}"],
    ["launch", "{spec}", "--cold"], ["plan", "{scen}", "--jitter", "nan"],
]


@pytest.mark.parametrize("template", SUBPROCESS_CASES, ids=[" ".join(c[:2]) for c in SUBPROCESS_CASES])
def test_the_console_script_fails_in_one_line(world, template):
    values = {"junk": world.junk[0], "scen": world.scenario, "spec": world.spec, "dir": world.dir,
              "root": world.root, "missing": world.missing}
    argv = [a.format(**values) for a in template]
    env = cli_env(HPCSTAGGER_SHM_ROOT=world.root)
    proc = subprocess.run([str(BIN / "hpcstagger"), *argv], capture_output=True, text=True, timeout=120, env=env,
                          cwd=world.tmp)
    assert proc.returncode in (1, 2), (argv, proc.returncode, proc.stdout, proc.stderr)
    assert not problems_of(argv, proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.startswith("hpcstagger")


def test_cache_clear_of_a_name_that_is_no_cache_name_removes_nothing(world):
    keep = Path(world.root) / "keep"
    keep.write_text("x")
    for name in (".", ".."):
        code, _, err = run_main(["cache", "clear", name, "--root", world.root])
        assert code == 1 and f"invalid cache name '{name}'" in err
    assert keep.read_text() == "x" and Path(world.spec).exists()
    keep.unlink()


def test_the_fuzz_is_deterministic(tmp_path, shm_root):
    lines = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        w = World(tmp_path / name, shm_root, random.Random(SEED))
        lines.append([[x.replace(str(tmp_path / name), "") for x in command_line(w)[0]] for _ in range(50)])
        assert Path(w.specs[5]).read_bytes() == Path(str(w.specs[5]).replace(f"/{name}/", "/a/")).read_bytes()
    assert lines[0] == lines[1]
