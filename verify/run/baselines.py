"""Muon baselines a user would pick instead of DMuon (docs/spec.md §7).

- :class:`NaiveShardedMuon`: gather the full gradient in the step, NS on every rank.
- :class:`ZeroOneMuon`: reduce_scatter of owner-aligned gradients, NS on each matrix's owner,
  all_gather of the updated params (ZeRO-1 style).

The naive baseline is what users do without DMuon under FSDP2 / HSDP: each Muon matrix stays a Shard(0)
DTensor, ``step()`` all-gathers its gradient (``full_tensor()``: one all_gather over the
shard axis), every rank keeps a full momentum buffer and runs Newton–Schulz on the whole
matrix (N or N·R redundant copies), then applies its own row chunk of the update.
The math is ``torch.optim.Muon``'s (``dmuon.optim.muon_math``), so results match DMuon.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from dmuon import annotate
from dmuon.optim.muon_math import MUON_DEFAULTS, adjust_lr, muon_update_, zeropower_via_newtonschulz
from dmuon.ownership.plan import plan_ownership, specs_from_named_parameters


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


class ZeroOneMuon(Optimizer):
    """ZeRO-1-style Muon: the scheme a user would pick instead of DMuon (docs/spec.md §7).

    As in modded-nanogpt and KellerJordan/Muon's distributed step: the model stays replicated
    (DDP all-reduces everything *except* these params), and ``step()`` runs three phases over
    one flat buffer laid out owner by owner so that every matrix lies whole in its owner's
    chunk:

    1. ``reduce_scatter`` (sum) of the flat gradient buffer, shape ``(W * C,)``: each
       rank receives its chunk of ``C`` elements, its owned matrices' summed gradients, and
       divides by W (the same sum-then-divide as DMuon, so results are comparable);
    2. each owner runs Muon (momentum, Newton–Schulz, update) on its owned matrices;
    3. ``all_gather`` of the updated chunks, copied back into every param.

    ``C`` is the largest per-owner total (the plan balances NS cost, not bytes), so owners
    with fewer elements pad their chunk: :attr:`padding_elems` reports it. Per step and rank
    the traffic is 2(N-1)/N · N·C elements: 2(N-1)/N · P_M when no owner pads.

    Ownership is :func:`dmuon.ownership.plan.plan_ownership` on a ``(1, W)`` mesh (the planner is shared
    with the harness, which predicts this layout from the same plan).

    Args:
        named_params: ``(name, param)`` pairs of 2-D params, identical on every rank.
        group: the process group (default: the world).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon``.

    Attributes:
        ns_calls: Newton–Schulz invocations on this rank.
        chunk_elems: ``C``, elements per rank in both collectives.
        padding_elems: ``W * C - P_M``, padding elements in the flat buffer.

    Raises:
        ValueError: a param is not a plain 2-D tensor.
    """

    def __init__(self, named_params, group=None, **hyper) -> None:
        named = list(named_params)
        for name, p in named:
            if isinstance(p, DTensor) or p.ndim != 2:
                raise ValueError(
                    f"Invalid param {name} of shape {tuple(p.shape)}: ZeroOneMuon takes plain "
                    "(replicated) 2-D params; leave them out of DDP / FSDP2."
                )
        super().__init__([p for _, p in named], {**MUON_DEFAULTS, **hyper})
        self.group = group
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        plan = plan_ownership(list(specs_from_named_parameters(named)), (1, world))
        by_owner: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(world)]
        for name, p in named:
            by_owner[plan.owner[name]].append((name, p))
        self.chunk_elems = max(sum(p.numel() for _, p in owned) for owned in by_owner)
        self.padding_elems = world * self.chunk_elems - sum(p.numel() for _, p in named)
        # (param, offset in the flat buffer) for every matrix; the owner's chunk is
        # [rank * C, (rank + 1) * C).
        self._slots: list[tuple[torch.Tensor, int]] = []
        for rank, owned in enumerate(by_owner):
            offset = rank * self.chunk_elems
            for _, p in owned:
                self._slots.append((p, offset))
                offset += p.numel()
        self._owned = [(p, off - me * self.chunk_elems) for p, off in self._slots
                       if me * self.chunk_elems <= off < (me + 1) * self.chunk_elems]
        first = named[0][1]
        self._flat = torch.zeros(world * self.chunk_elems, dtype=first.dtype, device=first.device)
        self._chunk = torch.zeros(self.chunk_elems, dtype=first.dtype, device=first.device)
        self._world = world
        self.ns_calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        flat, chunk = self._flat, self._chunk
        for p, off in self._slots:
            view = flat[off : off + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        dist.reduce_scatter_single(chunk, flat, op=dist.ReduceOp.SUM, group=self.group)
        chunk.div_(self._world)
        group = self.param_groups[0]
        for p, off in self._owned:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            with annotate.span("zero1.newton_schulz"):
                muon_update_(p, chunk[off : off + p.numel()].view_as(p), state["momentum_buffer"],
                             **{k: group[k] for k in MUON_DEFAULTS})
            self.ns_calls += 1
            chunk[off : off + p.numel()].copy_(p.reshape(-1))
        dist.all_gather_single(flat, chunk, group=self.group)
        for p, off in self._slots:
            p.copy_(flat[off : off + p.numel()].view_as(p))
        return None
