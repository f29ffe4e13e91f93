"""``torch.amp.GradScaler`` with DMuon: one skip decision on every rank.

A scaler skips ``step()`` on a rank whose grads hold an Inf or NaN. Under DDP (and
``rest="replicate"``) only a dedicated matrix's owner holds its reduced grad, so only the owner
sees an Inf there: without an agreement it skips and halves its scale while the other ranks
step and keep theirs, the replicated weights split and the next forward's broadcasts no longer
pair (a hang). (FSDP2's DTensor grads agree inside the scaler's own check, and
``ShardedGradScaler`` all-reduces its flags, but a plain scaler under DDP does not.)

:class:`~dmuon.optim.optimizer.DMuon` therefore declares ``_step_supports_amp_scaling``: a
scaler's ``step(opt)`` then calls ``opt.step(grad_scaler=scaler)`` on every rank instead of
deciding itself, and :func:`found_inf_everywhere` unscales (where the user did not call
``scaler.unscale_(opt)`` already), takes the maximum of the flags over DMuon's world group and
writes it back into the scaler's per-device flags, which its ``update()`` reads: every rank
skips (and backs off its scale) together, or steps together.
"""

from __future__ import annotations

import warnings

import torch

from dmuon import annotate
from dmuon.runtime import collectives

# torch 2.13's GradScaler warns at every step that it will stop passing itself to optimizers
# that take ``grad_scaler``; DMuon needs the scaler (its flags), so the notice is not the user's.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


def found_inf_everywhere(opt, grad_scaler) -> bool:
    """Unscale ``opt``'s grads with ``grad_scaler`` (unless already done this step) and agree
    on its found-Inf flags over DMuon's world group; returns whether every rank skips.

    One all_reduce (MAX) of one fp32 element (phase ``optimizer``, span ``dmuon.found_inf``)
    per scaled step; the scaler's ``found_inf_per_device`` tensors then hold the agreed flag
    on every rank, so ``scaler.update()`` backs off the same scale everywhere. Uses the
    scaler's per-optimizer record (``_per_optimizer_states``, torch 2.13).
    """
    from torch.amp.grad_scaler import OptState

    record = grad_scaler._per_optimizer_states[id(opt)]
    if record["stage"] is OptState.READY:
        grad_scaler.unscale_(opt)
    flags = record["found_inf_per_device"]
    world = opt.dedicated.groups.world
    device = collectives.collective_device(world)
    found = torch.zeros((), dtype=torch.float32, device=device)
    for flag in flags.values():
        found += flag.to(device=device, dtype=torch.float32)
    with annotate.phase("optimizer"), annotate.span("dmuon.found_inf"):
        collectives.all_reduce_max_(found, world)
    for flag in flags.values():
        flag.copy_(found.to(device=flag.device, dtype=flag.dtype))
    return bool(found.item() > 0)
