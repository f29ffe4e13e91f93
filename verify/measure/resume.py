"""A checkpoint in the gate's window: save with DCP, load into a fresh model and optimizer, and
require the next step to equal the uninterrupted run's bit for bit (docs/verify.md, "Checkpoint").

Uses torch's standard calls only (``get_state_dict`` / ``set_state_dict`` with default
options, ``dcp.save`` / ``dcp.load``), as a user's training script would. A rank's
:func:`snapshot` is everything it is authoritative for: its owned dedicated params and their
Muon momentum, and its local part of every other param and of its AdamW state (FSDP2 shards).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from verify.measure.block_order import bare_model


def save(model: nn.Module, opt, path: Path) -> None:
    """``dcp.save`` of ``get_state_dict(model, opt)`` to ``path`` (a collective: every rank)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load(model: nn.Module, opt, path: Path) -> None:
    """``dcp.load`` from ``path`` into ``get_state_dict``'s templates, then ``set_state_dict``
    (a collective: every rank)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def warm_up(model: nn.Module, opt, loss_fn, step: int) -> None:
    """One forward and backward of ``loss_fn(model, rank, step)`` and ``opt.zero_grad()``: no
    step (a collective: every rank)."""
    import torch.distributed as dist

    loss_fn(model, dist.get_rank(), step).backward()
    opt.zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def snapshot(model: nn.Module, opt, dm) -> dict[str, torch.Tensor]:
    """Clones of what this rank is authoritative for, by name: ``<param>`` and
    ``<param>:momentum`` of each owned dedicated param, ``<param>`` and ``<param>:<state key>``
    (local shards) of every other param."""
    owned = {id(p) for p in dm.owned()}
    dedicated = {id(p) for p in dm.params}
    out = {}
    for name, p in bare_model(model).named_parameters():
        state = opt.state.get(p, {})
        if id(p) in dedicated:
            if id(p) in owned:
                out[name] = p.detach().clone()
                out[name + ":momentum"] = opt.momentum_of(p).clone()
            continue
        out[name] = _local(p).detach().clone()
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{name}:{key}"] = _local(value).clone()
    return out


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical (or present in one of the two only), sorted."""
    return sorted(k for k in got.keys() | want.keys()
                  if k not in got or k not in want or not torch.equal(got[k], want[k]))
