"""Which job of a spec a rank belongs to (:func:`resolve_job`, pure)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from hpcstagger.errors import ConfigError
from hpcstagger.spec import runenv

__all__ = ["resolve_job"]


def resolve_job(names: Sequence[str], *, explicit: str | None = None,
                environ: Mapping[str, str] | None = None, appnum: int | None = None,
                het_component: int | None = None) -> int:
    """Index into ``names`` of this rank's job: the ``job`` argument (``explicit``), else
    ``HPCSTAGGER_JOB`` (a name or an index), else the MPMD application number (``appnum``), else the
    heterogeneous-job component, else the only job.

    Raises ConfigError when the identity names no known job or cannot be told apart.
    """
    env = os.environ if environ is None else environ

    def pick(value: str, source: str) -> int:
        if value in names:
            return list(names).index(value)
        if value.isdigit() and int(value) < len(names):
            return int(value)
        raise ConfigError(f"{source} = {value!r} names no job; jobs: {', '.join(names)} "
                          f"(or an index 0..{len(names) - 1})")

    if explicit is not None:
        return pick(explicit, "job")
    if env.get(runenv.JOB):
        return pick(env[runenv.JOB], runenv.JOB)
    for value, source in ((appnum, "the MPMD application number"),
                          (het_component, "the heterogeneous-job component")):
        if value is not None:
            if 0 <= value < len(names):
                return value
            raise ConfigError(f"{source} is {value} but the spec has {len(names)} job(s) "
                              f"({', '.join(names)}); launch one MPMD part per job, in spec order")
    if len(names) == 1:
        return 0
    raise ConfigError(f"cannot tell which job this rank belongs to among {', '.join(names)}: launch with "
                      f"MPMD mpiexec or srun --multi-prog, or set {runenv.JOB}")
