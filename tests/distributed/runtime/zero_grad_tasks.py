"""Rank-side tasks: an expert that runs in step 0 only, trained with ``zero_grad(set_to_none)``
True or False (torch keeps a zeroed grad with False and steps the idle expert on its momentum;
with True its grad is None and it does not move)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

import dmuon

D, STEPS, BATCH = 8, 3, 4  # BATCH per rank
LR, ADAMW_LR = 0.02, 3e-3
DEDICATED = ["inp.weight", "experts.0.weight", "experts.1.weight"]


class Net(nn.Module):
    """``experts.1`` runs in step 0 only (``self.step``), on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(2))
        self.head = nn.Linear(D, 3)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.experts[0](h) + (self.experts[1](h) if self.step == 0 else 0)
        return self.head(h)


def _data(step: int, world: int):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(world * BATCH, D, generator=g), torch.randint(0, 3, (world * BATCH,), generator=g)


def oracle(world: int, set_to_none: bool, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process: torch.optim.Muon + AdamW on the global batch."""
    model = Net()
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[n] for n in DEDICATED], lr=LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in DEDICATED], lr=ADAMW_LR)
    for step in range(steps):
        model.step = step
        x, y = _data(step, world)
        F.cross_entropy(model(x), y).backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad(set_to_none)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(set_to_none: bool, z3: bool, bf16: bool) -> dict:
    """DMuon + DDP (Z3 if ``z3``, bf16 compute if ``bf16``); returns every param (after
    ``sync_params``) and, on the owner of ``experts.1``, its grad's max after step 1's
    backward (None if the grad is None) and its value after step 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    ) if bf16 else None
    dm = dmuon.dedicate_params(model, mesh, params=DEDICATED, reshard_after_forward=z3, mp_policy=mp)
    ddp = DistributedDataParallel(model)
    opt = dmuon.DMuon(ddp.parameters(), dedicated=dm, lr=LR, adamw_lr=ADAMW_LR)
    idle = model.experts[1].weight
    owns_idle = any(p is idle for p in dm.owned())
    idle_grad = after_step0 = None
    for step in range(STEPS):
        model.step = step
        x, y = _data(step, world)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        F.cross_entropy(ddp(x[sl]).float(), y[sl]).backward()
        if step == 1 and owns_idle:
            idle_grad = None if idle.grad is None else float(idle.grad.abs().max())
        opt.step()
        opt.zero_grad(set_to_none)
        if step == 0 and owns_idle:
            after_step0 = idle.detach().clone()
    dm.sync_params()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "owns_idle": owns_idle,
        "idle_grad": idle_grad,
        "idle_after_step0": after_step0,
    }


def step_after_no_sync_only(z3: bool) -> dict:
    """A step whose only backward ran inside ``dm.no_sync()`` must raise on every rank (the
    owners would step on their own micro-batch); ``zero_grad()`` drops those grads, and a
    normal step afterwards matches the oracle's first step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    dm = dmuon.dedicate_params(model, mesh, params=DEDICATED, reshard_after_forward=z3)
    ddp = DistributedDataParallel(model)
    opt = dmuon.DMuon(ddp.parameters(), dedicated=dm, lr=LR, adamw_lr=ADAMW_LR)
    x, y = _data(0, world)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    with dm.no_sync(), ddp.no_sync():
        F.cross_entropy(ddp(x[sl]), y[sl]).backward()
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    opt.zero_grad()
    F.cross_entropy(ddp(x[sl]), y[sl]).backward()
    opt.step()
    dm.sync_params()
    return {"error": error, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def second_backward_error(after_step: bool) -> str | None:
    """Two iterations that clear grads with ``model.zero_grad()`` (``after_step``) or a
    second backward with no step between; returns the error text (None if none)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    dm = dmuon.dedicate_params(model, mesh, params=DEDICATED, reshard_after_forward=True)
    ddp = DistributedDataParallel(model)
    opt = dmuon.DMuon(ddp.parameters(), dedicated=dm, lr=LR, adamw_lr=ADAMW_LR)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    try:
        for step in range(2):
            x, y = _data(step, world)
            F.cross_entropy(ddp(x[sl]), y[sl]).backward()
            if after_step:
                opt.step()
                model.zero_grad()
    except RuntimeError as e:
        return str(e)
    return None
