"""Tensor parallelism (TP): DMuon on a mesh with a ``"tp"`` axis, whose TP-sharded params are
``DTensor`` s (torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``).

The protocol is ``dmuon/runtime/dedicate.py``'s docstring, section "Tensor parallelism"; this
module is TP's placement (``base.py``): :class:`TPShard`, a TP-sharded matrix, and
:class:`TPMesh`, the mesh kind, so that the data-parallel runtime stays the same on every TP
column. It holds:

- the mesh rules and this rank's data-parallel :class:`~dmuon.ownership.topology.Topology`
  (:func:`topology`: the shard / replicate axes of this rank's TP column ``t``);
- the checks every rank runs before any collective (:func:`check_model`);
- the plan (:func:`plan_tp`): the existing planner over ``(R, N·T)`` slots, slot
  ``s' = s·T + t`` meaning "data-parallel owner ``(r, s)``, Newton–Schulz on TP rank ``t``";
- DMuon's process groups with the ``tp`` channel (:func:`make_groups`);
- the local-tensor accessors the buckets use (:meth:`TPShard.local`, :meth:`TPShard.like`): a TP
  param stays a ``DTensor`` (the TP modules' forwards need one) whose local tensor is a view
  into DMuon's flat buffer (``residency.flatten_into_views`` makes it so).

The step's gather / Newton–Schulz / scatter is :mod:`dmuon.placement.tp_step`.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dmuon.ownership.plan import OwnershipPlan, ParamSpec, plan_ownership
from dmuon.ownership.topology import Topology, check_initialized, check_spans_world
from dmuon.placement import tp_step
from dmuon.placement.base import MeshLayout, Placement
from dmuon.placement.dense import Dense

#: Name of the tensor-parallel mesh axis.
TP_AXIS = "tp"


def is_tp_mesh(mesh) -> bool:
    """Whether ``mesh`` is a ``DeviceMesh`` with an axis named ``"tp"``."""
    return isinstance(mesh, DeviceMesh) and TP_AXIS in (mesh.mesh_dim_names or ())


def is_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (on a TP mesh, a TP-sharded param or grad)."""
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor its ops run on, not ``to_local()``, which
    returns a new view for a Parameter and a graph node under autograd), else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a local shard of ``p``'s local shape) as a tensor like ``p``: a DTensor with
    ``p``'s mesh, placements, global shape and stride (sharing ``t``'s memory), or ``t``."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def shard_dim(p: DTensor) -> int:
    """The dim (0 or 1) a TP param is sharded on (checked by :func:`check_model`)."""
    return p.placements[0].dim % p.ndim


# ---------------------------------------------------------------------------------- mesh
def check_mesh(mesh: DeviceMesh) -> None:
    """Check a TP mesh's axis names and size (local: every rank raises the same error).

    Raises:
        ValueError, RuntimeError: as :func:`check_column_mesh`.
    """
    check_column_mesh(mesh, TP_AXIS, "tensor-parallel",
                      "parallelize the blocks on mesh['tp'] (parallelize_module)")


