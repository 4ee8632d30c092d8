"""torch.distributed started by hpcstagger on one process (comm=None), with the gated DDP hook."""

from __future__ import annotations

import pytest
import torch

from hpcstagger.checkpoint import ActivityGate
from hpcstagger.errors import ConfigError
from hpcstagger.integrations.torch_ddp import destroy_process_group, gated_allreduce_hook, init_process_group

pytestmark = pytest.mark.timeout(120)


def test_single_process_group_and_gated_hook():
    import torch.distributed as dist

    group = init_process_group(None, timeout=60)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1 and group is dist.group.WORLD
        with pytest.raises(ConfigError, match="already initialised"):
            init_process_group(None)
        gate = ActivityGate()
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        model.register_comm_hook(None, gated_allreduce_hook(gate))
        x = torch.randn(3, 4)
        model(x).sum().backward()
        assert gate.entered >= 1 and gate.count == 0
        ref = torch.nn.Linear(4, 2)
        ref.load_state_dict(model.module.state_dict())
        ref(x).sum().backward()
        assert torch.allclose(ref.weight.grad, model.module.weight.grad)  # averaging over 1 rank
    finally:
        destroy_process_group()
    assert not dist.is_initialized()
