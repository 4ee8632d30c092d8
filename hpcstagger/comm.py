"""One communicator type: an mpi4py communicator, or a single process.

Every hpcstagger component takes ``comm=None`` (a single process, rank 0 of 1) or a communicator,
so the same code runs with and without ``mpiexec``. :func:`as_comm` turns either, or a raw mpi4py
communicator, into a :class:`Comm`.

Collectives take an optional ``timeout`` (seconds; the default is the ``collective_timeout`` knob,
``None`` waits forever). A guarded collective first meets the other ranks at a non-blocking
barrier that this rank polls; only when every rank has arrived does it run the real collective.
If the deadline passes first, :class:`~hpcstagger.errors.CollectiveTimeout` is raised and the
communicator is marked broken, since the abandoned barrier can no longer be matched safely.

:meth:`Comm.guard` and :meth:`Comm.run_all` run a step on every rank and, if it raised on any
rank, raise one :class:`~hpcstagger.errors.CollectiveError` naming every failing rank on every
rank, so one rank's bad input never leaves the others waiting.

Polled waits (the guarded collectives here, the checkpoint writer's gate and snapshot agreement,
the launch rendezvous) share :class:`Backoff`, the pauses between polls, and :func:`poll_until`,
the loop itself.

mpi4py is imported only when MPI is actually used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any, NoReturn, TypeVar
from collections.abc import Callable, Iterator

from hpcstagger import config
from hpcstagger.errors import (
    CollectiveError,
    CollectiveTimeout,
    DependencyError,
    describe_exception,
)

__all__ = ["Backoff", "Comm", "as_comm", "launched_by_mpi", "mpi_module", "poll_until"]

log = logging.getLogger(__name__)
T = TypeVar("T")
ABORT_GRACE_SECONDS = 0.5  # pause before MPI_Abort so the launcher forwards the last output

# Environment variables that MPI launchers (Hydra, PMI-2 srun, PMIx, Open MPI, MVAPICH) set per rank.
_LAUNCHER_VARS = (
    "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
)


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


UNSET: Any = _Unset()


def launched_by_mpi(environ: dict[str, str] | None = None) -> bool:
    """True when this process looks like one rank of an MPI launch (mpiexec, srun --mpi=...)."""
    env = os.environ if environ is None else environ
    return any(v in env for v in _LAUNCHER_VARS)


def mpi_module() -> Any:
    """Import and initialise ``mpi4py.MPI`` (thread level MULTIPLE), or raise DependencyError."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # also raised when libmpi cannot be loaded
        raise DependencyError(
            f"mpi4py cannot be imported ({exc}); install an MPI and mpi4py "
            "(pip install mpi4py mpich, or load your site's MPI module and pip install mpi4py)"
        ) from exc
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def _timeout_value(timeout: Any) -> float | None:
    if timeout is UNSET:
        timeout = config.get("collective_timeout")
    if timeout is None:
        return None
    timeout = float(timeout)
    if timeout <= 0 or timeout == float("inf"):
        return None
    return timeout


class Backoff:
    """The pauses of one polled wait: short at first, then growing geometrically to a cap.

    The first ``spins`` pauses are 0 s: a pause of 0 is ``os.sched_yield()``, which gives up the CPU
    and the GIL and returns within a microsecond when nothing else wants them (for waits whose
    latency matters, which usually end within microseconds). It is not ``time.sleep(0)``: that
    sleeps for the kernel's timer slack, about 80 us on Linux, longer than the wait it serves. Then the pauses are
    ``first`` seconds, multiplied by ``factor`` after each, up to ``cap``: the defaults give
    0.2, 0.4, ... 6.4 ms, then 10 ms for good, so a short wait ends promptly and a long one wakes
    at most 100 times a second. ``factor=1`` and ``cap=first`` give a constant pause.

    One instance serves one wait (it is not thread-safe); :meth:`reset` starts it over.
    Raises ValueError for a negative ``first`` or ``spins``, ``cap < first`` or ``factor < 1``.
    """

    def __init__(self, first: float = 0.0002, cap: float = 0.01, *, factor: float = 2.0, spins: int = 0):
        if first < 0 or cap < first or factor < 1 or spins < 0:
            raise ValueError(f"Backoff needs 0 <= first <= cap, factor >= 1 and spins >= 0, not "
                             f"first={first}, cap={cap}, factor={factor}, spins={spins}")
        self.first, self.cap, self.factor, self.spins = float(first), float(cap), float(factor), int(spins)
        self.reset()

    def __repr__(self) -> str:
        return f"Backoff(first={self.first:g}, cap={self.cap:g}, factor={self.factor:g}, spins={self.spins})"

    def reset(self) -> None:
        """Start the schedule over: the next pause is the first again."""
        self._spun = 0
        self._pause = self.first

    def next_pause(self) -> float:
        """The next pause in seconds (0 while spinning), advancing the schedule."""
        if self._spun < self.spins:
            self._spun += 1
            return 0.0
        pause = self._pause
        self._pause = min(pause * self.factor, self.cap)
        return pause

    def sleep(self, limit: float | None = None) -> float:
        """Sleep for the next pause, but at most ``limit`` seconds; return the seconds asked for."""
        pause = self.next_pause()
        if limit is not None:
            pause = max(min(pause, limit), 0.0)
        if pause > 0:
            time.sleep(pause)
        else:
            os.sched_yield()
        return pause