def check_column_mesh(mesh: DeviceMesh, axis: str, kind: str, fix: str) -> None:
    """Check a mesh ``("shard", axis)`` or ``("replicate", "shard", axis)`` (a model-parallel
    ``axis`` last: TP's, EP's) and that it spans the world (local: every rank raises the same
    error). ``kind`` and ``fix`` word the message.

    Raises:
        ValueError: other axis names, or the mesh does not span the world or does not hold
            this rank.
        RuntimeError: torch.distributed is not initialised.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("shard", axis), ("replicate", "shard", axis)):
        raise ValueError(
            f"Invalid mesh_dim_names={names!r} of a {kind} mesh of shape {tuple(mesh.shape)}. "
            f"Must be ('shard', '{axis}') or ('replicate', 'shard', '{axis}'), {axis!r} last, e.g. "
            f"init_device_mesh(device, (N, {axis.upper()}), mesh_dim_names=('shard', '{axis}')); "
            f"{fix}, and pass the whole mesh to dmuon.dedicate_params."
        )
    check_initialized()
    check_spans_world(mesh, f"W = R * N * {axis.upper()}", f"init_device_mesh(device, (W // "
                      f"{axis.upper()}, {axis.upper()}), mesh_dim_names=('shard', '{axis}'))")


def _grid(mesh: DeviceMesh) -> list[list[list[int]]]:
    """World ranks as ``grid[r][s][t]`` (R = 1 for a ("shard", "tp") mesh)."""
    ranks = mesh.mesh.tolist()
    return [ranks] if mesh.ndim == 2 else ranks


def topology(mesh: DeviceMesh) -> Topology:
    """This rank's data-parallel topology on a TP mesh: the shard (and replicate) axes of its
    TP column, the ranks with its TP index ``t`` (what ``mesh["shard"]`` /
    ``mesh["replicate"]`` give). ``world_size`` is R·N, the data-parallel size (the divisor
    of the reduced grads: TP ranks of one column see the same batch).

    Raises:
        ValueError, RuntimeError: as :func:`check_mesh`.
    """
    check_mesh(mesh)
    return column_topology(mesh)


def column_topology(mesh: DeviceMesh) -> Topology:
    """This rank's column of a mesh ``(shard, X)`` or ``(replicate, shard, X)`` (X = ``"tp"`` or
    ``"ep"``, last): the ranks with its index on X, as an ``(R, N)`` data-parallel topology."""
    shard = mesh["shard"].get_group()
    shard_ranks = tuple(dist.get_process_group_ranks(shard))
    s = dist.get_group_rank(shard, dist.get_rank())
    r, rep, rep_ranks, R = 0, None, (), 1
    if mesh.ndim == 3 and mesh.shape[0] > 1:
        rep = mesh["replicate"].get_group()
        rep_ranks = tuple(dist.get_process_group_ranks(rep))
        r, R = dist.get_group_rank(rep, dist.get_rank()), mesh.shape[0]
    return Topology(replicate_size=R, shard_size=len(shard_ranks), replicate_index=r,
                    shard_index=s, shard_group=shard, replicate_group=rep,
                    shard_group_ranks=shard_ranks, replicate_group_ranks=rep_ranks)


# ---------------------------------------------------------------------------------- checks
def check_model(model: nn.Module, mesh: DeviceMesh | None, dedicated: set[str]) -> None:
    """Check the model's DTensor params against the mesh (local, every rank, before any
    collective).

    Every DTensor param must be TP-sharded on ``mesh["tp"]`` (a DTensor on another mesh is
    an FSDP2-wrapped model). A dedicated DTensor param must be a 2-D matrix with one
    placement, ``Shard(0)`` or ``Shard(1)``, whose sharded dim T divides.

    Raises:
        ValueError: naming the param, its mesh / placement / shape, the rule and the fix.
    """
    tp_mesh = mesh[TP_AXIS] if is_tp_mesh(mesh) else None
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        if tp_mesh is None or tuple(p.device_mesh.mesh_dim_names or ()) != (TP_AXIS,) or (
            p.device_mesh.mesh.tolist() != tp_mesh.mesh.tolist()
        ):
            where = ("a mesh without a 'tp' axis" if tp_mesh is None
                     else f"mesh['tp'] = ranks {tp_mesh.mesh.tolist()}")
            raise ValueError(
                f"Invalid model of type {type(model).__name__}: param {name!r} is a DTensor on "
                f"mesh {p.device_mesh.mesh_dim_names} (ranks {p.device_mesh.mesh.tolist()}), "
                f"and dedicate_params got {where}. Either it is already wrapped by DDP or "
                "FSDP2 (call dmuon.dedicate_params on the bare model first, then wrap it with "
                "fully_shard(..., ignored_params=set(dm))), or it is tensor parallel: then "
                "parallelize it on mesh['tp'] of the ('shard', 'tp') or ('replicate', 'shard', "
                "'tp') mesh you pass to dedicate_params."
            )
        if name not in dedicated:
            continue
        T = tp_mesh.size()
        pl = tuple(p.placements)
        if not (len(pl) == 1 and type(pl[0]) is Shard and p.ndim == 2):
            raise ValueError(
                f"Invalid tensor-parallel param {name!r}: shape {tuple(p.shape)}, placements "
                f"{pl} on mesh['tp']. DMuon's Muon matrices under TP must be 2-D with "
                "placement Shard(0) (ColwiseParallel) or Shard(1) (RowwiseParallel); keep "
                "other layouts out of DMuon (params= / predicate= of dedicate_params) or "
                "shard them with ColwiseParallel / RowwiseParallel."
            )
        d = shard_dim(p)
        if p.shape[d] % T:
            raise ValueError(
                f"Invalid tensor-parallel param {name!r}: shape {tuple(p.shape)} sharded on "
                f"dim {d} over T = {T} TP ranks, and {p.shape[d]} is not a multiple of {T}. "
                "DMuon needs equal shards (the gather and scatter of the step move equal "
                "pieces): choose a TP degree that divides the dim, or pad the layer."
            )


# ---------------------------------------------------------------------------------- plan
def plan_tp(specs: list[ParamSpec], mesh_shape: tuple[int, int], T: int,
            tp_names: set[str]) -> tuple[OwnershipPlan, OwnershipPlan, dict[str, int]]:
    """Plan the owners on a ``(R, N, T)`` mesh.

    The existing planner balances the Newton–Schulz cost of the full matrices (``specs``:
    global shapes) over the W = R·N·T ranks as ``(R, N·T)`` slots; slot ``g' = r·N·T + s'``
    with ``s' = s·T + t`` gives the data-parallel owner ``g = r·N + s`` (the owner, over
    the data-parallel ``(R, N)`` mesh, of the local shards in every TP column) and, for a
    TP-sharded param (``tp_names``), the TP index ``t`` of the rank that runs Newton–Schulz.
    A dedicated param that is not TP-sharded (replicated over TP) is stepped by its owner in
    every TP column.

    Returns:
        ``(full_plan, dp_plan, ns_rank)``: the ``(R, N·T)`` plan, the ``(R, N)`` plan the
        data-parallel runtime uses, and name -> ``t`` for the TP params.
    """
    R, N = mesh_shape
    full = plan_ownership(specs, (R, N * T))
    owner, ns_rank = {}, {}
    for name, g in full.owner.items():
        r, sp = divmod(g, N * T)
        s, t = divmod(sp, T)
        owner[name] = r * N + s
        if name in tp_names:
            ns_rank[name] = t
    dp = OwnershipPlan(mesh_shape=(R, N), specs=full.specs, owner=owner, ns_cost=full.ns_cost)
    return full, dp, ns_rank


# ---------------------------------------------------------------------------------- groups
def make_groups(mesh: DeviceMesh):
    """DMuon's process groups on a TP mesh (a collective: every rank, the same order).

    ``broadcast`` and ``reduce``: this rank's shard axis in its TP column (the N ranks
    ``(r, *, t)``); ``replicate`` (R > 1): ``(*, s, t)``; ``world``: all W ranks (the block
    order agreement); ``tp``: this rank's TP group ``(r, s, *)`` in ``t`` order (the step's
    gather and scatter). Each is created for every column / group on every rank.

    Returns:
        A :class:`~dmuon.runtime.collectives.DMuonGroups` with ``tp`` set.
    """
    return column_groups(mesh, last_axis_group=True)


def column_groups(mesh: DeviceMesh, *, last_axis_group: bool, world=None):
    """The column groups of a mesh ``(shard, X)`` / ``(replicate, shard, X)`` (see
    :func:`make_groups`): ``tp`` set to the last axis' group when ``last_axis_group``;
    ``world`` created unless given (a collective: every rank, the same order)."""
    from dmuon.runtime.collectives import DMuonGroups, new_group

    me = dist.get_rank()
    grid = _grid(mesh)
    R, N, T = len(grid), len(grid[0]), len(grid[0][0])
    mine: dict[str, dist.ProcessGroup] = {}

    def create(kind: str, ranks: list[int]) -> None:
        g = new_group(ranks)
        if me in ranks:
            mine[kind] = g

    for kind in ("broadcast", "reduce"):
        for t in range(T):
            for r in range(R):
                create(kind, [grid[r][s][t] for s in range(N)])
    if R > 1:
        for t in range(T):
            for s in range(N):
                create("replicate", [grid[r][s][t] for r in range(R)])
    if world is None:
        create("world", sorted(x for plane in grid for row in plane for x in row))
    if last_axis_group:
        for r in range(R):
            for s in range(N):
                create("tp", list(grid[r][s]))
    return DMuonGroups(mine["broadcast"], mine["reduce"], mine.get("replicate"),
                       world if world is not None else mine["world"], tp=mine.get("tp"))


def placed_like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A grad ``g`` of ``p`` with ``p``'s placements (a TP grad that autograd produced with
    other placements is redistributed, a DTensor collective on ``p``'s mesh); plain tensors
    and matching DTensors are returned as they are."""
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        return g.redistribute(p.device_mesh, p.placements)
    return g


