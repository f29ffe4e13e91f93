"""An example model factory for ``make verify-traffic ARGS="--model examples.my_model:factory"``.

The protocol (``verify.workload.usermodel``): ``factory() -> (model, loss_fn)``, and
``loss_fn(model, rank, step)`` returns the scalar loss of this rank's batch at ``step``.

The model is a small residual MLP with widths not divisible by 3 or 4 (so FSDP2 pads its shards
and DMuon's owners get uneven matrices): ``inp`` Linear(20, 50), 3 blocks of
Linear(50, 70) -> GELU -> Linear(70, 50) in an ``nn.ModuleList`` (FSDP2 wraps each block), and
an output head ``head`` Linear(50, 10) left to AdamW by DMuon's default predicate. The task is a
fixed random teacher network, so the loss falls within a few steps. Every batch is a pure
function of ``(step, rank)``: the same on every run and world size.
"""

from __future__ import annotations

import torch
from torch import nn

D_IN, D_MODEL, D_HIDDEN, D_OUT, N_BLOCKS = 20, 50, 70, 10, 3
#: Rows of each rank's batch per step.
BATCH_PER_RANK = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D_MODEL, D_HIDDEN, bias=False)
        self.down = nn.Linear(D_HIDDEN, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D_MODEL) -> (B, D_MODEL)."""
        return x + self.down(nn.functional.gelu(self.up(x)))


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D_MODEL, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D_IN) float -> (B, D_OUT)."""
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(BATCH_PER_RANK, D_IN, generator=gen)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(D_IN, D_OUT, generator=teacher) / D_IN**0.5
    return x, torch.tanh(x @ w)


def loss_fn(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """Mean squared error of this rank's batch at ``step`` (a 0-dim fp32 tensor). The output is
    cast to fp32 first: under a bf16 ``MixedPrecisionPolicy`` it is bf16, and torch 2.11's
    ``mse_loss`` cannot backpropagate over mixed dtypes (pytorch#94086)."""
    x, y = _batch(rank, step)
    device = next(model.parameters()).device
    return nn.functional.mse_loss(model(x.to(device)).float(), y.to(device))


def factory() -> tuple[nn.Module, object]:
    """A fresh ResidualMLP (the harness seeds torch before calling) and its loss."""
    return ResidualMLP(), loss_fn
