"""A stack sharded on dim 0: a DTensor of 3+ dims whose placements are ``Shard(0)`` on some
mesh dims (expert parallelism: each rank holds whole experts, ``examples/ep_moe.py``). Every
slice is its own matrix, so its owner steps the local slices where they live, no collective.

Sharded on data-parallel dims (experts on an expert-parallel dim, whose ranks see different
tokens), the stack moves over its **column**: the data-parallel dims it is not sharded on, the
ranks holding the same slices (``layout.py``)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dmuon.placement.base import Placement, StepContext
from dmuon.placement.dense import batched_step


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor its ops run on, not ``to_local()``, which
    returns a new view for a Parameter and a graph node under autograd), else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a local shard of ``p``'s local shape) as a tensor like ``p``: a DTensor with
    ``p``'s mesh, placements, global shape and stride (sharing ``t``'s memory), or ``t``."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def placed_like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A grad ``g`` of ``p`` with ``p``'s placements (a grad that autograd produced with other
    placements is redistributed, a DTensor collective on ``p``'s mesh); plain tensors and
    matching DTensors are returned as they are."""
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        return g.redistribute(p.device_mesh, p.placements)
    return g


class Sharded(Placement):
    """A DTensor param: the buckets hold its local tensor (a view into DMuon's flat buffer,
    ``residency.flatten_into_views``), shown as the DTensor the sharded modules' forwards need."""

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return local(t)

    def like(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return like(p, t)

    def placed_like(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return placed_like(p, g)

    def guarded(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The DTensor and its local tensor (``to_local()`` hands the latter out without a
        torch function call)."""
        return (p, local(p))


class StackShard(Sharded):
    """A stack's local slices: global shape ``(X, rows, cols)``, this rank holds ``X/E`` whole
    slices. Its column's owner runs Newton–Schulz on them (no collective) and keeps their
    momentum, a DTensor like the param (so DCP saves each column's slices at their offsets and
    loads them at another degree)."""

    kind = "stack"
    step_order = 2

    def new_momentum(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros like ``p``: a DTensor with ``p``'s placements, local ``(X/E, rows, cols)``."""
        return like(p, torch.zeros_like(local(p), memory_format=torch.preserve_format))

    @classmethod
    def step(cls, ctx: StepContext, params: list[torch.Tensor]) -> int:
        """Muon on the local stacks (:func:`~dmuon.placement.dense.batched_step`: one batched
        Newton–Schulz per matrix shape over every local slice); no collective."""
        return batched_step(ctx, params, local)
