"""Ownership planner: which rank owns (reduces to, runs NS for, broadcasts) each Muon matrix.

A pure function of parameter names, shapes and dtypes and of the mesh shape: every rank computes
the same plan with no communication, and :meth:`OwnershipPlan.digest` lets the runtime compare
plans across ranks before the first collective.

Mesh glossary: ``mesh_shape = (R, N)``, R = replicate size (mesh axis ``"replicate"``), N =
shard size (mesh axis ``"shard"``), W = R * N owners. Global owner index ``g`` in [0, W) has
mesh coordinates ``r = g // N`` (replicate index) and ``s = g % N`` (shard index), the row-major
layout of ``init_device_mesh(device, (R, N), mesh_dim_names=("replicate", "shard"))``. DDP and
FSDP2 (1-D meshes) use ``(1, N)`` so that ``g == s``.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import torch
from tabulate import tabulate

from dmuon.muon_math import ns_cost

__all__ = ["OwnershipPlan", "ParamSpec", "plan_ownership", "specs_from_named_parameters"]

#: Bumped whenever the algorithm or the digest's JSON layout changes.
PLAN_VERSION = 1


def _dtype_bytes(dtype: str, where: str) -> int:
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(
            f"Invalid {dtype=} for {where}. Must be a torch dtype name such as 'float32' or "
            "'bfloat16' (str(tensor.dtype) without the 'torch.' prefix)."
        )
    return torch_dtype.itemsize


@dataclass(frozen=True)
class ParamSpec:
    """What the planner (and the traffic predictor) knows about one parameter.

    Attributes:
        name: fully qualified parameter name (``model.named_parameters()``), e.g.
            ``"blocks.0.attn.qkv.weight"``; the plan's key and its tie-breaker.
        shape: the full (unsharded) shape; :func:`plan_ownership` requires 2-D
            ``(rows, cols)`` with positive dims (the predictor also describes 1-D params).
        dtype: torch dtype name, e.g. ``"float32"``.
        module: fully qualified name of the module holding the param (``"blocks.0.attn.qkv"``);
            the runtime packs same-owner params of one block (``dmuon.buckets``) into one broadcast.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    module: str

    @property
    def numel(self) -> int:
        """Elements of the full (unsharded) tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the full matrix (numel * dtype size)."""
        return self.numel * _dtype_bytes(self.dtype, self.name)

    @property
    def ns_cost(self) -> int:
        """:func:`dmuon.muon_math.ns_cost` of the matrix (per NS iteration, up to a constant)."""
        return ns_cost(self.shape[0], self.shape[1])


def specs_from_named_parameters(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
) -> list[ParamSpec]:
    """``ParamSpec`` per ``(name, tensor)``; ``module`` is the name up to its last dot.

    The caller selects which params are Muon targets (e.g. the 2-D weights of hidden Linear
    layers). Raises ``ValueError`` (from :func:`plan_ownership`) later for non-2-D ones.
    """
    return [
        ParamSpec(
            name=name,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            module=name.rpartition(".")[0],
        )
        for name, tensor in named_parameters
    ]


def _is_int_at_least(x, low: int) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= low


def _validate_mesh_shape(mesh_shape) -> tuple[int, int]:
    ok = (
        isinstance(mesh_shape, (tuple, list))
        and len(mesh_shape) == 2
        and all(_is_int_at_least(x, 1) for x in mesh_shape)
    )
    if not ok:
        raise ValueError(
            f"Invalid {mesh_shape=}. Must be (replicate_size R, shard_size N) with two positive "
            "ints; use (1, N) for DDP and 1-D FSDP2."
        )
    return int(mesh_shape[0]), int(mesh_shape[1])


def _validate_specs(specs: Sequence[ParamSpec]) -> tuple[ParamSpec, ...]:
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise ValueError(f"Invalid spec={spec!r}. Must be a dmuon.plan.ParamSpec.")
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"Invalid name={spec.name!r} in {spec}. Must be a non-empty str.")
        if spec.name in seen:
            raise ValueError(
                f"Invalid specs: duplicate name={spec.name!r}. Names must be unique (use the "
                "fully qualified names from model.named_parameters())."
            )
        seen.add(spec.name)
        shape = spec.shape
        if (
            not isinstance(shape, tuple)
            or len(shape) != 2
            or not all(_is_int_at_least(d, 1) for d in shape)
        ):
            raise ValueError(
                f"Invalid shape={shape!r} for param {spec.name!r}. Must be a 2-D tuple of "
                "positive ints (rows, cols): only 2-D matrices are Muon targets; leave other "
                "params to AdamW."
            )
        if not isinstance(spec.module, str):
            raise ValueError(f"Invalid module={spec.module!r} for {spec.name!r}. Must be a str.")
        _dtype_bytes(spec.dtype, f"param {spec.name!r}")
    return tuple(sorted(specs, key=lambda sp: sp.name))


