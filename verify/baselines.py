"""The naive sharded Muon baseline: gather the full gradient in the step, NS on every rank.

This is what users do without DMuon under FSDP2 / HSDP: each Muon matrix stays a Shard(0)
DTensor, ``step()`` all-gathers its gradient (``full_tensor()``: one all_gather over the
shard axis), every rank keeps a full momentum buffer and runs Newton–Schulz on the whole
matrix (N or N·R redundant copies), then applies its own row chunk of the update.
The math is ``torch.optim.Muon``'s (``dmuon.muon_math``), so results match DMuon.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from dmuon import annotate
from dmuon.muon_math import MUON_DEFAULTS, adjust_lr, zeropower_via_newtonschulz


class NaiveShardedMuon(Optimizer):
    """Muon over FSDP2-sharded 2-D params by gathering full gradients (the baseline).

    Args:
        params: DTensor params sharded on dim 0 along the last mesh axis (FSDP2 / HSDP).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon``.

    Attributes:
        ns_calls: Newton–Schulz invocations on this rank.

    Raises:
        ValueError: a param is not a 2-D DTensor sharded on dim 0.
    """

    def __init__(self, params, **hyper) -> None:
        defaults = {**MUON_DEFAULTS, **hyper}
        params = list(params)
        for i, p in enumerate(params):
            if not isinstance(p, DTensor) or p.ndim != 2 or p.placements[-1] != Shard(0):
                raise ValueError(
                    f"Invalid params[{i}] of shape {tuple(p.shape)}: must be a 2-D DTensor "
                    "with Shard(0) on the last mesh axis (wrap its module with fully_shard)."
                )
        super().__init__(params, defaults)
        self.ns_calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                full_grad = p.grad.full_tensor()  # all_gather over the shard axis
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(full_grad)
                buf = state["momentum_buffer"]
                buf.lerp_(full_grad, 1 - group["momentum"])
                update = full_grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                with annotate.span("naive.newton_schulz"):
                    ortho = zeropower_via_newtonschulz(
                        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
                    )
                self.ns_calls += 1
                lr = group["lr"]
                local = p.to_local()
                mesh = p.device_mesh
                shard_index = mesh.get_local_rank(mesh.ndim - 1)
                shard_count = mesh.size(mesh.ndim - 1)
                rows = torch.chunk(ortho, shard_count, dim=0)
                mine = rows[shard_index] if shard_index < len(rows) else ortho[:0]
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(mine, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return None
