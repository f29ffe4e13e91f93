"""Bucket layout: which dedicated params travel together in one collective (pure).

A **block** is the part of the model whose dedicated params share hooks: for a param of
module ``m``, the longest prefix of ``m``'s dotted name whose last component is an integer
(an element of a ``ModuleList`` / ``Sequential``: ``blocks.3`` for ``blocks.3.attn.qkv``,
``layers.0.experts.5`` for ``layers.0.experts.5.w1``); a module with no such prefix
(``head``, the root ``""``) is its own block (:func:`block_of`).

A **unit** is a run of consecutive blocks (model order of their first dedicated param) whose
dedicated params share collectives, chosen by the α-β cost of a call (:func:`unit_layout`,
docs/traffic-model.md "Coalescing"): walking the blocks in model order, a block joins the
current unit while the unit's bytes (the params' own dtype) plus the block's stay at most
``target_bytes``; otherwise it starts a new unit. A unit of several blocks is kept only if
it needs fewer calls per channel than its blocks would as units of their own (an aligned
group counts one call, any other bucket one each): blocks whose owners all differ and that
do not form an aligned group would only lose their per-block overlap, so they stay alone.
``target_bytes = 0`` gives one unit per block; :func:`resolve_coalesce` turns
``dedicate_params``' ``coalesce`` into the target (``"auto"``: the backend's half-bandwidth
size α/β, :data:`LINK_COSTS`). A unit is named by its first block.

A **bucket** is the dedicated params of one unit with the same global owner and dtype, in
model order, cut into consecutive runs of at most ``cap_bytes`` (a param larger than the cap
is a bucket of its own). Within a unit the buckets are ordered by dtype (first appearance),
then by owner: first appearance, except in an **aligned** dtype group (only when
``target_bytes > 0``: ``coalesce="block"`` keeps one call per bucket): exactly one bucket
per global owner ``g`` in ``[0, W)`` (none split by the cap), of any size, all with the same
``numel`` and the same number of params, except on a backend that reduces by gather
(gloo), where their sizes may differ (an **uneven** group: every call of it is an
all_to_all, which takes any split). Its buckets are ordered by ``(s, r)`` (shard index,
then replicate index, ``g = r * N + s``) and move in one call per channel instead of one
``broadcast`` / ``reduce`` each: ``all_gather`` / ``reduce_scatter``, or an ``all_to_all``
where the members' parts differ (protocol in ``docs/protocol.md``). :func:`bucket_layout` lists units in model
order, so the buckets of any module's subtree are a contiguous range; after the first step
DMuon renumbers them unit by unit in the execution order (``order.py``, ``docs/protocol.md``
step 7). DMuon's runtime (``runtime.py``) uses :func:`bucket_layout`; the traffic predictor
(``verify/traffic/predict.py``) implements the same documented rule on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dmuon.errors import invariant
from dmuon.ownership.plan import OwnershipPlan, ParamSpec

#: Default bucket cap, in MiB (DDP's ``bucket_cap_mb`` default).
DEFAULT_BUCKET_CAP_MB = 25

#: ``coalesce`` values besides a byte count: ``"auto"`` (the backend's α/β), ``"block"`` (one
#: unit per block, no coalescing), ``"all"`` (one unit for the whole model).
COALESCE_MODES = ("auto", "block", "all")


@dataclass(frozen=True)
class LinkCost:
    """The α-β cost of one collective call: ``alpha_us + bytes / (gbps * 1e9)`` seconds, and
    whether DMuon runs
    its reductions as gathers (``reduce_by_gather``: a reduce as a gather to the root, a
    reduce_scatter as an all_to_all, each summed locally by the receiver; the elements each
    rank sends and receives are the same on the W-average, docs/traffic-model.md). Where it
    does, aligned groups may be uneven (module docstring): their calls are all_to_alls.

    ``flat_hsdp``: under ``hierarchy="auto"`` an HSDP model whose dedicated params are one
    unit moves them as on a 1-D mesh of all W ranks (:func:`resolve_hierarchy`).

    :attr:`half_bytes` is α/β, the message size at which a call spends as long on its fixed
    cost as on moving bytes (Hockney's n½): below it a call is latency-bound and coalescing
    pays, above it the saving is less than half a call and per-block calls keep their
    overlap with compute.
    """

    alpha_us: float
    gbps: float
    reduce_by_gather: bool = False
    flat_hsdp: bool = False

    @property
    def half_bytes(self) -> int:
        return int(self.alpha_us * 1e-6 * self.gbps * 1e9)


#: Documented defaults per backend (docs/traffic-model.md, "Coalescing"): ``nccl`` = the
#: intra-node NVLink figures ``dmuon-plan`` assumes (10 µs per call, 360 GB/s bus bandwidth,
#: ``verify.traffic.scale.CostModel``); every call kind costs alike, so aligned groups have no
#: size limit, and reduce / reduce_scatter (single pipelined passes) stay. ``gloo`` = measured
#: on a 2-core CPU machine at W=4 (``benchmarks/bench_gloo_call_cost.py``; β a round figure,
#: about 1 GB/s for large messages):
#:
#: - ``reduce_by_gather``: gloo's reduce and reduce_scatter run several message rounds, so DMuon
#:   reduces by gather: W gathers + local sums took 3.3-6.0 ms against 9.0-10.1 ms for W
#:   reduces, an all_to_all + local sum 2.7-3.0 ms against 6.7-8.2 ms for a reduce_scatter, at
#:   16-256 KiB per bucket (``--aligned``);
#: - no size limit on an aligned group's buckets, and uneven groups: TinyGPT (owner shares 7, 7, 5, 5 d²)
#:   and the MLP (256 KiB buckets) with ``rest="replicate"`` in one call per channel measured
#:   0.93-1.17x the fastest baseline against 1.02-1.37x with per-owner calls, both layouts in
#:   the same rounds (``benchmarks/bench_step.py``, docs/performance.md "Units and
#:   aligned groups"; a 64 KiB limit stood while the group's reduce was a multi-round reduce_scatter).
#:
#: - ``flat_hsdp``: an HSDP model of one unit moves flat (:func:`resolve_hierarchy`): the same
#:   bytes in 3 calls per rank-step against 5 with ``rest="replicate"`` (the replicate reduce and
#:   broadcast go); ``bench_step.py`` measured dmuon-hsdp-z2 hierarchical at 1.09-1.18x the
#:   fastest baseline on TinyGPT and the MLP, flat at 0.97-1.13x, in the same rounds
#:   (docs/performance.md, "HSDP: flat or hierarchical"). Not on NCCL: unmeasured there, and
#:   between hosts flat sends N times the bytes over the replicate axis's links.
#:
#: Any other backend uses ``nccl``'s.
LINK_COSTS = {"nccl": LinkCost(alpha_us=10.0, gbps=360.0),
              "gloo": LinkCost(alpha_us=2000.0, gbps=1.0, reduce_by_gather=True, flat_hsdp=True)}

#: ``dedicate_params(link=...)`` values: ``"auto"`` (the policy of the backend DMuon's groups
#: run on, ``collectives.link_backend``) or a key of :data:`LINK_COSTS` (that backend's policy
#: on any backend: ``"nccl"`` on gloo runs the reduces and aligned reduce_scatters as such, with
#: NCCL's coalescing target and hierarchy rule).
LINK_POLICIES = ("auto", *LINK_COSTS)


def _check_choice(name: str, value, choices: tuple[str, ...], meaning: str) -> None:
    """Raise ``ValueError`` naming ``name``, ``value`` and ``choices`` unless ``value`` is one
    of the strings ``choices``; ``meaning`` says what the keyword decides."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Invalid {name}={value!r}. Must be one of {choices}: {meaning}")


