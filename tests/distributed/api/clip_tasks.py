"""Rank-side tasks for DMuon.clip_grad_norm_: the zero_grad_tasks model (an expert idle after
step 0) trained with clipping that bites, against one process with torch's own clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import dmuon
from tests.distributed.parity.dmuon_tasks import root_unit
from tests.distributed.runtime.zero_grad_tasks import ADAMW_LR, BATCH, DEDICATED, LR, STEPS, Net, _data

MAX_NORM = 0.05  # below every step's norm: every step clips


def oracle(world: int, norm_type: float) -> dict:
    """One process, global batch, torch.nn.utils.clip_grad_norm_ over every param."""
    model = Net()
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[n] for n in DEDICATED], lr=LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in DEDICATED], lr=ADAMW_LR)
    norms = []
    for step in range(STEPS):
        model.step = step
        x, y = _data(step, world)
        F.cross_entropy(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def train(wrap: str, norm_type: float) -> dict:
    """DMuon under DDP (``wrap="ddp"``) or one root FSDP2 unit (``"fsdp"``, Z2), clipping
    with ``opt.clip_grad_norm_`` each step; returns the norms and every param."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    dm = dmuon.dedicate_params(model, mesh, params=DEDICATED, reshard_after_forward=False)
    wrapped, opt = root_unit(model, mesh, dm, ddp=wrap == "ddp", lr=LR, adamw_lr=ADAMW_LR)
    norms = []
    for step in range(STEPS):
        model.step = step
        x, y = _data(step, world)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        F.cross_entropy(wrapped(x[sl]), y[sl]).backward()
        norms.append(float(opt.clip_grad_norm_(MAX_NORM, norm_type)))
        opt.step()
        opt.zero_grad()
    dm.sync_params()
    params = {}
    for n, p in model.named_parameters():
        params[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return {"params": params, "norms": norms}


def misuse() -> list[str]:
    """The errors of a call before any backward and of invalid arguments (no collective)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Net()
    dm = dmuon.dedicate_params(model, mesh, params=DEDICATED, reshard_after_forward=False)
    opt = dmuon.DMuon(DistributedDataParallel(model).parameters(), dedicated=dm, lr=LR)
    out = []
    for args in ((1.0,), (0.0,), (1.0, -2.0), (math.nan,)):
        try:
            opt.clip_grad_norm_(*args)
        except (ValueError, RuntimeError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out
