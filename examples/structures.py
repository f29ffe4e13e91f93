"""Example factories for model structures that DMuon and ``verify-traffic`` must handle
(``make verify-traffic ARGS="--nproc 2 --model examples.structures:<factory>"``):

- :func:`shared_block`: weight sharing, a block called twice in one forward
  (``blocks.0``, ``blocks.1``, then ``blocks.0`` again, ALBERT-style).
- :func:`linear_list`: a plain MLP written as an ``nn.ModuleList`` of bare ``nn.Linear``.
- :func:`equal_blocks`: four identical residual blocks after a fixed input projection:
  DMuon's default coalescing makes them one aligned unit (one all_gather and one
  reduce_scatter per step instead of a broadcast and a reduce per owner).
- :func:`frozen_input`: the same with a frozen input Linear (``requires_grad=False``).
- :func:`conv_net`: a small conv net (``Conv1d`` / ``Conv2d`` weights: Muon on the
  ``(out, in·k…)`` flattened view).

Same task and loss protocol as :mod:`examples.my_model` (``factory() -> (model, loss_fn)``,
``loss_fn(model, rank, step)``): a fixed random teacher, batches a pure function of
``(step, rank)``; :func:`linear_list` and :func:`conv_net` train on one fixed batch per rank
(:func:`fixed_loss`): they learn too slowly for the first loss to beat the fourth on fresh
batches, whose targets differ by more than four steps of progress.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.my_model import BATCH_PER_RANK, D_IN, D_OUT, Block, loss_fn

D_MODEL = 50


class SharedBlockMLP(nn.Module):
    """``inp`` Linear(20, 50), two residual blocks run as 0, 1, 0 (block 0 twice), a head."""

    #: The order the blocks run in each forward.
    SCHEDULE = (0, 1, 0)

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D_MODEL, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i in self.SCHEDULE:
            h = self.blocks[i](h)
        return self.head(self.norm(h))


class LinearList(nn.Module):
    """An MLP as an ``nn.ModuleList`` of bare ``nn.Linear`` (20 -> 48 -> 40 -> 48 -> 10)."""

    def __init__(self) -> None:
        super().__init__()
        widths = (D_IN, 48, 40, 48, D_OUT)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class ConvNet(nn.Module):
    """The 20 inputs as a (1, 4, 5) image: Conv2d(1, 6, 3) -> Conv2d(6, 8, 3) -> Conv1d over
    the flattened rows -> Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 8, 3, padding=1)])
        self.seq = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * D_IN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, 1, 4, 5)
        for conv in self.convs:
            h = torch.tanh(conv(h))
        h = torch.tanh(self.seq(h.flatten(2)))
        return self.head(h.flatten(1))


class EqualBlocks(nn.Module):
    """A fixed random (20, 50) projection (a buffer: not trained, not dedicated), four
    identical residual blocks (``Block``: 50x70 and 70x50 weights), a LayerNorm and a Linear
    head."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(D_IN, D_MODEL) / D_IN**0.5)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, D_OUT)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D_IN) -> (B, D_MODEL), not trained."""
        return x @ self.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def fixed_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """:func:`examples.my_model.loss_fn` on step 0's batch of ``rank`` at every step."""
    return loss_fn(model, rank, 0)


def shared_block() -> tuple[nn.Module, object]:
    return SharedBlockMLP(), loss_fn


def linear_list() -> tuple[nn.Module, object]:
    return LinearList(), fixed_loss


def equal_blocks() -> tuple[nn.Module, object]:
    return EqualBlocks(), loss_fn


class FrozenInput(EqualBlocks):
    """:class:`EqualBlocks` with a trainable-shaped but frozen ``inp`` Linear(20, 50) instead of
    the buffer (a frozen layer: DDP skips it, FSDP2 gathers it and reduces no grad for it)."""

    def __init__(self) -> None:
        super().__init__()
        del self.proj
        self.inp = nn.Linear(D_IN, D_MODEL, bias=False).requires_grad_(False)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x)


def frozen_input() -> tuple[nn.Module, object]:
    return FrozenInput(), loss_fn


def conv_net() -> tuple[nn.Module, object]:
    return ConvNet(), fixed_loss


__all__ = ["BATCH_PER_RANK", "ConvNet", "EqualBlocks", "FrozenInput", "LinearList", "SharedBlockMLP",
           "conv_net", "equal_blocks", "frozen_input", "linear_list", "fixed_loss", "shared_block"]
