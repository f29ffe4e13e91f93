"""Rank-side tasks: torch's own clipping functions in a DMuon script."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dmuon
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity import dmuon_tasks as T
from verify.workload.data import local_slice

MAX_NORM = 0.05  # below the test model's grad norm (about 2): clipping bites
CLIP_VALUE = 2e-3  # clamps part of every grad's elements, not all


def _clip(how: str, wrapped, opt) -> None:
    params = list(wrapped.parameters())
    if how == "norm":
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    elif how == "norm_not_biting":  # max_norm above the norm: torch multiplies by 1.0
        torch.nn.utils.clip_grad_norm_(params, 1e6)
    elif how == "total_norm":
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    elif how == "value":
        torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
    elif how == "dmuon":
        opt.clip_grad_norm_(MAX_NORM)
    elif how == "dmuon_then_value":
        opt.clip_grad_norm_(MAX_NORM)
        torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
    elif how != "none":
        raise AssertionError(how)


def step_after(mode: str, how: str, **dm_kw) -> dict:
    """One backward, ``how``'s clipping, ``opt.step()``: the error (or ``""``), whether any
    param changed, and the params this rank holds authoritative values of."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model, dm, opt = T.build(mode, **dm_kw)
    x, y = T.corpus().global_batch(0, T.GLOBAL_BATCH, T.SMALL.seq_len)
    T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    _clip(how, wrapped, opt)
    before = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    try:
        opt.step()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], _local(p))]
    again = ""
    if error:  # a retried step() refuses again
        try:
            opt.step()
        except RuntimeError as exc:
            again = str(exc)
    return {"error": error, "again": again, "changed": changed}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _clip_all(how: str, params) -> None:
    if how == "value":
        torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
    else:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)


def oracle(steps: int, how: str, micro_batches: int = 1, nudge: str | None = None) -> dict:
    """One process: torch.optim.Muon + AdamW, torch's ``clip_grad_value_`` (``how="value"``)
    or ``clip_grad_norm_`` (``"norm"``) on the global batch's grads; ``clamped``: the fraction
    of grad elements over ``CLIP_VALUE``, ``norms``: the grad norm before each clip.
    ``micro_batches`` > 1: the batch accumulated as that many slices; ``nudge``: one of
    ``noise_floor.NUDGES``."""
    with oracle_threads(nudge):
        return _oracle(steps, how, micro_batches, nudge)


def _oracle(steps: int, how: str, micro_batches: int, nudge: str | None) -> dict:
    model = nudge_init_(T.make_model(), nudge)
    modules = dict(model.named_modules())
    named = dict(model.named_parameters())
    targets = [n for n, p in named.items() if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]
    muon = torch.optim.Muon([named[n] for n in targets], lr=T.MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in targets], lr=T.ADAMW_LR)
    clamped, norms = [], []
    for step in range(steps):
        x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
        for m in range(micro_batches):
            xs, ys = local_slice(x, m, micro_batches), local_slice(y, m, micro_batches)
            (T._loss(model, xs, ys) / micro_batches).backward()
        grads = [p.grad for p in model.parameters()]
        clamped.append(sum(int((g.abs() > CLIP_VALUE).sum()) for g in grads) / sum(g.numel() for g in grads))
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        _clip_all(how, model.parameters())
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "clamped": clamped, "norms": norms}


def train(mode: str, steps: int, how: str, via_opt: bool = False, **dm_kw) -> dict:
    """DMuon with torch's ``clip_grad_value_`` / ``clip_grad_norm_`` (``how``) over the
    model's params every step (``via_opt``: ``opt.clip_grad_value_`` / ``opt.clip_grad_norm_``);
    ``norms``: what the clip returned each step, on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model, dm, opt = T.build(mode, **dm_kw)
    norms = []
    for step in range(steps):
        x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
        T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        if how == "norm":
            total = opt.clip_grad_norm_(MAX_NORM) if via_opt else torch.nn.utils.clip_grad_norm_(
                wrapped.parameters(), MAX_NORM)
            norms.append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))
        elif via_opt:
            opt.clip_grad_value_(CLIP_VALUE)
        else:
            _clip_all(how, wrapped.parameters())
        opt.step()
        opt.zero_grad()
    return {"params": T.authoritative_params(model, dm), "norms": norms}
