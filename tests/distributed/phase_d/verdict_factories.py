"""``--model`` factories that follow the protocol but fail a verify-traffic check
(tests/run/test_launch.py): the traffic is exactly right, something else is not."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from examples.my_model import ResidualMLP, loss_fn


def rising_loss_raises_under_ddp():
    """examples.my_model's network whose loss rises by 1 per step (the gradients, and so the
    collectives, are those of the falling loss), and whose ``loss_fn`` raises from step 2 on
    (the first measured step with ``--steps-warmup 2``: the recorders are open) when the model
    is wrapped in DDP (``dmuon-ddp``), alike on every rank."""

    def rising(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
        if step >= 2 and isinstance(model, DistributedDataParallel):
            raise RuntimeError("verdict test: this loss_fn refuses DDP")
        return loss_fn(model, rank, step) + step

    return ResidualMLP(), rising