def check_link(link) -> None:
    """Raise ``ValueError`` unless ``link`` is one of :data:`LINK_POLICIES`."""
    _check_choice("link", link, LINK_POLICIES,
                  "whose link policy DMuon follows (coalescing target, reduce by gather, flat "
                  "HSDP; docs/user-guide.md, 'Link policy'); 'auto' is the process group's "
                  "backend's.")


#: ``dedicate_params(hierarchy=...)`` values (:func:`resolve_hierarchy`).
HIERARCHY_MODES = ("auto", "hierarchical", "flat")


@dataclass(frozen=True)
class Coalescing:
    """What ``dedicate_params(coalesce=...)`` resolves to on a backend: the unit target in
    bytes (module docstring) and how the backend's reductions run
    (:attr:`LinkCost.reduce_by_gather`)."""

    target_bytes: int
    reduce_by_gather: bool = False
    flat_hsdp: bool = False


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: ``numel`` elements of ``dtype`` (torch name) owned by global index ``owner``.

    ``module`` is its unit (named by the unit's first block), ``blocks`` the unit's blocks in
    model order; ``aligned`` whether it belongs to an aligned dtype group of its unit (module
    docstring).
    """

    module: str
    owner: int
    dtype: str
    names: tuple[str, ...]
    numel: int
    blocks: tuple[str, ...] = ()
    aligned: bool = False


def block_of(module: str) -> str:
    """The block of a param of ``module`` (dotted name, ``""`` = root): module docstring."""
    parts = module.split(".") if module else []
    for k in range(len(parts), 0, -1):
        if parts[k - 1].isdigit():
            return ".".join(parts[:k])
    return module


def resolve_coalesce(coalesce: str | int, backend: str) -> Coalescing:
    """What ``dedicate_params(coalesce=...)`` means on ``backend`` (module docstring).

    Args:
        coalesce: ``"auto"`` (target ``LINK_COSTS[backend].half_bytes``), ``"block"`` (0),
            ``"all"`` (no limit) or a target in bytes >= 0.
        backend: the process group backend name (``"nccl"``, ``"gloo"``, ...); it also says
            how reductions run (:data:`LINK_COSTS`).

    Raises:
        ValueError: ``coalesce`` is none of these.
    """
    cost = LINK_COSTS.get(backend, LINK_COSTS["nccl"])
    if coalesce == "auto":
        target = cost.half_bytes
    elif coalesce == "block":
        target = 0
    elif coalesce == "all":
        target = sys.maxsize
    elif isinstance(coalesce, bool) or not isinstance(coalesce, int) or coalesce < 0:
        raise ValueError(
            f"Invalid coalesce={coalesce!r}. Must be one of {COALESCE_MODES} or a byte count "
            ">= 0 (the most bytes of dedicated params per unit of blocks sharing collectives)."
        )
    else:
        target = coalesce
    return Coalescing(target, cost.reduce_by_gather, cost.flat_hsdp)


def check_hierarchy(hierarchy) -> None:
    """Raise ``ValueError`` unless ``hierarchy`` is one of :data:`HIERARCHY_MODES`."""
    _check_choice("hierarchy", hierarchy, HIERARCHY_MODES,
                  "how an HSDP mesh moves the dedicated params ('hierarchical': shard axis, then "
                  "replicate axis; 'flat': one call per direction over all W ranks; 'auto': flat "
                  "on a backend that allows it when the dedicated params are one unit).")


def resolve_hierarchy(hierarchy: str, coalescing: Coalescing,
                      layout: Callable[[], Sequence[BucketSpec]]) -> bool:
    """Whether an HSDP mesh moves the dedicated params flat (docs/traffic-model.md, "HSDP:
    flat or hierarchical").

    Flat: as on a 1-D mesh of all W ranks (owner index g = world rank g, the owner its only
    holder, no replicate-axis calls). ``"auto"`` picks it when the backend's
    :attr:`LinkCost.flat_hsdp` holds (gloo) and ``layout()`` (:func:`bucket_layout` of the
    hierarchical plan: the units do not depend on the mesh's shape) is one unit: then the
    W-average bytes equal the hierarchical closed form's (Z3 keeps the last unit, here all of
    P_M), and the replicate reduce and broadcast, two calls per step, go.

    Args:
        hierarchy: ``"auto"``, ``"hierarchical"`` or ``"flat"`` (:func:`check_hierarchy`).
        coalescing: the resolved ``coalesce`` on this backend.
        layout: gives the buckets; called only when ``"auto"`` needs them.
    """
    if hierarchy != "auto":
        return hierarchy == "flat"
    return coalescing.flat_hsdp and len({b.module for b in layout()}) == 1


def unit_layout(specs: Sequence[ParamSpec], target_bytes: int) -> dict[str, tuple[str, ...]]:
    """Block -> the blocks of its unit, in model order (module docstring).

    Args:
        specs: the dedicated params in model order.
        target_bytes: the most bytes per unit of more than one block (>= 0).
    """
    sizes: dict[str, int] = {}
    for spec in specs:
        block = block_of(spec.module)
        sizes[block] = sizes.get(block, 0) + spec.nbytes
    units: list[list[str]] = []
    unit_bytes = 0
    for block, nbytes in sizes.items():
        if units and unit_bytes + nbytes <= target_bytes:
            units[-1].append(block)
            unit_bytes += nbytes
        else:
            units.append([block])
            unit_bytes = nbytes
    return {block: tuple(unit) for unit in units for block in unit}


def bucket_layout(specs: Sequence[ParamSpec], plan: OwnershipPlan, cap_bytes: int,
                  target_bytes: int = 0, uneven: bool = False) -> list[BucketSpec]:
    """Buckets in model order of their units (module docstring).

    Args:
        specs: the dedicated params in model order (``model.named_parameters()`` order).
        plan: the ownership plan computed from the same specs.
        cap_bytes: bucket cap in bytes of the params' dtype (> 0).
        target_bytes: unit target (:func:`unit_layout`); 0: one unit per block and no
            aligned groups.
        uneven: aligned groups may have buckets of different sizes (the backend reduces by
            gather, :attr:`LinkCost.reduce_by_gather`).

    Raises:
        KeyError: a spec is not in the plan.
    """
    invariant(cap_bytes > 0 and target_bytes >= 0,
              lambda: f"bucket_layout: cap_bytes={cap_bytes}, target_bytes={target_bytes} "
                      "(resolved options must be > 0 and >= 0)")
    units = unit_layout(specs, target_bytes)
    if target_bytes == 0:
        return _layout(specs, plan, cap_bytes, units, False, uneven)
    # a unit of several blocks stays only if it saves calls; else its blocks stand alone
    joined = _layout(specs, plan, cap_bytes, units, True, uneven)
    alone = _layout(specs, plan, cap_bytes, {b: (b,) for b in units}, False, uneven)
    kept = {u for u in {b.module for b in joined}
            if len(units[u]) > 1 and _calls(joined, {u}) < _calls(alone, set(units[u]))}
    final = {b: (units[b] if units[b][0] in kept else (b,)) for b in units}
    return _layout(specs, plan, cap_bytes, final, True, uneven)


def _calls(layout: list[BucketSpec], units: set[str]) -> int:
    """Calls per channel of the buckets of ``units``: one per aligned group, else per bucket."""
    members = [b for b in layout if b.module in units]
    return len({(b.module, b.dtype) if b.aligned else id(b) for b in members})


def _layout(specs: Sequence[ParamSpec], plan: OwnershipPlan, cap_bytes: int,
            units: dict[str, tuple[str, ...]], may_align: bool, uneven: bool) -> list[BucketSpec]:
    """Buckets of the given units (``may_align`` False: none aligned)."""
    replicas, shards = plan.mesh_shape
    world = replicas * shards
    # unit -> dtype -> owner -> runs of params (dicts keep first appearance)
    members: dict[str, dict[str, dict[int, list[list[ParamSpec]]]]] = {}
    for spec in specs:
        blocks = units[block_of(spec.module)]
        runs = members.setdefault(blocks[0], {}).setdefault(spec.dtype, {}).setdefault(
            plan.owner[spec.name], [[]])
        run = runs[-1]
        if run and (sum(s.nbytes for s in run) + spec.nbytes) > cap_bytes:
            runs.append(run := [])
        run.append(spec)
    layout = []
    for unit, by_dtype in members.items():
        blocks = units[unit]
        for dtype, by_owner in by_dtype.items():
            aligned = may_align and _aligned(by_owner, world, uneven)
            owners = sorted(by_owner, key=lambda g: (g % shards, g // shards)) if aligned else by_owner
            for owner in owners:
                for run in by_owner[owner]:
                    layout.append(BucketSpec(unit, owner, dtype, tuple(s.name for s in run),
                                             sum(s.numel for s in run), blocks, aligned))
    return layout


def _aligned(by_owner: dict[int, list[list[ParamSpec]]], world: int, uneven: bool) -> bool:
    """One run per owner of ``[0, world)`` (world > 1), with equal element and param counts
    unless ``uneven``."""
    if world < 2 or sorted(by_owner) != list(range(world)) or any(len(r) != 1 for r in by_owner.values()):
        return False
    runs = [r[0] for r in by_owner.values()]
    return uneven or len({(sum(s.numel for s in run), len(run)) for run in runs}) == 1
