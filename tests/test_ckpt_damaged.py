"""Damaged checkpoints are loud: load() warns or raises, `ckpt ls` marks them, the ckpt CLI's errors
are one line. Real torch state saved by AsyncCheckpointer, damaged for real (cut, flipped, deleted)."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import warnings

import h5py
import pytest
import torch

from hpcstagger.checkpoint import AsyncCheckpointer, load
from hpcstagger.checkpoint.load import load_entry
from hpcstagger.cli import build_parser
from hpcstagger.cli import main as cli_main
from hpcstagger.errors import CheckpointError, CheckpointWarning, HpcstaggerError
from support.ckpt_util import plain, same, trained
from support.cli import run_cli

pytestmark = pytest.mark.timeout(180)

SHARD = "shard-00000-of-00001.h5"


def _step(n: int) -> str:
    return f"step-{n:09d}"


def _state(model, opt, step):
    return {"model": model, "optimizer": opt, "step": step, "bf": torch.arange(5).bfloat16()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three committed checkpoints (steps 0-2) and what each step's state loads as."""
    d = tmp_path_factory.mktemp("ckpts")
    model, opt = trained(width=128)
    expected = {}
    with AsyncCheckpointer(d, keep=5) as ck:
        for step in range(3):
            ck.save(step, _state(model, opt, step))
            ck.wait()
            expected[step] = plain(_state(model, opt, step))
    return d, expected


@pytest.fixture
def ckdir(saved, tmp_path):
    """A private copy of the three checkpoints, to damage."""
    return shutil.copytree(saved[0], tmp_path / "ck")


def _truncate(path, by=100):
    os.truncate(path, os.path.getsize(path) - by)


def _flip_tensor_byte(shard, dataset="model/0.weight"):
    with h5py.File(shard, "r") as f:
        off = f[dataset].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 0x01]))


def _load_recording(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = load(*args, **kwargs)
    return state, [w for w in caught if issubclass(w.category, CheckpointWarning)]


# ------------------------------------------------------------------------------- load()
def test_checkpoint_warning_is_a_user_warning_of_the_family():
    assert issubclass(CheckpointWarning, UserWarning) and issubclass(CheckpointWarning, HpcstaggerError)
    assert not issubclass(CheckpointWarning, CheckpointError)  # `except CheckpointError` never swallows it


def test_load_warns_once_per_skipped_step_naming_step_and_file(saved, ckdir):
    _, expected = saved
    _truncate(ckdir / _step(2) / SHARD)
    _flip_tensor_byte(ckdir / _step(1) / SHARD)
    state, caught = _load_recording(ckdir)
    same(expected[0], state)
    assert len(caught) == 2, [str(w.message) for w in caught]
    first, second = (str(w.message) for w in caught)
    assert "step 2" in first and str(ckdir / _step(2) / SHARD) in first and "truncated" in first
    assert "step 1" in second and str(ckdir / _step(1) / SHARD) in second and "fails its checksum" in second
    assert all("loaded step 0" in m for m in (first, second))
    assert "\n" not in first + second
    # The warning points at the caller, not at hpcstagger's insides.
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]


def test_a_sound_load_does_not_warn(saved, ckdir):
    state, caught = _load_recording(ckdir)
    assert caught == [] and state["step"] == 2


