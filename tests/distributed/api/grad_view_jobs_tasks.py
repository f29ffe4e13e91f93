"""Rank-side tasks: torch's ``clip_grad_norm_`` with ``norm_type=inf`` on the dedicated grads
shown as DTensors under FSDP2 (``dmuon/runtime/grad_view.py``), found by helper h18 trying the
view the way training jobs use it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.distributed.parity import dmuon_tasks as T
from verify.workload.data import local_slice

MAX_NORM = 1e-3  # below every grad's largest element: the clip bites


def _max_abs_over_world(params) -> float:
    """The largest |grad element| over the world, from each rank's local part (owners' plain
    grads, FSDP2's shards), reduced here with one all_reduce(MAX): the reference."""
    local = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        if g is not None:
            g = g.to_local() if isinstance(g, DTensor) else g
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().double())
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local)


def inf_norm_clip(mode: str, one_matrix: bool) -> dict:
    """One backward, the reference inf-norm, then ``torch.nn.utils.clip_grad_norm_(...,
    norm_type=inf)``: what it returned (or the error) and the reference. ``one_matrix``: only
    one dedicated matrix, so one rank owns every dedicated param."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = {}
    if one_matrix:
        kw["params"] = [next(n for n, p in T.make_model().named_parameters()
                             if p.ndim == 2 and n.startswith("blocks."))]
    wrapped, model, dm, opt = T.build(mode, **kw)
    x, y = T.corpus().global_batch(0, T.GLOBAL_BATCH, T.SMALL.seq_len)
    T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    ref = _max_abs_over_world(wrapped.parameters())
    try:
        total = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), MAX_NORM, norm_type=float("inf"))
        return {"total": float(total.full_tensor() if isinstance(total, DTensor) else total),
                "ref": ref, "error": ""}
    except RuntimeError as exc:
        return {"total": None, "ref": ref, "error": str(exc)}
