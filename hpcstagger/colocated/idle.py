"""Flushing in the wait: a waiting job copies the running jobs' staged checkpoints.

With ``[checkpoint] flush = "queue"`` (and a ``staging_dir``), every job's checkpointer built from
:meth:`~.coordinator.Session.checkpoint_options` posts the copy of its staged shards to the durable
level in the run's flush queue, ``<staging_dir>/<run name>/.flushq``, as long as an idle process
has registered there; and every rank of a job that waits runs an
:func:`~hpcstagger.checkpoint.flusher.idle_flusher` on that queue as its last idle work. Once no
job waits, nobody is registered and each writer copies its shards itself again, at once. The
atomic commit, the checksums and the owner's fallback are the checkpointer's own
(:mod:`hpcstagger.checkpoint.flushq`).
"""

from __future__ import annotations

import os
from typing import Any
from hpcstagger.checkpoint.flusher import idle_flusher

__all__ = ["flush_root", "flusher_for"]


def flush_root(spec: Any) -> str:
    """The directory whose flush queue the run's jobs share: ``<staging_dir>/<run name>``."""
    return os.path.join(spec.checkpoint.staging_dir, spec.run.name)


def flusher_for(session: Any) -> Any:
    """An idle flusher for a rank of a waiting job when the spec flushes through the queue, else None."""
    spec = session.spec
    if (spec is None or session.delay <= 0 or session.calibrating or spec.checkpoint.flush != "queue"
            or not spec.checkpoint.staging_dir):
        return None

    return idle_flusher(flush_root(spec))
