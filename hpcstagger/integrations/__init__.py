"""Hooks from training frameworks into hpcstagger: what feeds the checkpoint gate, and rendezvous.

- :mod:`.horovod`: a Horovod ``DistributedOptimizer`` that marks a gate busy while its gradient
  all-reduces are in flight.
- :mod:`.torch_ddp`: ``init_process_group`` on a hpcstagger communicator, and a DDP comm hook that
  marks a gate busy while its all-reduces are in flight.

Neither module imports Horovod or torch until one of its functions is called.
"""

from __future__ import annotations

__all__: list[str] = []
