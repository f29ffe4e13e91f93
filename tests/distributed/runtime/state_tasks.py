"""Rank-side tasks for the per-bucket states' regressions: sequences the
old loose flags got wrong."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import dmuon
from tests.distributed.parity.dmuon_tasks import _loss, _mesh, make_model
from tests.distributed.runtime.runtime_tasks import batch, owned_params


def sync_forward_sync(mode: str) -> dict:
    """Mixed precision: sync_params, a forward without backward, sync_params again. The
    master copies' state must agree on every rank (the old master_valid flag stayed True on
    holders only, so the second sync's broadcasts did not pair)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = make_model()
    dm = dmuon.dedicate_params(model, _mesh("flat"), reshard_after_forward=mode == "z3",
                               mp_policy=policy)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    x, y = batch(0)
    _loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    dm.sync_params()
    with torch.no_grad():
        model(x)
    dm.sync_params()
    values = {n: p.detach().clone() for n, p in zip(dm.names, dm.params)}
    dm.close()
    return {"values": values, "owned": owned_names(dm)}


def owned_names(dm) -> list[str]:
    return [n for n, o in zip(dm.names, [dm.plan.owner[n] for n in dm.names])
            if o == dm.topology.global_index]


def accumulate_with_failed_forward(fail: bool) -> dict:
    """Two micro-batches (the first under no_sync); with ``fail``, a forward that raises in
    between. The accumulated grads must survive it (the old recovery freed non-holders'
    grad buffers, which held them)."""
    model = make_model()
    dm = dmuon.dedicate_params(model, _mesh("flat"), reshard_after_forward=True)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    x, y = batch(0)
    with dm.no_sync():
        (0.5 * _loss(model, x, y)).backward()
    if fail:
        h = model.blocks[0].register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyError()))
        try:
            _loss(model, x, y)
        except KeyError:
            pass
        h.remove()
    (0.5 * _loss(model, x, y)).backward()
    opt.step()
    out = owned_params(model, dm)
    dm.close()
    return out
