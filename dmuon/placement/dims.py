"""Which dims of a ``DeviceMesh`` are data parallel, and the ranks along any set of its dims.

``dedicate_params(model, mesh, replicate_dim=..., shard_dims=...)`` declares them in FSDP2's
terms: at most one **replicate** dim (HSDP's outer dim) and one or more **shard** dims, whose
product is the shard group a dedicated matrix is broadcast over and reduced to its owner on (a
flattened ``dp_shard_cp`` is one shard dim; ``("dp_shard", "cp")`` two). Every other dim is
model parallel: its ranks see the same batch and hold other pieces of the same params. A dim
across which ranks see different data (data parallel, context parallel, expert parallel,
whose tokens come from every rank of the dim) is a shard dim.

Without a declaration the mesh's names decide, as before these arguments existed: a 1-D mesh
(any name or none) is one shard dim; ``("replicate", "shard")`` is HSDP; a mesh with a dim named
``"tp"`` (model parallel) or ``"ep"`` (a shard dim whose ranks hold different experts) must be
``("shard", X)`` or ``("replicate", "shard", X)``. Any other name needs the declaration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

#: Default-named meshes (no declaration): the last dim and whether it is data parallel.
LEGACY_LAST = {"tp": False, "ep": True}


@dataclass(frozen=True)
class MeshDims:
    """A mesh's dims, split into data-parallel and model-parallel ones (mesh order).

    Attributes:
        names: every dim's name (``"0"``, ``"1"`` … for a mesh without names).
        sizes: every dim's size.
        replicate: the replicate dim, or ``None``.
        shard: the shard dims (mesh order), at least one.
        model: the other dims (mesh order): model parallel.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    replicate: str | None
    shard: tuple[str, ...]
    model: tuple[str, ...]

    def size(self, dims) -> int:
        """The product of the sizes of ``dims`` (1 for none)."""
        return math.prod(self.sizes[self.names.index(d)] for d in dims)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else self.size((self.replicate,))

    @property
    def data_parallel(self) -> tuple[str, ...]:
        """Every data-parallel dim: the replicate dim (if any) and the shard dims."""
        return ((self.replicate,) if self.replicate else ()) + self.shard

    def is_plain(self) -> bool:
        """A 1-D or HSDP mesh: one shard dim, perhaps a replicate dim, nothing else."""
        return not self.model and len(self.shard) == 1


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or (str(i) for i in range(mesh.ndim)))


def resolve(mesh: DeviceMesh, replicate_dim, shard_dims) -> MeshDims:
    """The data-parallel dims of ``mesh``: as declared, or from its names (module docstring).
    Local: every rank raises the same error.

    Raises:
        ValueError: a declared dim is not a dim of the mesh, is declared twice, ``shard_dims``
            is empty or missing while ``replicate_dim`` is given; or, without a declaration,
            names the default cannot read (the message names the declaration that fixes it).
    """
    names = _names(mesh)
    sizes = tuple(int(s) for s in mesh.shape)
    if shard_dims is None and replicate_dim is None:
        return _from_names(mesh, names, sizes)
    if shard_dims is None:
        raise ValueError(
            f"Invalid replicate_dim={replicate_dim!r} without shard_dims. Declare both, e.g. "
            f"dedicate_params(model, mesh, replicate_dim={replicate_dim!r}, "
            f"shard_dims=('dp_shard',)) on a mesh with dims {names!r}.")
    shard = (shard_dims,) if isinstance(shard_dims, str) else tuple(shard_dims)
    declared = shard + ((replicate_dim,) if replicate_dim is not None else ())
    unknown = [d for d in declared if not isinstance(d, str) or d not in names]
    if not shard or unknown or len(set(declared)) != len(declared):
        raise ValueError(
            f"Invalid replicate_dim={replicate_dim!r}, shard_dims={shard_dims!r} for a mesh with "
            f"mesh_dim_names={names!r}. Must name distinct dims of the mesh: at most one replicate "
            "dim and one or more shard dims (the dims whose ranks see different data), e.g. "
            "replicate_dim='dp_replicate', shard_dims=('dp_shard', 'cp').")
    shard = tuple(d for d in names if d in shard)  # mesh order
    model = tuple(d for d in names if d not in declared)
    return MeshDims(names, sizes, replicate_dim, shard, model)