def test_strict_raises_instead_of_falling_back(saved, ckdir):
    os.unlink(ckdir / _step(2) / SHARD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and does not warn on the way
        with pytest.raises(CheckpointError) as info:
            load(ckdir, strict=True)
    msg = str(info.value)
    assert "step 2" in msg and str(ckdir / _step(2) / SHARD) in msg and "is missing" in msg
    assert "step=N" in msg and "hpcstagger ckpt verify" in msg and "\n" not in msg
    # An older step asked for explicitly loads, strict or not; the damaged one asked for raises.
    same(saved[1][1], load(ckdir, step=1, strict=True))
    with pytest.raises(CheckpointError, match="checkpoint of step 2 .* is damaged: shard .* is missing"):
        load(ckdir, step=2)


def test_strict_takes_an_intact_copy_of_the_same_step_on_another_level(saved, tmp_path, ckdir):
    slow = shutil.copytree(ckdir, tmp_path / "slow")
    _flip_tensor_byte(ckdir / _step(2) / SHARD)
    entry, state = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry, state = load_entry([ckdir, slow], strict=True)
    same(saved[1][2], state)
    assert entry.step == 2 and entry.path == str(slow / _step(2))
    assert len(caught) == 1 and "a copy on another level" in str(caught[0].message)


def test_a_damaged_manifest_is_named(saved, ckdir):
    m = ckdir / _step(2) / "manifest.json"
    m.write_text(m.read_text().replace('"step": 2', '"step": 7'))
    state, caught = _load_recording(ckdir)
    assert state["step"] == 1
    assert len(caught) == 1 and str(m) in str(caught[0].message) and "manifest checksum mismatch" in str(
        caught[0].message)


def test_unreadable_places_are_checkpoint_errors(saved, ckdir, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match="cannot list the checkpoints in"):
        load(a_file)
    m = ckdir / _step(2) / "manifest.json"
    os.unlink(m)
    os.mkdir(m)  # a manifest that cannot be read: the step is skipped, loudly
    state, caught = _load_recording(ckdir)
    assert state["step"] == 1 and len(caught) == 1 and f"{m} cannot be read" in str(caught[0].message)


def test_every_step_damaged_is_one_line_error(ckdir):
    for step in range(3):
        _truncate(ckdir / _step(step) / SHARD)
    with pytest.raises(CheckpointError) as info:
        load(ckdir)
    msg = str(info.value)
    assert "every committed one is damaged" in msg and "\n" not in msg
    assert all(str(ckdir / _step(s) / SHARD) in msg for s in range(3))


# ----------------------------------------------------------------------------- ckpt ls
def _ls(d, *extra):
    out = run_cli("ckpt", "ls", "--json", *extra, str(d))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return {c["step"]: c for c in json.loads(out.stdout)["checkpoints"]}


def test_ls_marks_missing_and_cut_shards_damaged_and_names_the_file(ckdir):
    _truncate(ckdir / _step(2) / SHARD)
    os.unlink(ckdir / _step(1) / SHARD)
    rows = _ls(ckdir)
    assert rows[2]["status"] == "damaged" and str(ckdir / _step(2) / SHARD) in rows[2]["error"]
    assert "truncated" in rows[2]["error"]
    assert rows[1]["status"] == "damaged" and "is missing" in rows[1]["error"]
    assert rows[0]["status"] == "committed"
    table = run_cli("ckpt", "ls", str(ckdir)).stdout.splitlines()
    assert [ln.split()[:2] for ln in table[1:]] == [["2", "damaged"], ["1", "damaged"], ["0", "committed"]]
    assert SHARD in table[1] and "is missing" in table[2]


def test_ls_is_cheap_and_ls_verify_checksums(ckdir, monkeypatch, capsys):
    _flip_tensor_byte(ckdir / _step(2) / SHARD)  # the same size: only a checksum sees it
    shard1 = ckdir / _step(1) / SHARD
    shard1.write_bytes(b"\0" * shard1.stat().st_size)  # replaced by zeros of the same size
    # Plain ls opens no shard: fail any attempt to.
    real_open, real_file = builtins.open, h5py.File

    def no_shard(path, *a, **k):
        assert not str(path).endswith(".h5"), f"ckpt ls read shard data: {path}"
        return real_open(path, *a, **k)

    def no_h5(path, *a, **k):
        raise AssertionError(f"ckpt ls opened {path} with h5py")

    monkeypatch.setattr(builtins, "open", no_shard)
    monkeypatch.setattr(h5py, "File", no_h5)
    assert cli_main(["ckpt", "ls", "--json", str(ckdir)]) == 0
    monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setattr(h5py, "File", real_file)
    rows = {c["step"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert [rows[s]["status"] for s in (2, 1, 0)] == ["committed"] * 3
    rows = _ls(ckdir, "--verify")
    assert rows[2]["status"] == "damaged" and "checksum mismatch" in rows[2]["error"]
    assert rows[1]["status"] == "damaged" and str(shard1) in rows[1]["error"]
    assert rows[0]["status"] == "committed"


# ------------------------------------------------------------------------ ckpt export
def test_export_names_the_step_and_warns_once(saved, ckdir, tmp_path):
    _truncate(ckdir / _step(2) / SHARD)
    out_file = tmp_path / "s.pt"
    out = run_cli("ckpt", "export", str(ckdir), "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"wrote step 1 from {ckdir / _step(1)} to {out_file} ")
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcstagger ckpt: warning: "), out.stderr
    assert "step 2" in lines[0] and SHARD in lines[0]
    same(saved[1][1], torch.load(out_file, weights_only=True))
    # One step directory as DIR exports that step.
    out = run_cli("ckpt", "export", str(ckdir / _step(0)), "--out", str(out_file))
    assert out.returncode == 0 and out.stdout.startswith("wrote step 0 ") and out.stderr == ""


# ------------------------------------------------------------------ every error is one line
def _cases(d, tmp):
    """(argv, exit status, a fragment of the error) for each error path of the ckpt commands."""
    good, bad = str(d["good"]), str(d["bad"])
    a_file, empty, out = str(d["file"]), str(d["empty"]), str(tmp / "o.pt")
    return [
        (["ls", str(tmp / "nope")], 1, "does not exist"),
        (["ls", a_file], 1, "is not a directory"),
        (["ls"], 2, "the following arguments are required: DIR"),
        (["ls", "--bogus", good], 2, "unrecognized arguments"),
        (["verify", str(tmp / "nope")], 1, "does not exist"),
        (["verify", a_file], 1, "is not a directory"),
        (["verify", empty], 1, "no checkpoints in"),
        (["verify", "--step", "9", good], 1, "no checkpoint of step 9"),
        (["verify", "--step", "x", good], 2, "invalid int value"),
        (["export", str(tmp / "nope"), "--out", out], 1, "does not exist"),
        (["export", a_file, "--out", out], 1, "is not a directory"),
        (["export", empty, "--out", out], 1, "no committed checkpoint in"),
        (["export", good, "--step", "9", "--out", out], 1, "no committed checkpoint of step 9"),
        (["export", bad, "--step", "2", "--out", out], 1, "checkpoint of step 2"),
        (["export", str(d["all_bad"]), "--out", out], 1, "every committed one is damaged"),
        (["export", good, "--out", str(tmp)], 1, "is a directory"),
        (["export", good, "--out", str(tmp / "no" / "dir" / "o.pt")], 1, "is not a directory"),
        (["export", good, "--out", a_file + "/o.pt"], 1, "is not a directory"),
        (["export", str(d["good"] / _step(1)), "--step", "2", "--out", out], 1, "disagrees"),
        (["export", str(d["good"] / _step(5)), "--out", out], 1, "does not exist"),
        (["export", good, "--out", "/sys/hpcstagger-export.pt"], 1, "cannot write"),  # sysfs creates no files
        (["ls", str(d["odd"])], 0, ""),  # a manifest that cannot be read is a damaged row, not an error
        (["export", good], 2, "the following arguments are required: --out"),
        (["bogus", good], 2, "invalid choice"),
    ]


@pytest.fixture(scope="module")
def error_dirs(saved, tmp_path_factory):
    root = tmp_path_factory.mktemp("errs")
    d = {"good": shutil.copytree(saved[0], root / "good"), "bad": shutil.copytree(saved[0], root / "bad"),
         "all_bad": shutil.copytree(saved[0], root / "all_bad"), "file": root / "a-file", "empty": root / "empty"}
    _truncate(d["bad"] / _step(2) / SHARD)
    for step in range(3):
        os.unlink(d["all_bad"] / _step(step) / SHARD)
    d["odd"] = shutil.copytree(saved[0], root / "odd")
    os.unlink(d["odd"] / _step(1) / "manifest.json")
    os.mkdir(d["odd"] / _step(1) / "manifest.json")  # reading it fails with IsADirectoryError
    d["file"].write_text("not a checkpoint\n")
    d["empty"].mkdir()
    return d


@pytest.mark.parametrize("case", range(24))
def test_every_ckpt_error_is_one_line(error_dirs, tmp_path, case):
    cases = _cases(error_dirs, tmp_path)
    assert len(cases) == 24, "keep the parametrize range in step with _cases"
    argv, status, fragment = cases[case]
    out = run_cli("ckpt", *argv)
    assert out.returncode == status, (argv, out.stdout, out.stderr)
    if status == 0:
        assert out.stderr == "" and "damaged" in out.stdout, out.stdout
        return
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("hpcstagger"), (argv, out.stderr)
    assert "Traceback" not in out.stderr and fragment in out.stderr, (argv, out.stderr)
    assert not (tmp_path / "o.pt").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".o.pt.tmp")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes through any permission bits")
def test_unreadable_and_unwritable_paths_are_one_line(error_dirs, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    shut = shutil.copytree(error_dirs["good"], tmp_path / "shut")
    os.chmod(shut, 0)
    try:
        for argv in (["export", str(error_dirs["good"]), "--out", str(locked / "o.pt")],
                     ["ls", str(shut)], ["verify", str(shut)], ["export", str(shut), "--out", str(tmp_path / "o.pt")]):
            out = run_cli("ckpt", *argv)
            assert out.returncode == 1 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    finally:
        os.chmod(shut, 0o700)


def test_verify_of_a_damaged_step_reports_one_line_per_problem(error_dirs):
    out = run_cli("ckpt", "verify", "--step", "2", str(error_dirs["bad"]))
    assert out.returncode == 1 and out.stderr == "" and "Traceback" not in out.stdout
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step 2: PROBLEM: shard ") and "truncated" in lines[0]
    assert lines[-1] == "0 of 1 checkpoint(s) sound; problems in step(s) 2"


# ----------------------------------------------------------------------------- --help
def test_every_ckpt_positional_has_help():
    ckpt = next(a for a in build_parser()._actions if a.dest == "command").choices["ckpt"]  # private, no accessor
    subs = next(a for a in ckpt._actions if a.dest == "ckpt_command").choices
    assert set(subs) >= {"ls", "verify", "export"}
    for name, parser in subs.items():
        positionals = [a for a in parser._actions if not a.option_strings]
        assert positionals, name
        for a in positionals:
            assert a.help and len(a.help) > 10, f"ckpt {name}: {a.metavar or a.dest} has no help"
            assert " ".join(a.help.split()[:6]) in " ".join(parser.format_help().split()), name
