"""Muon baselines a user would pick instead of DMuon (docs/spec.md §7).

- :class:`MatrixMuon`: ``torch.optim.Muon`` given every matrix of n-D params (each slice of
  an expert stack, a conv weight's flattened view) as its own 2-D parameter: the ``ddp-muon``
  baseline and the tests' single-process oracle.
- :class:`NaiveShardedMuon`: gather the full gradient in the step, NS on every rank.
- :class:`ZeroOneMuon`: reduce_scatter of owner-aligned gradients, NS on each matrix's owner,
  all_gather of the updated params (ZeRO-1 style).

Every param is seen by Muon as ``param.view(-1, rows, cols)`` with ``(rows, cols)`` its
matrix shape (``dmuon.ownership.select.matrix_shape``; default ``shape[-2:]``).

The naive baseline is what users do without DMuon under FSDP2 / HSDP: each Muon matrix stays a Shard(0)
DTensor, ``step()`` all-gathers its gradient (``full_tensor()``: one all_gather over the
shard axis), every rank keeps a full momentum buffer and runs Newton–Schulz on the whole
matrix (N or N·R redundant copies), then applies its own row chunk of the update.
The math is ``torch.optim.Muon``'s (``dmuon.optim.muon_math``), so results match DMuon.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from dmuon import annotate
from dmuon.optim.muon_math import (
    MUON_DEFAULTS,
    adjust_lr,
    muon_update_matrices_,
    zeropower_via_newtonschulz,
    zeropower_via_newtonschulz_batched,
)
from dmuon.ownership.plan import plan_ownership, specs_from_named_parameters
from verify._compat import all_gather_single, reduce_scatter_single


def _matrix(p: torch.Tensor, matrix_shape) -> tuple[int, int]:
    return tuple(matrix_shape) if matrix_shape is not None else tuple(p.shape[-2:])


class MatrixMuon:
    """``torch.optim.Muon`` over every matrix of ``params``: each param of shape ``S`` with
    matrix shape ``(rows, cols)`` becomes ``numel / (rows·cols)`` 2-D leaf params that are
    views of its storage (a 2-D param whose matrix is itself is passed as is), so torch's
    update of a view updates the param. :meth:`step` hands each view its slice of the
    param's grad first.

    Args:
        params: tensors with at least 2 dims (plain, not DTensor), contiguous.
        matrix_shapes: one ``(rows, cols)`` or ``None`` (``shape[-2:]``) per param; default
            all ``None``.
        **hyper: ``torch.optim.Muon``'s keyword arguments.

    Attributes:
        muon: the ``torch.optim.Muon`` over the views.
    """

    def __init__(self, params, matrix_shapes=None, **hyper) -> None:
        self.params = list(params)
        shapes = list(matrix_shapes) if matrix_shapes is not None else [None] * len(self.params)
        self._views: list[tuple[torch.Tensor, tuple[int, int], list[torch.Tensor]]] = []
        flat = []
        for p, shape in zip(self.params, shapes):
            rows, cols = _matrix(p, shape)
            if p.ndim == 2 and tuple(p.shape) == (rows, cols):
                views = [p]
            else:
                data = p.detach().view(-1, rows, cols)
                views = [nn.Parameter(data[i]) for i in range(data.shape[0])]
            self._views.append((p, (rows, cols), views))
            flat += views
        self.muon = torch.optim.Muon(flat, **hyper)

    @torch.no_grad()
    def step(self) -> None:
        for p, (rows, cols), views in self._views:
            if views[0] is p:
                continue
            grads = None if p.grad is None else p.grad.reshape(-1, rows, cols)
            for i, v in enumerate(views):
                v.grad = None if grads is None else grads[i]
        self.muon.step()

    def zero_grad(self) -> None:
        for p, _, views in self._views:
            p.grad = None
            for v in views:
                v.grad = None


class NaiveShardedMuon(Optimizer):
    """Muon over FSDP2-sharded params by gathering full gradients (the baseline).

    Args:
        params: DTensor params of at least 2 dims sharded on dim 0 along the last mesh axis
            (FSDP2 / HSDP).
        matrix_shapes: Muon's ``(rows, cols)`` per param (``None``: ``shape[-2:]``).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon``.

    Attributes:
        ns_calls: matrices orthogonalized on this rank (an expert stack of E counts E).

    Raises:
        ValueError: a param is not a DTensor of at least 2 dims sharded on dim 0.
    """

    def __init__(self, params, matrix_shapes=None, **hyper) -> None:
        defaults = {**MUON_DEFAULTS, **hyper}
        params = list(params)
        for i, p in enumerate(params):
            if not isinstance(p, DTensor) or p.ndim < 2 or p.placements[-1] != Shard(0):
                raise ValueError(
                    f"Invalid params[{i}] of shape {tuple(p.shape)}: must be a DTensor of at "
                    "least 2 dims with Shard(0) on the last mesh axis (wrap its module with "
                    "fully_shard)."
                )
        super().__init__(params, defaults)
        shapes = list(matrix_shapes) if matrix_shapes is not None else [None] * len(params)
        self._matrix = {id(p): _matrix(p, m) for p, m in zip(params, shapes)}
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
                rows, cols = self._matrix[id(p)]
                stack = update.reshape(-1, rows, cols)
                ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
                with annotate.span("naive.newton_schulz"):
                    if stack.shape[0] == 1:
                        ortho = zeropower_via_newtonschulz(stack[0], *ns)
                    else:
                        ortho = zeropower_via_newtonschulz_batched(stack, *ns)
                ortho = ortho.reshape(full_grad.shape)
                self.ns_calls += stack.shape[0]
                lr = group["lr"]
                local = p.to_local()
                mesh = p.device_mesh
                shard_index = mesh.get_local_rank(mesh.ndim - 1)
                shard_count = mesh.size(mesh.ndim - 1)
                chunks = torch.chunk(ortho, shard_count, dim=0)
                mine = chunks[shard_index] if shard_index < len(chunks) else ortho[:0]
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(mine, alpha=-adjust_lr(lr, group["adjust_lr_fn"], (rows, cols)))
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
        named_params: ``(name, param)`` pairs of params of at least 2 dims, identical on
            every rank.
        group: the process group (default: the world).
        matrix_shapes: name -> Muon's ``(rows, cols)`` for params not in the stack layout
            (conv weights).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon``.

    Attributes:
        ns_calls: Newton–Schulz invocations on this rank.
        chunk_elems: ``C``, elements per rank in both collectives.
        padding_elems: ``W * C - P_M``, padding elements in the flat buffer.

    Raises:
        ValueError: a param is not a plain tensor of at least 2 dims.
    """

    def __init__(self, named_params, group=None, matrix_shapes=None, **hyper) -> None:
        named = list(named_params)
        for name, p in named:
            if isinstance(p, DTensor) or p.ndim < 2:
                raise ValueError(
                    f"Invalid param {name} of shape {tuple(p.shape)}: ZeroOneMuon takes plain "
                    "(replicated) params of at least 2 dims; leave them out of DDP / FSDP2."
                )
        super().__init__([p for _, p in named], {**MUON_DEFAULTS, **hyper})
        self.group = group
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        specs = specs_from_named_parameters(named, matrix_shapes)
        plan = plan_ownership(specs, (1, world))
        self._matrix = {id(p): sp.matrix_shape for (_, p), sp in zip(named, specs)}
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
        reduce_scatter_single(chunk, flat, op=dist.ReduceOp.SUM, group=self.group)
        chunk.div_(self._world)
        group = self.param_groups[0]
        for p, off in self._owned:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            rows, cols = self._matrix[id(p)]
            with annotate.span("zero1.newton_schulz"):
                muon_update_matrices_([p], [chunk[off : off + p.numel()].view_as(p)],
                                      [state["momentum_buffer"]], matrix_shape=(rows, cols),
                                      **{k: group[k] for k in MUON_DEFAULTS})
            self.ns_calls += p.numel() // (rows * cols)
            chunk[off : off + p.numel()].copy_(p.reshape(-1))
        all_gather_single(flat, chunk, group=self.group)
        for p, off in self._slots:
            p.copy_(flat[off : off + p.numel()].view_as(p))
        return None
