"""Mesh topology: which ranks share a shard group and a replicate group.

Glossary:

- **shard axis** (size N): the ranks among which a dedicated matrix is broadcast before
  forward and reduced to its shard owner in backward. For DDP and FSDP2 (1-D meshes) this is
  the whole world.
- **replicate axis** (size R): HSDP's second mesh axis. Ranks with the same shard index s
  form a replicate group; the global owner broadcasts updated matrices along it.
- Mesh coordinates ``(r, s)``; global owner index ``g = r * N + s`` (row-major, the layout of
  ``init_device_mesh(device, (R, N), mesh_dim_names=("replicate", "shard"))``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

#: Required names and order of a 2-D (HSDP) mesh's axes.
HSDP_AXES = ("replicate", "shard")


@dataclass(frozen=True)
class Topology:
    """This rank's place in the mesh and the process groups of its two axes.

    Attributes:
        replicate_size: R (1 for a 1-D mesh).
        shard_size: N.
        replicate_index: r of this rank.
        shard_index: s of this rank.
        shard_group: process group of this rank's shard axis (N ranks).
        replicate_group: process group of this rank's replicate axis (R ranks), ``None`` if R == 1.
        shard_group_ranks: world ranks of ``shard_group`` in group-rank order.
        replicate_group_ranks: world ranks of ``replicate_group`` in group-rank order.
    """

    replicate_size: int
    shard_size: int
    replicate_index: int
    shard_index: int
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    shard_group_ranks: tuple[int, ...]
    replicate_group_ranks: tuple[int, ...]
    #: world ranks of a pipeline stage's mesh (:func:`stage_ranks`), sorted; ``()`` for a mesh
    #: that spans the world
    mesh_ranks: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        """W = R * N."""
        return self.replicate_size * self.shard_size

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(R, N)``, the planner's ``mesh_shape``."""
        return (self.replicate_size, self.shard_size)

    @property
    def global_index(self) -> int:
        """g = r * N + s of this rank."""
        return self.replicate_index * self.shard_size + self.shard_index

    def coords(self, g: int) -> tuple[int, int]:
        """Mesh coordinates ``(r, s)`` of global owner index ``g``."""
        return divmod(g, self.shard_size)

    def flattened(self) -> Topology:
        """This rank's place when DMuon moves the dedicated params flat on an HSDP mesh
        (``dedicate_params(hierarchy=...)``): a 1-D layout of all W ranks, shard index = world
        rank (DMuon's groups list ranks sorted, as ``dist.new_group`` numbers them), so owner
        index g is world rank g. On a pipeline stage's mesh (:attr:`mesh_ranks`): the stage's W
        ranks sorted, owner index g the g-th of them."""
        world = self.world_size
        if self.mesh_ranks:
            return Topology(replicate_size=1, shard_size=world, replicate_index=0,
                            shard_index=self.mesh_ranks.index(dist.get_rank()),
                            shard_group=self.shard_group, replicate_group=None,
                            shard_group_ranks=self.mesh_ranks, replicate_group_ranks=(),
                            mesh_ranks=self.mesh_ranks)
        return Topology(replicate_size=1, shard_size=world, replicate_index=0,
                        shard_index=dist.get_rank(), shard_group=dist.group.WORLD,
                        replicate_group=None, shard_group_ranks=tuple(range(world)),
                        replicate_group_ranks=())


