"""Rank-side tasks for DMuon with torch-style param groups.

The groups (by param name of ``dmuon_tasks.SMALL``'s TinyGPT):

- 0 "decay": embeddings, head (AdamW) and the attention matrices (Muon), ``weight_decay=0.1``;
- 1 "no_decay": ``ln1`` and ``ln_f`` (AdamW only), ``weight_decay=0.0`` and ``lr=6e-3``;
- 2 "mlp": the MLP matrices (Muon) with ``ln2`` (AdamW) in one group, each hyper-parameter set:
  Muon ``lr, momentum, nesterov, adjust_lr_fn``, AdamW ``adamw_lr, betas``, both ``eps`` and
  ``weight_decay``.

The oracle spells the same groups out for ``torch.optim.Muon`` and ``torch.optim.AdamW`` by
the rule of ``dmuon/optim/groups.py`` (a shared key reaches both, an ``adamw_`` key the AdamW
part only), written here independently of that module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

import dmuon
from tests.distributed.api import checkpoint_tasks as C
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity import dmuon_tasks as T
from verify.workload.data import local_slice

ATTN = ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight"]
MLP = ["blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"]
DECAY_ADAMW = ["tok_emb.weight", "pos_emb.weight", "head.weight"]
NO_DECAY = ["blocks.0.ln1.weight", "blocks.0.ln1.bias", "ln_f.weight", "ln_f.bias"]
LN2 = ["blocks.0.ln2.weight", "blocks.0.ln2.bias"]
MLP_HP = {"lr": 0.01, "momentum": 0.9, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"}
SHARED_HP = {"eps": 1e-6, "weight_decay": 0.05}


def user_groups(named: dict) -> list[dict]:
    """The groups a user passes to DMuon (mixing Muon and AdamW params in groups 0 and 2)."""
    return [
        {"params": [named[n] for n in DECAY_ADAMW + ATTN], "weight_decay": 0.1},
        {"params": [named[n] for n in NO_DECAY], "weight_decay": 0.0, "lr": 6e-3},
        {"params": [named[n] for n in MLP + LN2], **MLP_HP, **SHARED_HP,
         "adamw_lr": 1e-3, "betas": (0.8, 0.99)},
    ]


def factor(user_group: int):
    """The LR schedule of a user group: group 1 constant, the others 0.8 ** step."""
    return (lambda s: 1.0) if user_group == 1 else (lambda s: 0.8 ** s)


def oracle(steps: int, micro_batches: int = 1, schedule: bool = True,
           nudge: str | None = None) -> dict[str, torch.Tensor]:
    """One process, the global batch: torch.optim.Muon and AdamW with the same groups (and,
    with ``schedule``, the same per-group LambdaLR); the params after ``steps`` steps.
    ``micro_batches`` > 1: the batch accumulated as that many slices; ``nudge``: one of
    ``noise_floor.NUDGES``."""
    with oracle_threads(nudge):
        return _oracle(steps, micro_batches, schedule, nudge)


def _oracle(steps: int, micro_batches: int, schedule: bool, nudge: str | None) -> dict:
    model = nudge_init_(T.make_model(), nudge)
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([
        {"params": [named[n] for n in ATTN], "weight_decay": 0.1},
        {"params": [named[n] for n in MLP], **MLP_HP, **SHARED_HP},
    ], lr=T.MUON_LR)
    adamw = torch.optim.AdamW([
        {"params": [named[n] for n in DECAY_ADAMW], "weight_decay": 0.1},
        {"params": [named[n] for n in NO_DECAY], "weight_decay": 0.0, "lr": 6e-3},
        {"params": [named[n] for n in LN2], **SHARED_HP, "lr": 1e-3, "betas": (0.8, 0.99)},
    ], lr=T.ADAMW_LR)
    scheds = [LambdaLR(muon, [factor(0), factor(2)]), LambdaLR(adamw, [factor(0), factor(1), factor(2)])]
    for step in range(steps):
        x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
        for m in range(micro_batches):
            xs, ys = local_slice(x, m, micro_batches), local_slice(y, m, micro_batches)
            (T._loss(model, xs, ys) / micro_batches).backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        if schedule:
            for s in scheds:
                s.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grouped(run_model, dm, wrapped) -> dmuon.DMuon:
    named = dict(run_model.named_parameters())
    return dmuon.DMuon(user_groups(named), dedicated=dm, lr=T.MUON_LR, adamw_lr=T.ADAMW_LR)


def scheduler(opt: dmuon.DMuon) -> LambdaLR:
    """One LambdaLR over DMuon's parts, each part scheduled as its user group."""
    return LambdaLR(opt, [factor(g["group"]) for g in opt.param_groups])


