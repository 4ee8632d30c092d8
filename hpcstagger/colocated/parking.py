"""A job held at its first batch: a guarded plan's ``park`` (:mod:`hpcstagger.stagger.guard`).

:func:`hpcstagger.init` does not wait for such a job. It returns, the job sets itself up (its
backend, model, optimizer and DataLoader), and the wait comes when the loop asks
``session.loader`` for its first batch, before the loader's workers start and read anything. The
release then begins the loop at once: the job's start-up ran while it was held, beside the other
jobs' start-ups. Its status records that set-up as ``parked_setup`` (seconds after time zero),
which the run's history counts in the job's start-up.

A parked job that never calls ``session.loader`` is never held (it runs as if released at once),
and one that called ``init(wait=False)`` waits where it calls :meth:`Session.wait`.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["parks", "wait_or_park", "at_first_batch"]

log = logging.getLogger(__name__)


def parks(session: Any) -> bool:
    """Whether the plan holds this rank's job at its first batch."""
    steer = session.plan.steer or {}
    return session.job in (steer.get("park") or ()) and session.delay > 0 and not session.calibrating


def wait_or_park(session: Any, idle_work: Sequence[Any]) -> None:
    """:func:`hpcstagger.init`'s wait: now, or at the first batch for a parked job."""
    if parks(session):
        session.parked = list(idle_work)
        session.say(f"held at its first batch until released (planned +{session.delay:.1f} s; set up meanwhile)")
    else:
        session.wait(idle_work)


def at_first_batch(session: Any, iterable: Iterable[Any]) -> Iterable[Any]:
    """``iterable``, which waits for the job's release when its first pass begins, where the job is parked."""
    return iterable if getattr(session, "parked", None) is None else _Held(session, iterable)


class _Held:
    """An iterable whose first pass waits out the session's hold; the rest is ``inner``'s."""

    def __init__(self, session: Any, inner: Iterable[Any]):
        self.session, self.inner = session, inner

    def __iter__(self) -> Iterator[Any]:
        session = self.session
        idle, session.parked = session.parked, None
        if idle is not None:
            session.timings["parked_setup"] = session.elapsed()
            log.debug("job %s set up in %.2f s; waiting for its release", session.job, session.elapsed())
            session.wait(idle)
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
