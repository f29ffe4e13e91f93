"""Rank-side task functions for the DMuon distributed tests (run inside DistributedPool)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from verify.data import ByteCorpus, local_slice
from verify.model import GPTConfig, TinyGPT

SMALL = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
GLOBAL_BATCH = 8
MUON_LR, ADAMW_LR = 0.02, 3e-3
_corpus = None


def corpus() -> ByteCorpus:
    global _corpus
    if _corpus is None:
        _corpus = ByteCorpus.from_stdlib(200_000)
    return _corpus


def make_model(config: GPTConfig = SMALL) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(config)


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def oracle(steps: int, config: GPTConfig = SMALL, **muon_kw) -> dict[str, torch.Tensor]:
    """Single process: torch.optim.Muon on the default targets + torch.optim.AdamW, full batch."""
    model = make_model(config)
    modules = dict(model.named_modules())
    named = dict(model.named_parameters())
    targets = [n for n, p in named.items() if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]
    muon = torch.optim.Muon([named[n] for n in targets], lr=MUON_LR, **muon_kw)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in targets], lr=ADAMW_LR)
    for step in range(steps):
        x, y = corpus().global_batch(step, GLOBAL_BATCH, config.seq_len)
        _loss(model, x, y).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _mesh(kind: str):
    world = dist.get_world_size()
    if kind == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def train_dmuon(mode: str, steps: int, config: GPTConfig = SMALL, **dm_kw) -> dict:
    """Train with DMuon; returns the full params this rank holds authoritative values of.

    mode: "ddp", "z2", "z3", "hsdp-z2", "hsdp-z3".
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    model = make_model(config)
    reshard = mode.endswith("z3")
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard, **dm_kw)
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=set(dm))
        fully_shard(model, mesh=mesh, ignored_params=set(dm))
        wrapped = model
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    for step in range(steps):
        x, y = corpus().global_batch(step, GLOBAL_BATCH, config.seq_len)
        _loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    dm.wait_pending()
    owned = {id(p) for p in dm.owned()}
    out = {}
    for name, p in model.named_parameters():
        if p in dm:
            if id(p) in owned:
                out[name] = p.detach().clone()
        else:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().clone()
    return {"params": out, "ns_calls": opt.ns_calls, "momentum_on": sorted(
        n for n, p in model.named_parameters() if p in dm and "momentum_buffer" in opt.state.get(p, {}))}


def merge_owned(results: list[dict]) -> dict[str, torch.Tensor]:
    """One full parameter set from the ranks' results (dedicated ones from their owners)."""
    merged = {}
    for r in results:
        for name, t in r["params"].items():
            merged.setdefault(name, t)
    return merged


def oracle_grads(config: GPTConfig = SMALL) -> dict[str, torch.Tensor]:
    """Single process: grads of one backward on global batch 0."""
    model = make_model(config)
    x, y = corpus().global_batch(0, GLOBAL_BATCH, config.seq_len)
    _loss(model, x, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def dmuon_owner_grads(mode: str, config: GPTConfig = SMALL) -> dict[str, torch.Tensor]:
    """One backward under DMuon; the dedicated grads this rank owns (after reduce-to-owner),
    and the names whose grad is None here (non-owners must have dropped theirs)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    model = make_model(config)
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=mode.endswith("z3"))
    wrapped = DistributedDataParallel(model) if mode == "ddp" else model
    x, y = corpus().global_batch(0, GLOBAL_BATCH, config.seq_len)
    _loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    owned = {id(p) for p in dm.owned()}
    grads, dropped = {}, []
    for n, p in model.named_parameters():
        if p in dm:
            if id(p) in owned:
                grads[n] = p.grad.clone()
            elif p.grad is None:
                dropped.append(n)
    return {"grads": grads, "dropped": dropped, "n_dedicated": len(dm)}
