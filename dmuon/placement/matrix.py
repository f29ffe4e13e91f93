"""A matrix sharded on a model-parallel dim: a DTensor ``Shard(d)`` of one of its two matrix
dims on a mesh dim that is not data parallel (tensor parallelism: ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``). This rank holds shard ``t`` of the T shards; DMuon's
buckets hold and move the local shard over the data-parallel dims (each model-parallel
column on its own), and the step needs the whole matrix (protocol: ``docs/protocol.md``).

The step. After the data-parallel reduces, every rank of the owner's model-parallel group
(the T ranks along the dim, the same data-parallel coordinates) holds the averaged gradient of
its own shard (``.grad``, a DTensor). For each rank ``t_o`` of the group that runs Newton–Schulz
for at least one of the group's owned params (the plan's ``ns_rank``), and each (dtype,
device) of those params, in that order:

1. **gather** (channel ``tp``, phase ``optimizer``): every rank of the group sends the
   concatenation of its local grad shards of those params (model order, each flattened) to
   group rank ``t_o`` (``dist.gather``); all gathers are issued before any is waited.
2. rank ``t_o`` rebuilds each full gradient (the T shards concatenated along the sharded
   dim), and runs ``torch.optim.Muon``'s momentum and Newton–Schulz on the full matrix; the
   momentum buffer (full shape, the param's dtype) lives on ``t_o`` only.
3. **scatter** (channel ``tp``, phase ``optimizer``): rank ``t_o`` sends each rank its shards
   of the updates, concatenated the same way, in the param's dtype (``dist.scatter``).
4. every rank applies its shard: ``p.mul_(1 - lr·wd)`` then ``p.add_(u, alpha=-adjusted lr)``,
   the lr adjusted with the **full** matrix shape, as ``torch.optim.Muon`` on the full matrix.

Params without a grad (unused on every rank: reduced usage 0) take no part, on every rank of
the group alike (their usage sums are equal: the ranks of a group run the same modules).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon import annotate
from dmuon.optim.muon_math import _momentum_update, adjust_lr, zeropower_via_newtonschulz
from dmuon.placement.base import StepContext
from dmuon.placement.stack import Sharded, local

#: The launcher channel (and stream) of the step's gathers and scatters.
CHANNEL = "tp"


class MatrixShard(Sharded):
    """A matrix sharded on a model-parallel dim (module docstring). Its Newton–Schulz runs on
    group rank ``ns_rank`` of its owner's group along that dim, which keeps the full-shape
    momentum.

    Attributes:
        ns_rank: the index ``t_o`` along the dim of the rank that runs its Newton–Schulz.
        shard_dim: the tensor dim (0 or 1) it is sharded on.
        index: this rank's index ``t`` along the mesh dim; size: T.
        group_key: the mesh dim (``StepContext.groups``' key of its group).
    """

    kind = "matrix"
    step_order = 0

    def __init__(self, name: str, *, ns_rank: int, shard_dim: int, index: int, size: int,
                 group_key: str, counted: bool = True) -> None:
        super().__init__(name, counted=counted)
        self.ns_rank, self.shard_dim, self.index = ns_rank, shard_dim, index
        self.size, self.group_key = size, group_key

    def keeps_momentum(self) -> bool:
        return self.ns_rank == self.index

    def new_momentum(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros of the **full** (global) shape, its dtype, on its local shard's device (a plain
        tensor, kept on the Newton–Schulz rank only)."""
        return torch.zeros(tuple(p.shape), dtype=p.dtype, device=local(p).device)

    @classmethod
    def step(cls, ctx: StepContext, params: list[torch.Tensor]) -> int:
        """Steps 1-4 of the module docstring for ``params``. Returns the number of matrices
        orthogonalized on this rank. Collectives go through ``ctx.launcher(device)``."""
        batches: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            pl = ctx.placement_of(p)
            batches.setdefault((pl.group_key, pl.ns_rank, p.dtype, local(p).device), []).append(p)
        count = 0
        for key in sorted({k[0] for k in batches}):  # one model-parallel dim after another
            count += _run(ctx, {k[1:]: ps for k, ps in batches.items() if k[0] == key},
                          ctx.groups[key])
        return count


def _run(ctx: StepContext, batches: dict[tuple, list[torch.Tensor]], group) -> int:
    if not batches:
        return 0
    first = ctx.placement_of(next(iter(batches.values()))[0])
    me, T = first.index, first.size
    keys = sorted(batches, key=lambda k: (k[0], str(k[1]), str(k[2])))
    gathered = {}
    with annotate.phase("optimizer"):
        for key in keys:  # 1. every gather issued, then waited
            root, ps = key[0], batches[key]
            send = torch.cat([local(p.grad).reshape(-1) for p in ps])
            recv = [torch.empty_like(send) for _ in range(T)] if me == root else None
            _, block, owner = ctx.label(ps[0])
            with annotate.span("dmuon.tp_gather", module=block, owner=owner):
                work = ctx.launcher(send.device).launch(
                    CHANNEL, lambda async_op, send=send, recv=recv, root=root: dist.gather(
                        send, recv, group=group, group_dst=root, async_op=async_op), send, *(recv or ()))
            gathered[key] = (work, send, recv)
        count, scatters = 0, []
        for key in keys:
            root, ps = key[0], batches[key]
            work, send, recv = gathered[key]
            work.wait()
            chunks = None
            if me == root:  # 2. momentum and Newton-Schulz on the full matrices
                chunks = _updates(ctx, ps, recv, T)
                count += len(ps)
            out = torch.empty_like(send)
            _, block, owner = ctx.label(ps[0])
            with annotate.span("dmuon.tp_scatter", module=block, owner=owner):
                work = ctx.launcher(out.device).launch(
                    CHANNEL, lambda async_op, out=out, chunks=chunks, root=root: dist.scatter(
                        out, chunks, group=group, group_src=root, async_op=async_op), out, *(chunks or ()))
            scatters.append((work, out, ps))
        hp = ctx.hparams
        lr, wd, fn = hp["lr"], hp["weight_decay"], hp["adjust_lr_fn"]
        for work, out, ps in scatters:  # 4. each rank applies its shards
            work.wait()
            offset = 0
            for p in ps:
                data = local(p)
                u = out[offset : offset + data.numel()].view_as(data)
                data.mul_(1 - lr * wd)
                data.add_(u, alpha=-adjust_lr(lr, fn, tuple(p.shape)))
                offset += data.numel()
    return count


def _updates(ctx: StepContext, params, recv, T: int) -> list[torch.Tensor]:
    """On the Newton–Schulz rank: the full grads from the gathered shards, momentum, NS; the
    update shards for each rank of the group, concatenated in ``params`` order (the scatter
    list)."""
    hp = ctx.hparams
    shards: list[list[torch.Tensor]] = [[] for _ in range(T)]
    offset = 0
    for p in params:
        dim = ctx.placement_of(p).shard_dim
        local_shape = local(p).shape
        n = local_shape.numel()
        grad = torch.cat([recv[t][offset : offset + n].view(local_shape) for t in range(T)], dim=dim)
        _, block, owner = ctx.label(p)
        with annotate.span("dmuon.newton_schulz", module=block, owner=owner):
            update = _momentum_update(grad, ctx.momentum_of(p), hp["momentum"], hp["nesterov"])
            update = zeropower_via_newtonschulz(update, hp["ns_coefficients"], hp["ns_steps"],
                                                hp["eps"])
        for t, piece in enumerate(update.to(p.dtype).chunk(T, dim=dim)):
            shards[t].append(piece.reshape(-1))
        offset += n
    return [torch.cat(s) for s in shards]
