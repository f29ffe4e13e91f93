"""Factories that break the ``--model`` protocol in one way each (verify.workload.usermodel)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from examples.my_model import ResidualMLP, loss_fn


def model_only():
    return ResidualMLP()


def vector_loss():
    return ResidualMLP(), lambda model, rank, step: loss_fn(model, rank, step).reshape(1).expand(2)


def rank_dependent_shapes():
    model = ResidualMLP()
    if dist.get_rank() == 1:
        model.extra = nn.Linear(3, 3)
    return model, loss_fn