def train(mode: str, steps: int) -> dict:
    """DMuon with the groups and the scheduler; the params this rank is authoritative for,
    and each part's hyper-parameters (every rank's, to compare)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model, dm, _ = T.build(mode)
    opt = grouped(model, dm, wrapped)
    sched = scheduler(opt)
    for step in range(steps):
        x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
        T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {"params": T.authoritative_params(model, dm), "groups": _hparams(opt)}


def _hparams(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
            for g in opt.param_groups]


def state_dict_round_trip() -> dict:
    """Two steps with the scheduler; ``opt.state_dict()`` into a fresh grouped DMuon built
    with other defaults; what it holds after loading. Then the errors of loading into a DMuon
    of other groups."""
    run = C.Run("z2")
    run.opt = grouped(run.model, run.dm, run.wrapped)
    sched = scheduler(run.opt)
    for s in range(2):
        run.step(s)
        sched.step()
    saved = run.opt.state_dict()
    fresh = dmuon.DMuon(user_groups(dict(run.model.named_parameters())), dedicated=run.dm, lr=0.5,
                        adamw_lr=0.5, momentum=0.5)
    fresh.load_state_dict(saved)
    states_equal = all(
        all(torch.equal(_t(run.opt.state[p][k]), _t(v)) for k, v in fresh.state[p].items())
        and fresh.state[p].keys() == run.opt.state[p].keys()
        for g in run.opt.param_groups for p in g["params"])
    named = dict(run.model.named_parameters())
    ded, rest = [named[n] for n in ATTN + MLP], [named[n] for n in LN2 + NO_DECAY[:2]]
    errors = []
    for src, dst in ((run.opt, dmuon.DMuon(run.wrapped.parameters(), dedicated=run.dm)),
                     (dmuon.DMuon([{"params": ded}, {"params": rest}], dedicated=run.dm),
                      dmuon.DMuon([{"params": rest}, {"params": ded}], dedicated=run.dm))):
        try:
            dst.load_state_dict(src.state_dict())
        except ValueError as exc:
            errors.append(str(exc))
    return {"saved": _hparams(run.opt), "loaded": _hparams(fresh), "states_equal": states_equal,
            "errors": errors}


def _t(x):
    return x.to_local() if hasattr(x, "to_local") else x


def dcp_save(mode: str, root: str) -> dict:
    """Train 2 steps with the groups and the scheduler, save with DCP; the full view and the
    parts' hyper-parameters."""
    run = C.Run(mode)
    run.opt = grouped(run.model, run.dm, run.wrapped)
    sched = scheduler(run.opt)
    for s in range(2):
        run.step(s)
        sched.step()
    run.dcp_save(root)
    return {"view": run.full_view(), "groups": _hparams(run.opt)}


def dcp_load(mode: str, root: str) -> dict:
    """A fresh grouped DMuon with other defaults (and its scheduler, whose ``initial_lr`` DCP
    restores too) at this world size loads the checkpoint."""
    run = C.Run(mode)
    named = dict(run.model.named_parameters())
    run.opt = dmuon.DMuon(user_groups(named), dedicated=run.dm, lr=0.5, adamw_lr=0.5)
    scheduler(run.opt)  # as a resuming script does: DCP loads the keys its template has
    run.dcp_load(root)
    return {"view": run.full_view(), "groups": _hparams(run.opt)}
