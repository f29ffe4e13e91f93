"""Rank-side tasks for the coalescing tests: a stack of equal blocks trained with
``coalesce="block"`` and ``"all"`` (an aligned group: one all_gather / reduce_scatter per
channel instead of one broadcast / reduce per bucket)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.ownership import buckets
from tests.distributed.parity.dmuon_tasks import _mesh, dedicate
from tracer.interposer import Interposer

BLOCKS, D = 8, 16


class Stack(nn.Module):
    """``blocks`` equal blocks (Linear(D, D) + tanh): at W=4 and ``BLOCKS`` every rank owns two
    matrices; 5 blocks give owner shares of 2, 1, 1, 1 matrices (an uneven group)."""

    def __init__(self, blocks: int = BLOCKS) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@contextmanager
def gloo_reductions(by_gather: bool):
    """gloo's entry of ``buckets.LINK_COSTS`` with ``reduce_by_gather`` set as given (False:
    NCCL's reduce / reduce_scatter, so a CPU run covers the ops a GPU run issues)."""
    saved = buckets.LINK_COSTS["gloo"]
    buckets.LINK_COSTS["gloo"] = dataclasses.replace(saved, reduce_by_gather=by_gather)
    try:
        yield
    finally:
        buckets.LINK_COSTS["gloo"] = saved


def train(mode: str, coalesce: str, steps: int = 3, bf16: bool = False, by_gather: bool = True,
          blocks: int = BLOCKS) -> dict:
    """``steps`` steps of ``mode`` (ddp, z2, z3, hsdp-z2, hsdp-z3) on a :class:`Stack` of
    ``blocks``; the last step recorded by the interposer. Returns every rank's full dedicated
    params (after ``sync_params``), the aligned flags and the last step's DMuon calls as
    ``(op, phase) -> count``. ``by_gather``: gloo's reductions as gathers / all_to_alls (its default) or as reduces /
    reduce_scatters. HSDP runs the hierarchical protocol, whose replicate calls these tests check
    (``dmuon_tasks.dedicate``)."""
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    model = Stack(blocks)
    reshard = mode.endswith("z3")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    with gloo_reductions(by_gather):
        dm = dedicate(model, mesh, reshard_after_forward=reshard, coalesce=coalesce, mp_policy=mp)
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        fully_shard(model, mesh=mesh, ignored_params=set(dm), mp_policy=mp or MixedPrecisionPolicy())
        wrapped = model
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=0.05, adamw_lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    ip = Interposer()
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world, D, generator=g)[rank * 4 : (rank + 1) * 4]
        if step == steps - 1:
            ip.__enter__()
        wrapped(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == steps - 1:
            dm.wait_pending()
            ip.__exit__(None, None, None)
    dm.sync_params()
    groups = {dm.groups.broadcast, dm.groups.reduce, dm.groups.replicate}
    mine = [e for e in ip.events if e.phase in ("forward", "backward", "replicate")
            and e.module is not None and e.module.startswith("blocks")]
    ops = Counter((e.op, e.phase) for e in mine)
    out = {"params": {n: p.detach().float().clone() for n, p in model.named_parameters() if p in dm},
           "aligned": [b.aligned for b in dm.buckets], "ops": dict(ops), "groups": len(groups - {None}),
           "coalescing": dm.coalescing()}
    dm.close()
    return out


def cast_one_block(whole_unit: bool) -> str:
    """An uneven group (5 blocks, ``coalesce="all"``) after ``.to(float64)`` of its block 1
    only, or of every block: the error the next forward raises (``""``: none; the forward and
    a step then ran)."""
    model = Stack(5)
    dm = dmuon.dedicate_params(model, _mesh("flat"), coalesce="all", rest="replicate")
    (model if whole_unit else model.blocks[1]).to(torch.float64)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.05, adamw_lr=1e-2)
    try:
        model(torch.randn(4, D, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
        return ""
    except ValueError as exc:
        return str(exc)
    finally:
        dm.close()
