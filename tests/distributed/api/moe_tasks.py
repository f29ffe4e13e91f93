"""Conditional execution under DMuon: a 4-expert top-1-routed MoE whose
experts go idle on some ranks, an expert no token reaches, and a module used on rank 0 only."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dmuon
from tests.distributed.parity.dmuon_tasks import _mesh, authoritative_params, root_unit

D, N_EXPERTS, N_CLASSES = 16, 4, 5
TOKENS_PER_RANK = 2  # at most 2 of the 3 routable experts run per rank and step
STEPS = 3
MUON_LR, ADAMW_LR = 0.02, 3e-3


class MoE(nn.Module):
    """Top-1 routing over ``N_EXPERTS`` experts; expert 3 is never chosen (masked router)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, N_EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(N_EXPERTS))

    def forward(self, h):
        logits = self.router(h)
        logits = logits.masked_fill(torch.arange(N_EXPERTS) == N_EXPERTS - 1, float("-inf"))
        gate, idx = F.softmax(logits, dim=-1).max(dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if mask.any():  # experts without tokens do not run on this rank
                out = out.index_put((mask.nonzero().squeeze(1),), expert(h[mask]) * gate[mask, None])
        return h + out


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)
        self.moe = MoE()
        self.aux = nn.Linear(D, D, bias=False)  # used by rank 0 only
        self.head = nn.Linear(D, N_CLASSES)

    def forward(self, x, use_aux: bool):
        h = self.moe(torch.tanh(self.inp(x)))
        if use_aux:
            h = h + self.aux(h)
        return self.head(h)


DEDICATED = ["inp.weight", "aux.weight"] + [f"moe.experts.{e}.weight" for e in range(N_EXPERTS)]


def make_net() -> MoENet:
    torch.manual_seed(0)
    return MoENet()


def data(step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * TOKENS_PER_RANK, D, generator=g)
    y = torch.randint(0, N_CLASSES, (world * TOKENS_PER_RANK,), generator=g)
    return x, y


def _rank_loss(model, x, y, r):
    sl = slice(r * TOKENS_PER_RANK, (r + 1) * TOKENS_PER_RANK)
    return F.cross_entropy(model(x[sl], use_aux=(r == 0)), y[sl])


def oracle(world: int) -> dict:
    """One process, torch.optim.Muon + AdamW, loss = mean over the ranks' losses."""
    model = make_net()
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[n] for n in DEDICATED], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in DEDICATED], lr=ADAMW_LR)
    for step in range(STEPS):
        x, y = data(step, world)
        (sum(_rank_loss(model, x, y, r) for r in range(world)) / world).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(mode: str) -> dict:
    """mode: "ddp-z2", "ddp-z3" (DDP for the rest) or "fsdp-z3" (root fully_shard)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh("flat")
    model = make_net()
    before = model.moe.experts[N_EXPERTS - 1].weight.detach().clone()
    dm = dmuon.dedicate_params(model, mesh, params=DEDICATED, reshard_after_forward=mode.endswith("z3"))
    wrapped, opt = root_unit(model, mesh, dm, ddp=mode.startswith("ddp"), lr=MUON_LR, adamw_lr=ADAMW_LR)
    ran = []
    for e, expert in enumerate(model.moe.experts):
        expert.register_forward_pre_hook(lambda m, a, e=e: ran.append((step, e)))
    for step in range(STEPS):
        x, y = data(step, world)
        _rank_loss(wrapped, x, y, rank).backward()
        opt.step()
        opt.zero_grad()
    out = authoritative_params(model, dm)
    owned = {id(p) for p in dm.owned()}
    idle_expert = model.moe.experts[N_EXPERTS - 1].weight
    return {"params": out, "experts_run": sorted(set(ran)),
            "idle_unchanged": torch.equal(idle_expert.detach(), before) if id(idle_expert) in owned else None,
            # DMuon creates momentum at construction (checkpointing needs complete state):
            # an expert never routed to keeps it at zero, as it keeps its weight.
            "idle_momentum": bool(opt.state.get(idle_expert, {}).get(
                "momentum_buffer", torch.zeros(())).count_nonzero())}
