"""``hpcstagger slurm render|submit SPEC``: the sbatch script for a job spec, and its submission."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from hpcstagger.cli._args import add_spec
from hpcstagger._version import __version__
from hpcstagger.errors import LaunchError, ConfigError
from hpcstagger.cli.cmd_launch import format_result


def register(sub: Any) -> None:
    p = sub.add_parser("slurm", help="render or submit the sbatch script of a job spec",
                       description="Render the sbatch script that runs a job spec's co-located jobs on one "
                                   "node, or submit it (optionally waiting for it to end).")
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = acts.add_parser("render", help="print the sbatch script", description="Print the sbatch script for SPEC.")
    add_spec(r)
    r.add_argument("--out", metavar="FILE", help="write the script to FILE instead of standard output")
    r.set_defaults(func=run_render)
    s = acts.add_parser("submit", help="submit the sbatch script",
                        description="Render SPEC's sbatch script into <workdir>/slurm/, submit it with sbatch, "
                                    "and print the job id. With --wait, poll the job until it ends (asking the "
                                    "controller every 0.2 s at first, then up to every 2 s, and at once when "
                                    "the script has written its end marker), print each job's times, and exit "
                                    "non-zero unless it completed.")
    add_spec(s)
    s.add_argument("--wait", action="store_true", help="wait for the job to end")
    s.add_argument("--timeout", type=float, metavar="S",
                   help="with --wait, give up after S seconds (default: [run] timeout + 10 minutes)")
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="an extra sbatch argument (repeatable), e.g. --sbatch-arg=--qos=debug")
    s.set_defaults(func=run_submit)
    d = acts.add_parser("run-dir", help="create and print the status directory of a batch job's run",
                        description="Create <workdir>/runs/slurm-<job id> for SPEC (the job id from --job-id, "
                                    "else SLURM_JOB_ID) and print its path. Batch scripts that start the ranks "
                                    "themselves (slurm/hetjob.sbatch) use it as HPCSTAGGER_RUN_DIR, so that "
                                    "'hpcstagger status SPEC' finds the run.")
    add_spec(d)
    d.add_argument("--job-id", metavar="ID", help="the Slurm job id (default: SLURM_JOB_ID)")
    d.set_defaults(func=run_run_dir)
    pr = acts.add_parser("prepare", help="size the cache and start the plan, before a batch job's ranks",
                         description="Inside a batch job, before its ranks start, do what hpcstagger launch does "
                                     "first: size SPEC's [cache] capacity \"auto\" from the memory free now, and "
                                     "start world rank 0's planning process, which plans while the ranks start "
                                     "and leaves its plan in RUN_DIR. Prints the variables for the ranks as "
                                     "'export NAME=VALUE' lines (the rendered batch script evaluates them); why "
                                     "the cache got its size goes to standard error.")
    add_spec(pr, then="run_dir")
    pr.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                    help="the run's status directory, which must exist (the batch script's $run_dir)")
    pr.set_defaults(func=run_prepare)


def _render(spec: Any) -> str:
    from hpcstagger.colocated.batch import render_batch

    return render_batch(spec, python_bin=os.path.dirname(sys.executable), version=__version__)


def run_render(args: argparse.Namespace) -> int:
    from hpcstagger._io import atomic_write
    from hpcstagger.spec.jobspec import Spec

    text = _render(Spec.from_toml(args.spec))
    if args.out:
        atomic_write(args.out, text.encode(), mode=0o755)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def run_submit(args: argparse.Namespace) -> int:
    from hpcstagger._io import atomic_write
    from hpcstagger.slurm import submit, wait_for_job
    from hpcstagger.spec.jobspec import Spec

    from hpcstagger.colocated.batch import END_MARKER
    from hpcstagger.colocated.launch import collect_results

    spec = Spec.from_toml(args.spec)
    script_dir = os.path.join(spec.run.workdir, "slurm")
    os.makedirs(script_dir, exist_ok=True)
    script = os.path.join(script_dir, f"{spec.run.name}.sbatch")
    atomic_write(script, _render(spec).encode(), mode=0o755)
    workdir = os.path.dirname(spec.path)
    job_id = submit(script, ["--chdir", workdir, *args.sbatch_arg])
    output = os.path.join(workdir, spec.slurm.output.replace("%x", spec.run.name).replace("%j", str(job_id)))
    print(f"submitted job {job_id} (script {script}, output {output})", flush=True)
    if not args.wait:
        return 0
    run_dir = slurm_run_dir(spec.run.workdir, str(job_id))
    # the controller is asked every 0.2 s at first, then up to every 2 s; the script's end marker,
    # a stat every 0.2 s, brings the quick queries back at the job's end
    marker = os.path.join(run_dir, END_MARKER)
    record = wait_for_job(job_id, args.timeout or spec.run.timeout + 600, max_poll=2.0,
                          ended=lambda: os.path.exists(marker))
    state, code = record.get("JobState", "?"), record.get("ExitCode", "?")
    if os.path.isdir(run_dir):
        print(format_result(collect_results(spec, run_dir)))
    if state != "COMPLETED":
        raise LaunchError(f"job {job_id} ended {state} (exit code {code}); see {output}")
    print(f"job {job_id} COMPLETED")
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from hpcstagger.colocated import planahead
    from hpcstagger.spec import cachesize, runenv
    from hpcstagger.spec.jobspec import Spec

    if not args.run_dir:
        raise ConfigError("no run directory: give it after the spec (hpcstagger slurm prepare SPEC RUN_DIR)")
    spec = Spec.from_toml(args.spec)
    if not os.path.isdir(args.run_dir):
        raise ConfigError(f"the run directory {args.run_dir} does not exist; create it first (mkdir -p)")
    env = {**os.environ, runenv.SPEC: spec.path}
    out = []
    sized = cachesize.for_launch(spec, env)
    if sized is not None:
        env[runenv.CACHE_CAPACITY] = str(sized.capacity)
        out.append(f"export {runenv.CACHE_CAPACITY}={sized.capacity}")
        print(f"hpcstagger slurm prepare: [cache] capacity auto: {sized.why}", file=sys.stderr)
    mode = env.get(runenv.MODE) or spec.plan.mode
    env[runenv.RUN_DIR] = args.run_dir
    ahead, _ = planahead.start(spec, mode, env, Path(args.run_dir), [j.name for j in spec.jobs], detach=True)
    out += [f"export {k}={shlex.quote(v)}" for k, v in ahead.items()]
    print("\n".join(out))
    return 0


def slurm_run_dir(workdir: str, job_id: str) -> str:
    """The status directory of Slurm job ``job_id`` for a spec whose workdir is ``workdir``."""
    return os.path.join(workdir, "runs", f"slurm-{job_id}")


def run_run_dir(args: argparse.Namespace) -> int:
    from hpcstagger.spec.jobspec import Spec

    job_id = args.job_id or os.environ.get("SLURM_JOB_ID", "")
    if not job_id:
        raise ConfigError("no job id: run this inside a Slurm job (SLURM_JOB_ID) or pass --job-id")
    if not re.fullmatch(r"\d+(?:[_+]\d+)?", job_id):
        raise ConfigError(f"--job-id {job_id!r} is not a Slurm job id (digits, e.g. 1234 or 1234_5)")
    run_dir = slurm_run_dir(Spec.from_toml(args.spec).run.workdir, job_id)
    os.makedirs(run_dir, exist_ok=True)
    print(run_dir)
    return 0
