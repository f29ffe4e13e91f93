"""``dmuon-plan --model`` factories a new user might pass (tests/run/test_plan_cli.py,
tests/run/test_fuzz_plan_cli.py): one that raises, and models with no 2-D Linear to dedicate."""

from __future__ import annotations

import torch
from torch import nn


def raises() -> nn.Module:
    raise RuntimeError("no weights on this machine")


def conv_only() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))


class Experts3d(nn.Module):
    """MoE experts as one 3-D tensor (E, d_in, d_out) and a 1-D gate bias."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.zeros(4, 16, 32))
        self.gate_bias = nn.Parameter(torch.zeros(4))


def experts_3d() -> nn.Module:
    return Experts3d()


def relu() -> nn.Module:
    return nn.ReLU()


def complex_linear() -> nn.Module:
    """A hidden Linear in complex64, whose element size the traffic model does not know."""
    return nn.Sequential(nn.Linear(8, 8, dtype=torch.complex64), nn.Linear(8, 2, dtype=torch.complex64))


def not_a_module():
    return 42


class FourBlocks(nn.Module):
    """An embedding (3, 8) for AdamW and four blocks of one (8, 8) Linear each: the
    hand-computed memory case of tests/run/test_plan_memory.py."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(3, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False)) for _ in range(4))


def four_blocks() -> nn.Module:
    return FourBlocks()
