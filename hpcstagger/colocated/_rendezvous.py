"""Point-to-point rendezvous with a deadline: rank 0 hears from every rank, decides, and answers each.

A gather cannot say who is missing when a rank never arrives. Here every rank sends its hello to
rank 0 with a distinct tag; rank 0 polls for them until a deadline, so it knows exactly which
ranks are missing and can name them (and the jobs they belong to) in the error it sends to the
ranks that did arrive. Every rank leaves with the same outcome: its reply, or a CollectiveError.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable, Mapping

from hpcstagger.comm import Comm, mpi_module, poll_until
from hpcstagger.errors import CollectiveError, CollectiveTimeout

__all__ = ["rendezvous"]

_TAG_HELLO = 0x6870   # 'hp'
_TAG_REPLY = 0x6871


def rendezvous(world: Comm, hello: Any, decide: Callable[[list[Any]], Mapping[int, Any]], *,
               timeout: float, describe_missing: Callable[[list[int]], str] | None = None,
               what: str = "rendezvous") -> Any:
    """Send ``hello`` to rank 0; rank 0 calls ``decide(hellos)`` (a list in rank order) which returns
    a reply per rank; return this rank's reply.

    Raises CollectiveTimeout on every rank that arrived when some rank did not reach rank 0 within
    ``timeout`` seconds (``describe_missing(ranks)`` words the message), CollectiveTimeout on a rank
    that hears nothing back in time, and CollectiveError on every rank when ``decide`` raised.
    """
    if not world.is_mpi or world.size == 1:
        return decide([hello])[0]
    MPI = mpi_module()
    c = world.mpi
    deadline = time.monotonic() + timeout
    if world.rank != 0:
        c.send(hello, dest=0, tag=_TAG_HELLO)  # small message: buffered eagerly, returns at once
        box: list[Any] = []

        def arrived() -> bool:
            msg = c.improbe(source=0, tag=_TAG_REPLY)
            if msg is None:
                return False
            box.append(msg.recv())
            return True

        if not poll_until(deadline, arrived):
            raise CollectiveTimeout(f"{what}: rank {world.rank} heard nothing from the coordinator (world rank 0) "
                                    f"within {timeout:g} s; check rank 0's log, or raise "
                                    "HPCSTAGGER_COLLECTIVE_TIMEOUT if start-up is legitimately slow")
        kind, payload = box[0]
        if kind == "error":
            raise CollectiveError(payload)
        return payload

    hellos: list[Any] = [hello] + [None] * (world.size - 1)
    pending = set(range(1, world.size))

    status = MPI.Status()

    def all_arrived() -> bool:
        while True:
            msg = c.improbe(source=MPI.ANY_SOURCE, tag=_TAG_HELLO, status=status)
            if msg is None:
                return not pending
            src = status.Get_source()
            hellos[src] = msg.recv()
            pending.discard(src)

    if not poll_until(deadline, all_arrived):
        missing = sorted(pending)
        detail = describe_missing(missing) if describe_missing else f"world rank(s) {missing}"
        message = (f"{what}: {detail} did not reach the coordinator within {timeout:g} s; they crashed "
                   "or never started (see their output)")
        for r in range(1, world.size):
            if r not in pending:
                c.send(("error", message), dest=r, tag=_TAG_REPLY)
        raise CollectiveTimeout(message, {r: "did not arrive" for r in missing})
    try:
        replies = decide(hellos)
    except Exception as exc:  # sent to every rank, then raised here
        message = f"{what} failed on the coordinator (world rank 0): {type(exc).__name__}: {exc}"
        for r in range(1, world.size):
            c.send(("error", message), dest=r, tag=_TAG_REPLY)
        raise CollectiveError(message, {0: str(exc)}) from exc
    reqs = [c.isend(("ok", replies[r]), dest=r, tag=_TAG_REPLY) for r in range(1, world.size)]
    for req in reqs:
        req.wait()
    return replies[0]
