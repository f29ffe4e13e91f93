"""DMuon on an expert-parallel mesh (``dmuon/placement/stack.py``): rank tasks and the oracle.

The model is ``examples.ep_moe.tiny_qwen3_moe_ep``: a tiny Qwen3-MoE whose sparse blocks are
the reference EP layer, its expert stacks ``Shard(0)`` over ``mesh["ep"]``. The oracle is the
same model unsharded in one process: ``torch.optim.Muon`` on every matrix (each expert its own
matrix: ``MatrixMuon``) and AdamW on the rest, on the mean of the W ranks' losses (each rank's
batch: ``hf_tasks.batch``). DMuon runs with ``rest="replicate"`` (the rest is data parallel
over all W ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from examples.ep_moe import tiny_qwen3_moe_ep
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity.hf_tasks import _loss, batch, rolled_experts, run_oracle

#: Mesh layouts: name -> (shape, dim names); W = prod(shape), EP last but for a "tp" dim.
#: ``dp_shard x ep x tp``: torchtitan's names, attention tensor parallel on "tp" (its q, k, v,
#: o projections: :func:`parallelize_attention`), experts on "ep", the data-parallel dims
#: declared (:data:`DECLARED`).
MESHES = {"shard2xep2": ((2, 2), ("shard", "ep")), "ep4": ((1, 4), ("shard", "ep")),
          "ep2": ((1, 2), ("shard", "ep")), "hsdp2x1xep2": ((2, 1, 2), ("replicate", "shard", "ep")),
          "dp_shard1xep2xtp2": ((1, 2, 2), ("dp_shard", "ep", "tp"))}
#: ``dedicate_params``' declaration of a mesh's data-parallel dims where its names need one.
DECLARED = {"dp_shard1xep2xtp2": {"shard_dims": ("dp_shard", "ep")}}


def parallelize_attention(model, tp_mesh) -> None:
    """Every attention of the Qwen3-MoE tensor parallel on ``tp_mesh``: q, k, v column-wise
    (each rank its heads), o row-wise (torch's ``parallelize_module``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.model.layers:
        parallelize_module(layer.self_attn, tp_mesh, {
            "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel()})


def data_rank(mesh) -> int:
    """This rank's data-parallel index: its coordinates on every dim but "tp" (whose ranks see
    the same batch), row-major."""
    index = 0
    for name, size, c in zip(mesh.mesh_dim_names, mesh.shape, mesh.get_coordinate()):
        if name != "tp":
            index = index * size + c
    return index


def _held(p, dm) -> torch.Tensor:
    """What this rank holds of ``p``: a dedicated expert stack's local experts, any other DTensor
    whole (a tensor-parallel matrix, an FSDP2 shard: ``full_tensor``, a collective over its
    mesh, every rank in model order)."""
    if hasattr(p, "device_mesh") and not (p in dm and p.device_mesh.mesh_dim_names == ("ep",)):
        return p.full_tensor().detach().clone()
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


#: Steps compared: the second is the first that uses the momentum; the third already moves a
#: one-ulp nudge of the oracle's init by a tenth of its displacement (``noise_floor``).
STEPS = 2


def oracle(world: int, steps: int = STEPS, nudge: str | None = None,
           frozen_qk_norms: bool = False) -> dict:
    """The single-process run (module docstring; ``hf_tasks.run_oracle``); ``nudge``: one of
    ``noise_floor.NUDGES``; ``frozen_qk_norms``: as :func:`train` on a mesh with a "tp" dim
    (:func:`freeze_qk_norms`)."""
    with oracle_threads(nudge):
        model = nudge_init_(tiny_qwen3_moe_ep(None), nudge)
        if frozen_qk_norms:
            freeze_qk_norms(model)
        run = run_oracle(model, world, steps)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if frozen:  # nothing to compare (no displacement), as train() reports them
        for key in ("init", "final"):
            run[key] = {n: t for n, t in run[key].items() if n not in frozen}
        run["steps"] = [{n: t for n, t in after.items() if n not in frozen} for after in run["steps"]]
    return run


def freeze_qk_norms(model) -> None:
    """Freeze the attentions' q / k norm weights. They are plain params inside the tensor-parallel
    region (applied to each rank's heads), so their grads are partial sums over "tp", which no
    data-parallel wrapper of plain params sums: a limit of this test model under TP (torchtitan's
    models keep such weights as DTensors), not of DMuon, which never sees them."""
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.requires_grad_(False)


def train(mesh_name: str, z3: bool, steps: int = STEPS, plant: str | None = None) -> dict:
    """DMuon on the EP mesh ``mesh_name`` for ``steps`` steps: after each step, ``sync_params``
    and every param this rank holds (``steps``; an expert stack as its local experts; ``held``:
    after the last), its EP index, the NS count, which names DMuon dedicated, and the global grad
    norm of each step (``opt.clip_grad_norm_``).
    ``plant``: a control; ``"column-divisor"``, the expert grads averaged over their column
    (R·N ranks) instead of W (Muon's update is blind to a grad's scale, the norm is not);
    ``"roll-experts"``, each expert handed its neighbour's orthogonalized update
    (``hf_tasks.rolled_experts``)."""
    if plant == "roll-experts":
        with rolled_experts():
            return train(mesh_name, z3, steps)
    if plant is not None:
        if plant != "column-divisor":
            raise ValueError(f"Invalid plant={plant!r}. Must be None, 'column-divisor' or "
                             "'roll-experts'.")
        from unittest import mock

        from dmuon.placement.layout import MeshLayout

        original = MeshLayout.extra_meshes

        def column_divisor(layout, groups):
            columns = original(layout, groups)
            assert columns, "no column of expert stacks to plant the divisor in"
            return {key: (topo, plan, grps, topo.world_size)
                    for key, (topo, plan, grps, _) in columns.items()}

        with mock.patch.object(MeshLayout, "extra_meshes", column_divisor):
            return train(mesh_name, z3, steps)
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    rank = data_rank(mesh)
    model = tiny_qwen3_moe_ep(mesh["ep"])
    tp = "tp" in names
    if tp:  # the rest under FSDP2 on the data-parallel ranks ("ep" here: dp_shard is 1)
        freeze_qk_norms(model)
        parallelize_attention(model, mesh["tp"])
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3,
                               rest="wrapper" if tp else "replicate", **DECLARED.get(mesh_name, {}))
    if tp:
        from torch.distributed.fsdp import fully_shard

        assert mesh["dp_shard"].size() == 1, "the rest's FSDP2 mesh is mesh['ep'] only then"
        fully_shard(model, mesh=mesh["ep"], reshard_after_forward=z3, ignored_params=set(dm))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    norms, after = [], []
    for step in range(steps):
        _loss(model, batch(step, rank)).backward()
        norms.append(opt.clip_grad_norm_(1e9).item())  # the global norm; never clips here
        opt.step()
        opt.zero_grad()
        dm.sync_params()
        after.append({n: _held(p, dm) for n, p in model.named_parameters()
                      if p.requires_grad})  # frozen ones do not move (freeze_qk_norms)
    out = {"held": after[-1], "steps": after, "ep_rank": mesh.get_local_rank("ep"), "ep": mesh["ep"].size(),
           "ns_calls": opt.ns_calls, "dedicated": sorted(dm.names), "grad_norms": norms}
    dm.close()
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def checkpoint_run(mesh_name: str, path: str, steps: range, load: bool) -> dict:
    """On the EP mesh ``mesh_name`` (Z3): a fresh model and DMuon, loaded from the DCP checkpoint
    at ``path`` when ``load`` (``get_state_dict`` / ``dcp.load`` / ``set_state_dict``), then the
    steps ``steps`` (batches of those step numbers), then saved to ``path`` unless ``load``.
    Returns, for what this rank holds: the params right after the load (``loaded``), the
    momentum of each param it owns (``momentum``, local experts for a stack) and its EP index."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    rank = dist.get_rank()
    model = tiny_qwen3_moe_ep(mesh["ep"], seed=1 if load else 0)  # a load must overwrite all
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=True, rest="replicate")
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    out = {"ep_rank": mesh.get_local_rank("ep"), "ep": mesh["ep"].size()}
    if load:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        dm.sync_params()
        out["loaded"] = {n: _local(p) for n, p in model.named_parameters()}
        out["momentum"] = {n: _local(opt.state[p]["momentum_buffer"])
                           for n, p in zip(dm.names, dm.params) if id(p) in {id(q) for q in dm.owned()}}
    for step in steps:
        _loss(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    if not load:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dm.sync_params()
        out["saved"] = {n: _local(p) for n, p in model.named_parameters()}
        out["momentum"] = {n: _local(opt.state[p]["momentum_buffer"])
                           for n, p in zip(dm.names, dm.params) if id(p) in {id(q) for q in dm.owned()}}
    else:
        dm.sync_params()
        out["final"] = {n: _local(p) for n, p in model.named_parameters()}
    dm.close()
    return out


def expect_error(case: str) -> str:
    """Run one unsupported EP setup on every rank; the error ``dedicate_params`` raised, as
    ``"Type: message"`` (``"no error"`` if none). Cases: ``flat`` (``hierarchy="flat"``),
    ``stack_2d`` (a dedicated 2-D DTensor on mesh["ep"]), ``other_mesh`` (an expert stack
    sharded on another mesh than the one passed)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "ep"))
    model = tiny_qwen3_moe_ep(mesh["ep"])
    kwargs = {}
    if case == "flat":
        kwargs["hierarchy"] = "flat"
    elif case == "stack_2d":
        router = model.model.layers[0].mlp.router
        model.model.layers[0].mlp.router = torch.nn.Parameter(distribute_tensor(
            router.detach(), mesh["ep"], [Shard(0)], src_data_rank=None))
    elif case == "other_mesh":
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "shard"))
        model = tiny_qwen3_moe_ep(other["ep"])
    else:
        raise ValueError(f"Invalid case={case!r}.")
    try:
        dm = dmuon.dedicate_params(model, mesh, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    dm.close()
    return "no error"


def ddp_on_a_subgroup(ep_mesh: bool) -> str:
    """``rest="wrapper"`` with the rest under a DDP whose group is ``mesh["shard"]`` (2 of the
    4 ranks) on an EP mesh (``ep_mesh``) or an HSDP mesh: the error ``step()`` raised here
    (``"no error"`` if none). Such a DDP averages the rest over 2 ranks while DMuon averages
    the dedicated grads over 4: the ranks would drift apart with no error (found by a trial)."""
    from torch.nn.parallel import DistributedDataParallel

    if ep_mesh:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "ep"))
        model = tiny_qwen3_moe_ep(mesh["ep"])
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = tiny_qwen3_moe_ep(None)
    dm = dmuon.dedicate_params(model, mesh)
    ddp = DistributedDataParallel(model, process_group=mesh["shard"].get_group())
    opt = dmuon.DMuon(ddp.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    _loss(ddp, batch(0, dist.get_rank())).backward()
    try:
        opt.step()
        out = "no error"
    except RuntimeError as exc:
        out = f"RuntimeError: {exc}"
    opt.zero_grad()
    dm.close()
    return out


def _crafted_oracle(world: int, steps: int, nudge: str | None) -> dict:
    from tests.distributed.ep.ep_tasks import crafted_layer, layer_loss
    from tests.distributed.parity.hf_tasks import muon_matrices
    from verify.modes.baselines import MatrixMuon

    layer = nudge_init_(crafted_layer(2, True), nudge)
    init = {n: p.detach().clone() for n, p in layer.named_parameters()}
    named = dict(layer.named_parameters())
    matrices = muon_matrices(layer)
    muon = MatrixMuon([named[n] for n in matrices], list(matrices.values()), lr=MUON_LR)
    after = []
    for _ in range(steps):
        (sum(layer_loss(layer, r)[0] for r in range(world)) / world).backward()
        muon.step()
        muon.zero_grad()
        after.append({n: p.detach().clone() for n, p in layer.named_parameters()})
    return {"init": init, "steps": after, "final": after[-1], "muon": matrices}


def crafted_oracle(world: int, steps: int = STEPS, nudge: str | None = None) -> dict:
    """One process: MatrixMuon on ``ep_tasks.crafted_layer`` (EP 2's routing: world rank 0 sends
    no token to its peers, the last expert gets none at all), the mean of the W ranks' losses:
    ``init``, the params after each step (``steps``) and after the last (``final``).
    ``nudge``: one of ``noise_floor.NUDGES``."""
    with oracle_threads(nudge):
        return _crafted_oracle(world, steps, nudge)


def train_crafted(z3: bool, steps: int = STEPS) -> dict:
    """DMuon on the crafted layer alone (its router and expert stacks dedicated, the layer the
    root) on the ``("shard", "ep")`` 2 x 2 mesh: what this rank holds after ``steps`` steps,
    and each step's expert-stack grads of the last expert (the one no token reaches)."""
    from examples.ep_moe import shard_experts
    from tests.distributed.ep.ep_tasks import crafted_layer, layer_loss

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "ep"))
    layer = shard_experts(crafted_layer(2, True), mesh["ep"])
    dm = dmuon.dedicate_params(layer, mesh, reshard_after_forward=z3, rest="replicate")
    opt = dmuon.DMuon(layer.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    idle_grads, after = [], []
    e = mesh.get_local_rank("ep")
    for _ in range(steps):
        layer_loss(layer, dist.get_rank())[0].backward()
        if e == 1:  # the last expert lives on EP rank 1; its owner holds the averaged grad
            idle_grads += [_local(p.grad)[-1].abs().max().item() for p in (layer.gate_up_proj,
                                                                           layer.down_proj)
                           if p.grad is not None]
        opt.step()
        opt.zero_grad()
        dm.sync_params()
        after.append({n: _local(p) for n, p in layer.named_parameters()})
    out = {"held": after[-1], "steps": after, "ep_rank": e, "ep": 2, "idle_grads": idle_grads}
    dm.close()
    return out
