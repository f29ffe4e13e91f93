"""Rank-side tasks for ``dedicate_params(rest="replicate")`` (``dmuon/runtime/rest.py``): DMuon
keeps the params it does not dedicate replicated and averages their grads itself; nothing wraps
the model."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
from tests.distributed.parity.dmuon_tasks import (
    ADAMW_LR, GLOBAL_BATCH, MUON_LR, SMALL, _loss, _mesh, build, corpus, make_model,
)
from tracer.interposer import Interposer
from verify.workload.data import local_slice


def _batch(step: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = corpus().global_batch(step, GLOBAL_BATCH, SMALL.seq_len)
    return local_slice(x, rank, world), local_slice(y, rank, world)


def one_step_calls(mode: str) -> dict:
    """Two steps of ``mode`` with rest="replicate"; the second recorded by the interposer.
    Returns its calls (op, phase, group size, count, dtype, span), the rest's size and
    ``dm.coalescing()``."""
    wrapped, model, dm, opt = build(mode, rest="replicate")
    ip = Interposer()
    for step in range(2):
        if step == 1:
            ip.__enter__()
        _loss(wrapped, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            dm.wait_pending()
            ip.__exit__(None, None, None)
    rest = [p for n, p in model.named_parameters() if n in set(dm.rest_names)]
    out = {"events": [(e.op, e.phase, e.group_size, e.count, e.dtype, e.module) for e in ip.events],
           "rest_numel": sum(p.numel() for p in rest), "rest_params": len(rest),
           "rest_names": list(dm.rest_names), "dedicated": list(dm.names),
           "all_names": [n for n, _ in model.named_parameters()], "coalescing": dm.coalescing()}
    dm.close()
    return out


def divergent_init(perturb: bool) -> dict:
    """rest="replicate" on a model whose rest differs per rank before the first forward
    (``perturb``: ranks > 0 add noise): the first forward broadcasts rank 0's values, so the
    run equals the unperturbed one. Returns every param after 2 steps (after sync)."""
    wrapped, model, dm, opt = build("z2", rest="replicate")
    if perturb and dist.get_rank() > 0:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in set(dm.rest_names):
                    p.add_(torch.randn_like(p))
    for step in range(2):
        _loss(wrapped, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    dm.sync_params()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    dm.close()
    return out


def accumulate(micro_batches: int) -> dict:
    """One step over the global batch 0 as ``micro_batches`` no_sync micro-batches per rank,
    then ``clip_grad_norm_``; returns the total norm and the rest's averaged grads."""
    wrapped, model, dm, opt = build("z3", rest="replicate")
    x, y = _batch(0)
    for m in range(micro_batches):
        xs, ys = local_slice(x, m, micro_batches), local_slice(y, m, micro_batches)
        if m < micro_batches - 1:
            with dm.no_sync():
                (_loss(wrapped, xs, ys) / micro_batches).backward()
        else:
            (_loss(wrapped, xs, ys) / micro_batches).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if n in set(dm.rest_names)}
    norm = opt.clip_grad_norm_(1e9)
    dm.close()
    return {"grads": grads, "norm": norm}


class _Branchy(nn.Module):
    """``extra`` is used on rank 0 only (``used_on`` = {0}) or nowhere."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.extra = nn.Linear(8, 8, bias=False)
        self.extra_bias = nn.Parameter(torch.zeros(8))

    def forward(self, x, use_extra: bool):
        for b in self.blocks:
            x = torch.tanh(b(x))
        if use_extra:
            x = self.extra(x) + self.extra_bias
        return x


def usage(where: str) -> dict:
    """A rest param used on rank 0 only (``where="rank0"``) or on no rank (``"nowhere"``):
    its grad is the sum over ranks / W, or None (and AdamW leaves it unchanged)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Branchy()
    dm = dmuon.dedicate_params(model, _mesh("flat"), params=[b.weight for b in model.blocks]
                               + [model.extra.weight], reshard_after_forward=False, rest="replicate")
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    before = model.extra_bias.detach().clone()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x, where == "rank0" and rank == 0).pow(2).sum().backward()
    grad = None if model.extra_bias.grad is None else model.extra_bias.grad.clone()
    # the local grad each rank would have produced, for the expected average
    local = torch.zeros(8)
    if where == "rank0" and rank == 0:
        probe = _Branchy()
        probe.load_state_dict(model.state_dict())
        probe(x, True).pow(2).sum().backward()
        local = probe.extra_bias.grad.clone()
    opt.step()
    out = {"grad": grad, "local": local, "unchanged": torch.equal(before, model.extra_bias.detach())}
    dm.close()
    return out


def checkpoint_resume(mode: str) -> dict:
    """rest="replicate": DCP save after 2 steps, a fresh model + optimizer loads it, and both
    run step 2; returns both losses and the largest param difference after it."""
    shared = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    wrapped, model, dm, opt = build(mode, rest="replicate")
    for step in range(2):
        _loss(wrapped, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=shared[0])
    w2, model2, dm2, opt2 = build(mode, rest="replicate")
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=shared[0])
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for w, o in ((wrapped, opt), (w2, opt2)):
        loss = _loss(w, *_batch(2))
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    dm.sync_params()
    dm2.sync_params()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), model2.parameters()))
    dm.close()
    dm2.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(shared[0])
    return {"losses": losses, "diff": diff}


def bad_input(case: str) -> str:
    """One misuse of rest="replicate"; the exception type and message on this rank."""
    model = make_model()
    mesh = _mesh("flat")
    try:
        if case == "value":
            dmuon.dedicate_params(model, mesh, rest="shard")
        elif case == "mp_bias":  # a dedicated Linear weight beside its fp32 bias (the rest)
            torch.manual_seed(0)
            biased = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            dmuon.dedicate_params(biased, mesh, rest="replicate", mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, output_dtype=torch.float32))
        elif case == "wrapped":
            dm = dmuon.dedicate_params(model, mesh, rest="replicate")
            fully_shard(model, mesh=mesh, ignored_params=set(dm))
            try:
                _loss(model, *_batch(0))
            finally:
                dm.close(sync=False)
    except Exception as e:  # noqa: BLE001 - the test asserts type and message
        return f"{type(e).__name__}: {e}"
    return "no error"
