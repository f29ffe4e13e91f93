"""Rank-side tasks of ``test_breakit_regressions.py`` (bugs found by the coalescing review)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.runtime.state import Copy

D = 16


class Stack(nn.Module):
    """``n`` equal blocks (bias-free Linear(D, D) + tanh); the blocks in ``skip`` do not run
    (on every rank)."""

    def __init__(self, n: int, skip: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D, bias=False), nn.Tanh()) for _ in range(n))
        self.skip = skip
        self.probe = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i in self.skip:
                continue
            if self.probe is not None:
                self.probe()
            x = block(x)
        return x


def double_after_optimizer(coalesce: str) -> str:
    """``model.double()`` after ``DMuon(...)`` was built, before the first step, then one step:
    torch optimizers create their state at the first step, so this trains in fp64."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Stack(4)
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=False, coalesce=coalesce)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.05, adamw_lr=1e-2)
    model.double()
    model(torch.randn(4, D, dtype=torch.float64)).pow(2).mean().backward()
    try:
        opt.step()
        return "ok"
    except RuntimeError as e:
        return str(e)
    finally:
        opt.zero_grad()
        dm.close()


def z3_peak_with_skipped_blocks(coalesce, skip: tuple[int, ...]) -> dict:
    """Z3, 16 blocks; the most non-holder compute-copy bytes allocated before any block's
    forward, against ``dm.coalescing()["z3_peak_bytes"]``."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Stack(16, skip)
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=True, coalesce=coalesce)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.05, adamw_lr=1e-2)
    seen = []
    model.probe = lambda: seen.append(sum(b.numel * b.flat.element_size() for b in dm.buckets
                                          if not b.is_holder and b.copy is not Copy.FREED))
    for step in range(2):
        model(torch.randn(4, D)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    skipped_units = {b.module_name for b in dm.buckets
                     if any(x.split(".")[:2] == ["blocks", str(i)] for i in skip for x in b.blocks)}
    out = {"measured": max(seen), "reported": dm.coalescing()["z3_peak_bytes"],
           "target": dm.coalesce_bytes,
           "skipped_units_bytes": sum(b.numel * b.flat.element_size() for b in dm.buckets
                                      if not b.is_holder and b.module_name in skipped_units)}
    dm.close()
    return out
