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
import heapq
import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import torch

from dmuon.optim.muon_math import ns_flops

__all__ = [
    "OwnershipPlan",
    "ParamSpec",
    "makespan_lower_bound",
    "plan_ownership",
    "specs_from_named_parameters",
]

#: Bumped whenever the algorithm or the digest's JSON layout changes. 2: NS cost = the FLOPs
#: of the configured iteration (was rows*cols*min), LPT on a heap keyed (load, bytes, g).
#: 3: n-D params (expert stacks, conv weights) with their Muon matrix shape in the digest.
PLAN_VERSION = 3

#: NS iterations the default cost model assumes (``torch.optim.Muon``'s default ``ns_steps``).
DEFAULT_NS_STEPS = 5


def _dtype_bytes(dtype: str, where: str) -> int:
    size = _DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
    if size is not None:
        return size
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(
            f"Invalid {dtype=} for {where}. Must be a torch dtype name such as 'float32' or "
            "'bfloat16' (str(tensor.dtype) without the 'torch.' prefix)."
        )
    _DTYPE_BYTES[dtype] = torch_dtype.itemsize
    return torch_dtype.itemsize


_DTYPE_BYTES: dict[str, int] = {}


@dataclass(frozen=True)
class ParamSpec:
    """What the planner (and the traffic predictor) knows about one parameter.

    A Muon target is one matrix or several of one shape: Muon sees the param as
    ``param.view(-1, *matrix_shape)`` (:attr:`matrix_shape`, :attr:`matrices`). Two layouts:

    - a **stack** (the default): the last two dims are the matrix, the leading ones index
      matrices; a 2-D ``(rows, cols)`` weight is a stack of one, a 3-D expert stack
      ``(E, rows, cols)`` holds E.
    - **flattened** (conv weights, ``matrix=(shape[0], prod(shape[1:]))``): one matrix of the
      output channels by everything else, as Muon is usually applied to convolutions.

    Attributes:
        name: fully qualified parameter name (``model.named_parameters()``), e.g.
            ``"blocks.0.attn.qkv.weight"``; the plan's key and its tie-breaker.
        shape: the full (unsharded) shape; :func:`plan_ownership` requires at least 2 dims,
            all positive (the predictor also describes 1-D params).
        dtype: torch dtype name, e.g. ``"float32"``.
        module: fully qualified name of the module holding the param (``"blocks.0.attn.qkv"``);
            the runtime packs same-owner params of one block (``dmuon.ownership.buckets``) into one broadcast.
        matrix: the shape ``(rows, cols)`` of one Muon matrix, ``None`` for the stack layout
            (``shape[-2:]``); must be ``shape[-2:]`` or ``(shape[0], prod(shape[1:]))``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    module: str
    matrix: tuple[int, int] | None = None

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one Muon matrix of this param (class docstring)."""
        return self.matrix if self.matrix is not None else tuple(self.shape[-2:])

    @property
    def matrices(self) -> int:
        """How many Muon matrices the param holds (Newton–Schulz calls per step)."""
        rows, cols = self.matrix_shape
        return self.numel // (rows * cols)

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
        """:func:`dmuon.optim.muon_math.ns_flops` of the param at ``DEFAULT_NS_STEPS`` (FLOPs):
        :attr:`matrices` times one matrix's."""
        return self.matrices * ns_flops(*self.matrix_shape, DEFAULT_NS_STEPS)


def specs_from_named_parameters(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    matrix_shapes: Mapping[str, tuple[int, int]] | None = None,
) -> list[ParamSpec]:
    """``ParamSpec`` per ``(name, tensor)``; ``module`` is the name up to its last dot.

    ``matrix_shapes``: name -> Muon matrix shape for params not in the stack layout (conv
    weights, :func:`dmuon.select.matrix_shape`); a value equal to ``shape[-2:]`` is stored
    as ``None``. The caller selects which params are Muon targets. Raises ``ValueError``
    (from :func:`plan_ownership`) later for params with fewer than 2 dims.
    """
    out = []
    for name, tensor in named_parameters:
        shape = tuple(tensor.shape)
        matrix = (matrix_shapes or {}).get(name)
        if matrix is not None:
            matrix = tuple(int(d) for d in matrix)
            if matrix == shape[-2:]:
                matrix = None
        out.append(ParamSpec(
            name=name,
            shape=shape,
            dtype=str(tensor.dtype).removeprefix("torch."),
            module=name.rpartition(".")[0],
            matrix=matrix,
        ))
    return out


