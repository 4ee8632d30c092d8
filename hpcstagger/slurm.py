"""Slurm: pure parsers of Slurm's text and small submit and wait functions.

Parsers (node lists, ``scontrol show`` records, ``sbatch --parsable`` output, a heterogeneous
job's component) are pure and tested on literal strings. :func:`submit` and :func:`wait_for_job`
are the only functions here that run Slurm commands. The batch script of a co-located run is
rendered by :mod:`hpcstagger.colocated.batch`.
``sbatch --wait`` polls with a multi-second back-off, so :func:`wait_for_job` polls
``scontrol show job`` itself, backing off too, but looking at a cheap end marker in between.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from itertools import product
from collections.abc import Callable, Mapping, Sequence

from hpcstagger.errors import ConfigError, LaunchError

__all__ = [
    "TERMINAL_STATES",
    "expand_nodelist",
    "parse_scontrol",
    "parse_sbatch_parsable",
    "job_context",
    "het_component",
    "submit",
    "job_record",
    "job_records",
    "wait_for_job",
]

log = logging.getLogger(__name__)

#: Job states after which a job will not run again.
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED",
})

# ---------------------------------------------------------------------------- pure parsers


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {text!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ConfigError(f"node list {text!r} has an unmatched '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ConfigError(f"node list {whole!r}: bad range {item!r} inside brackets")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"node list {whole!r}: range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm host list such as ``node[01-03,07],gpu1`` into host names, in order.

    Zero padding is kept and several bracket groups in one name multiply out
    (``r[1-2]n[1-2]`` gives r1n1, r1n2, r2n1, r2n2). Raises ConfigError on malformed input.
    """
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [_expand_range(p[1:-1], text) if p.startswith("[") else [p] for p in pieces if p]
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/.\-]*)=")


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """Parse ``scontrol show job|node|partition`` output into one dict per record.

    A record starts on a line that is not indented and goes on over the indented lines below it,
    so both the normal and the one-line (``-o``) formats parse. A value runs until the next
    ``Key=`` that follows white space, so values holding ``=`` (``TRES=cpu=1,node=1``) survive.
    """
    groups: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace() and groups:
            groups[-1].append(line.strip())
        else:
            groups.append([line.strip()])
    records: list[dict[str, str]] = []
    for group in groups:
        flat = " ".join(group)
        matches = list(_KEY.finditer(flat))
        rec: dict[str, str] = {}
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(flat)
            rec[m.group(1)] = flat[m.end():end].strip()
        if rec:
            records.append(rec)
    return records


def parse_sbatch_parsable(text: str) -> int:
    """The job id from ``sbatch --parsable`` output (``123`` or ``123;cluster``)."""
    line = text.strip().splitlines()[-1] if text.strip() else ""
    m = re.fullmatch(r"(\d+)(?:;\S+)?", line.strip())
    if not m:
        raise LaunchError(f"could not read a job id from sbatch output {text.strip()!r}; "
                          "check that sbatch ran with --parsable")
    return int(m.group(1))


