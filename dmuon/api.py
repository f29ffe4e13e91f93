"""The public entry point: :func:`dedicate_params` validates, plans, agrees and installs hooks."""

from __future__ import annotations

import torch.nn as nn

from . import collectives
from .dedicate import DedicatedParams
from .plan import plan_ownership, specs_from_named_parameters
from .select import Predicate, select_params
from .topology import topology_from_mesh


def dedicate_params(
    model: nn.Module,
    mesh,
    *,
    params=None,
    predicate: Predicate | None = None,
    reshard_after_forward: bool = True,
    mp_policy=None,
) -> DedicatedParams:
    """Give every Muon-target matrix of ``model`` one owner rank and install DMuon's hooks.

    Call it on every rank, on the bare model, **before** wrapping: then
    ``DistributedDataParallel(model)`` skips the dedicated params (they are registered in
    DDP's params-to-ignore list here) and ``fully_shard(module, mesh=..., ignored_params=set(dm))``
    leaves them to DMuon.

    Args:
        model: the bare ``nn.Module`` (not yet DDP / FSDP2 wrapped), identical on all ranks.
        mesh: a 1-D ``DeviceMesh`` (DDP, FSDP2) or a 2-D one named ``("replicate", "shard")`` (HSDP).
        params: optional explicit dedicated params (Parameters or names); default: ``predicate``.
        predicate: ``f(name, param, module) -> bool``; default :func:`default_predicate`.
        reshard_after_forward: ``True`` = Z3 (non-holders free after forward and receive
            again before backward), ``False`` = Z2 (keep until the next step).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (the object and keyword
            ``fully_shard`` takes): forward runs on ``param_dtype`` copies, broadcasts send
            them, reduces run in ``reduce_dtype``; owners keep fp32 master weights and
            momentum (README, "Mixed precision"). ``None``: everything in the params' dtype.

    Returns:
        The :class:`DedicatedParams` handle.

    Raises:
        ValueError: ``model`` is already DDP- or FSDP2-wrapped, a dedicated param is not 2-D
            or not in the model, or the mesh is invalid (see ``topology_from_mesh``).
        RuntimeError: the ranks computed different plans (checked with one all_gather of the
            plan digest before any other DMuon collective).
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or any(
        type(p).__name__ == "DTensor" for p in model.parameters()
    ):
        raise ValueError(
            f"Invalid model of type {type(model).__name__}: already wrapped by DDP or FSDP2. "
            "Call dmuon.dedicate_params on the bare model first, then wrap it with "
            "DistributedDataParallel(model) or fully_shard(..., ignored_params=set(dm))."
        )
    topology = topology_from_mesh(mesh)
    named = select_params(model, params, predicate)
    plan = plan_ownership(specs_from_named_parameters((n, p) for n, p, _ in named), topology.mesh_shape)
    collectives.check_plan_agreement(plan.digest(), "ownership plan")
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, _, _ in named]
    )
    return DedicatedParams(model, named, topology, plan, reshard_after_forward, mesh=mesh, mp_policy=mp_policy)