def _is_int_at_least(x, low: int) -> bool:
    if type(x) is int:  # the common case, without the ABC check below
        return x >= low
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


class _ValidSpecs(tuple):
    """A tuple of specs that :func:`_validate_specs` checked and sorted (checked once only)."""


def _validate_specs(specs: Sequence[ParamSpec]) -> tuple[ParamSpec, ...]:
    if type(specs) is _ValidSpecs:
        return specs
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise ValueError(f"Invalid spec={spec!r}. Must be a dmuon.ownership.plan.ParamSpec.")
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"Invalid name={spec.name!r} in {spec}. Must be a non-empty str.")
        if spec.name in seen:
            raise ValueError(
                f"Invalid specs: duplicate name={spec.name!r}. Names must be unique (use the "
                "fully qualified names from model.named_parameters())."
            )
        seen.add(spec.name)
        shape = spec.shape
        if type(shape) is tuple and len(shape) == 2 and type(shape[0]) is int and type(shape[1]) is int:
            ok_shape = shape[0] >= 1 and shape[1] >= 1  # the common case, without ABC checks
        else:
            ok_shape = (
                isinstance(shape, tuple) and len(shape) >= 2
                and all(_is_int_at_least(d, 1) for d in shape)
            )
        if not ok_shape:
            raise ValueError(
                f"Invalid shape={shape!r} for param {spec.name!r}. Must be a tuple of at least 2 "
                "positive ints: a matrix (rows, cols), a stack of matrices (E, rows, cols) or a "
                "conv weight (out, in, k...); leave 1-D params to AdamW."
            )
        if spec.matrix is not None:
            flat = (shape[0], math.prod(shape[1:]))
            if not isinstance(spec.matrix, tuple) or spec.matrix not in (tuple(shape[-2:]), flat):
                raise ValueError(
                    f"Invalid matrix={spec.matrix!r} for param {spec.name!r} of shape {shape}. "
                    f"Must be None, {tuple(shape[-2:])} (a stack of matrices) or {flat} (the "
                    "conv layout: output channels by the rest)."
                )
        if not isinstance(spec.module, str):
            raise ValueError(f"Invalid module={spec.module!r} for {spec.name!r}. Must be a str.")
        if spec.dtype not in _DTYPE_BYTES:
            _dtype_bytes(spec.dtype, f"param {spec.name!r}")
    return _ValidSpecs(sorted(specs, key=lambda sp: sp.name))