def _from_names(mesh: DeviceMesh, names, sizes) -> MeshDims:
    """The default (module docstring)."""
    last = names[-1]
    if mesh.ndim >= 2 and last in LEGACY_LAST:
        if names not in (("shard", last), ("replicate", "shard", last)):
            kind = "tensor-parallel" if last == "tp" else "expert-parallel"
            raise ValueError(
                f"Invalid mesh_dim_names={names!r} of a {kind} mesh of shape {sizes}. Must be "
                f"('shard', '{last}') or ('replicate', 'shard', '{last}'), {last!r} last, or "
                "declare the data-parallel dims: dedicate_params(model, mesh, shard_dims=(...), "
                "replicate_dim=...), e.g. shard_dims=('dp_shard',) for ('dp_shard', 'tp').")
        rep = "replicate" if names[0] == "replicate" else None
        shard = ("shard", last) if LEGACY_LAST[last] else ("shard",)
        model = () if LEGACY_LAST[last] else (last,)
        return MeshDims(names, sizes, rep, shard, model)
    if mesh.ndim == 1:
        return MeshDims(names, sizes, None, names, ())
    if mesh.ndim == 2:
        if names != ("replicate", "shard"):
            raise ValueError(
                f"Invalid mesh_dim_names={mesh.mesh_dim_names!r} of a 2-D mesh. Must be "
                "('replicate', 'shard') in that order (replicate axis first, shard axis second), "
                "as in init_device_mesh(device, (R, N), mesh_dim_names=('replicate', 'shard')), "
                "or declare the data-parallel dims: dedicate_params(model, mesh, "
                "replicate_dim=..., shard_dims=(...))."
            )
        return MeshDims(names, sizes, "replicate", ("shard",), ())
    raise ValueError(
        f"Invalid mesh with ndim={mesh.ndim} (shape {sizes}, mesh_dim_names={names!r}). Without "
        "a declaration it must be 1-D (DDP, FSDP2), ('replicate', 'shard') (HSDP), or end in a "
        "model-parallel 'tp' or an expert-parallel 'ep' dim; declare the data-parallel dims of "
        "any other mesh: dedicate_params(model, mesh, replicate_dim='dp_replicate', "
        "shard_dims=('dp_shard', 'cp'))."
    )


def ranks_along(mesh: DeviceMesh, dims: MeshDims, vary: tuple[str, ...],
                fixed: dict[str, int]) -> list[int]:
    """World ranks of the mesh points whose coordinates on every dim not in ``vary`` are
    ``fixed`` (missing ones: 0), row-major over ``vary`` in the order given."""
    t = mesh.mesh
    others = [i for i, n in enumerate(dims.names) if n not in vary]
    order = others + [dims.names.index(n) for n in vary]
    t = t.permute(*order) if order else t
    for i in others:
        t = t[fixed.get(dims.names[i], 0)]
    return [int(x) for x in torch.as_tensor(t).reshape(-1).tolist()]


def points(dims: MeshDims, over: tuple[str, ...]):
    """Every coordinate dict over the dims ``over``, row-major in that order."""
    out = [{}]
    for d in over:
        out = [{**c, d: i} for c in out for i in range(dims.size((d,)))]
    return out


def flat_index(dims: MeshDims, over: tuple[str, ...], coord: dict[str, int]) -> int:
    """Row-major index of ``coord`` over the dims ``over`` (0 for none)."""
    i = 0
    for d in over:
        i = i * dims.size((d,)) + coord[d]
    return i


#: Names of a pipeline-parallel mesh dim (torchtitan's): a stage's data-parallel mesh must not
#: hold it (its ranks run different stages).
PIPELINE_DIMS = ("pp",)
#: A pipeline stage's data-parallel slice and the mesh it is sliced from, for messages.
STAGE_SLICE = "mesh['dp_shard']"
STAGE_MESH = "init_device_mesh(device, (P, N), mesh_dim_names=('pp', 'dp_shard'))"


def check_stage_mesh(mesh) -> None:
    """Raise ``ValueError`` where a pipeline stage's mesh holds a pipeline dim
    (:data:`PIPELINE_DIMS`): a mesh across stages would average grads of different modules
    ("mismatched stage meshes"). Local, every rank, before any collective."""
    names = tuple(mesh.mesh_dim_names or ())
    bad = [d for d in names if d in PIPELINE_DIMS]
    if bad:
        raise ValueError(
            f"Invalid mesh with mesh_dim_names={names!r} (ranks {mesh.mesh.tolist()}): the dim "
            f"{bad[0]!r} is pipeline parallel, its ranks hold different stages. Pass the stage's "
            f"data-parallel slice, the pipeline dim left out: {STAGE_SLICE} (or "
            "mesh['dp_replicate', 'dp_shard'] with replicate_dim=) of the whole mesh.")
