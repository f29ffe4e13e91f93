"""Expert parallelism (EP): DMuon on a mesh with an ``"ep"`` axis, whose expert stacks are
``DTensor`` s ``Shard(0)`` on ``mesh["ep"]`` (each rank holds X/E of the X experts; tokens reach
them by all_to_all, ``examples/ep_moe.py``). The protocol is ``dmuon/runtime/dedicate.py``'s
docstring, section "Expert parallelism"; this module is EP's placement (``base.py``):
:class:`EPShard`, an expert stack's local experts, and :class:`EPMesh`, the mesh kind.

Two data-parallel meshes, one runtime: the dense params move over the whole mesh as an
``(R, N·E)`` mesh (the EP axis is a data axis for them), the expert stacks over their column, the
``(R, N)`` ranks with the same EP index (``mesh["shard"]`` / ``mesh["replicate"]``), each bucket on
its own groups (``copies.Bucket.groups``); both divide the summed grads by W.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dmuon.ownership.plan import OwnershipPlan, plan_ownership
from dmuon.ownership.topology import Topology, topology_from_mesh
from dmuon.placement.base import MeshLayout, Placement
from dmuon.placement.dense import Dense, batched_step
from dmuon.placement.tp import (check_column_mesh, column_groups, column_topology, like, local,
                                 placed_like)
from dmuon.runtime import collectives

#: Name of the expert-parallel mesh axis.
EP_AXIS = "ep"
#: ``Placement.mesh_key`` of the expert stacks: their column's ``(R, N)`` mesh.
COLUMN = "ep-column"


def is_ep_mesh(mesh) -> bool:
    """Whether ``mesh`` is a ``DeviceMesh`` with an axis named ``"ep"``."""
    return isinstance(mesh, DeviceMesh) and EP_AXIS in (mesh.mesh_dim_names or ())


def check_mesh(mesh: DeviceMesh) -> None:
    """Check an EP mesh's axis names and size (local: every rank raises the same error).

    Raises:
        ValueError, RuntimeError: as :func:`~dmuon.placement.tp.check_column_mesh`.
    """
    check_column_mesh(mesh, EP_AXIS, "expert-parallel",
                      "shard the experts on mesh['ep'] (examples/ep_moe.py: shard_experts)")


def _dense_rows(mesh: DeviceMesh) -> list[list[int]]:
    """The dense params' data-parallel mesh as world ranks: one row of the N·E ranks
    ``(r, *, *)`` per replicate index r."""
    R = mesh.shape[0] if mesh.ndim == 3 else 1
    return mesh.mesh.reshape(R, -1).tolist()


def check_model(model: nn.Module, mesh: DeviceMesh, dedicated: set[str]) -> None:
    """Check the model's DTensor params against the EP mesh (local, every rank, before any
    collective): each is on ``mesh["ep"]`` with placements ``(Shard(0),)``; a dedicated one is a
    3-D expert stack ``(X, rows, cols)`` whose X the EP size E divides.

    Raises:
        ValueError: naming the param, its mesh / placement / shape, the rule and the fix.
    """
    ep_mesh = mesh[EP_AXIS]
    E = ep_mesh.size()
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        if tuple(p.device_mesh.mesh_dim_names or ()) != (EP_AXIS,) or (
            p.device_mesh.mesh.tolist() != ep_mesh.mesh.tolist()
        ) or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"Invalid model of type {type(model).__name__}: param {name!r} is a DTensor on "
                f"mesh {p.device_mesh.mesh_dim_names} (ranks {p.device_mesh.mesh.tolist()}) with "
                f"placements {tuple(p.placements)}, and dedicate_params got an expert-parallel "
                f"mesh whose mesh['ep'] is ranks {ep_mesh.mesh.tolist()}. Under EP every DTensor "
                "param must be an expert stack sharded Shard(0) on mesh['ep'] "
                "(examples/ep_moe.py: shard_experts); call dmuon.dedicate_params before "
                "wrapping the model with DDP or FSDP2."
            )
        if name in dedicated and (p.ndim != 3 or p.shape[0] % E):
            raise ValueError(
                f"Invalid expert stack {name!r}: shape {tuple(p.shape)} sharded Shard(0) over "
                f"E = {E} EP ranks. DMuon's expert stacks must be 3-D (experts, rows, cols) with "
                "a number of experts that E divides (each rank holds whole experts); choose an "
                "EP degree that divides the expert count, or keep the param out of DMuon "
                "(params= / predicate= of dedicate_params)."
            )


class EPShard(Placement):
    """An expert stack's local experts: a 3-D ``DTensor`` ``Shard(0)`` on ``mesh["ep"]`` of
    global shape ``(X, rows, cols)``; this rank holds the local stack ``(X/E, rows, cols)``
    (EP index e: experts ``[e·X/E, (e+1)·X/E)``), which DMuon's buckets hold and move over the
    column (the ranks with the same e). Its column's owner runs Newton–Schulz on the local
    experts (no collective) and keeps their momentum, a DTensor like the param (so DCP saves
    each column's experts at their offsets and loads them at another EP degree)."""

    kind = "ep"
    step_order = 2
    mesh_key = COLUMN

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return local(t)

    def like(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return like(p, t)

    def placed_like(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return placed_like(p, g)

    def guarded(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (p, local(p))

    def new_momentum(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros like ``p``: a DTensor ``Shard(0)`` on ``mesh["ep"]``, local ``(X/E, rows, cols)``."""
        return like(p, torch.zeros_like(local(p), memory_format=torch.preserve_format))

    @classmethod
    def step(cls, opt, params: list[torch.Tensor], hparams: dict) -> int:
        """Muon on the local stacks (:func:`~dmuon.placement.dense.batched_step`: one batched
        Newton–Schulz per matrix shape over every local expert); no collective."""
        return batched_step(opt, params, hparams, local)


class EPMesh(MeshLayout):
    """A mesh ``("shard", "ep")`` (N × E) or ``("replicate", "shard", "ep")`` (R × N × E): expert
    stacks are :class:`EPShard` on their column's ``(R, N)`` mesh, every other dedicated matrix
    :class:`~dmuon.placement.dense.Dense` on the ``(R, N·E)`` mesh of all W ranks.

    Attributes (besides :class:`~dmuon.placement.base.MeshLayout`'s; ``plan`` is the dense
    params' plan over ``(R, N·E)``, ``agreed_plan`` both kinds', an expert's owner there being
    its column owner's rank in column 0):
        column_topology, column_plan: the expert stacks' ``(R, N)`` column and their plan
            (owner ``r·N + s`` in every column).
        world_size: W, the divisor of both kinds' reduced grads.
    """

    kind = "expert-parallel"
    axis = EP_AXIS
    allows_flat = False
    shows_grad_view = False  # an expert grad is a DTensor on mesh["ep"] already
    joins_blocks = False  # dense and expert buckets of a block share one unit

    @classmethod
    def matches(cls, mesh) -> bool:
        return is_ep_mesh(mesh)

    @classmethod
    def check_model(cls, model: nn.Module, mesh, dedicated: set[str]) -> None:
        check_model(model, mesh, dedicated)

    @classmethod
    def topology(cls, mesh) -> Topology:
        """The dense params' topology: the ``(R, N·E)`` mesh of all W ranks (a ``DeviceMesh``
        made over the same ranks, a collective: every rank, the same order)."""
        check_mesh(mesh)
        rows = _dense_rows(mesh)
        if len(rows) == 1:
            dense = DeviceMesh(mesh.device_type, rows[0])
        else:
            dense = DeviceMesh(mesh.device_type, rows, mesh_dim_names=("replicate", "shard"))
        return topology_from_mesh(dense)

    @classmethod
    def build(cls, mesh, named, specs, topology) -> EPMesh:
        """Plan the expert stacks over their column's ``(R, N)`` (the local stacks' NS cost),
        then the dense params over ``(R, N·E)`` starting from the experts' load on every rank
        (``plan_ownership(initial_load=...)``)."""
        E = mesh[EP_AXIS].size()
        column = column_topology(mesh)
        R, N = column.mesh_shape
        experts = {n for n, p, _ in named if isinstance(p, DTensor)}
        local_specs = [dataclasses.replace(sp, shape=(sp.shape[0] // E, *sp.shape[1:]))
                       for sp in specs if sp.name in experts]
        column_plan = plan_ownership(local_specs, (R, N))
        load = [0.0] * (R * N * E)
        for name, c in column_plan.owner.items():
            r, s = divmod(c, N)
            for e in range(E):
                load[(r * N + s) * E + e] += column_plan.ns_cost[name]
        dense_plan = plan_ownership([sp for sp in specs if sp.name not in experts], (R, N * E),
                                    initial_load=load)
        owner = dict(dense_plan.owner)
        owner.update({n: c * E for n, c in column_plan.owner.items()})  # (r, s, 0): r·N·E + s·E
        agreed = OwnershipPlan(mesh_shape=(R, N * E), specs=tuple(specs), owner=owner)
        e = mesh.get_local_rank(EP_AXIS)
        placements = {n: (EPShard(n) if n in experts else Dense(n)) for n, _, _ in named}
        layout = cls(dense_plan, placements, index=e, size=E, agreed_plan=agreed)
        layout.column_topology, layout.column_plan = column, column_plan
        layout.world_size = R * N * E
        return layout

    def extra_meshes(self, groups) -> dict[str, tuple]:
        return {COLUMN: (self.column_topology, self.column_plan, groups.column, self.world_size)}

    def make_groups(self, mesh, topology):
        """The dense groups (as a data-parallel mesh's, over the ``(R, N·E)`` rows), with the
        expert column's (``column``: broadcast / reduce over ``(r, *, e)``, replicate over
        ``(*, s, e)``) sharing their ``world``."""
        dense = collectives.make_groups(_dense_rows(mesh))
        return dataclasses.replace(dense, column=column_groups(mesh, last_axis_group=False,
                                                                world=dense.world))

