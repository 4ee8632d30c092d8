"""Horovod: gate the checkpoint writer on gradient all-reduces in flight.

Horovod's ``DistributedOptimizer`` starts an asynchronous all-reduce for each gradient as backward
produces it and waits for all of them in ``synchronize()`` (called by ``step()``). After
:func:`gate_optimizer`, the gate is busy from the first all-reduce an iteration submits until
``synchronize()`` returns, which is when Horovod's own thread moves the gradients.

    import horovod.torch as hvd
    from hpcstagger.checkpoint import ActivityGate
    from hpcstagger.integrations.horovod import DistributedOptimizer

    gate = ActivityGate()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), gate=gate,
                               named_parameters=model.named_parameters())
    ckpt = AsyncCheckpointer(dir, comm=job_comm, gate=gate)

Horovod 0.28.1 is built by ``scripts/install-horovod``; ``init(comm)`` starts it on a hpcstagger (or
mpi4py) communicator, so each co-located job gets its own Horovod.
"""

from __future__ import annotations

import threading
from typing import Any

from hpcstagger.errors import DependencyError
from hpcstagger.comm import Comm, as_comm

__all__ = ["hvd_module", "init", "gate_optimizer", "DistributedOptimizer"]

_ASYNC_METHODS = ("_allreduce_grad_async", "_grouped_allreduce_grad_async", "_sparse_allreduce_grad_async")


def hvd_module() -> Any:
    """Import ``horovod.torch``, or raise DependencyError saying how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise DependencyError(f"horovod.torch cannot be imported ({exc}); build it with scripts/install-horovod "
                              "(Horovod 0.28.1 with MPI and Gloo against the installed torch)") from exc
    return hvd


def init(comm: Any = None) -> Any:
    """Start Horovod on ``comm`` (a hpcstagger Comm or mpi4py communicator; None: MPI's world).

    Returns the ``horovod.torch`` module. Raises DependencyError when Horovod is missing.
    """
    hvd = hvd_module()
    c = as_comm(comm) if comm is not None else Comm.world()
    if c.is_mpi:
        hvd.init(comm=c.mpi)
    else:
        hvd.init()
    return hvd


def gate_optimizer(optimizer: Any, gate: Any) -> Any:
    """Make a Horovod ``DistributedOptimizer`` mark ``gate`` (an ActivityGate) busy while its
    all-reduces are in flight; returns the same optimizer. Raises TypeError for another optimizer."""
    if not all(hasattr(optimizer, m) for m in ("_allreduce_grad_async", "synchronize")):
        raise TypeError(f"{type(optimizer).__name__} is not a Horovod DistributedOptimizer "
                        "(wrap it with hvd.DistributedOptimizer first)")
    lock = threading.Lock()
    inflight = [False]

    def begin() -> None:
        with lock:
            if not inflight[0]:
                inflight[0] = True
                gate.enter()

    def end() -> None:
        with lock:
            if inflight[0]:
                inflight[0] = False
                gate.exit()

    def wrap_async(fn: Any) -> Any:
        def submit(*args: Any, **kwargs: Any) -> Any:
            begin()
            return fn(*args, **kwargs)
        return submit

    for name in _ASYNC_METHODS:
        fn = getattr(optimizer, name, None)
        if fn is not None:
            setattr(optimizer, name, wrap_async(fn))
    sync = optimizer.synchronize

    def synchronize(*args: Any, **kwargs: Any) -> Any:
        try:
            return sync(*args, **kwargs)
        finally:
            end()

    optimizer.synchronize = synchronize
    optimizer._hpcstagger_gate = gate
    return optimizer


def DistributedOptimizer(optimizer: Any, *args: Any, gate: Any = None, **kwargs: Any) -> Any:
    """``hvd.DistributedOptimizer(optimizer, *args, **kwargs)``, gated on ``gate`` when given."""
    hvd = hvd_module()
    opt = hvd.DistributedOptimizer(optimizer, *args, **kwargs)
    return gate_optimizer(opt, gate) if gate is not None else opt
