"""The command line's parsers: options only as spelled in full, a described positional argument
everywhere, the job spec as the first argument (or --spec) in every subcommand that reads one, and
a scenario and a job spec each named as such when given to the other's command."""

from __future__ import annotations

import argparse
import os

import pytest

from hpcstagger.cli import SUBCOMMANDS, build_parser, main
from hpcstagger.cli._args import settle_spec
from hpcstagger.stagger import history as H
from hpcstagger.spec.jobspec import Spec
from support.spec_util import fill, write_spec


def walk(parser: argparse.ArgumentParser, path: str = "hpcstagger"):
    """(command path, parser) for ``parser`` and every parser below it, through every subparsers action."""
    yield path, parser
    for action in parser._actions:  # private, but argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{path} {name}")


PARSERS = list(walk(build_parser()))


def spec_commands() -> list[str]:
    return [path for path, p in PARSERS if any(a.dest == "spec_option" for a in p._actions)]


def test_the_walk_sees_every_registered_subcommand():
    top = {path.split()[1] for path, _ in PARSERS if len(path.split()) > 1}
    assert top == set(SUBCOMMANDS) | {"status", "exec"}  # launch registers status and exec beside itself
    assert {"hpcstagger cache clear", "hpcstagger ckpt verify", "hpcstagger slurm submit"} <= {p for p, _ in PARSERS}


@pytest.mark.parametrize("path, parser", PARSERS, ids=[p for p, _ in PARSERS])
def test_no_parser_takes_abbreviations(path, parser):
    assert parser.allow_abbrev is False, f"{path}: allow_abbrev is on: a prefix of an option would act as the option"


@pytest.mark.parametrize("path, parser", PARSERS, ids=[p for p, _ in PARSERS])
def test_every_positional_argument_is_described(path, parser):
    bare = [a.metavar or a.dest for a in parser._actions
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
            and (not a.help or a.help == argparse.SUPPRESS)]
    assert not bare, f"{path}: positional argument(s) without help text: {bare}"
    if any(not a.option_strings for a in parser._actions):
        assert "positional arguments:" in parser.format_help()


def test_every_subcommand_that_reads_a_spec_takes_it_first():
    assert set(spec_commands()) >= {"hpcstagger calibrate", "hpcstagger launch", "hpcstagger status",
                                    "hpcstagger exec", "hpcstagger sweep", "hpcstagger history",
                                    "hpcstagger slurm render", "hpcstagger slurm submit", "hpcstagger slurm run-dir",
                                    "hpcstagger slurm prepare"}


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_prefix_of_a_destructive_flag_is_a_usage_error_that_empties_nothing(tmp_path, shm_root, capsys):
    path = write_spec(tmp_path, shm_root)
    spec = Spec.from_toml(path)
    fill(shm_root, 3)
    H.write_record(spec.run.workdir, {"time": 1.0, "source": 0.9, "jobs": {}, "node": H.node_identity(),
                                      "scenario": {"sha256": "x"}})
    for argv in (["launch", path, "--cold"], ["launch", path, "--cold-c"], ["history", path, "--cl"],
                 ["history", path, "--clea"]):
        err = _usage_error(argv, capsys)
        assert "unrecognized arguments: --c" in err
    from hpcstagger.cache.store import ShmCache

    cache = ShmCache("warm", None, root=shm_root)
    try:
        assert cache.stats()["entries"] == 3  # not emptied
    finally:
        cache.close()
    assert len(H.read_history(spec.run.workdir)) == 1  # not cleared
    assert not os.path.exists(os.path.join(spec.run.workdir, "runs"))  # no run was started either


def test_the_spec_as_first_argument_or_as_option_and_not_both(tmp_path, capsys):
    missing = str(tmp_path / "nope.toml")
    for argv in (["calibrate", missing], ["calibrate", "--spec", missing], ["status", missing],
                 ["history", "--spec", missing], ["slurm", "render", missing]):
        assert main(argv) == 1, argv  # the spec was taken: reading it fails
        err = capsys.readouterr().err
        assert f"spec file {missing} does not exist" in err and len(err.strip().splitlines()) == 1
    for path in spec_commands():
        words = path.split()[1:]
        # status and slurm prepare: 'status --spec SPEC RUN_DIR' is fine
        extra = ["runs/1"] if path in ("hpcstagger status", "hpcstagger slurm prepare") else []
        err = _usage_error([*words, "a.toml", *extra, "--spec", "b.toml"], capsys)
        assert "the spec is given twice" in err and f"{path} --help" in err
        if path != "hpcstagger calibrate":  # calibrate also measures step factories without a spec
            err = _usage_error(words, capsys)
            assert "required: SPEC" in err


def test_status_takes_its_run_directory_after_the_spec_option():
    parser = build_parser()
    args = parser.parse_args(["status", "--spec", "s.toml", "runs/1"])
    settle_spec(args)
    assert (args.spec, args.run_dir) == ("s.toml", "runs/1")
    args = parser.parse_args(["status", "s.toml", "runs/1"])
    settle_spec(args)
    assert (args.spec, args.run_dir) == ("s.toml", "runs/1")


def test_calibrate_without_a_spec_asks_for_one_or_a_source(capsys):
    assert main(["calibrate"]) == 1
    err = capsys.readouterr().err
    assert "give a job spec (hpcstagger calibrate SPEC), or the source" in err


def test_plan_given_a_job_spec_says_to_pass_the_scenario(tmp_path, capsys):
    path = write_spec(tmp_path, str(tmp_path / "shm"))
    assert main(["plan", path]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "this is a job spec (it has [run]), not a scenario" in err
    assert "give the scenario that 'hpcstagger calibrate SPEC' writes" in err
    # without [run] and [plan], its jobs' commands still tell
    text = (tmp_path / "spec.toml").read_text()
    (tmp_path / "bare.toml").write_text(text[text.index("[dataset]"):text.index("[plan]")]
                                        + text[text.index("[[job]]"):])
    assert main(["plan", str(tmp_path / "bare.toml")]) == 1
    assert "this is a job spec (it has [[job]] command)" in capsys.readouterr().err


def test_launch_given_a_scenario_says_to_pass_the_job_spec(tmp_path, capsys):
    write_spec(tmp_path, str(tmp_path / "shm"))  # writes s.toml, a scenario
    assert main(["launch", str(tmp_path / "s.toml"), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "this is a scenario (it has [storage]), not a job spec: give the job spec" in err
