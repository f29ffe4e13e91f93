"""An MoE whose experts are one 3-D param per projection, as transformers 5 stores them:
``make verify-traffic ARGS="--nproc 2 --model examples.experts:factory"``.

Every expert matrix is a Muon target under DMuon's default selection (docs/selection.md):
``w_in (E, D, F)`` and ``w_out (E, F, D)`` are stacks of E matrices (one owner each, E
Newton–Schulz calls), the router ``router (E, D)`` is a 2-D param of a custom module, and
``inp`` an ``nn.Linear``; the output head ``head`` goes to AdamW. Top-2 routing over
``N_EXPERTS`` experts with gather-then-``bmm`` (every expert's slice gets a gradient, zero
where no token went). Widths are not multiples of 4, so FSDP2 pads the stacks' dim 0 (E) in
the naive modes. Same task and loss protocol as :mod:`examples.my_model`.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.my_model import D_IN, D_OUT, loss_fn

D_MODEL, D_FF, N_EXPERTS, N_LAYERS, TOP_K = 24, 40, 5, 2, 2


class MoELayer(nn.Module):
    """Residual top-2 MoE feed-forward: ``x + sum_k gate_k · w_out[e_k]ᵀ gelu(w_in[e_k]ᵀ x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(N_EXPERTS, D_MODEL) / D_MODEL**0.5)
        self.w_in = nn.Parameter(torch.randn(N_EXPERTS, D_MODEL, D_FF) / D_MODEL**0.5)
        self.w_out = nn.Parameter(torch.randn(N_EXPERTS, D_FF, D_MODEL) / D_FF**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D_MODEL) -> (B, D_MODEL)."""
        gates, idx = torch.softmax(x @ self.router.T, dim=-1).topk(TOP_K, dim=-1)  # (B, K)
        h = x.unsqueeze(1).expand(-1, TOP_K, -1).reshape(-1, 1, D_MODEL)  # (B·K, 1, D)
        e = idx.reshape(-1)
        h = nn.functional.gelu(torch.bmm(h, self.w_in[e]))  # (B·K, 1, F)
        h = torch.bmm(h, self.w_out[e]).view(x.shape[0], TOP_K, D_MODEL)
        return x + (gates.unsqueeze(-1) * h).sum(1)


class ExpertsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D_MODEL, bias=False)
        self.layers = nn.ModuleList(MoELayer() for _ in range(N_LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D_IN) -> (B, D_OUT)."""
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def factory() -> tuple[nn.Module, object]:
    """A fresh ExpertsMLP (the harness seeds torch first) and its loss."""
    return ExpertsMLP(), loss_fn
