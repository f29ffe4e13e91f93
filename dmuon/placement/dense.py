"""The dense placement: a plain matrix (or expert stack, or conv weight), identical on every
rank of its data-parallel mesh. The protocol is ``docs/protocol.md``; this is the kind it
describes first."""

from __future__ import annotations

import torch

from dmuon import annotate
from dmuon.optim.muon_math import muon_update_matrices_
from dmuon.placement.base import Placement, StepContext


class Dense(Placement):
    """A plain tensor held whole on every rank (its owner's copy is authoritative).

    ``counted``: whether this rank's owned grad enters the global norm; ``False`` in the
    model-parallel columns other than the first, where the same matrix is owned once per column."""

    kind = "dense"
    step_order = 1

    @classmethod
    def step(cls, ctx: StepContext, params: list[torch.Tensor]) -> int:
        """:func:`batched_step` on the params themselves. No collective."""
        return batched_step(ctx, params, lambda t: t)


def batched_step(ctx: StepContext, params: list[torch.Tensor], local) -> int:
    """Muon on ``local(p)`` of each param (with ``local(p.grad)`` and ``local(momentum)``): one
    Newton–Schulz ``bmm`` chain per batch of matrices of one (matrix shape, dtype, device), an
    expert stack's slices included (tolerance: see
    :func:`~dmuon.optim.muon_math.zeropower_via_newtonschulz_batched`); a single matrix takes
    the per-matrix path (``torch.optim.Muon``'s arithmetic). One span per batch, named after its
    first param's unit. Returns the number of matrices orthogonalized."""
    batches: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        batches.setdefault((ctx.matrix_shape(p), p.dtype, local(p).device), []).append(p)
    count = 0
    for (matrix, _, _), ps in batches.items():
        bufs = [local(ctx.momentum_of(p)) for p in ps]
        data = [local(p) for p in ps]
        unit, _, owner = ctx.label(ps[0])
        with annotate.span("dmuon.newton_schulz", module=unit, owner=owner):
            muon_update_matrices_(data, [local(p.grad) for p in ps], bufs, matrix_shape=matrix,
                                  **ctx.hparams)
        count += sum(t.numel() for t in data) // (matrix[0] * matrix[1])
    return count
