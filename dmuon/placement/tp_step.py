"""The Muon step of TP-sharded dedicated params, :meth:`dmuon.placement.tp.TPShard.step`
(protocol: ``dmuon/runtime/dedicate.py``, "Tensor parallelism").

After the data-parallel reduces, every rank ``(r, s, t)`` of the owner's TP group holds the
averaged gradient of its own shard (``.grad``, a DTensor). For each TP rank ``t_o`` of the
group that runs Newton–Schulz for at least one of the group's owned params (the plan's
``ns_rank``), and each (dtype, device) of those params, in that order:

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
the group alike (their usage sums are equal: the TP ranks of a group run the same modules).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon import annotate
from dmuon.optim.muon_math import _momentum_update, adjust_lr, zeropower_via_newtonschulz


def run(opt, params: list[torch.Tensor], hparams: dict) -> int:
    """Steps 1-4 above for ``params``: the owned TP params of one param group that have a grad,
    each with a :class:`~dmuon.placement.tp.TPShard` placement. Returns the number of matrices
    orthogonalized on this rank.

    Collectives go through ``opt.launcher(device)`` (channel ``tp``): work handles on gloo, a
    side stream and events on CUDA, as every other DMuon call."""
    dm = opt.dedicated
    tpg = dm.groups.tp
    batches: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        pl = dm.placement_of(p)
        batches.setdefault((pl.ns_rank, p.dtype, pl.local(p).device), []).append(p)
    if not batches:
        return 0
    me, T = dm.layout.index, dm.layout.size
    keys = sorted(batches, key=lambda k: (k[0], str(k[1]), str(k[2])))
    gathered = {}
    with annotate.phase("optimizer"):
        for key in keys:  # 1. every gather issued, then waited
            root, ps = key[0], batches[key]
            send = torch.cat([dm.placement_of(p).local(p.grad).reshape(-1) for p in ps])
            recv = [torch.empty_like(send) for _ in range(T)] if me == root else None
            with annotate.span("dmuon.tp_gather", module=dm.block_of(ps[0]), owner=dm.owner_of(ps[0])):
                work = opt.launcher(send.device).launch(
                    "tp", lambda async_op, send=send, recv=recv, root=root: dist.gather(
                        send, recv, group=tpg, group_dst=root, async_op=async_op), send, *(recv or ()))
            gathered[key] = (work, send, recv)
        count, scatters = 0, []
        for key in keys:
            root, ps = key[0], batches[key]
            work, send, recv = gathered[key]
            work.wait()
            chunks = None
            if me == root:  # 2. momentum and Newton-Schulz on the full matrices
                chunks = _updates(opt, ps, recv, T, hparams)
                count += len(ps)
            out = torch.empty_like(send)
            with annotate.span("dmuon.tp_scatter", module=dm.block_of(ps[0]), owner=dm.owner_of(ps[0])):
                work = opt.launcher(out.device).launch(
                    "tp", lambda async_op, out=out, chunks=chunks, root=root: dist.scatter(
                        out, chunks, group=tpg, group_src=root, async_op=async_op), out, *(chunks or ()))
            scatters.append((work, out, ps))
        lr, wd, fn = hparams["lr"], hparams["weight_decay"], hparams["adjust_lr_fn"]
        for work, out, ps in scatters:  # 4. each rank applies its shards
            work.wait()
            offset = 0
            for p in ps:
                data = dm.placement_of(p).local(p)
                u = out[offset : offset + data.numel()].view_as(data)
                data.mul_(1 - lr * wd)
                data.add_(u, alpha=-adjust_lr(lr, fn, tuple(p.shape)))
                offset += data.numel()
    return count


def _updates(opt, params, recv, T: int, hparams) -> list[torch.Tensor]:
    """On the Newton–Schulz rank: the full grads from the gathered shards, momentum, NS; the
    update shards for each TP rank, concatenated in ``params`` order (the scatter list)."""
    dm = opt.dedicated
    shards: list[list[torch.Tensor]] = [[] for _ in range(T)]
    offset = 0
    for p in params:
        pl = dm.placement_of(p)
        local_shape = pl.local(p).shape
        n = local_shape.numel()
        grad = torch.cat([recv[t][offset : offset + n].view(local_shape) for t in range(T)],
                         dim=pl.shard_dim)
        with annotate.span("dmuon.newton_schulz", module=dm.block_of(p), owner=dm.owner_of(p)):
            update = _momentum_update(grad, opt.momentum_of(p), hparams["momentum"],
                                      hparams["nesterov"])
            update = zeropower_via_newtonschulz(update, hparams["ns_coefficients"],
                                                hparams["ns_steps"], hparams["eps"])
        for t, piece in enumerate(update.to(p.dtype).chunk(T, dim=pl.shard_dim)):
            shards[t].append(piece.reshape(-1))
        offset += n
    return [torch.cat(s) for s in shards]