def job_context(environ: Mapping[str, str] | None = None) -> dict[str, object] | None:
    """The Slurm job this process runs in, from its environment; None outside a job."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None

    def num(name: str) -> int | None:
        value = env.get(name, "")
        m = re.match(r"\d+", value)
        return int(m.group(0)) if m else None

    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    try:
        nodes = expand_nodelist(nodelist) if nodelist else []
    except ConfigError:
        nodes = []
    return {
        "job_id": int(job_id) if job_id.isdigit() else job_id,
        "job_name": env.get("SLURM_JOB_NAME"),
        "partition": env.get("SLURM_JOB_PARTITION"),
        "nodelist": nodelist,
        "nodes": nodes,
        "num_nodes": num("SLURM_JOB_NUM_NODES") or num("SLURM_NNODES"),
        "ntasks": num("SLURM_NTASKS") or num("SLURM_NPROCS"),
        "cpus_on_node": num("SLURM_CPUS_ON_NODE"),
        "procid": num("SLURM_PROCID"),
        "localid": num("SLURM_LOCALID"),
        "array_job_id": num("SLURM_ARRAY_JOB_ID"),
        "array_task_id": num("SLURM_ARRAY_TASK_ID"),
        "het_size": num("SLURM_HET_SIZE"),
        "step_id": env.get("SLURM_STEP_ID"),
    }


def het_component(environ: Mapping[str, str] | None = None) -> int | None:
    """Which component of a heterogeneous job step this task belongs to; None outside one.

    Slurm 22.05 sets no per-task component variable in ``srun --het-group=...`` steps, but every
    task sees ``SLURM_PROCID`` (its rank across all components) and ``SLURM_NTASKS_HET_GROUP_<k>``
    for each component, in order: the component is the one whose task range holds the rank.
    """
    env = os.environ if environ is None else environ
    size = env.get("SLURM_HET_SIZE")
    procid = env.get("SLURM_PROCID")
    if not size or procid is None or not size.isdigit() or not procid.isdigit():
        return None
    rank, first = int(procid), 0
    for k in range(int(size)):
        count = env.get(f"SLURM_NTASKS_HET_GROUP_{k}")
        if count is None or not count.isdigit():
            return None
        if rank < first + int(count):
            return k
        first += int(count)
    return None


# ---------------------------------------------------------------------------- side effects


def _command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"'{name}' is not on PATH; run this on a Slurm login node or load "
                          "your site's Slurm module")
    return path


def submit(script: str | os.PathLike[str], args: Sequence[str] = (), *,
           env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
           timeout: float = 60.0, script_args: Sequence[str] = ()) -> int:
    """Submit a batch script file with ``sbatch --parsable [args] script [script_args]``; return the job id.

    Raises LaunchError with sbatch's own message when the submission is refused.
    """
    cmd = [_command("sbatch"), "--parsable", *args, os.fspath(script), *script_args]
    log.info("submitting: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else dict(env), cwd=cwd)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch refused {os.fspath(script)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return parse_sbatch_parsable(proc.stdout)


def job_records(job_id: int | str, *, env: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """``scontrol show job`` for a job as a list of records: one, or one per task of an array or
    component of a heterogeneous job; [] when Slurm does not know the job."""
    proc = subprocess.run([_command("scontrol"), "show", "job", str(job_id)], capture_output=True,
                          text=True, timeout=30, env=None if env is None else dict(env))
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return []
        raise LaunchError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    return parse_scontrol(proc.stdout)


def job_record(job_id: int | str, *, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The first record of :func:`job_records`, or None if Slurm does not know the job."""
    records = job_records(job_id, env=env)
    return records[0] if records else None


def wait_for_job(job_id: int | str, timeout: float, *, poll: float = 0.2, max_poll: float | None = None,
                 ended: Callable[[], bool] | None = None,
                 env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Poll ``scontrol show job`` until the job (every task of an array, every component of a
    heterogeneous job) reaches a terminal state; return its record, or the first record that did
    not complete.

    The controller is asked every ``poll`` seconds at first, then less often, up to every
    ``max_poll`` seconds (default ``poll``: no back-off), so that a long wait does not load it.
    ``ended``, a cheap check such as a file the batch script writes last, is looked at every
    ``poll`` seconds in between: once it is true the controller is asked every ``poll`` seconds
    again, so the job's end is seen at once.

    Raises LaunchError if the job is unknown to the controller or still running after ``timeout``
    seconds (the job is left alone; cancel it with ``scancel`` if it should not go on).
    """
    deadline = time.monotonic() + timeout
    interval, longest, seen_end = poll, max(poll, max_poll or poll), False
    while True:
        records = job_records(job_id, env=env)
        if not records:
            raise LaunchError(f"Slurm does not know job {job_id}: it was never submitted or has aged "
                              "out of the controller (MinJobAge)")
        states = [r.get("JobState", "UNKNOWN").split()[0] for r in records]
        if all(s in TERMINAL_STATES for s in states):
            bad = [r for r, s in zip(records, states, strict=True) if s != "COMPLETED"]
            return bad[0] if bad else records[0]
        now = time.monotonic()
        if now >= deadline:
            waiting = next(r for r, s in zip(records, states, strict=True) if s not in TERMINAL_STATES)
            raise LaunchError(f"job {job_id} is still {waiting.get('JobState', '?')} after {timeout:g} s "
                              f"(reason: {waiting.get('Reason', '?')}); cancel it with 'scancel {job_id}'")
        ask_at = min(now + interval, deadline)
        while not seen_end and ended is not None and time.monotonic() + poll < ask_at:
            time.sleep(poll)
            if ended():
                seen_end, ask_at = True, time.monotonic()  # ask the controller now
        time.sleep(max(0.0, ask_at - time.monotonic()))
        interval = poll if seen_end else min(interval * 1.5, longest)
