"""torch.distributed on a hpcstagger communicator, and a DDP comm hook that feeds a checkpoint gate.

:func:`init_process_group` starts torch.distributed on the ranks of one communicator (one job's
ranks in a co-located launch). Rank 0 starts the rendezvous store on a port the kernel picks
(port 0), so jobs sharing a node never collide and no port is guessed, and broadcasts its address
and port over MPI; every rank then joins. :func:`gated_allreduce_hook` is DDP's default all-reduce,
marking an :class:`~hpcstagger.checkpoint.gates.ActivityGate` busy from each bucket's launch until its
result is ready::

    init_process_group(job_comm)                      # gloo by default
    ddp = DistributedDataParallel(model)
    gate = ActivityGate()
    ddp.register_comm_hook(None, gated_allreduce_hook(gate))
    ckpt = AsyncCheckpointer(dir, comm=job_comm, gate=gate)
"""

from __future__ import annotations

import datetime
import socket
from typing import Any
from collections.abc import Callable

from hpcstagger import config
from hpcstagger.comm import as_comm
from hpcstagger.errors import ConfigError, LaunchError

__all__ = ["init_process_group", "destroy_process_group", "gated_allreduce_hook"]


def _timedelta(timeout: Any) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _rendezvous_host(hosts: list[str]) -> str:
    addr = str(config.get("rendezvous_addr")).strip()
    if addr:
        return addr
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    return socket.getfqdn(hosts[0])


def init_process_group(comm: Any, backend: str = "gloo", timeout: Any = 1800.0) -> Any:
    """Start torch.distributed's default process group on the ranks of ``comm`` (collective).

    ``comm``: a hpcstagger Comm, an mpi4py communicator, or None (one process). ``backend``:
    "gloo" (CPU) or "nccl" (GPU). ``timeout``: seconds or a timedelta, for the rendezvous and
    torch's collectives. Returns the default ProcessGroup. Raises ConfigError when a default group
    already exists, LaunchError (on every rank) when the rendezvous fails.
    """
    import torch.distributed as dist

    c = as_comm(comm)
    td = _timedelta(timeout)
    already = dist.is_available() and dist.is_initialized()
    if any(c.allgather(already)):
        raise ConfigError("torch.distributed is already initialised in this process; call "
                          "destroy_process_group() first (one default process group per job communicator)")
    host = _rendezvous_host(c.allgather(socket.gethostname()))
    store = None
    port = 0
    try:
        with c.guard("torch.distributed rendezvous store on rank 0"):
            if c.rank == 0:
                store = dist.TCPStore(host, 0, c.size, True,
                                      timeout=td, wait_for_workers=False)
                port = store.port
        port = c.bcast(port)
        with c.guard(f"torch.distributed rendezvous at {host}:{port}"):
            if c.rank != 0:
                store = dist.TCPStore(host, port, c.size, False, timeout=td)
        with c.guard(f"torch.distributed init_process_group({backend!r})"):
            dist.init_process_group(backend, store=store, rank=c.rank, world_size=c.size, timeout=td)
    except Exception as exc:
        raise LaunchError(f"starting torch.distributed ({backend}) on {c.size} rank(s) failed: {exc}; "
                          "set HPCSTAGGER_RENDEZVOUS_ADDR to an address every rank can reach if the "
                          "hosts' names do not resolve") from exc
    return dist.group.WORLD


def destroy_process_group(comm: Any = None) -> None:
    """End torch.distributed's default process group, if any (collective over ``comm`` when given).

    With ``comm`` the ranks meet before and after, so rank 0's rendezvous store outlives every
    rank's use of it; without that, a rank leaving early can abort a slower one at exit.
    """
    import torch.distributed as dist

    c = as_comm(comm) if comm is not None else None
    if c is not None:
        c.barrier()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if c is not None:
        c.barrier()


def gated_allreduce_hook(gate: Any) -> Callable[[Any, Any], Any]:
    """A DDP comm hook that averages gradients like DDP's default and keeps ``gate`` busy meanwhile.

    Register it with ``ddp.register_comm_hook(process_group_or_None, hook)``.
    """
    import torch.distributed as dist

    def hook(state, bucket):  # no annotations: DDP rejects any but its own types
        group = state if state is not None else dist.group.WORLD
        gate.enter()
        try:
            tensor = bucket.buffer()
            tensor.div_(dist.get_world_size(group))
            fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        except BaseException:
            gate.exit()
            raise

        def done(f: Any) -> Any:
            try:
                return f.value()[0]
            finally:
                gate.exit()

        return fut.then(done)

    return hook
