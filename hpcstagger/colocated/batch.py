"""The sbatch script of a co-located run: pure rendering, a job spec in, script text out.

:func:`render_batch` is tested against golden text; ``hpcstagger slurm submit`` writes its output
and submits it with :func:`hpcstagger.slurm.submit`. :func:`job_wrapper` and
:func:`multiprog_conf` are shared with ``hpcstagger launch --launcher srun``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable

from hpcstagger.spec import runenv
from hpcstagger.spec.jobspec import JobSpec, Spec

__all__ = ["render_batch", "multiprog_conf", "job_wrapper", "END_MARKER"]

_EOF = "HPCSTAGGER_EOF"


def job_wrapper(job: JobSpec, workdir: str) -> str:
    """A small shell script that runs one job's command on each of its ranks (``srun --multi-prog``
    splits its lines on white space, so commands with quoted arguments go through these)."""
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in {runenv.JOB: job.name, **job.env}.items())
    return (f"#!/bin/bash\nexport {env}\ncd {shlex.quote(workdir)}\n"
            f"exec {shlex.join(job.command)}\n")


def multiprog_conf(spec: Spec, wrapper: Callable[[str], str]) -> str:
    """The ``srun --multi-prog`` configuration: each job's task range runs ``bash wrapper(job name)``."""
    conf, first = [], 0
    for job in spec.jobs:
        ranks = f"{first}" if job.ranks == 1 else f"{first}-{first + job.ranks - 1}"
        conf.append(f"{ranks} bash {wrapper(job.name)}")
        first += job.ranks
    return "\n".join(conf) + "\n"


END_MARKER = "batch.exit"
"""The file in the run directory to which the batch script writes its exit code as its last act."""


def render_batch(spec: Spec, *, python_bin: str | None = None, version: str = "") -> str:
    """The sbatch script that runs every job of ``spec`` co-located on one node.

    With ``[slurm] launcher = "srun"`` the jobs start as one ``srun --multi-prog`` step (one MPI
    world, PMI-2) through a small wrapper script per job, since ``--multi-prog`` lines cannot hold
    quoted arguments; with ``"mpiexec"`` as one MPMD ``mpiexec``. Mode sequential starts one step
    per job, one after another. ``python_bin`` (the directory of the Python environment to use) is
    put first on PATH. The script ends with ``hpcstagger status``, which prints each job's times, beside
    ``hpcstagger clean --after-run`` (what the run leaves in /dev/shm, before the job's end kills it),
    then writes its exit code to :data:`END_MARKER` in the run directory.
    """
    sl = spec.slurm
    lines = ["#!/bin/bash",
             f"# hpcstagger batch script for run '{spec.run.name}'"
             f"{', rendered by hpcstagger ' + version if version else ''}.",
             f"# Re-render after editing the spec: hpcstagger slurm render {spec.path or 'SPEC'}",
             f"#SBATCH --job-name={spec.run.name}",
             "#SBATCH --nodes=1",
             f"#SBATCH --ntasks={spec.total_ranks}",
             f"#SBATCH --cpus-per-task={sl.cpus_per_task}",
             f"#SBATCH --time={sl.time}",
             f"#SBATCH --output={sl.output}"]
    if sl.partition:
        lines.append(f"#SBATCH --partition={sl.partition}")
    if sl.account:
        lines.append(f"#SBATCH --account={sl.account}")
    lines += [f"#SBATCH {opt}" for opt in sl.options]
    lines += ["", "set -euo pipefail"]
    if python_bin:
        lines.append(f'export PATH={shlex.quote(python_bin)}:"$PATH"   # the Python environment of hpcstagger')
    lines += list(sl.setup)
    workdir = os.path.dirname(spec.path) if spec.path else "."
    run_dir = f"{spec.run.workdir}/runs/slurm-${{SLURM_JOB_ID}}"
    lines += [f"export {runenv.SPEC}={shlex.quote(spec.path)}",
              f"export {runenv.MODE}={spec.plan.mode}",
              "unset MPIR_CVAR_PMI_VERSION",
              f'run_dir="{run_dir}"',
              'mkdir -p "$run_dir"',
              # as hpcstagger launch does before the ranks: [cache] capacity auto sized once for every process
              # (from the memory free now), and world rank 0's plan started, made while the ranks start
              f'prepared="$(hpcstagger slurm prepare "${runenv.SPEC}" "$run_dir")"',
              'eval "$prepared"',
              "rc=0",
              'step() { if [ "$rc" -eq 0 ]; then "$@" || rc=$?; fi; }   # run until the first failure',
              f'echo "hpcstagger: run {spec.run.name}, mode {spec.plan.mode}, {len(spec.jobs)} job(s) on '
              f'$SLURM_JOB_NODELIST; status in $run_dir"']
    srun = "srun --mpi=pmi2 --kill-on-bad-exit=1"
    if sl.launcher == "mpiexec":
        lines.append(f"cd {shlex.quote(workdir)}")
    else:
        for job in spec.jobs:
            lines += [f'cat > "$run_dir/job-{job.name}.sh" <<\'{_EOF}\'',
                      job_wrapper(job, workdir).rstrip("\n"), _EOF]
    if spec.plan.mode == "sequential":
        for job in spec.jobs:
            env = f'env {runenv.ONLY}={job.name} {runenv.MODE}=sequential {runenv.RUN_DIR}="$run_dir/{job.name}"'
            lines.append(f'mkdir -p "$run_dir/{job.name}"')
            if sl.launcher == "srun":
                lines.append(f'step {env} {srun} --ntasks={job.ranks} bash "$run_dir/job-{job.name}.sh"')
            else:
                lines.append(f"step {env} mpiexec -n {job.ranks} {_env_command(job)}")
    elif sl.launcher == "srun":
        conf = multiprog_conf(spec, lambda name: f"$run_dir/job-{name}.sh").rstrip("\n").split("\n")
        lines += [f'cat > "$run_dir/multiprog.conf" <<{_EOF}', *conf, _EOF,
                  f'step env {runenv.RUN_DIR}="$run_dir" {srun} --multi-prog "$run_dir/multiprog.conf"']
    else:
        parts = [f"-n {job.ranks} {_env_command(job)}" for job in spec.jobs]
        lines.append(f'step env {runenv.RUN_DIR}="$run_dir" mpiexec ' + " : ".join(parts))
    # the step's ranks are gone: stop the shared loaders' idle producers now (the job's end would kill them,
    # leaving their files in /dev/shm) and remove what no process uses; beside the status report
    lines += ["hpcstagger clean --after-run > /dev/null &", "cleaning=$!",
              f'hpcstagger status "${runenv.SPEC}" "$run_dir" || true', 'wait "$cleaning" || true',
              # the script's last act: what `hpcstagger slurm submit --wait` looks for between its queries
              f'echo "$rc" > "$run_dir/{END_MARKER}"', 'exit "$rc"']
    return "\n".join(lines) + "\n"


def _env_command(job: JobSpec) -> str:
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in {runenv.JOB: job.name, **job.env}.items())
    return f"env {env} {shlex.join(job.command)}"
