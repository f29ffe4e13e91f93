"""Rank-side tasks of the API-check tests (validation on every rank, plan digest, selection)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests.distributed import dmuon_tasks as T
from verify.data import local_slice

#: Two dedicated matrices: on 4 ranks two ranks own nothing (the ranks that used to hang).
TWO_MATRICES = ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight"]

#: Bad DMuon keyword -> the text its error must contain (rules: torch.optim.Muon / AdamW).
BAD_HYPERPARAMETERS = {
    "lr": (-0.1, "Invalid lr=-0.1. Must be a finite float >= 0"),
    "weight_decay": (-1, "Invalid weight_decay=-1. Must be a finite float >= 0"),
    "momentum": (float("nan"), "Invalid momentum=nan"),
    "nesterov": ("yes", "Invalid nesterov='yes'. Must be True or False"),
    "ns_coefficients": ((3.4, -4.7), "Invalid ns_coefficients=(3.4, -4.7)"),
    "eps": (0.0, "Invalid eps=0.0. Must be a finite float > 0"),
    "ns_steps": (100, "Invalid ns_steps=100. Must be an int in [0, 100)"),
    "adjust_lr_fn": ("rms", "Invalid adjust_lr_fn='rms'"),
    "adamw_lr": (float("inf"), "Invalid adamw_lr=inf"),
    "adamw_betas": ((0.9, 1.0), "Invalid adamw_betas=(0.9, 1.0). Must be two floats in [0, 1)"),
    "adamw_eps": (-1e-8, "Invalid adamw_eps=-1e-08"),
    "adamw_weight_decay": (-0.01, "Invalid adamw_weight_decay=-0.01"),
    "dedicated": (None, "Invalid dedicated=None (type NoneType). Must be the DedicatedParams"),
}


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_hyperparameters() -> dict:
    """Every bad keyword of DMuon on this rank: {keyword: error text}, plus ``owned`` and a
    bad value set in ``param_groups`` after construction (``step``)."""
    model = T.make_model()
    dm = dmuon.dedicate_params(model, T._mesh("flat"), params=TWO_MATRICES)
    out = {"owned": len(dm.owned())}
    for key, (value, _) in BAD_HYPERPARAMETERS.items():
        kwargs = {"dedicated": dm, key: value}
        out[key] = _error(lambda: dmuon.DMuon(model.parameters(), **kwargs))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = T.corpus().global_batch(0, T.GLOBAL_BATCH, T.SMALL.seq_len)
    T._loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    opt.param_groups[0]["weight_decay"] = -1.0  # e.g. a broken scheduler
    out["step"] = _error(opt.step)
    # the object stays usable: fix the value, step, and the next iteration runs
    opt.param_groups[0]["weight_decay"] = 0.1
    opt.step()
    opt.zero_grad()
    out["after"] = T._loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).item()
    return out
