"""Gradient clipping by the global norm across DMuon's owners (``DMuon.clip_grad_norm_``).

After backward a dedicated matrix's averaged grad lives on its owner only (the other ranks
have ``None``), so ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would compute a
different norm on every rank. Here the total p-norm of all grads is

    ||g||_p^p = sum over ranks of (this rank's owned dedicated grads)^p   (one all_reduce)
              + (the other params' grads)^p

where the other params' part is what ``torch.nn.utils.get_total_norm`` gives: for FSDP2
DTensor grads the norm over the whole (sharded) tensor (one reduction per mesh: FSDP2 × TP
holds 1-D and 2-D DTensors), for DDP's replicated plain grads the local norm, the same on every
rank. On a TP mesh a rank's owned part is its TP shards' elements, plus the grads replicated
over TP on TP index 0 only, so every element counts once. ``p = inf`` takes maxima instead of sums. Every grad,
dedicated (owners) and other, is then scaled by ``min(1, max_norm / (total + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does (torch 2.13, ``torch/nn/utils/clip_grad.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from dmuon import annotate

from dmuon.runtime import collectives
from dmuon.runtime.dedicated_params import DedicatedParams
from dmuon.runtime.state import TrainingState


def _counted(dm: DedicatedParams, dedicated: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The owned dedicated grads this rank adds to the norm, each element of every matrix
    once over the W ranks (``Placement.counts_in_norm``; the local tensor: under TP, a TP
    param's shard, a param replicated over TP on TP index 0 only)."""
    out = []
    for q in dedicated:
        pl = dm.placement_of(q)
        if q.grad is not None and pl.counts_in_norm():
            out.append(pl.local(q.grad))
    return out


def clip_grad_norm_(
    dm: DedicatedParams,
    dedicated: Sequence[torch.Tensor],
    others: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    pipeline_group=None,
) -> torch.Tensor:
    """Scale every grad so that the global ``norm_type``-norm is at most ``max_norm``.

    A collective over all W ranks (one ``all_reduce`` of one fp32 element on DMuon's world
    group, phase ``optimizer``; plus ``DTensor`` norm reductions on FSDP2's mesh for
    ``others``, phase ``optimizer`` too: docs/traffic-model.md, "Clipping"): call it on every
    rank, after ``backward()`` and before ``step()``.

    Args:
        dm: the model's DedicatedParams.
        dedicated: the dedicated params (grads on owners after backward).
        others: every other param (plain or FSDP2 ``DTensor``; ``None`` grads skipped).
        max_norm: the largest allowed total norm (> 0).
        norm_type: p of the p-norm (> 0, or ``math.inf``).
        error_if_nonfinite: raise if the total norm is nan or inf (after the collective, so
            every rank raises).
        pipeline_group: under pipeline parallelism, the pipeline group of this rank (``mesh.get_group
            ("pp")``: one rank of each stage, the same data-parallel index): the stages' totals
            are then combined by one more all_reduce of one fp32 element over it (phase
            ``optimizer``), so every stage clips by the norm of the whole model, as torchtitan
            does. ``None``: the norm of this stage's (this model's) grads.

    Returns:
        The total norm before clipping, a 0-dim fp32 CPU tensor, equal on every rank.

    Raises:
        ValueError: ``max_norm`` or ``norm_type`` invalid (before any collective).
        RuntimeError: called when the last backward's grads were not reduced to their owners
            (before any collective; same state on every rank), or a nonfinite norm with
            ``error_if_nonfinite``.
    """
    if not isinstance(max_norm, int | float) or not max_norm > 0 or not math.isfinite(max_norm):
        raise ValueError(f"Invalid max_norm={max_norm!r}. Must be a finite number > 0.")
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"Invalid norm_type={norm_type!r}. Must be > 0 or math.inf.")
    if dm.state != TrainingState.BACKWARD_DONE or dm.unreduced_param() is not None:
        raise RuntimeError(
            f"DMuon: clip_grad_norm_ called in state {dm.state.name} with dedicated grads not "
            "reduced to their owners. Call it after loss.backward() (outside dm.no_sync()) "
            "and before optimizer.step(), on every rank."
        )
    mine = [g for g in (q.grad for q in dedicated) if g is not None]
    counted = _counted(dm, dedicated)
    inf = math.isinf(p)
    world = dm.groups.world
    device = collectives.collective_device(world)
    if counted:
        part = torch.nn.utils.get_total_norm(counted, p).to(device=device, dtype=torch.float32)
        local = part if inf else part.pow(p)
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    with annotate.phase("optimizer"), annotate.span("dmuon.clip_grad_norm"):
        collectives.all_reduce_max_(local, world) if inf else collectives.all_reduce_sum_(local, world)
    ded = local.cpu()
    grads = [q.grad for q in others if q.grad is not None]
    rest = torch.zeros((), dtype=torch.float32)
    meshes: dict[object, list[torch.Tensor]] = {}  # DTensor grads by mesh (FSDP2; FSDP2 x TP: two)
    for g in grads:
        meshes.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    # DTensor grads (one norm reduction per mesh), plain ones (DDP); tagged like the all_reduce
    with annotate.phase("optimizer"), annotate.span("dmuon.clip_grad_norm"):
        for group in meshes.values():
            if group:
                n = torch.nn.utils.get_total_norm(group, p)
                n = (n.full_tensor() if isinstance(n, DTensor) else n).float().cpu()
                rest = torch.maximum(rest, n) if inf else rest + n.pow(p)
    combined = torch.maximum(ded, rest) if inf else ded + rest
    if pipeline_group is not None:  # every stage's total, once per stage (its data-parallel twin)
        across = combined.to(device=collectives.collective_device(pipeline_group))
        with annotate.phase("optimizer"), annotate.span("dmuon.clip_grad_norm"):
            if inf:
                collectives.all_reduce_max_(across, pipeline_group)
            else:
                collectives.all_reduce_sum_(across, pipeline_group)
        combined = across.cpu()
    total = combined if inf else combined.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"DMuon: the total norm of order {norm_type} of the gradients is {total.item()}. "
            "Pass error_if_nonfinite=False to clip anyway (the grads then become nan)."
        )
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for g in mine + grads:
                g.mul_(coef)
    return total