@dataclass(frozen=True)
class OwnershipPlan:
    """The owner of every Muon-target parameter on a ``(R, N)`` mesh. Immutable.

    Attributes:
        mesh_shape: ``(R, N)``.
        specs: the planned params, sorted by name.
        owner: param name -> global owner index ``g`` in [0, R * N).
    """

    mesh_shape: tuple[int, int]
    specs: tuple[ParamSpec, ...]
    owner: Mapping[str, int] = field(repr=False)

    def __post_init__(self) -> None:
        mesh_shape = _validate_mesh_shape(self.mesh_shape)
        specs = _validate_specs(self.specs)
        world = mesh_shape[0] * mesh_shape[1]
        owner = dict(self.owner)
        names = [sp.name for sp in specs]
        if sorted(owner) != names:
            raise ValueError(
                f"Invalid owner keys. Must be exactly the spec names; missing="
                f"{sorted(set(names) - set(owner))}, extra={sorted(set(owner) - set(names))}."
            )
        for name, g in owner.items():
            if not _is_int_at_least(g, 0) or g >= world:
                raise ValueError(
                    f"Invalid owner[{name!r}]={g!r}. Must be an int in [0, {world}) for "
                    f"mesh_shape={mesh_shape}."
                )
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "owner", MappingProxyType({n: int(owner[n]) for n in names}))

    def __hash__(self) -> int:
        return hash(self.digest())

    # ----- mesh coordinates ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """W = R * N, the number of owners."""
        return self.mesh_shape[0] * self.mesh_shape[1]

    def _owner_of(self, name: str) -> int:
        try:
            return self.owner[name]
        except KeyError:
            raise ValueError(
                f"Invalid {name=}. Must be one of the {len(self.specs)} planned params "
                f"(e.g. {[sp.name for sp in self.specs[:3]]})."
            ) from None

    def shard_owner(self, name: str) -> int:
        """Shard index ``s = g % N`` of ``name``'s owner (its root inside every shard group)."""
        return self._owner_of(name) % self.mesh_shape[1]

    def replicate_owner(self, name: str) -> int:
        """Replicate index ``r = g // N`` of ``name``'s owner (root of the replicate reduce)."""
        return self._owner_of(name) // self.mesh_shape[1]

    def params_of(self, g: int) -> list[str]:
        """Names owned by global owner ``g``, sorted by name. ``ValueError`` if g not in [0, W)."""
        if not _is_int_at_least(g, 0) or g >= self.world_size:
            raise ValueError(f"Invalid {g=}. Must be an int in [0, {self.world_size}).")
        return [sp.name for sp in self.specs if self.owner[sp.name] == g]

    # ----- load -----------------------------------------------------------------------------
    @cached_property
    def ns_load(self) -> tuple[int, ...]:
        """Per global owner g: sum of :func:`ns_cost` of the params it owns. Length W."""
        load = [0] * self.world_size
        for sp in self.specs:
            load[self.owner[sp.name]] += sp.ns_cost
        return tuple(load)

    @cached_property
    def bytes_load(self) -> tuple[int, ...]:
        """Per global owner g: bytes of the full params it owns. Length W."""
        load = [0] * self.world_size
        for sp in self.specs:
            load[self.owner[sp.name]] += sp.nbytes
        return tuple(load)

    @cached_property
    def bytes_load_per_shard(self) -> tuple[int, ...]:
        """Per shard index s: bytes of params whose owner has shard index s. Length N.

        This is what rank (r, s) broadcasts to its shard group in each forward, for every r.
        """
        load = [0] * self.mesh_shape[1]
        for g, b in enumerate(self.bytes_load):
            load[g % self.mesh_shape[1]] += b
        return tuple(load)

    @property
    def ns_max_over_mean(self) -> float:
        """max / mean of :attr:`ns_load` over all W owners (1.0 is perfect; 1.0 if no params)."""
        return _max_over_mean(self.ns_load)

    @property
    def bytes_max_over_mean(self) -> float:
        """max / mean of :attr:`bytes_load_per_shard` over the N shard indices (1.0 if empty)."""
        return _max_over_mean(self.bytes_load_per_shard)

    # ----- identity and display ----------------------------------------------------------------
    def canonical_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace, ASCII) of the plan; :meth:`digest` input."""
        doc = {
            "version": PLAN_VERSION,
            "mesh_shape": list(self.mesh_shape),
            "params": [
                {
                    "name": sp.name,
                    "shape": list(sp.shape),
                    "dtype": sp.dtype,
                    "module": sp.module,
                    "owner": self.owner[sp.name],
                }
                for sp in self.specs
            ],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    def digest(self) -> str:
        """sha256 hex of :meth:`canonical_json`; equal across processes and hash seeds."""
        return hashlib.sha256(self.canonical_json().encode("ascii")).hexdigest()

    def summary(self) -> str:
        """A short table of per-owner load, then per-shard bytes and the max/mean ratios."""
        n = self.mesh_shape[1]
        rows = [
            (g, g // n, g % n, len(self.params_of(g)), self.ns_load[g], self.bytes_load[g])
            for g in range(self.world_size)
        ]
        owners = tabulate(
            rows,
            headers=["owner g", "replicate r", "shard s", "params", "ns_cost", "param_bytes"],
            tablefmt="github",
        )
        return (
            f"OwnershipPlan mesh_shape={self.mesh_shape} params={len(self.specs)} "
            f"digest={self.digest()[:12]}\n{owners}\n"
            f"bytes per shard s: {list(self.bytes_load_per_shard)}\n"
            f"ns_cost max/mean over owners: {self.ns_max_over_mean:.3f}; "
            f"bytes max/mean over shard indices: {self.bytes_max_over_mean:.3f}"
        )


def _max_over_mean(load: Sequence[int]) -> float:
    total = sum(load)
    return 1.0 if total == 0 else max(load) * len(load) / total


def plan_ownership(specs: Sequence[ParamSpec], mesh_shape: tuple[int, int]) -> OwnershipPlan:
    """Assign each 2-D param one global owner on a ``(R, N)`` mesh; deterministic everywhere.

    Algorithm (greedy longest-processing-time first, Graham 1969):

    1. Order params by decreasing NS cost (:func:`dmuon.muon_math.ns_cost`), then decreasing
       bytes, then name: never by input order or hash order, so every rank agrees.
    2. Give each, in turn, to the owner g minimising, lexicographically: the owner's NS load
       after adding it; the bytes of its shard index s = g % N after adding it (balances the
       forward broadcasts, which every (r, s) sends to its shard group); the owner's bytes;
       g itself.

    Guarantee: step 2's first key is plain LPT, so the maximum NS load over owners is at most
    (4/3 - 1/(3W)) times the optimum (Graham, "Bounds on multiprocessing timing anomalies",
    SIAM J. Appl. Math. 17(2), 1969). Bytes balance is best effort (second key).

    Fewer params than owners is fine (some owners idle); an empty ``specs`` gives an empty plan.

    Raises:
        ValueError: a non-2-D shape or non-positive dim, a duplicate name, an unknown dtype
            name, or a ``mesh_shape`` that is not two positive ints.
    """
    replicate_size, shard_size = _validate_mesh_shape(mesh_shape)
    ordered = sorted(_validate_specs(specs), key=lambda sp: (-sp.ns_cost, -sp.nbytes, sp.name))
    world = replicate_size * shard_size
    ns_load = [0] * world
    bytes_load = [0] * world
    shard_bytes = [0] * shard_size
    owner: dict[str, int] = {}
    for sp in ordered:
        cost, nbytes = sp.ns_cost, sp.nbytes
        g = min(
            range(world),
            key=lambda o: (
                ns_load[o] + cost,
                shard_bytes[o % shard_size] + nbytes,
                bytes_load[o] + nbytes,
                o,
            ),
        )
        owner[sp.name] = g
        ns_load[g] += cost
        bytes_load[g] += nbytes
        shard_bytes[g % shard_size] += nbytes
    return OwnershipPlan(mesh_shape=(replicate_size, shard_size), specs=tuple(specs), owner=owner)
