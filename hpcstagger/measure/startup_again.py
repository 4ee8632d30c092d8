"""Each job's start-up measured a second time, when the calibration has the time for it.

A job's start-up (from its start to its loop's first batch request: its backend, its model and
optimizer, starting its DataLoader's workers) is CPU work, mostly imports and first calls, and a
calibration times it once. On a node whose speed varies (a VM beside other tenants, a node that
other work shares) that one time can be far off: on the 2-core VM one job's start-up measured
2.49 s where its runs took 1.05 to 1.56 s, and the model then put every stagger that starts that
job first 14 to 16% behind a simultaneous start, against 2 to 3% with the runs' start-up
(docs/model.md, "What measurements showed"). A slower moment only ever adds time, so the lesser
of two measurements taken apart is the better estimate of the work.

:func:`measure_again` runs each job's command once more in calibration mode with its share of
time already spent, so that the job's loop meter stops it, with status 0 on every rank, at its
first batch; the job's start-up is the lesser of the two. The jobs go in reverse order, so that
the first job measured is measured again last, furthest in time from its first measurement. It
runs a job only while at least :data:`LEFT_SHARE` of the budget would be left after it (its cost
guessed as its start-up and :data:`START_S`, then as the longest run again so far), so that the
source's later levels keep their time; a job run again costs its process start
(interpreter, imports), its start-up and its first batch: about 5 s a job on the 2-core VM, time
the later levels then do without (their windows are shorter, and fewer disagreeing levels are
measured a third time).
"""

from __future__ import annotations

import os
import time
from typing import Any

from hpcstagger.colocated.jobmeter import GRACE_S
from hpcstagger.colocated.launch import run_group
from hpcstagger.stagger.jobfields import read_reports, startup_of

__all__ = ["LEFT_SHARE", "measure_again"]

LEFT_SHARE = 0.35  # the share of the budget that must be left after a job's start-up is measured again
START_S = 3.0      # a process start (interpreter, imports, MPI) and exit: a first guess at a run again's cost
_LIMIT_S = 120.0   # a job run again that has not ended by then is stopped (its first measurement stands)


def measure_again(run: Any, meas: dict[str, Any]) -> list[str]:
    """Measure the start-up of the jobs in ``meas["jobs"]`` that ran their own command once more,
    while ``run`` (a spec calibration) has the time; keep the lesser of each job's two and record
    both (``startup_first``, ``startup_again``). Returns the jobs measured again."""
    jobs = [j for j in reversed(run.spec.jobs)
            if (meas["jobs"].get(j.name) or {}).get("route") == "command"
            and "startup_again" not in meas["jobs"][j.name]]
    done: list[str] = []
    cost = 0.0  # the longest run again so far
    for k, job in enumerate(jobs):
        fields = meas["jobs"][job.name]
        need = LEFT_SHARE * run.budget + max(cost, float(fields["startup"]) + START_S)
        if run.left() < need:
            run.say(f"calibrate: no time left to measure the start-up of {', '.join(j.name for j in jobs[k:])} "
                    f"again ({run.left():.0f} s of the budget left, {need:.0f} s needed): one measurement stands")
            if k:
                run.bar.total -= len(jobs) - k
            break
        if k == 0:
            run.bar.total += len(jobs)
            run.bar.refresh()
        t0 = time.monotonic()
        again = _startup_once(run, job)
        cost = max(cost, time.monotonic() - t0)
        run.bar.update(1)
        if again is None:
            continue
        first = float(fields["startup"])
        fields.update(startup_first=first, startup_again=again, startup=min(first, again))
        run.parts.save_job(job, fields)
        run.say(f"calibrate: job {job.name}: start-up again {again:.2f} s (first {first:.2f} s): "
                f"{min(first, again):.2f} s kept")
        done.append(job.name)
    return done


def _startup_once(run: Any, job: Any) -> float | None:
    """``job``'s start-up in a run of its command stopped at its first batch; None (said why) when
    the run failed or wrote no measurement."""
    directory = run.reports / job.name / "again"
    directory.mkdir(parents=True, exist_ok=True)
    run.bar.set_postfix_str(f"job {job.name}: its start-up again")
    env = run.job_env(job, directory, time.time() - GRACE_S - 1.0)  # its share spent: it stops at its first batch
    with open(directory / "output.log", "wb") as out:
        rc = run_group(run.command(job), env, os.path.dirname(run.spec.path) or ".", _LIMIT_S, output=out)
    report = read_reports(str(directory))["job"]
    if rc != 0 or not report or report.get("setup_s") is None:
        run.say(f"calibrate: job {job.name}: its start-up was not measured again (exit status {rc}; output: "
                f"{directory / 'output.log'}); its first measurement stands")
        return None
    return startup_of(report)
