"""Rank-side tasks: edits made by a ``register_step_post_hook`` hook reach every rank's compute
copy."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.distributed.parity import dmuon_tasks as T
from verify.workload.data import local_slice

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CLAMP = 1e-3


def clamp_in_post_hook(mode: str, steps: int = 2) -> dict:
    """Train (bf16 compute copies) with a post-step hook that clamps every dedicated param this
    rank owns to [-CLAMP, CLAMP] (the masters; other ranks' copies of them are DMuon's to
    refresh); every forward after the first step counts the uses of a dedicated module whose
    weight (the compute copy it runs on) breaks the clamp."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model, dm, opt = T.build(mode, mp_policy=BF16)
    dedicated = {id(p) for p in dm.params}
    modules = [m for m in model.modules() if any(id(p) in dedicated for p in m.parameters(recurse=False))]
    uses = {"seen": 0, "stale": 0}
    counting = [False]

    def look(module, args):
        if counting[0]:
            uses["seen"] += 1
            uses["stale"] += int(module.weight.detach().float().abs().max() > CLAMP * 1.01)

    for m in modules:
        m.register_forward_pre_hook(look)

    def clamp(optimizer, args, kwargs):
        with torch.no_grad():
            for p in dm.owned():
                p.clamp_(-CLAMP, CLAMP)

    opt.register_step_post_hook(clamp)
    for step in range(steps + 1):
        counting[0] = step > 0  # the first forward runs on the initial weights
        x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
        loss = T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world))
        if step == steps:
            break
        loss.backward()
        opt.step()
        opt.zero_grad()
    dm.wait_pending()
    return uses
