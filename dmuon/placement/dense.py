"""The dense placement: a plain matrix (or expert stack, or conv weight), identical on every
rank, data parallel over the whole mesh (a 1-D mesh, a process group, or an HSDP mesh). The
protocol is ``dmuon/runtime/dedicate.py``'s docstring; this is the kind it describes first."""

from __future__ import annotations

import torch
import torch.nn as nn

from dmuon import annotate
from dmuon.optim.muon_math import muon_update_matrices_
from dmuon.ownership.plan import plan_ownership
from dmuon.ownership.topology import topology_from_mesh
from dmuon.placement.base import MeshLayout, Placement
from dmuon.runtime import collectives


class Dense(Placement):
    """A plain tensor held whole on every rank (its owner's copy is authoritative).

    ``counted``: whether this rank's owned grad enters the global norm; ``False`` on the TP
    columns other than the first, where the same matrix is owned once per column
    (``dmuon/placement/tp.py``)."""

    kind = "dense"
    step_order = 1

    def __init__(self, name: str, *, counted: bool = True) -> None:
        super().__init__(name)
        self._counted = counted

    def counts_in_norm(self) -> bool:
        return self._counted

    @classmethod
    def step(cls, opt, params: list[torch.Tensor], hparams: dict) -> int:
        """:func:`batched_step` on the params themselves. No collective."""
        return batched_step(opt, params, hparams, lambda t: t)


def batched_step(opt, params: list[torch.Tensor], hparams: dict, local) -> int:
    """Muon on ``local(p)`` of each param (with ``local(p.grad)`` and ``local(momentum)``): one
    Newton–Schulz ``bmm`` chain per batch of matrices of one (matrix shape, dtype, device), an
    expert stack's slices included (tolerance: see
    :func:`~dmuon.optim.muon_math.zeropower_via_newtonschulz_batched`); a single matrix takes
    the per-matrix path (``torch.optim.Muon``'s arithmetic). One span per batch, named after its
    first param's unit. Returns the number of matrices orthogonalized."""
    batches: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        batches.setdefault((opt.matrix_shape(p), p.dtype, local(p).device), []).append(p)
    count = 0
    for (matrix, _, _), ps in batches.items():
        bufs = [local(opt.momentum_of(p)) for p in ps]
        data = [local(p) for p in ps]
        with annotate.span("dmuon.newton_schulz", module=opt.dedicated.unit_of(ps[0]),
                           owner=opt.dedicated.owner_of(ps[0])):
            muon_update_matrices_(data, [local(p.grad) for p in ps], bufs, matrix_shape=matrix,
                                  **hparams)
        count += sum(t.numel() for t in data) // (matrix[0] * matrix[1])
    return count


class DataParallelMesh(MeshLayout):
    """No model-parallel axis: a process group, a 1-D mesh (FSDP2, DDP) or a 2-D HSDP mesh
    ``(replicate, shard)``; every dedicated param is :class:`Dense`."""

    kind = "data-parallel"

    @classmethod
    def matches(cls, mesh) -> bool:
        return True  # the fallback: every other layout is asked first

    @classmethod
    def check_model(cls, model: nn.Module, mesh, dedicated: set[str]) -> None:
        """Refuse DTensor params: on a mesh without a model-parallel axis they are FSDP2's.

        Raises:
            ValueError: naming the model's type and the fix.
        """
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise already_wrapped(model)

    @classmethod
    def topology(cls, mesh):
        return topology_from_mesh(mesh)

    @classmethod
    def build(cls, mesh, named, specs, topology) -> DataParallelMesh:
        plan = plan_ownership(specs, topology.mesh_shape)
        return cls(plan, {n: Dense(n) for n, _, _ in named})

    def make_groups(self, mesh, topology):
        """DMuon's groups over the rows of the data-parallel mesh ``topology`` moves on: one row
        per replicate index; one row of all W ranks for a 1-D mesh and for an HSDP mesh moved
        flat (``collectives.make_groups``)."""
        if mesh is None or topology.replicate_size == 1:
            assert mesh is None or topology.world_size == mesh.size(), "a 1-D topology spans the mesh"
            rows = [list(topology.shard_group_ranks)]
        else:
            ranks = mesh.mesh.tolist()
            rows = [ranks] if mesh.ndim == 1 else ranks
        return collectives.make_groups(rows)



def already_wrapped(model: nn.Module) -> ValueError:
    """The error for a model already wrapped by DDP or FSDP2, naming its type and the fix."""
    return ValueError(
        f"Invalid model of type {type(model).__name__}: already wrapped by DDP or FSDP2. "
        "Call dmuon.dedicate_params on the bare model first, then wrap it with "
        "DistributedDataParallel(model) or fully_shard(..., ignored_params=set(dm)). A "
        "tensor-parallel model (DTensor params from parallelize_module) needs the whole "
        "mesh, named ('shard', 'tp') or ('replicate', 'shard', 'tp'), whose mesh['tp'] "
        "its blocks were parallelized on."
    )