def check_initialized() -> None:
    """Raise ``RuntimeError`` unless ``torch.distributed`` is initialised."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call dist.init_process_group (torchrun sets "
            "the environment) before dmuon.dedicate_params."
        )


def root_of(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``root[dims]``), or ``mesh`` itself."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if callable(get_root) else None
    return root if isinstance(root, DeviceMesh) else mesh


def stage_ranks(mesh) -> tuple[int, ...] | None:
    """The sorted world ranks of a pipeline stage's data-parallel mesh, or ``None``.

    A stage's mesh is a slice ``root[dims]`` of a ``DeviceMesh`` ``root`` that spans the world
    and has a pipeline dim (``dmuon.placement.dims.PIPELINE_DIMS``, torchtitan's name:
    ``init_device_mesh(device, (P, N), mesh_dim_names=(<pipeline dim>, "dp_shard"))["dp_shard"]``),
    smaller than the world and holding this rank: DMuon then keeps every setup check, agreement
    and group inside its ranks (docs/user-guide.md, "Pipeline parallelism"). ``None`` for a mesh
    that spans the world, for a mesh built over some ranks only without a root over all of
    them (refused by :func:`check_spans_world`), without ``torch.distributed``, and for
    anything that is not a ``DeviceMesh``. Local, no collective."""
    from dmuon.placement.dims import PIPELINE_DIMS

    if not isinstance(mesh, DeviceMesh) or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    root = root_of(mesh)
    if mesh.size() == world or root is mesh or root.size() != world or mesh.get_coordinate() is None:
        return None
    if not set(root.mesh_dim_names or ()) & set(PIPELINE_DIMS):
        return None  # a slice of a mesh without a pipeline dim: the whole-world rule holds
    return tuple(sorted(int(r) for r in mesh.mesh.reshape(-1).tolist()))


def check_spans_world(mesh: DeviceMesh, size_name: str, example: str) -> None:
    """Raise ``ValueError`` unless ``mesh`` covers the whole world and holds this rank, or is
    a pipeline stage's slice of a mesh that does (:func:`stage_ranks`).

    Checked before any ``get_group()``: a rank outside the mesh gets an IndexError from
    ``DeviceMesh.get_group``, while the ranks inside would go on to the plan agreement.
    ``size_name`` names the mesh size in the message (``"W = R * N"``), ``example`` a mesh
    that would do.
    """
    from dmuon.placement.dims import PIPELINE_DIMS, STAGE_MESH, STAGE_SLICE

    world = dist.get_world_size()
    if stage_ranks(mesh) is not None:
        return
    if mesh.size() != world or mesh.get_coordinate() is None:
        raise ValueError(
            f"Invalid mesh of shape {tuple(mesh.shape)}: {size_name} = {mesh.size()} "
            f"must equal the world size {world} (mesh ranks {mesh.mesh.flatten().tolist()[:8]}"
            f"{'...' if mesh.size() > 8 else ''}; this rank {dist.get_rank()} is "
            f"{'in' if mesh.get_coordinate() is not None else 'not in'} it). DMuon's owners "
            f"span the whole job, or a pipeline stage: build the mesh over every rank, e.g. "
            f"{example}, or, under pipeline parallelism, the stage's slice of a mesh over every "
            f"rank with a pipeline dim named {PIPELINE_DIMS[0]!r} ({STAGE_SLICE} of {STAGE_MESH})."
        )


def topology_from_mesh(mesh: DeviceMesh) -> Topology:
    """Validate ``mesh`` and read this rank's topology from it.

    Args:
        mesh: a 1-D ``DeviceMesh`` (DDP, FSDP2) or a 2-D one with
            ``mesh_dim_names == ("replicate", "shard")`` (HSDP), spanning the whole world or a
            pipeline stage's slice of a mesh that does (:func:`stage_ranks`).

    Raises:
        ValueError: not a DeviceMesh, a mesh of 3 or more dimensions, a 2-D mesh whose axes
            are not named ``("replicate", "shard")`` in that order, or a mesh whose size
            W = R * N differs from the world size or that does not hold this rank (checked
            before any ``get_group``, so every rank raises the same error).
        RuntimeError: torch.distributed is not initialised.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"Invalid mesh={mesh!r}. Must be a torch.distributed.device_mesh.DeviceMesh, e.g. "
            "init_device_mesh('cuda', (world_size,)) or init_device_mesh('cuda', (R, N), "
            "mesh_dim_names=('replicate', 'shard'))."
        )
    check_initialized()
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"Invalid mesh with ndim={mesh.ndim} (shape {tuple(mesh.shape)}). Must be 1-D "
            "(DDP, FSDP2) or 2-D ('replicate', 'shard') for HSDP; declare the data-parallel dims "
            "of any other mesh (dedicate_params(..., replicate_dim=..., shard_dims=...))."
        )
    check_spans_world(mesh, "W = R * N", "init_device_mesh(device, (dist.get_world_size(),))")
    if mesh.ndim == 1:
        group = mesh.get_group()
        ranks = tuple(dist.get_process_group_ranks(group))
        n = len(ranks)
        r, s, rep_group, rep_ranks = 0, dist.get_group_rank(group, dist.get_rank()), None, ()
        replicate_size = 1
    else:
        if tuple(mesh.mesh_dim_names or ()) != HSDP_AXES:
            raise ValueError(
                f"Invalid mesh_dim_names={mesh.mesh_dim_names!r} of a 2-D mesh. Must be "
                f"{HSDP_AXES} in that order (replicate axis first, shard axis second), as in "
                "init_device_mesh(device, (R, N), mesh_dim_names=('replicate', 'shard'))."
            )
        group = mesh.get_group("shard")
        rep_group = mesh.get_group("replicate")
        ranks = tuple(dist.get_process_group_ranks(group))
        rep_ranks = tuple(dist.get_process_group_ranks(rep_group))
        replicate_size, n = mesh.shape
        s = dist.get_group_rank(group, dist.get_rank())
        r = dist.get_group_rank(rep_group, dist.get_rank())
        if replicate_size == 1:
            rep_group, rep_ranks = None, ()
    return Topology(
        replicate_size=replicate_size,
        shard_size=n,
        replicate_index=r,
        shard_index=s,
        shard_group=group,
        replicate_group=rep_group,
        shard_group_ranks=ranks,
        replicate_group_ranks=rep_ranks,
        mesh_ranks=stage_ranks(mesh) or (),
    )
