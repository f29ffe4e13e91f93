"""Rank-side tasks of test_dmuon_mp_swaps.py: where a bf16 policy's compute params are
registered (``dmuon/runtime/precision.py``, ``ModuleSwaps``) when a dedicated module runs
outside its block's forward hooks (activation-checkpoint recompute of the block's body), and
the per-call casts when a dedicated module's forward raises inside another's."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

import dmuon
from tests.distributed.runtime.runtime_tasks import SMALL, _apply_ac, _mesh, batch, make_model


def train_mp_ac(mode: str, variant: str | None, steps: int = 3) -> dict:
    """verify-traffic's model and ``mode`` with ``--mixed-precision bf16``, every block
    checkpointed (``variant`` of runtime_tasks._apply_ac; None: no AC). Returns the owned
    params after ``steps``, the dtype of ``blocks.0.mlp.fc1.weight`` at each of its forwards
    (recomputes included), and whether every dedicated param is registered again after."""
    from verify.modes.build import build as build_mode
    from verify.run.runner import train_step

    built = build_mode(mode, lambda: make_model(SMALL), mixed_precision="bf16")
    model = built.model.module if mode == "dmuon-ddp" else built.model
    if variant is not None:
        _apply_ac(model, variant)
    seen = []  # registered after DMuon's hooks: sees what the module computes with
    model.get_submodule("blocks.0.mlp.fc1").register_forward_pre_hook(
        lambda m, a: seen.append(str(m.weight.dtype)))
    for step in range(steps):
        x, y = batch(step)
        train_step(built.model, built.optimizer, x, y)
    dm = built.dedicated
    dm.wait_pending()
    owned = {id(p) for p in dm.owned()}
    # checkpoint_wrapper (applied after dedicate_params here) inserts a name component
    names = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in zip(dm.names, dm.params) if id(p) in owned},
            "fc1_dtypes": seen,
            "registered": all(names[n] is p for n, p in zip(dm.names, dm.params))}


class _Outer(nn.Module):
    """A block holding a dedicated matrix itself and a dedicated Linear whose call raises
    inside its forward (wrong width), which the block catches."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 8)
        self.inner = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        try:
            self.inner(x[..., :3])
        except RuntimeError:
            pass
        return F.linear(x, self.weight)


class _Catching(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Outer()])
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.blocks[0](x))


def caught_inner_error() -> dict:
    """DDP (the rest in fp32) with a bf16 policy on ``_Catching``: the dtype the block hands
    back after its inner module raised, and the per-call entries left in flight."""
    torch.manual_seed(0)
    model = _Catching()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dm = dmuon.dedicate_params(model, _mesh("flat"), params=[model.blocks[0].weight, model.blocks[0].inner.weight],
                               mp_policy=policy)
    wrapped = DistributedDataParallel(model)
    seen = []
    model.blocks[0].register_forward_hook(lambda m, a, out: seen.append(str(out.dtype)))
    wrapped(torch.randn(4, 8)).sum().backward()
    return {"block_out": seen, "in_flight": len(dm._runtime.mp.calls)}