@dataclass(frozen=True)
class OwnershipPlan:
    """The owner of every Muon-target parameter on a ``(R, N)`` mesh. Immutable.

    Attributes:
        mesh_shape: ``(R, N)``.
        specs: the planned params, sorted by name.
        owner: param name -> global owner index ``g`` in [0, R * N).
        ns_cost: param name -> the NS cost the planner balanced (FLOPs, or the unit of a
            measured table); default :attr:`ParamSpec.ns_cost`. Not part of the digest (the
            owners it produced are).
    """

    mesh_shape: tuple[int, int]
    specs: tuple[ParamSpec, ...]
    owner: Mapping[str, int] = field(repr=False)
    ns_cost: Mapping[str, float] | None = field(default=None, repr=False, compare=False)

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
        cost = self.ns_cost
        if cost is None:
            cost = {sp.name: sp.ns_cost for sp in specs}
        elif sorted(cost) != names:
            raise ValueError("Invalid ns_cost keys. Must be exactly the spec names.")
        object.__setattr__(self, "ns_cost", MappingProxyType(dict(cost)))

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
        return list(self._names_by_owner.get(g, ()))

    @cached_property
    def _names_by_owner(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for sp in self.specs:
            out.setdefault(self.owner[sp.name], []).append(sp.name)
        return out

    # ----- load -----------------------------------------------------------------------------
    @cached_property
    def ns_load(self) -> tuple[int, ...]:
        """Per global owner g: sum of :attr:`ns_cost` of the params it owns. Length W."""
        load = [0] * self.world_size
        for sp in self.specs:
            load[self.owner[sp.name]] += self.ns_cost[sp.name]
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
    def idle_owners(self) -> int:
        """Owners with no param (W minus the distinct owners); > 0 whenever W > matrices."""
        return self.world_size - len(set(self.owner.values()))

    def ns_lower_bound(self) -> float:
        """:func:`makespan_lower_bound` of this plan's costs on its W owners."""
        return makespan_lower_bound(list(self.ns_cost.values()), self.world_size)

    @property
    def bytes_max_over_mean(self) -> float:
        """max / mean of :attr:`bytes_load_per_shard` over the N shard indices (1.0 if empty)."""
        return _max_over_mean(self.bytes_load_per_shard)

    # ----- identity ------------------------------------------------------------------------------
    def canonical_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace, ASCII) of the plan; :meth:`digest` input."""
        doc = {
            "version": PLAN_VERSION,
            "mesh_shape": list(self.mesh_shape),
            "params": [
                {
                    "name": sp.name,
                    "shape": list(sp.shape),
                    "matrix": list(sp.matrix_shape),
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


def _max_over_mean(load: Sequence[int]) -> float:
    total = sum(load)
    return 1.0 if total == 0 else max(load) * len(load) / total


def _cost_model(
    specs: Sequence[ParamSpec], ns_steps: int, cost_table: Mapping[tuple[int, int], float] | None
) -> dict[str, float]:
    if cost_table is None:
        by_shape: dict[tuple[int, int], int] = {}
        for sp in specs:
            m = sp.matrix_shape
            if m not in by_shape:
                by_shape[m] = ns_flops(m[0], m[1], ns_steps)
        return {sp.name: sp.matrices * by_shape[sp.matrix_shape] for sp in specs}
    out = {}
    for sp in specs:
        cost = cost_table.get(tuple(sp.matrix_shape))
        if not isinstance(cost, numbers.Real) or isinstance(cost, bool) or not 0 < cost < math.inf:
            raise ValueError(
                f"Invalid cost_table[{tuple(sp.matrix_shape)}]={cost!r} for param {sp.name!r}. "
                "Must be a positive finite number (e.g. measured seconds) for every planned "
                "matrix shape."
            )
        out[sp.name] = sp.matrices * cost
    return out


def plan_ownership(
    specs: Sequence[ParamSpec],
    mesh_shape: tuple[int, int],
    *,
    ns_steps: int = DEFAULT_NS_STEPS,
    cost_table: Mapping[tuple[int, int], float] | None = None,
    initial_load: Sequence[float] | None = None,
) -> OwnershipPlan:
    """Assign each param one global owner on a ``(R, N)`` mesh; deterministic everywhere.

    The unit of ownership is the whole param: a 3-D expert stack has one owner, which runs
    Newton–Schulz on its E slices in one batch (why not slices: docs/traffic-model.md,
    "Expert stacks and conv weights"). Cost of a param: :attr:`ParamSpec.matrices` times
    the cost of one matrix of :attr:`ParamSpec.matrix_shape`, which is
    :func:`dmuon.optim.muon_math.ns_flops` with ``ns_steps`` (the FLOPs of the NS call the owner
    runs, derived there from the iteration's arithmetic), or ``cost_table[matrix_shape]``
    when a measured per-shape table is given (any positive unit, e.g. seconds; every planned
    matrix shape must be in it). All ranks must pass the same arguments: the
    plan digest check of :func:`dmuon.dedicate_params` catches a mismatch.

    Algorithm (greedy longest-processing-time first, Graham 1969), O(M log M + M log W):

    1. Order params by decreasing cost, then decreasing bytes, then name: never by input
       order or hash order, so every rank agrees.
    2. Give each, in turn, to the owner with the least ``(NS load, param bytes, g)`` (a heap
       of W entries; ties on load go to the owner with fewer bytes, then the lowest g, which
       walks the shard indices s = g % N first and so spreads the forward broadcasts).
    3. If the maximum load exceeds :data:`MULTIFIT_TRIGGER` times
       :func:`makespan_lower_bound` and there are at most :data:`MULTIFIT_MAX_MATRICES`
       matrices, also run MULTIFIT (first-fit decreasing at a bisected
       capacity, O(25 M log W)) and keep its plan if its maximum load is lower. LPT misses
       by up to 10% on sets of few distinct sizes where the optimum groups matrices of one
       size together (GPT-2 small at W=16: {9, 9, 3} and {7, 7, 7}); MULTIFIT finds those.

    Guarantee: the maximum NS load is at most (4/3 - 1/(3W)) times the optimum (Graham,
    "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2), 1969; step 3
    only lowers it);
    :meth:`OwnershipPlan.ns_lower_bound` gives a bound on the optimum to compare with.

    Fewer params than owners is fine (some owners idle); an empty ``specs`` gives an empty plan.

    ``initial_load``: an NS load already on each of the W owners (the cost unit above) that
    step 2 starts from (another kind's params planned first, e.g. expert stacks:
    ``dmuon/placement/layout.py``); MULTIFIT (step 3) is then skipped, and the guarantee below is
    LPT's on the combined load only in the usual sense of list scheduling with release loads.

    Raises:
        ValueError: a shape of fewer than 2 dims or a non-positive dim, a matrix shape that
            is neither layout of :class:`ParamSpec`, a duplicate name, an unknown dtype
            name, a ``mesh_shape`` that is not two positive ints, a bad ``ns_steps``, or a
            ``cost_table`` without a positive finite entry for a planned shape, or an
            ``initial_load`` whose length is not R * N.
    """
    replicate_size, shard_size = _validate_mesh_shape(mesh_shape)
    valid = _validate_specs(specs)
    cost = _cost_model(valid, ns_steps, cost_table)
    nbytes = {sp.name: sp.numel * _DTYPE_BYTES[sp.dtype] for sp in valid}
    ordered = sorted(valid, key=lambda sp: (-cost[sp.name], -nbytes[sp.name], sp.name))
    world = replicate_size * shard_size
    if initial_load is not None and len(initial_load) != world:
        raise ValueError(f"Invalid initial_load of length {len(initial_load)}. Must have one "
                         f"entry per owner: {world} for mesh_shape={mesh_shape}.")
    owner, worst = _lpt(ordered, cost, nbytes, world, initial_load)
    if (
        initial_load is None
        and 0 < len(ordered) <= MULTIFIT_MAX_MATRICES
        and worst > MULTIFIT_TRIGGER * makespan_lower_bound(list(cost.values()), world)
    ):
        packed = _multifit(ordered, cost, world, worst)
        if packed is not None and packed[1] < worst:
            owner = packed[0]
    return OwnershipPlan(
        mesh_shape=(replicate_size, shard_size), specs=valid, owner=owner, ns_cost=cost
    )


#: LPT's maximum load above this multiple of :func:`makespan_lower_bound` makes
#: :func:`plan_ownership` try MULTIFIT as well (GPT-2 small at W=16: LPT 1.095x, MULTIFIT 1.0x).
MULTIFIT_TRIGGER = 1.05

#: ... on at most this many matrices (25 first-fit passes; beyond, many matrices per owner
#: keep LPT within a few percent: Qwen3-30B-A3B's 18,576 at W=1024 within 1.023x).
MULTIFIT_MAX_MATRICES = 4096

#: Bisection steps of MULTIFIT's capacity search.
MULTIFIT_STEPS = 25


def _lpt(
    ordered: Sequence[ParamSpec], cost: Mapping[str, float], nbytes: Mapping[str, int], world: int,
    initial_load: Sequence[float] | None = None,
) -> tuple[dict[str, int], float]:
    """LPT on a heap of (NS load, bytes, g), from ``initial_load`` (else 0): (owner map,
    maximum load)."""
    heap = [(initial_load[g] if initial_load else 0, 0, g) for g in range(world)]
    heapq.heapify(heap)
    owner: dict[str, int] = {}
    replace = heapq.heapreplace
    for sp in ordered:
        name = sp.name
        load, held, g = heap[0]
        owner[name] = g
        replace(heap, (load + cost[name], held + nbytes[name], g))
    return owner, max(load for load, _, _ in heap)


def _first_fit_decreasing(ordered, cost, world: int, cap: float) -> dict[str, int] | None:
    """First-fit into ``world`` bins of capacity ``cap`` (items already in decreasing order):
    each item goes to the lowest-index bin with room, found in a max-segment tree over the
    bins' free room, O(log W) per item. ``None`` if an item fits nowhere."""
    size = 1
    while size < world:
        size *= 2
    room = [-1.0] * (2 * size)
    room[size:size + world] = [cap] * world
    for i in range(size - 1, 0, -1):
        room[i] = max(room[2 * i], room[2 * i + 1])
    owner: dict[str, int] = {}
    for sp in ordered:
        c = cost[sp.name]
        if room[1] < c:
            return None
        i = 1
        while i < size:
            i = 2 * i if room[2 * i] >= c else 2 * i + 1
        owner[sp.name] = i - size
        room[i] -= c
        i //= 2
        while i:
            room[i] = max(room[2 * i], room[2 * i + 1])
            i //= 2
    return owner


def _multifit(ordered, cost, world: int, upper: float) -> tuple[dict[str, int], float] | None:
    """MULTIFIT (Coffman, Garey and Johnson, SIAM J. Comput. 7(1), 1978): the smallest
    capacity, by bisection between the lower bound and ``upper``, at which first-fit
    decreasing packs every matrix into W owners; (owner map, maximum load) or ``None``."""
    lo, hi = makespan_lower_bound([cost[sp.name] for sp in ordered], world), upper
    best = None
    for _ in range(MULTIFIT_STEPS):
        cap = (lo + hi) / 2
        packed = _first_fit_decreasing(ordered, cost, world, cap)
        if packed is None:
            lo = cap
        else:
            hi, best = cap, packed
    if best is None:
        return None
    load: dict[int, float] = {}
    for sp in ordered:
        load[best[sp.name]] = load.get(best[sp.name], 0) + cost[sp.name]
    return best, max(load.values())


def makespan_lower_bound(costs: Sequence[float], world: int) -> float:
    """A lower bound on the optimal maximum load of ``costs`` over ``world`` owners.

    The maximum of the trivial bound ``max(largest cost, total / world)`` and the bin-packing
    bound L2 of Martello and Toth ("Lower bounds and reduction procedures for the bin packing
    problem", Discrete Appl. Math. 28(1), 1990) used as an infeasibility test: a capacity C is
    impossible when, for some alpha in [0, C/2], the items above C - alpha (one owner each),
    plus those in (C/2, C - alpha] (one owner each), plus the volume of the items in
    [alpha, C/2] that does not fit beside the latter, need more than ``world`` owners. The
    bound is the largest C that test rejects (bisection on C, 40 steps), or the trivial bound.
    It exceeds the trivial bound when few large matrices must each sit alone (Llama-3-70B at
    W=256: 240 MLP matrices, 16 owners for the rest). Cost O(distinct costs^2 * 40).

    Raises:
        ValueError: ``world`` not a positive int or a negative cost.
    """
    if not _is_int_at_least(world, 1):
        raise ValueError(f"Invalid {world=}. Must be a positive int.")
    if any(c < 0 for c in costs):
        raise ValueError("Invalid costs. Must be >= 0.")
    if not costs:
        return 0.0
    counts: dict[float, int] = {}
    for c in costs:
        counts[c] = counts.get(c, 0) + 1
    values = sorted(counts, reverse=True)
    trivial = max(values[0], sum(costs) / world)

    def infeasible(cap: float) -> bool:
        if values[0] > cap:
            return True
        for alpha in [0.0] + [v for v in values if v <= cap / 2]:
            big = sum(counts[v] for v in values if v > cap - alpha)
            mid = [v for v in values if cap / 2 < v <= cap - alpha]
            n_mid = sum(counts[v] for v in mid)
            room = n_mid * cap - sum(v * counts[v] for v in mid)
            small = sum(v * counts[v] for v in values if alpha <= v <= cap / 2 and v > 0)
            # the 1e-9 keeps float round-off from rejecting a capacity that fits exactly
            if big + n_mid + max(0, math.ceil((small - room) / cap - 1e-9)) > world:
                return True
        return False

    lo, hi = trivial, 2 * trivial  # LPT's 4/3 guarantee keeps the optimum below hi
    if not infeasible(lo):
        return trivial
    for _ in range(40):
        mid = (lo + hi) / 2
        if infeasible(mid):
            lo = mid
        else:
            hi = mid
    return lo