def full_momentum(p: torch.Tensor) -> torch.Tensor:
    """A fresh momentum buffer of a TP param: zeros of its full (global) shape, its dtype,
    on its local shard's device (a plain tensor, kept on its Newton–Schulz rank)."""
    return torch.zeros(tuple(p.shape), dtype=p.dtype, device=local(p).device)


# ---------------------------------------------------------------------------------- the objects
class TPShard(Placement):
    """A TP-sharded matrix: a 2-D ``DTensor`` ``Shard(d)`` on ``mesh["tp"]``; this rank holds
    shard ``index`` (its local tensor, n/T elements of a matrix of n), which DMuon's buckets
    hold and move per TP column. Its Newton–Schulz runs on TP index ``ns_rank`` of its owner's
    TP group, which keeps the full-shape momentum (:mod:`dmuon.placement.tp_step`).

    Attributes:
        ns_rank: the TP index ``t_o`` of the rank that runs its Newton–Schulz.
        shard_dim: the dim (0 or 1) it is sharded on.
        index: this rank's TP index ``t``.
    """

    kind = "tp"
    step_order = 0

    def __init__(self, name: str, *, ns_rank: int, shard_dim: int, index: int) -> None:
        super().__init__(name)
        self.ns_rank, self.shard_dim, self.index = ns_rank, shard_dim, index

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return local(t)

    def like(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return like(p, t)

    def placed_like(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return placed_like(p, g)

    def guarded(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The DTensor and its local tensor (``to_local()`` hands the latter out without a
        torch function call)."""
        return (p, local(p))

    def keeps_momentum(self) -> bool:
        return self.ns_rank == self.index

    def new_momentum(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros of the **full** (global) shape, kept on the Newton–Schulz rank only."""
        return full_momentum(p)

    @classmethod
    def step(cls, opt, params: list[torch.Tensor], hparams: dict) -> int:
        """Gather to the NS rank, Newton–Schulz on the full matrix, scatter
        (:func:`dmuon.placement.tp_step.run`; channel ``tp``)."""
        return tp_step.run(opt, params, hparams)


class TPMesh(MeshLayout):
    """A mesh ``("shard", "tp")`` or ``("replicate", "shard", "tp")``: TP-sharded matrices are
    :class:`TPShard`, other dedicated matrices (replicated over TP) :class:`~dmuon.placement.dense.Dense`,
    stepped by their owner in every TP column (counted in the norm on TP index 0 only).

    Attributes (besides :class:`~dmuon.placement.base.MeshLayout`'s, where ``agreed_plan`` is
    the plan over ``(R, N·T)`` slots):
        ns_rank: name of each TP-sharded param -> :attr:`TPShard.ns_rank`.
        shard_dims: the same names -> :attr:`TPShard.shard_dim`.
    """

    kind = "tensor-parallel"
    axis = TP_AXIS
    allows_flat = False
    shows_grad_view = False  # a TP grad is a DTensor on mesh["tp"] already

    @classmethod
    def matches(cls, mesh) -> bool:
        return is_tp_mesh(mesh)

    @classmethod
    def check_options(cls, mesh, *, hierarchy: str, rest: str) -> None:
        super().check_options(mesh, hierarchy=hierarchy, rest=rest)
        if rest == "replicate":
            raise ValueError(
                "Invalid rest='replicate' on a mesh with a 'tp' axis: the rest of a tensor-parallel "
                "model holds TP DTensors, which DMuon does not replicate. Use rest='wrapper' "
                "(fully_shard on mesh['shard'])."
            )

    @classmethod
    def check_model(cls, model: nn.Module, mesh, dedicated: set[str]) -> None:
        check_model(model, mesh, dedicated)

    @classmethod
    def topology(cls, mesh) -> Topology:
        return topology(mesh)

    @classmethod
    def build(cls, mesh, named, specs, topology) -> TPMesh:
        """The TP plan (:func:`plan_tp`) and the placements; warns when no dedicated param is
        TP-sharded (every matrix then runs Newton–Schulz T times)."""
        T = mesh[TP_AXIS].size()
        dims = {n: shard_dim(p) for n, p, _ in named if is_tp(p)}
        full, plan, ns_rank = plan_tp(specs, topology.mesh_shape, T, set(dims))
        if named and not ns_rank:
            warnings.warn(
                f"dmuon.dedicate_params got a mesh with a 'tp' axis of size {T} but no dedicated "
                "param is a TP DTensor: every matrix is stepped in each TP column (that many "
                "Newton–Schulz runs of it). Parallelize the blocks on mesh['tp'] "
                "(parallelize_module) before dedicate_params.",
                stacklevel=3,
            )
        t = list(map(int, mesh[TP_AXIS].mesh.tolist())).index(dist.get_rank())
        placements = {n: (TPShard(n, ns_rank=ns_rank[n], shard_dim=dims[n], index=t) if n in dims
                          else Dense(n, counted=t == 0)) for n, _, _ in named}
        layout = cls(plan, placements, index=t, size=T, agreed_plan=full)
        layout.ns_rank, layout.shard_dims = ns_rank, dims
        return layout

    def make_groups(self, mesh, topology):
        return make_groups(mesh)
