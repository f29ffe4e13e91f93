"""Rank-side tasks of the DCP resumes across a change of layout (``test_dcp_layouts.py``).

Two models, each on meshes named as torchtitan names them, the data-parallel dims declared:

- ``tp_tasks``' Linear blocks (``up`` column-wise, ``down`` row-wise on "tp" where the mesh has
  it; FSDP2 on the data-parallel sub-mesh, HSDP where it is 2-D), on :data:`DENSE`;
- ``examples.ep_moe``'s tiny Qwen3-MoE (experts on "ep"; attention tensor parallel on "tp"
  where the mesh has it, the rest under FSDP2 on "ep" then, else ``rest="replicate"``; the q / k
  norms frozen on every layout: ``dmuon_ep_tasks.freeze_qk_norms``), on :data:`MOE`.

A run saves with ``get_state_dict`` + ``dcp.save`` on one layout and a fresh run, seeded
otherwise (the load must overwrite every value), loads with ``get_state_dict`` + ``dcp.load`` +
``set_state_dict`` on another, then trains on.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests.distributed.parity import tp_tasks as T
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR

#: The dense model's layouts: name -> (mesh shape, dim names). W = 4 each.
DENSE = {"dp_shard2xtp2": ((2, 2), ("dp_shard", "tp")),
         "dp_shard4": ((4,), ("dp_shard",)),
         "dp_replicate2xdp_shard2": ((2, 2), ("dp_replicate", "dp_shard")),
         "dp_replicate2xdp_shard1xtp2": ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"))}
#: The MoE's layouts: name -> (mesh shape, dim names, the declared data-parallel dims). Two
#: data-parallel batches on each (the "tp" ranks of one index share theirs).
MOE = {"dp_shard1xep2xtp2": ((1, 2, 2), ("dp_shard", "ep", "tp"), ("dp_shard", "ep")),
       "dp_shard1xep2": ((1, 2), ("dp_shard", "ep"), ("dp_shard", "ep"))}
#: Controls: ``"no-optim"``, the load leaves the optimizer's state out (the resumed run
#: restarts Muon's momentum and AdamW's moments from zero).
PLANTS = (None, "no-optim")


def _dense(layout: str, load: bool):
    """(model, dm, opt, mesh) of the dense model on ``layout`` (Z3)."""
    shape, names = DENSE[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(1 if load else 0)
    model = T.TPNet()
    if "tp" in names:
        T.parallelize(model, mesh)
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=True, **T.declared_dims(mesh))
    dp = T.dp_mesh(mesh)
    for block in model.blocks:
        fully_shard(block, mesh=dp, reshard_after_forward=True, ignored_params=set(dm))
    fully_shard(model, mesh=dp, ignored_params=set(dm))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    return model, dm, opt, mesh


def _load(model, opt, path: str, plant: str | None) -> None:
    if plant not in PLANTS:
        raise ValueError(f"Invalid plant={plant!r}. Must be one of {PLANTS}.")
    if plant == "no-optim":
        model_sd = get_model_state_dict(model)
        dcp.load({"model": model_sd}, checkpoint_id=path)
        set_model_state_dict(model, model_sd)
        return
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _save(model, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dense_run(layout: str, path: str, start: int, stop: int, save_at: int | None = None,
              plant: str | None = None) -> dict:
    """The dense model on ``layout`` through the steps ``start .. stop - 1`` (``tp_tasks.batch``
    of those step numbers, this rank's rows of it): loaded first from the DCP checkpoint at
    ``path`` when ``start > 0`` (``plant``: a control of :data:`PLANTS`), saved to ``path``
    after step ``save_at - 1`` when given. Returns every param's full value and the momentum
    buffers this rank holds (full shape; ``tp_tasks.momenta``) at the save or right after the
    load (``state``), and every param's full value at the end (``final``)."""
    model, dm, opt, mesh = _dense(layout, start > 0)
    out = {}
    if start > 0:
        _load(model, opt, path, plant)
        out["state"] = {"params": T.full_params(model, dm), "momenta": T.momenta(opt, dm)}
    for step in range(start, stop):
        T.run_steps(model, opt, mesh, step, 1)
        if step + 1 == save_at:
            _save(model, opt, path)
            out["state"] = {"params": T.full_params(model, dm), "momenta": T.momenta(opt, dm)}
    out["final"] = T.full_params(model, dm)
    dm.close()
    return out


def moe_run(layout: str, path: str, start: int, stop: int, save_at: int | None = None) -> dict:
    """The MoE on ``layout`` (Z3), as :func:`dense_run` (``hf_tasks.batch`` of each step number
    and this rank's data-parallel index): what this rank holds (an expert stack as
    its local experts, any other param whole) at the save or right after the load
    (``state``: ``params`` and the momentum of each param it holds one of, ``momenta``) and at
    the end (``final``), with its EP index (``ep_rank``)."""
    from examples.ep_moe import tiny_qwen3_moe_ep
    from tests.distributed.ep import dmuon_ep_tasks as E
    from tests.distributed.parity.hf_tasks import _loss, batch

    shape, names, declared = MOE[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = tiny_qwen3_moe_ep(mesh["ep"], seed=1 if start > 0 else 0)
    E.freeze_qk_norms(model)
    tp = "tp" in names
    if tp:
        E.parallelize_attention(model, mesh["tp"])
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=True,
                               rest="wrapper" if tp else "replicate", shard_dims=declared)
    if tp:  # the rest under FSDP2 on the data-parallel ranks ("ep": dp_shard is 1)
        fully_shard(model, mesh=mesh["ep"], reshard_after_forward=True, ignored_params=set(dm))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)

    def held() -> dict:
        dm.sync_params()
        return {n: E._held(p, dm) for n, p in model.named_parameters() if p.requires_grad}

    def state() -> dict:
        momenta = {n: E._local(opt.state[p]["momentum_buffer"]) for n, p in zip(dm.names, dm.params)
                   if "momentum_buffer" in opt.state.get(p, {})}
        return {"params": held(), "momenta": momenta}

    out = {"ep_rank": mesh.get_local_rank("ep"), "ep": mesh["ep"].size()}
    if start > 0:
        _load(model, opt, path, None)
        out["state"] = state()
    rank = E.data_rank(mesh)
    for step in range(start, stop):
        _loss(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == save_at:
            _save(model, opt, path)
            out["state"] = state()
    out["final"] = held()
    dm.close()
    return out
