"""The one exception hierarchy of hpcstagger.

Every error raised on purpose by the library derives from :class:`HpcstaggerError`, and every
message says what was wrong and what to do about it. The CLI turns these into one line on stderr
and a non-zero exit. :func:`describe_exception` words any exception as text, for sending a failure
to the other ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "describe_exception",
    "HpcstaggerError",
    "ConfigError",
    "DependencyError",
    "CollectiveError",
    "CollectiveTimeout",
    "CacheError",
    "LoaderError",
    "CheckpointError",
    "CheckpointWarning",
    "LaunchError",
    "ModelError",
]


def describe_exception(exc: BaseException) -> str:
    """Describe ``exc`` as text: its type, its message and where it was raised.

    For example ``"KeyError: 'lr' (at config.py:42)"``; the place is the innermost frame of the
    exception's traceback (file name and line), left out when it has none. Used to send a failure
    to the other ranks as text.
    """
    tb = exc.__traceback__
    where = ""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" (at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


class HpcstaggerError(Exception):
    """Base class of every error hpcstagger raises on purpose."""


class ConfigError(HpcstaggerError, ValueError):
    """Bad configuration or input: a spec, scenario, argument or knob. The message names the field."""


class DependencyError(HpcstaggerError, ImportError):
    """An optional dependency (Horovod, mpi4py, Slurm's commands, ...) is missing or unusable."""


class CollectiveError(HpcstaggerError):
    """A step run on every rank failed on one or more ranks.

    Raised identically on every rank of the communicator, so no rank is left waiting.
    ``failures`` maps each failing rank to its error message.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None):
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})

    @classmethod
    def from_failures(cls, what: str, failures: Mapping[int, str], size: int) -> CollectiveError:
        """Build the error for ``what`` from a rank -> message map, listing every failing rank."""
        ranks = sorted(failures)
        lines = [f"{what} failed on {len(ranks)} of {size} rank(s): {', '.join(map(str, ranks))}"]
        for r in ranks:
            lines.append(f"  rank {r}: {failures[r]}")
        return cls("\n".join(lines), failures)


class CollectiveTimeout(CollectiveError):
    """Not every rank reached a collective within its timeout.

    The communicator that timed out is left unusable; the usual response is to abort the job.
    """


class CacheError(HpcstaggerError):
    """The shared sample cache cannot be used (bad name, unsafe directory, unknown cache, ...)."""


class LoaderError(HpcstaggerError):
    """The shared loader cannot be used: its producer died or failed, unsafe shared memory, bad batches."""


class CheckpointError(HpcstaggerError):
    """A checkpoint could not be written, found, verified or loaded."""


class CheckpointWarning(HpcstaggerError, UserWarning):
    """A checkpoint was passed over: :func:`~hpcstagger.checkpoint.load` skipped a damaged one and
    loaded an older step. Issued with :func:`warnings.warn`; ``warnings.simplefilter("error",
    CheckpointWarning)`` turns it into an exception (``load(strict=True)`` raises CheckpointError)."""


class LaunchError(HpcstaggerError):
    """Starting jobs failed: mpiexec, Slurm submission, or the coordinator."""


class ModelError(HpcstaggerError):
    """The performance model or planner cannot answer (for example, a scenario it cannot solve)."""
