"""The one mesh layout: a ``DeviceMesh`` with declared data-parallel dims (``dims.py``) and a
:class:`~dmuon.placement.base.Placement` per dedicated param read from its own DTensor layout.

Each dedicated param's kind comes from the mesh dims its placements name:

- a plain tensor is
  :class:`~dmuon.placement.dense.Dense`: data parallel over every data-parallel dim, stepped by
  its owner in every model-parallel column (counted in the norm in the first one only);
- ``Shard(d)`` of a matrix dim (one of the last two) on a model-parallel dim is
  :class:`~dmuon.placement.matrix.MatrixShard`: its shards are gathered to one rank of that
  dim for Newton–Schulz and the update scattered back (e.g. tensor parallelism);
- ``Shard(0)`` of a stack of 3+ dims on any dims is
  :class:`~dmuon.placement.stack.StackShard`: every slice is its own matrix, stepped where it
  lives (e.g. experts on an expert-parallel dim).

A param sharded on data-parallel dims K (experts) moves over its **column**: the data-parallel
dims other than K (the ranks with its slices); every other param over all data-parallel dims.
Each column is an ``(R, N_K)`` data-parallel mesh to the runtime: its topology, ownership plan,
DMuon's groups and the divisor of its reduced grads (the number of ranks whose batches differ:
the product of every data-parallel dim, the same for every column).

The plan (:func:`plan_layout`) gives every column's params owners over slots ``(r, s_K, m)``
(``m`` the rank's index over the model-parallel dims, row-major): the data-parallel owner
``(r, s_K)`` in every model-parallel column and, for a matrix shard, the index of the rank that
runs its Newton–Schulz. Columns are planned in turn, those of params sharded on data-parallel
dims first, each starting from the load the earlier ones left on each rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dmuon.ownership.plan import OwnershipPlan, ParamSpec, plan_ownership
from dmuon.ownership.topology import (Topology, check_initialized, check_spans_world, stage_ranks,
                                      topology_from_mesh)
from dmuon.placement import dims as dims_mod
from dmuon.placement.base import Placement
from dmuon.placement.dense import Dense
from dmuon.placement.dims import MeshDims
from dmuon.placement.matrix import MatrixShard
from dmuon.placement.stack import StackShard
from dmuon.runtime import collectives

#: ``Placement.mesh_key`` of the params that move over every data-parallel dim.
DP_KEY = "dp"


def column_key(sharded: tuple[str, ...]) -> str:
    """The ``mesh_key`` of the column of params sharded on the data-parallel dims ``sharded``."""
    return DP_KEY if not sharded else "column-" + "-".join(sharded)


@dataclass(frozen=True)
class ParamLayout:
    """What a dedicated DTensor's placements say, read against the mesh's dims.

    Attributes:
        data: the data-parallel dims it is sharded on (``Shard(0)`` of a stack): its column.
        stack: every dim it is sharded on along dim 0 of a stack (data or model parallel).
        matrix: the model-parallel dim it is sharded on along a matrix dim, or ``None``.
        shard_dim: that matrix dim (``-1`` without one).
    """

    data: tuple[str, ...] = ()
    stack: tuple[str, ...] = ()
    matrix: str | None = None
    shard_dim: int = -1

    @property
    def model(self) -> tuple[str, ...]:
        """The model-parallel dims it is sharded on (stack or matrix)."""
        return tuple(d for d in self.stack if d not in self.data) + ((self.matrix,) if self.matrix else ())


@dataclass(frozen=True)
class LayoutPlan:
    """:func:`plan_layout`'s result.

    Attributes:
        agreed: every param's owner over the world slots ``(R, N_all·M)`` (the setup digest's).
        plans: column key -> the ``(R, N_K)`` plan the runtime moves that column by.
        ns_index: matrix-shard name -> the row-major index over the model-parallel dims of the
            rank that runs its Newton–Schulz.
    """

    agreed: OwnershipPlan
    plans: dict[str, OwnershipPlan]
    ns_index: dict[str, int]


def plan_layout(dims: MeshDims, layouts: dict[str, ParamLayout],
                specs: list[ParamSpec]) -> LayoutPlan:
    """Plan every column's owners (module docstring; local and deterministic).

    ``specs``: the global specs; a stack's is cut to the slices one rank holds (dim 0 divided
    by the sizes of the dims it is stacked on) for its cost. ``layouts``: name -> its
    :class:`ParamLayout` (absent: dense)."""
    R, M = dims.replicate_size, dims.size(dims.model)
    n_all = dims.size(dims.shard)
    by_key: dict[tuple[str, ...], list[ParamSpec]] = {}
    for sp in specs:
        lay = layouts.get(sp.name, ParamLayout())
        if lay.stack:
            sp = dataclasses.replace(sp, shape=(sp.shape[0] // dims.size(lay.stack), *sp.shape[1:]))
        by_key.setdefault(lay.data, []).append(sp)
    keys = sorted(k for k in by_key if k) + [()]
    load = [0.0] * (R * n_all * M)  # world slots r·N_all·M + s_all·M + m
    agreed, plans, ns_index, planned = {}, {}, {}, False
    for key in keys:
        column = tuple(d for d in dims.shard if d not in key)
        n = dims.size(column)
        spread = dims_mod.points(dims, key)  # the column's copies, one per coordinate on key

        def world_slot(r: int, s: int, m: int, k: dict) -> int:
            coord = {**dict(zip(column, _unflat(dims, column, s))), **k}
            return (r * n_all + dims_mod.flat_index(dims, dims.shard, coord)) * M + m

        initial = None
        if planned:  # an earlier column's load, the busiest copy of each slot
            initial = [max(load[world_slot(r, s, m, k)] for k in spread)
                       for r in range(R) for s in range(n) for m in range(M)]
        plan = plan_ownership(by_key.get(key, []), (R, n * M), initial_load=initial)
        owner = {}
        for name, g in plan.owner.items():
            r, rest = divmod(g, n * M)
            s, m = divmod(rest, M)
            owner[name] = r * n + s
            if layouts.get(name, ParamLayout()).matrix:
                ns_index[name] = m
            for k in spread:
                load[world_slot(r, s, m, k)] += plan.ns_cost[name]
            agreed[name] = world_slot(r, s, m, {d: 0 for d in key})
        plans[column_key(key)] = plan if M == 1 else OwnershipPlan(
            mesh_shape=(R, n), specs=plan.specs, owner=owner, ns_cost=plan.ns_cost)
        planned = planned or bool(key)
        if len(keys) == 1:
            agreed_plan = plan
    if len(keys) > 1:
        agreed_plan = OwnershipPlan(mesh_shape=(R, n_all * M), specs=tuple(specs), owner=agreed)
    return LayoutPlan(agreed_plan, plans, ns_index)


def _unflat(dims: MeshDims, over: tuple[str, ...], i: int) -> list[int]:
    out = []
    for d in reversed(over):
        i, c = divmod(i, dims.size((d,)))
        out.append(c)
    return out[::-1]


class MeshLayout:
    """This rank's place in the mesh given to ``dedicate_params`` and every dedicated param's
    :class:`~dmuon.placement.base.Placement` (module docstring).

    Made by :func:`layout_for` (checks: local, every rank, before any collective);
    :meth:`build` plans and places (local).

    Attributes:
        dims: the mesh's :class:`~dmuon.placement.dims.MeshDims` (``None`` for a mesh DMuon
            refuses: :meth:`topology` raises).
        plan: the ``(R, N)`` plan of the params that move over every data-parallel dim.
        agreed_plan: every param's plan over the world slots (what the setup digest covers).
        placements: name -> :class:`Placement` of every dedicated param.
        ns_index: matrix-shard name -> its Newton–Schulz rank's index over the model-parallel
            dims (:attr:`LayoutPlan.ns_index`).
        divisor: the number of data-parallel ranks (the divisor of every reduced grad).
    """

    def __init__(self, mesh, dims: MeshDims | None) -> None:
        self.mesh, self.dims = mesh, dims
        self.plan = self.agreed_plan = None
        self.placements: dict[str, Placement] = {}
        self.layouts: dict[str, ParamLayout] = {}
        self.ns_index: dict[str, int] = {}
        self._columns: dict[str, tuple[Topology, OwnershipPlan]] = {}
        self._hierarchy = "auto"
        #: a pipeline stage's mesh: its sorted world ranks (``topology.stage_ranks``; DMuon's
        #: groups are then made by the stage's ranks only), else ``None``
        self.stage = stage_ranks(mesh)

    # ------------------------------------------------------------------ what kind of job
    @property
    def data_sharded(self) -> bool:
        """Whether some dedicated param is sharded on a data-parallel dim (its own column)."""
        return any(lay.data for lay in self.layouts.values())

    @property
    def model_dims(self) -> tuple[str, ...]:
        return () if self.dims is None else self.dims.model

    @property
    def allows_flat(self) -> bool:
        """Whether an HSDP mesh may be moved flat (``hierarchy="flat"``): no model-parallel dim
        and one column."""
        return not self.model_dims and not self.data_sharded

    @property
    def shows_grad_view(self) -> bool:
        """Whether a dedicated grad is shown as a DTensor on FSDP2's mesh between backward and
        ``step()`` (``dmuon/runtime/grad_view.py``): not where some dedicated grad is a DTensor
        of its own or the mesh has model-parallel dims (FSDP2's mesh is then not the data-parallel
        mesh DMuon reduces over)."""
        return self.allows_flat

    @property
    def joins_blocks(self) -> bool:
        """Whether ``coalesce`` may join consecutive blocks into one unit: not when params move
        over two columns (both columns' buckets of a block share its unit)."""
        return not self.data_sharded

    @property
    def size(self) -> int:
        """How many ranks the dedicated params differ across by design: the product of the
        model-parallel dims and of the data-parallel dims some param is sharded on (a mesh
        ``("shard", "tp")``: T; ``("shard", "ep")`` with expert stacks: E); 1 for a
        data-parallel job. ``dmuon/start.py`` makes every rank start from the first rank's
        values only where it is 1."""
        if self.dims is None:
            return 1
        sharded = {d for lay in self.layouts.values() for d in lay.data}
        return self.dims.size(self.dims.model) * self.dims.size(tuple(sorted(sharded)))

    @property
    def divisor(self) -> int:
        return self.dims.replicate_size * self.dims.size(self.dims.shard)

    # ------------------------------------------------------------------ checks
    def check_options(self, mesh, *, hierarchy: str, rest: str) -> None:
        """Refuse options this mesh cannot take (``ValueError``): ``hierarchy="flat"`` with
        model-parallel dims (and, in :meth:`check_model`, with params sharded on data dims);
        ``rest="replicate"`` with model-parallel dims: the grad of a plain param of the rest is
        whole on some model-parallel ranks and a partial sum on others (a norm inside a
        tensor-parallel region sees its heads only), which DMuon's all_reduce cannot tell apart
        (FSDP2 on DTensors can)."""
        if rest == "replicate" and self.model_dims:
            raise ValueError(
                f"Invalid rest='replicate' on a mesh with the model-parallel axis "
                f"{self.model_dims[0]!r}: the rest of such a model holds params whose grads are "
                "partial sums over that axis (or its DTensors), which DMuon does not replicate. "
                "Use rest='wrapper' (fully_shard on the data-parallel dims).")
        if hierarchy == "flat" and self.model_dims:
            raise self.flat_refused(self.model_dims[0])
        self._hierarchy = hierarchy

    @staticmethod
    def flat_refused(dim: str) -> ValueError:
        return ValueError(
            f"Invalid hierarchy='flat' on a mesh with the model-parallel axis {dim!r}: DMuon moves "
            f"its dedicated params over the shard and replicate axes of each {dim!r} column. Use "
            "hierarchy='auto' or 'hierarchical' there.")

    def check_model(self, model: nn.Module, mesh, dedicated: set[str]) -> None:
        """Check every DTensor param against the mesh, and a dedicated one's placements (local,
        every rank, before any collective). Fills :attr:`layouts` for the dedicated ones.

        Raises:
            ValueError: naming the param, its mesh / placements / shape, the rule and the fix.
        """
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                lay = self._read(model, name, p, name in dedicated)
                if name in dedicated:
                    self.layouts[name] = lay
        if self._hierarchy == "flat" and self.data_sharded:  # after check_options
            raise self.flat_refused(next(d for lay in self.layouts.values() for d in lay.data))

    def _read(self, model, name: str, p: DTensor, dedicated: bool) -> ParamLayout:
        dims = self.dims
        if dims is None:
            raise already_wrapped(model)
        pnames = tuple(p.device_mesh.mesh_dim_names or ())
        on_mesh = bool(pnames) and set(pnames) <= set(dims.names)
        if on_mesh:
            sub = self.mesh[pnames] if len(pnames) > 1 else self.mesh[pnames[0]]
            on_mesh = sub.mesh.tolist() == p.device_mesh.mesh.tolist()
        if not on_mesh and dims.is_plain():
            raise already_wrapped(model)
        if not on_mesh:
            raise ValueError(
                f"Invalid model of type {type(model).__name__}: param {name!r} is a DTensor on mesh "
                f"{p.device_mesh.mesh_dim_names} (ranks {p.device_mesh.mesh.tolist()}), which is not "
                f"a sub-mesh of the mesh given to dedicate_params (mesh_dim_names={dims.names!r}, "
                f"ranks {self.mesh.mesh.tolist()}). Either it is already wrapped by DDP or FSDP2 "
                "(call dmuon.dedicate_params on the bare model first, then wrap it with "
                "fully_shard(..., ignored_params=set(dm))), or shard it on mesh[dim] of the mesh you "
                "pass: tensor-parallel matrices Shard(0) / Shard(1) on a model-parallel dim "
                "(mesh['tp']), expert stacks Shard(0) on an expert-parallel one (Under EP every "
                "DTensor param must be an expert stack sharded Shard(0) on mesh['ep'], "
                "examples/ep_moe.py: shard_experts).")
        data, stack, matrix, shard_dim = [], [], None, -1
        for dim, pl in zip(pnames, p.placements):
            is_data = dim in dims.data_parallel
            if type(pl) is not Shard:
                if is_data or dedicated:
                    self._refuse_placement(model, name, p, dim, dedicated)
                continue
            d = pl.dim % p.ndim
            if is_data and (d != 0 or p.ndim < 3):
                raise ValueError(
                    f"Invalid model of type {type(model).__name__}: param {name!r} of shape "
                    f"{tuple(p.shape)} is sharded {pl} on the data-parallel dim {dim!r}. Either it is "
                    "already wrapped by DDP or FSDP2 (call dmuon.dedicate_params on the bare model "
                    "first, then wrap it), or it is an expert stack: DMuon's expert stacks must be "
                    "3-D (experts, rows, cols) and sharded Shard(0) on that dim (each rank holds "
                    "whole experts); keep other params out of DMuon (params= / predicate=).")
            if d == 0 and p.ndim >= 3:
                (data if is_data else stack).append(dim)
            elif not dedicated:
                continue
            elif d >= p.ndim - 2 and matrix is None:
                matrix, shard_dim = dim, d
            else:
                self._refuse_placement(model, name, p, dim, dedicated)
        if data and not [d for d in dims.shard if d not in data]:
            raise already_wrapped(model)  # split over every shard dim: FSDP2's Shard(0)
        if not dedicated:
            return ParamLayout()
        if matrix and (data or stack):
            raise ValueError(
                f"Invalid sharded param {name!r}: shape {tuple(p.shape)}, placements "
                f"{tuple(p.placements)} on mesh {pnames}. DMuon steps a stack sharded on dim 0 or a "
                "matrix sharded on one of its two matrix dims, not both at once; shard the experts' "
                "matrices on dim 0 only, or keep the param out of DMuon (params= / predicate=).")
        for dim in data + stack + ([matrix] if matrix else []):
            stacked = dim in data + stack  # the experts' dim 0, else the matrix's own dim
            n = dims.size(data + stack) if stacked else dims.size((matrix,))
            d = 0 if stacked else shard_dim
            if p.shape[d] % n:
                what = "experts" if stacked else "rows" if d == p.ndim - 2 else "columns"
                raise ValueError(
                    f"Invalid sharded param {name!r}: shape {tuple(p.shape)} sharded on dim {d} over "
                    f"{n} ranks (mesh dims {tuple(data + stack) if stacked else (matrix,)}), and "
                    f"{p.shape[d]} is not a multiple of {n}. DMuon needs equal shards of whole "
                    f"{what}: choose a degree that divides the dim, or pad the layer.")
        return ParamLayout(tuple(data), tuple(data + stack), matrix, shard_dim)

    @staticmethod
    def _refuse_placement(model, name, p, dim, dedicated):
        if not dedicated:
            raise ValueError(
                f"Invalid model of type {type(model).__name__}: param {name!r} is a DTensor with "
                f"placements {tuple(p.placements)} on mesh {p.device_mesh.mesh_dim_names}, "
                f"{dim!r} being a data-parallel dim: it is already wrapped by DDP or FSDP2. Call "
                "dmuon.dedicate_params on the bare model first, then wrap it with "
                "fully_shard(..., ignored_params=set(dm)).")
        raise ValueError(
            f"Invalid sharded param {name!r}: shape {tuple(p.shape)}, placements "
            f"{tuple(p.placements)} on mesh {p.device_mesh.mesh_dim_names}. A dedicated DTensor must "
            "be, on each dim of its mesh, a matrix with placement Shard(0) (ColwiseParallel) or "
            "Shard(1) (RowwiseParallel) of its last two dims on one model-parallel dim, or a stack "
            "of 3+ dims with Shard(0) (experts); keep other layouts out of DMuon (params= / "
            "predicate= of dedicate_params) or shard them so.")

    # ------------------------------------------------------------------ topology and plan
    def topology(self, mesh) -> Topology:
        """This rank's data-parallel topology of the params that move over every data-parallel
        dim (the runtime's ``"dp"`` mesh).

        Raises:
            ValueError, RuntimeError: as :func:`~dmuon.ownership.topology.topology_from_mesh`
                for a 1-D or HSDP mesh; the mesh does not span the world.
        """
        dims = self.dims
        if self.stage is not None:
            dims_mod.check_stage_mesh(mesh)
        if dims is None or (dims.is_plain() and dims.names in (dims.shard, ("replicate", "shard"))):
            return topology_from_mesh(mesh)
        check_initialized()
        check_spans_world(mesh, "the mesh size", "init_device_mesh(device, (...), "
                          f"mesh_dim_names={dims.names!r}) over every rank")
        return self._column_topology(())

    def _column_topology(self, key: tuple[str, ...]) -> Topology:
        """This rank's ``(R, N_K)`` column of the params sharded on the data dims ``key``: a
        collective where the column spans several shard dims (a ``DeviceMesh`` over every rank
        whose last dim is the column, as every rank builds it)."""
        dims, mesh = self.dims, self.mesh
        column = tuple(d for d in dims.shard if d not in key)
        R = dims.replicate_size
        rep_group, rep_ranks, r = None, (), 0
        if R > 1:
            rep_group = mesh.get_group(dims.replicate)
            rep_ranks = tuple(dist.get_process_group_ranks(rep_group))
            r = mesh.get_local_rank(dims.replicate)
        if len(column) == 1:
            group = mesh.get_group(column[0])
            s = mesh.get_local_rank(column[0])
        elif self.stage is not None:
            raise ValueError(
                f"Invalid pipeline stage mesh {dims.names!r} (ranks {list(self.stage)}): params "
                f"sharded on the data-parallel dims {key!r} leave a column over several shard dims "
                f"{column!r}, whose group DMuon can only build over every rank of the job. On a "
                "stage's mesh declare one shard dim besides the expert dim (flatten the others: "
                "mesh['dp_shard', 'cp']._flatten('dp_shard_cp') on every rank before slicing), or "
                "keep the expert stacks out of DMuon (params= / predicate=).")
        else:
            rest = tuple(d for d in dims.names if d not in column and d != dims.replicate)
            lead = (dims.replicate,) if dims.replicate else ()
            order = [dims.names.index(d) for d in rest + lead + column]
            ranks = mesh.mesh.permute(*order).reshape(-1, dims.size(column))
            if not rest and not lead:
                group = DeviceMesh(mesh.device_type, ranks.reshape(-1)).get_group()
            elif not rest:
                group = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("replicate", "shard")
                                   ).get_group("shard")
            else:
                sub = DeviceMesh(mesh.device_type, ranks.reshape(-1, R, dims.size(column)),
                                 mesh_dim_names=("other", "replicate", "shard"))
                group = sub.get_group("shard")
            s = dist.get_group_rank(group, dist.get_rank())
        return Topology(replicate_size=R, shard_size=dims.size(column), replicate_index=r,
                        shard_index=s, shard_group=group, replicate_group=rep_group,
                        shard_group_ranks=tuple(dist.get_process_group_ranks(group)),
                        replicate_group_ranks=rep_ranks, mesh_ranks=self.stage or ())

    def build(self, mesh, named: list[tuple[str, nn.Parameter, str]], specs: list[ParamSpec],
              topology: Topology) -> MeshLayout:
        """Plan the owners (:func:`plan_layout`) and place every dedicated param (local, but a
        collective for a column over several shard dims: :meth:`_column_topology`). Returns
        ``self``."""
        if self.dims is None or not self.layouts and not self.model_dims:
            plan = plan_ownership(specs, topology.mesh_shape)
            self.plan = self.agreed_plan = plan
            self.placements = {n: Dense(n) for n, _, _ in named}
            return self
        dims = self.dims
        result = plan_layout(dims, self.layouts, specs)
        self.agreed_plan, self.ns_index = result.agreed, result.ns_index
        self.plan = result.plans[DP_KEY]
        coord = dict(zip(dims.names, mesh.get_coordinate()))
        for key in sorted({lay.data for lay in self.layouts.values() if lay.data}):
            self._columns[column_key(key)] = (self._column_topology(key), result.plans[column_key(key)])
        for n, _, _ in named:
            lay = self.layouts.get(n, ParamLayout())
            counted = all(coord[d] == 0 for d in dims.model if d not in lay.model)
            key = column_key(lay.data)
            if lay.matrix:
                ns = dims_mod.points(dims, dims.model)[self.ns_index[n]][lay.matrix]
                self.placements[n] = MatrixShard(
                    n, ns_rank=ns, shard_dim=lay.shard_dim, index=coord[lay.matrix],
                    size=dims.size((lay.matrix,)), group_key=lay.matrix, counted=counted)
            elif lay.stack:
                self.placements[n] = StackShard(n, mesh_key=key, counted=counted)
            else:
                self.placements[n] = Dense(n, counted=counted)
        if named and self.model_dims and not self.layouts:
            import warnings

            dim = self.model_dims[0]
            warnings.warn(
                f"dmuon.dedicate_params got a mesh with a {dim!r} axis of size "
                f"{dims.size((dim,))} (model parallel) but no dedicated param is sharded on it: "
                f"every matrix is stepped in each {dim!r} column (that many Newton–Schulz runs "
                f"of it). Parallelize the blocks on mesh[{dim!r}] (parallelize_module) before "
                "dedicate_params, or declare the dim data parallel (shard_dims=).", stacklevel=3)
        return self

    # ------------------------------------------------------------------ groups
    def extra_meshes(self, groups) -> dict[str, tuple]:
        """The columns other than ``"dp"``: ``mesh_key`` -> ``(topology, plan, groups,
        divisor)``."""
        return {key: (topo, plan, groups.columns[key], self.divisor)
                for key, (topo, plan) in self._columns.items()}

    def make_groups(self, mesh, topology: Topology):
        """DMuon's process groups (a collective: every rank, the same order): the ``"dp"``
        column's broadcast / reduce rows (one per replicate index and model-parallel
        coordinate), replicate rows, ``world``; then one group per model-parallel dim a matrix
        is sharded on (for every coordinate of the other dims); then each other column's rows."""
        dims = self.dims
        if dims is None or not self.model_dims and not self.data_sharded:
            if dims is None or topology.replicate_size == 1:
                rows = [list(topology.shard_group_ranks)]
            else:
                rows = [dims_mod.ranks_along(mesh, dims, dims.shard, {dims.replicate: r})
                        for r in range(dims.replicate_size)]
            return collectives.make_groups(rows, local=self.stage is not None)
        dp = self._column_groups(mesh, (), None)
        model_parallel = {}
        for dim in sorted({lay.matrix for lay in self.layouts.values() if lay.matrix}):
            others = tuple(d for d in dims.names if d != dim)
            for point in dims_mod.points(dims, others):
                ranks = dims_mod.ranks_along(mesh, dims, (dim,), point)
                if self.stage is not None and dist.get_rank() not in ranks:
                    continue  # a stage's groups: made by their members only
                g = collectives.new_group(ranks, self.stage is not None)
                if dist.get_rank() in ranks:
                    model_parallel[dim] = g
        columns = {}
        for key in sorted({lay.data for lay in self.layouts.values() if lay.data}):
            columns[column_key(key)] = self._column_groups(mesh, key, dp.world)
        return dataclasses.replace(dp, model_parallel=model_parallel, columns=columns)

    def _column_groups(self, mesh, key: tuple[str, ...], world):
        dims = self.dims
        column = tuple(d for d in dims.shard if d not in key)
        rep = dims.replicate
        outer = tuple(d for d in dims.names if d in key or d in dims.model)
        me = dist.get_rank()
        R = dims.replicate_size
        if not outer:
            rows = [dims_mod.ranks_along(mesh, dims, column, {rep: r} if rep else {})
                    for r in range(R)]
            return collectives.make_groups(rows, local=self.stage is not None)
        mine: dict[str, dist.ProcessGroup] = {}

        def create(kind: str, ranks: list[int]) -> None:
            if self.stage is not None and me not in ranks:
                return  # a stage's groups: made by their members only
            g = collectives.new_group(ranks, self.stage is not None)
            if me in ranks:
                mine[kind] = g

        for kind in ("broadcast", "reduce"):
            for o in dims_mod.points(dims, outer):
                for r in range(R):
                    create(kind, dims_mod.ranks_along(mesh, dims, column, {**o, **({rep: r} if rep else {})}))
        if R > 1:
            for o in dims_mod.points(dims, outer):
                for c in dims_mod.points(dims, column):
                    create("replicate", dims_mod.ranks_along(mesh, dims, (rep,), {**o, **c}))
        if world is None:
            create("world", sorted(int(x) for x in mesh.mesh.reshape(-1).tolist()))
        return collectives.DMuonGroups(mine["broadcast"], mine["reduce"], mine.get("replicate"),
                                       world if world is not None else mine["world"])

    # ------------------------------------------------------------------ the rest
    def is_data_sharded(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a DTensor split over data-parallel ranks (an FSDP2 shard): its mesh
        has a dim that is not a model-parallel dim of this mesh, or, without dim names, spans
        more ranks than the model-parallel dims hold."""
        if not isinstance(p, DTensor):
            return False
        names = p.device_mesh.mesh_dim_names
        if names:
            return any(n not in self.model_dims for n in names)
        model = 1 if self.dims is None else self.dims.size(self.model_dims)
        return p.device_mesh.size() > model


def layout_for(mesh, replicate_dim=None, shard_dims=None) -> MeshLayout:
    """The :class:`MeshLayout` of ``mesh`` (a ``DeviceMesh``; anything else is refused by
    :meth:`MeshLayout.topology`) with the declared data-parallel dims (``dims.resolve``).

    Raises:
        ValueError: as :func:`dmuon.placement.dims.resolve`; dims declared for something that
            is not a ``DeviceMesh``.
    """
    if not isinstance(mesh, DeviceMesh):
        if replicate_dim is not None or shard_dims is not None:
            raise ValueError(
                f"Invalid mesh={mesh!r} with replicate_dim={replicate_dim!r}, shard_dims="
                f"{shard_dims!r}. Data-parallel dims are declared on a DeviceMesh: pass "
                "init_device_mesh(device, shape, mesh_dim_names=...).")
        return MeshLayout(mesh, None)
    return MeshLayout(mesh, dims_mod.resolve(mesh, replicate_dim, shard_dims))


def already_wrapped(model: nn.Module) -> ValueError:
    """The error for a model already wrapped by DDP or FSDP2, naming its type and the fix."""
    return ValueError(
        f"Invalid model of type {type(model).__name__}: already wrapped by DDP or FSDP2. "
        "Call dmuon.dedicate_params on the bare model first, then wrap it with "
        "DistributedDataParallel(model) or fully_shard(..., ignored_params=set(dm)). A "
        "tensor-parallel model (DTensor params from parallelize_module) needs the whole "
        "mesh, named ('shard', 'tp') or ('replicate', 'shard', 'tp'), whose mesh['tp'] "
        "its blocks were parallelized on, or any mesh with its data-parallel dims declared "
        "(dedicate_params(..., shard_dims=...))."
    )
