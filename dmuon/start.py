"""The same start as DDP: every rank's dedicated params take the first rank's values.

``DistributedDataParallel(model)`` broadcasts rank 0's params and buffers to every rank when it
is built, so a script that seeds each rank differently (``torch.manual_seed(1337 + rank)``
before building the model, as nanoGPT's ``train.py`` does) still starts from one model. DMuon's
dedicated params are outside DDP (its ignore list), and DMuon's runtime treats each owner's
values as authoritative: without this step each matrix would start from its owner's own
initialisation. :func:`from_first_rank` runs in :func:`dmuon.dedicate_params`, after the setup
agreement and before the runtime copies the params into its buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dmuon import annotate
from dmuon.runtime import collectives


def start_groups(mesh) -> list[dist.ProcessGroup]:
    """The groups whose first member's values every member takes, in order: each dim of a
    ``DeviceMesh`` (an HSDP mesh: replicate axis, then shard axis, so every rank ends with
    mesh rank (0, 0)'s values), the group itself for a process group, the default group for
    ``None``. A pipeline stage's slice of a larger mesh (``mesh["dp_shard"]``) gives its own
    dims' groups: the broadcast stays inside the stage."""
    if mesh is None:
        return [dist.group.WORLD]
    if isinstance(mesh, dist.ProcessGroup):
        return [mesh]
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def from_first_rank(params: list[torch.Tensor], mesh, model_parallel_size: int) -> int:
    """Overwrite ``params`` (the dedicated params, plain tensors, not yet in DMuon's buffers)
    on every rank of ``mesh`` with its first rank's values.

    One broadcast per mesh dim and (dtype, device) of the params, flattened (phase
    ``"setup"``, span ``dmuon.start_broadcast``): P_M elements from the first rank, once per
    ``dedicate_params``. Nothing where ``torch.distributed`` is not initialised, on a mesh of
    one rank, for params on the meta device (they are initialised after ``dedicate_params``:
    seed every rank the same there), or on a mesh with a model-parallel axis
    (``model_parallel_size`` > 1: TP shards and EP expert stacks differ across that axis by
    design; seed every rank the same).

    Returns:
        The number of elements broadcast per dim (0 where nothing was sent).
    """
    if not dist.is_initialized() or model_parallel_size > 1:
        return 0
    live = [p for p in params if p.device.type != "meta" and type(p).__name__ != "DTensor"]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in live:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    sent = 0
    for group in start_groups(mesh):
        if dist.get_world_size(group) < 2:
            continue
        for tensors in by_kind.values():
            flat = _flatten_dense_tensors([t.detach() for t in tensors])
            with torch.no_grad(), annotate.phase("setup"), annotate.span("dmuon.start_broadcast"):
                collectives.broadcast_(flat, 0, group)
                for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    t.detach().copy_(v)
        sent = sum(p.numel() for p in live)
    return sent