def poll_until(deadline: float | None, ready: Callable[[], Any], *, first: float = 0.0002, cap: float = 0.01,
               factor: float = 2.0, spins: int = 0) -> bool:
    """Call ``ready()`` until it returns true, pausing in between; False if ``deadline`` came first.

    ``deadline`` is a time of ``time.monotonic()``, or None to wait for ever. ``ready()`` is called
    at once (no pause when it is already true, and no :class:`Backoff` made), then after each pause of
    ``Backoff(first, cap, factor=factor, spins=spins)``; no pause runs past the deadline, so the last
    call of ``ready()`` is at the deadline and False comes back then. Returns True as soon as a call
    returns true, even when that call ends after the deadline.
    """
    if ready():
        return True
    backoff = Backoff(first, cap, factor=factor, spins=spins)
    while True:
        if deadline is None:
            backoff.sleep()
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            backoff.sleep(left)
        if ready():
            return True


class Comm:
    """A communicator: a wrapped mpi4py communicator, or a single process when ``mpi_comm`` is None.

    Lowercase collectives move picklable Python objects between live ranks (never from disk).
    """

    def __init__(self, mpi_comm: Any = None):
        self._c = mpi_comm
        self._broken: str | None = None
        self._pending: Any = None  # the barrier request abandoned by a timeout, if any
        if mpi_comm is None:
            self._rank, self._size = 0, 1
        else:
            self._rank, self._size = mpi_comm.Get_rank(), mpi_comm.Get_size()

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls) -> Comm:
        """A communicator of one process (rank 0 of 1); every collective is local."""
        return cls(None)

    @classmethod
    def world(cls) -> Comm:
        """``MPI.COMM_WORLD`` when MPI is in use, else a single process.

        The ``mpi`` knob (``HPCSTAGGER_MPI``) decides: ``auto`` uses MPI when an MPI launcher
        started this process or mpi4py is already imported; ``1`` always; ``0`` never.
        Raises DependencyError when MPI is wanted but mpi4py cannot be imported.
        """
        mode = str(config.get("mpi")).strip().lower()
        if mode in ("0", "no", "false", "off"):
            return cls.single()
        if mode in ("1", "yes", "true", "on") or launched_by_mpi() or "mpi4py.MPI" in sys.modules:
            return cls(mpi_module().COMM_WORLD)
        return cls.single()

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the communicator."""
        return self._size

    @property
    def is_mpi(self) -> bool:
        """True when this wraps a real MPI communicator."""
        return self._c is not None

    @property
    def mpi(self) -> Any:
        """The wrapped mpi4py communicator, or None for a single process."""
        return self._c

    def __repr__(self) -> str:
        kind = "mpi" if self.is_mpi else "single"
        return f"<Comm {kind} rank={self.rank} size={self.size}{' BROKEN' if self._broken else ''}>"

    @property
    def broken(self) -> str | None:
        """Why this communicator is unusable (see :meth:`mark_broken`), or None while it is usable."""
        return self._broken

    @property
    def abandoned(self) -> Any:
        """The request a timed-out wait left unfinished (see :meth:`mark_broken`), or None."""
        return self._pending

    # ------------------------------------------------------------------ guarding
    def mark_broken(self, reason: str, pending: Any = None) -> None:
        """Mark this communicator unusable after a failed collective: from now on every guarded
        collective (and :meth:`guard`, :meth:`run_all`) raises CollectiveError citing ``reason``.

        ``pending`` is the request of a non-blocking collective that the caller abandoned (one
        that timed out); it is kept alive here, because freeing an active MPI request is erroneous,
        and is available as :attr:`abandoned`. The usual next step is :meth:`abort`.
        """
        if pending is not None:
            self._pending = pending
        self._broken = reason

    def _check_usable(self, what: str) -> None:
        if self._broken:
            raise CollectiveError(
                f"{what} on rank {self.rank}: this communicator is unusable after an earlier failure "
                f"({self._broken}); abort the job (Comm.abort) and restart it"
            )

    def _arrive(self, what: str, timeout: Any) -> bool:
        """Wait, up to the timeout, until every rank has reached this point.

        Returns True when it synchronised the ranks, False when there was nothing to guard
        (a single process, or no timeout).
        """
        self._check_usable(what)
        if self._c is None:
            return False
        limit = _timeout_value(timeout)
        if limit is None:
            return False
        req = self._c.Ibarrier()
        start = time.monotonic()
        if not poll_until(start + limit, req.Test):  # pauses of 0.2 ms doubling to 10 ms
            waited = time.monotonic() - start
            self.mark_broken(f"{what} timed out after {limit:g} s", pending=req)
            raise CollectiveTimeout(
                f"{what}: rank {self.rank} of {self.size} waited {waited:.1f} s and not every "
                f"rank arrived; a rank has crashed, hung, or skipped this step. Check the other "
                f"ranks' logs; raise HPCSTAGGER_COLLECTIVE_TIMEOUT if the step is legitimately slow",
                {},
            )
        return True

    # ------------------------------------------------------------------ collectives
    def barrier(self, *, timeout: float | None = UNSET) -> None:
        """Block until every rank has called barrier; raise CollectiveTimeout past ``timeout``."""
        if not self._arrive("barrier", timeout) and self._c is not None:
            self._c.Barrier()

    def bcast(self, obj: T, root: int = 0, *, timeout: float | None = UNSET) -> T:
        """Return ``root``'s ``obj`` on every rank."""
        self._arrive("bcast", timeout)
        if self._c is None:
            return obj
        return self._c.bcast(obj, root=root)

    def gather(self, obj: T, root: int = 0, *, timeout: float | None = UNSET) -> list[T] | None:
        """On ``root``, the list of every rank's ``obj`` in rank order; None elsewhere."""
        self._arrive("gather", timeout)
        if self._c is None:
            return [obj]
        return self._c.gather(obj, root=root)

    def allgather(self, obj: T, *, timeout: float | None = UNSET) -> list[T]:
        """On every rank, the list of every rank's ``obj`` in rank order."""
        self._arrive("allgather", timeout)
        if self._c is None:
            return [obj]
        return self._c.allgather(obj)

    def allreduce(self, value: Any, op: str = "sum", *, timeout: float | None = UNSET) -> Any:
        """Reduce a Python number over all ranks with ``op`` in sum, max, min; result on every rank."""
        ops: dict[str, Callable[[list[Any]], Any]] = {"sum": sum, "max": max, "min": min}
        if op not in ops:
            raise ValueError(f"allreduce op must be one of {sorted(ops)}, not {op!r}")
        return ops[op](self.allgather(value, timeout=timeout))

    def split(self, color: int | None, key: int | None = None, *,
              timeout: float | None = UNSET) -> Comm | None:
        """Split into sub-communicators by ``color`` (ordered by ``key``, default this rank).

        Ranks passing ``color=None`` get None back. Collective over this communicator.
        """
        self._arrive("split", timeout)
        if color is not None and color < 0:
            raise ValueError(f"split color must be >= 0 or None, not {color}")
        if self._c is None:
            return None if color is None else Comm.single()
        MPI = mpi_module()
        sub = self._c.Split(MPI.UNDEFINED if color is None else color,
                            self.rank if key is None else key)
        return None if sub == MPI.COMM_NULL else Comm(sub)

    def dup(self, *, timeout: float | None = UNSET) -> Comm:
        """A new communicator with the same ranks and its own message space (collective)."""
        self._arrive("dup", timeout)
        if self._c is None:
            return Comm.single()
        return Comm(self._c.Dup())

    def free(self) -> None:
        """Release the MPI communicator this wraps (collective); a no-op for a single process or a
        world communicator."""
        if self._c is None or self._broken:
            return
        MPI = mpi_module()
        if self._c not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self._c.Free()
            self._c = None
            self.mark_broken("communicator was freed")

    def abort(self, code: int = 1) -> NoReturn:
        """End every rank of the job now (MPI_Abort); for a single process, exit with ``code``."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            if self._c is not None:
                # Hydra's mpiexec tears the run down as soon as the abort reaches it and can drop
                # what this rank wrote just before (seen: the reason for the abort lost); give the
                # launcher a moment to forward it.
                time.sleep(ABORT_GRACE_SECONDS)
        finally:
            if self._c is not None:
                self._c.Abort(code)
            os._exit(code)

    # ------------------------------------------------------------------ exception-safe steps
    @contextlib.contextmanager
    def guard(self, what: str, *, timeout: float | None = UNSET) -> Iterator[None]:
        """Run the ``with`` body on every rank; if it raised on any rank, raise CollectiveError on all.

        The error lists each failing rank and its message; the local exception, if any, is its cause.
        """
        local: BaseException | None = None
        try:
            yield
        except Exception as exc:  # collected and re-raised below
            local = exc
        status = None if local is None else describe_exception(local)
        statuses = self.allgather(status, timeout=timeout)
        failures = {r: s for r, s in enumerate(statuses) if s is not None}
        if failures:
            raise CollectiveError.from_failures(what, failures, self.size) from local

    def run_all(self, fn: Callable[..., T], *args: Any, what: str | None = None,
                timeout: float | None = UNSET, **kwargs: Any) -> T:
        """Call ``fn(*args, **kwargs)`` on every rank and return its result; see :meth:`guard`."""
        result: Any = None
        name: str = getattr(fn, "__name__", "step")
        with self.guard(what or name, timeout=timeout):
            result = fn(*args, **kwargs)
        return result


def as_comm(comm: Comm | Any | None) -> Comm:
    """Turn None (a single process), a :class:`Comm`, or an mpi4py communicator into a Comm."""
    if comm is None:
        return Comm.single()
    if isinstance(comm, Comm):
        return comm
    if hasattr(comm, "Get_rank") and hasattr(comm, "Get_size"):
        return Comm(comm)
    raise TypeError(f"expected None, a hpcstagger Comm or an mpi4py communicator, got {type(comm).__name__}")

