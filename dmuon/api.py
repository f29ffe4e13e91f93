"""The public entry point: :func:`dedicate_params` validates, plans, agrees and installs hooks."""

from __future__ import annotations

import hashlib
import json
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.placement import already_wrapped, layout_for
from dmuon import start
from dmuon.runtime import attach, collectives
from dmuon.options import DedicateOptions
from dmuon.ownership.buckets import DEFAULT_BUCKET_CAP_MB, Coalescing
from dmuon.runtime.dedicated_params import DedicatedParams
from dmuon.runtime import rest as replicated_rest
from dmuon.ownership.plan import OwnershipPlan, specs_from_named_parameters
from dmuon.ownership.select import Predicate, adamw_matrices, assign_params, select_params


def dedicate_params(
    model: nn.Module,
    mesh,
    *,
    params=None,
    predicate: Predicate | None = None,
    reshard_after_forward: bool = True,
    mp_policy=None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    prefetch_depth: int = 1,
    coalesce: str | int = "auto",
    rest: str = "wrapper",
    hierarchy: str = "auto",
    link: str = "auto",
    replicate_dim: str | None = None,
    shard_dims: str | tuple[str, ...] | None = None,
) -> DedicatedParams:
    """Give every Muon-target matrix of ``model`` one owner rank and install DMuon's hooks.

    Call it on every rank, on the bare model, **before** wrapping: then
    ``DistributedDataParallel(model)`` skips the dedicated params (they are added to DDP's
    params-to-ignore list here) and ``fully_shard(module, mesh=..., ignored_params=set(dm))``
    leaves them to DMuon. As DDP does for its params, every rank's dedicated params then take
    the mesh's first rank's values (one broadcast of them per mesh dim, after the setup
    agreement: ``dmuon/start.py``; not for meta-device params or on TP / EP meshes).

    Args:
        model: the bare ``nn.Module`` (not yet DDP / FSDP2 wrapped), identical on all ranks.
        mesh: the whole ``DeviceMesh`` of the job (every rank): a 1-D one (DDP, FSDP2), or any
            mesh whose data-parallel dims ``replicate_dim`` / ``shard_dims`` declare; the other
            dims are model parallel. Each dedicated param's kind comes from its own DTensor
            placements on dims of this mesh (docs/user-guide.md, "Meshes"): a plain tensor
            (dense), ``Shard(0)`` / ``Shard(1)`` of a matrix on a model-parallel dim (tensor
            parallel, ``parallelize_module``), ``Shard(0)`` of a 3-D stack (experts on an
            expert-parallel dim, ``examples/ep_moe.py``). Under pipeline parallelism: the
            stage's slice of a mesh over every rank (``mesh["dp_shard"]`` of
            ``init_device_mesh(device, (P, N), mesh_dim_names=("pp", "dp_shard"))``, or
            ``mesh["dp_replicate", "dp_shard"]`` with ``replicate_dim=``): every setup check,
            agreement, start broadcast and group of DMuon then stays inside the stage's ranks,
            and the other stages are never waited for (docs/user-guide.md, "Pipeline
            parallelism").
        params: optional explicit dedicated params (Parameters or names) of at least 2 dims;
            default: ``predicate``.
        predicate: ``f(name, param, module) -> bool``; default :func:`default_predicate`
            (every trainable hidden matrix: Linear weights, 3-D expert stacks, routers, conv
            weights; not embeddings, output heads or what is tied to them:
            docs/selection.md). A param of 3+ dims is a stack of ``shape[-2:]`` matrices, a
            conv weight one ``(out, in·k…)`` matrix (:func:`dmuon.ownership.select.matrix_shape`).
        reshard_after_forward: ``True`` = Z3 (non-holders free after forward and receive
            again before backward), ``False`` = Z2 (keep until the next step).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (the object and keyword
            ``fully_shard`` takes): forward runs on ``param_dtype`` copies, broadcasts send
            them, reduces run in ``reduce_dtype``; owners keep fp32 master weights and
            momentum (docs/user-guide.md, "Mixed precision"). ``None``: everything in the
            params' dtype.
        bucket_cap_mb: cap of one bucket in MiB (default 25, DDP's): a block's dedicated
            params with the same owner and dtype share one collective per phase, cut into
            runs of at most this many bytes (``dmuon/ownership/buckets.py``: the rule and "block").
        prefetch_depth: how many buckets ahead of the one a module needs the forward
            broadcasts (and Z3's backward re-broadcasts, in backward order) are issued,
            asynchronously; ``0`` issues each when it is needed. Changes when calls are
            issued, never which (docs/performance.md, "Overlap").
        coalesce: how many blocks share collectives (``dmuon/ownership/buckets.py``, "unit";
            docs/traffic-model.md, "Coalescing"): ``"auto"`` (default) joins consecutive
            blocks while a unit holds at most the backend's α/β bytes (2 MB on CPU / gloo,
            3.6 MB on NCCL: ``buckets.LINK_COSTS``, by the default process group's backend,
            ``collectives.link_backend``; never by the params' device), where a
            call costs as much in fixed latency as in bytes; ``"block"`` one unit per block
            and one call per bucket (most overlap, most calls); ``"all"`` one unit for the
            whole model (fewest calls; under Z3 a non-holder then holds every dedicated param
            during forward); or a byte count. A unit whose buckets are one per rank of equal
            size moves in one all_gather / reduce_scatter instead of one broadcast / reduce
            per bucket. Changes which calls carry the bytes, never the bytes per rank.
        rest: who handles the params DMuon does not dedicate (norms, biases, embeddings,
            heads). ``"wrapper"`` (default): DDP or FSDP2, wrapped after this call.
            ``"replicate"``: DMuon keeps them replicated like DDP (rank 0's values broadcast
            at the first forward, grads averaged by one all_reduce per dtype at the end of
            each backward; ``dmuon/runtime/rest.py``) and the model is not wrapped at all:
            one call per step instead of FSDP2's two, for a rest whose calls are
            latency-bound; its memory is not sharded (docs/user-guide.md, "Who handles the
            rest"). Not on TP meshes.
        hierarchy: how an HSDP mesh moves the dedicated params (docs/traffic-model.md, "HSDP:
            flat or hierarchical"). ``"hierarchical"``: over the shard axis, then the
            replicate axis (the replicate reduce and broadcast: two calls more per step, and
            (R-1)/(N·R)·P_M per term on the replicate axis's links). ``"flat"``: as on a 1-D
            mesh of all W ranks (one call per direction; the replicate axis then carries
            (R-1)/R·P_M, N times more: wrong between hosts). ``"auto"`` (default): flat on a
            backend where it measured faster (gloo, ``buckets.LINK_COSTS``) when the dedicated
            params are one unit (same W-average bytes), else hierarchical. No effect on a
            1-D mesh; a TP mesh stays hierarchical. :meth:`DedicatedParams.coalescing` says
            which was chosen. The wrapper's handling of the rest is unaffected.
        link: whose link policy DMuon follows (``buckets.LINK_COSTS``: the ``"auto"``
            coalescing target, whether reduces run as gathers and aligned reduce_scatters as
            all_to_alls, whether ``hierarchy="auto"`` may go flat). ``"auto"`` (default): the
            backend DMuon's groups run on (``collectives.link_backend``). ``"nccl"`` or
            ``"gloo"``: that backend's policy on any backend, e.g. ``"nccl"`` on a CPU/gloo
            job runs NCCL's calls (real reduces and reduce_scatters, equal aligned groups
            only) to check them without a GPU (docs/user-guide.md, "Link policy"). Changes
            which calls carry the bytes, never the results.

        replicate_dim, shard_dims: the mesh's data-parallel dims, in FSDP2's terms: at most one
            replicate dim (HSDP's outer dim) and one or more shard dims (a name or a tuple:
            a dim whose ranks see different data: data, context or expert parallel, e.g.
            ``replicate_dim="dp_replicate", shard_dims=("dp_shard", "cp")``; a flattened
            ``"dp_shard_cp"`` is one). The owners of a dense matrix span the shard dims' product
            (N); its grads are averaged over every data-parallel rank. ``None`` (default): read
            from the names: a 1-D mesh is one shard dim, ``("replicate", "shard")`` HSDP,
            ``("shard", "tp")`` / ``("replicate", "shard", "tp")`` tensor parallel,
            ``("shard", "ep")`` / ``("replicate", "shard", "ep")`` expert parallel (``"ep"`` a
            shard dim whose ranks hold different experts); any other names must be declared.

    Returns:
        The :class:`DedicatedParams` handle. Release it with ``dm.close()`` on every rank, or
        use it as a context manager (``with dmuon.dedicate_params(model, mesh) as dm:``):
        hooks, class swaps, DDP's ignore entries and DMuon's process groups (2 on a 1-D mesh
        or flat HSDP, 4 under hierarchical HSDP; ``collectives.py``) go; until then they stay,
        one set per call.
        Dropping the handle without ``close()`` frees the model but not the groups.

    Raises:
        ValueError: ``model`` is already DDP- or FSDP2-wrapped (a DTensor param not on a
            sub-mesh of ``mesh``, or split on its data-parallel dims other than as a 3-D stack's
            ``Shard(0)``), a dedicated DTensor is neither a matrix ``Shard(0)`` / ``Shard(1)`` on
            one model-parallel dim nor a stack ``Shard(0)``, or its sharded dim is not a multiple
            of the dims' size (``MeshLayout.check_model``), ``replicate_dim`` / ``shard_dims``
            do not name distinct dims of ``mesh`` or the mesh's names need them, ``dedicate_params`` was already
            called on it, a dedicated param has fewer than 2 dims, is frozen or not in the model,
            ``reshard_after_forward`` is not a bool, ``bucket_cap_mb`` is not a positive
            number, ``mp_policy`` is not ``None`` nor a mixed-precision policy (no
            ``param_dtype``, e.g. a bare ``torch.bfloat16``, or a dtype field that is not a
            floating ``torch.dtype``), ``prefetch_depth`` is not an int >= 0, ``coalesce``
            is not one of ``"auto"``, ``"block"``, ``"all"`` or an int >= 0, ``rest`` is not
            ``"wrapper"`` or ``"replicate"`` (or ``"replicate"`` on a TP mesh, or with an
            ``mp_policy`` whose ``param_dtype`` would meet a rest param of another dtype in a
            module holding a dedicated param: a Linear's bias), ``hierarchy`` is not one of
            ``"auto"``, ``"hierarchical"``, ``"flat"`` (or ``"flat"`` on a TP mesh), ``link``
            is not one of ``"auto"``, ``"nccl"``, ``"gloo"``, or the mesh is invalid (see
            ``topology_from_mesh``; a pipeline stage's slice holding the pipeline dim), or, on a
            pipeline stage's slice, nothing of the stage module is dedicated. The knobs are checked first, once, into one
            :class:`~dmuon.options.DedicateOptions` (``dm.options.given``). All checked
            locally, before any DMuon group exists; with ``torch.distributed`` initialised
            the raising rank still takes part in the setup agreement's one all_gather, so the
            other ranks raise too (below).
        RuntimeError: another rank raised one of the errors above (the message names those
            ranks), or the ranks computed different setups (plan, ``reshard_after_forward``,
            mixed-precision policy, bucket cap, coalescing, hierarchy, rest, devices:
            :func:`setup_digest`), checked with one all_gather of the digest before any other
            DMuon collective.

    Warns:
        UserWarning: nothing was selected (every param goes to AdamW); or, once, naming
            them, trainable params of at least 2 dims that go to AdamW other than embedding
            tables, output heads and params tied to an embedding
            (:meth:`DedicatedParams.assignments` lists every param and why).
    """
    from torch.nn.parallel import DistributedDataParallel

    try:  # local checks and the plan: a ValueError on some ranks must not strand the others
        # every knob validated once, here (dmuon/options.py); the runtime reads this object
        options = DedicateOptions(
            reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
            bucket_cap_mb=bucket_cap_mb, prefetch_depth=prefetch_depth, coalesce=coalesce,
            rest=rest, hierarchy=hierarchy, link=link)
        if isinstance(model, DistributedDataParallel):
            raise already_wrapped(model)
        kind = layout_for(mesh, replicate_dim, shard_dims)  # dmuon/placement/layout.py
        kind.check_model(model, mesh, set())  # a wrapped model, before anything reads it
        already = attach.dedicated_names(model)
        if already:
            raise ValueError(
                f"Invalid model: dmuon.dedicate_params was already called on it ({len(already)} "
                f"params already dedicated, e.g. {already[:3]}). Call it once per model, on every "
                "rank, and keep the returned handle (pass it to DMuon and to fully_shard's "
                "ignored_params); to start over, call close() on that handle (every rank) or "
                "build a fresh model."
            )
        kind.check_options(mesh, hierarchy=options.hierarchy, rest=options.rest)
        topology = kind.topology(mesh)
        assignments = assign_params(model, params, predicate)
        named = select_params(model, params, predicate, assignments)
        if not named and kind.stage is not None:
            raise ValueError(
                f"Invalid stage module {type(model).__name__}: no dedicated matrix (params= / "
                f"predicate= selected none of its {len(list(model.parameters()))} params) on the "
                f"pipeline stage's mesh of ranks {list(kind.stage)}. Every pipeline stage must "
                "dedicate at least one matrix (give each stage at least one block, as torchtitan "
                "does); or leave this stage's module out of DMuon (a plain torch optimizer on it).")
        if not named:
            warnings.warn(
                f"dmuon.dedicate_params found no Muon target in {type(model).__name__}: nothing is "
                "dedicated and DMuon will step every param with AdamW. The default predicate takes "
                "every trainable hidden matrix (Linear and conv weights, expert stacks, routers; "
                "not embeddings or output heads); pass params= or predicate= to choose others.",
                stacklevel=2,
            )
        _warn_adamw_matrices(assignments)
        matrices = {a.name: a.matrix for a in assignments if a.matrix is not None}
        specs = specs_from_named_parameters(((n, p) for n, p, _ in named), matrices)
        kind.check_model(model, mesh, {n for n, _, _ in named})
        layout = kind.build(mesh, named, specs, topology)  # the plan and every param's placement
        dedicated = {n for n, _, _ in named}
        rest_params = replicated_rest.rest_of(model, dedicated)  # agreed on in every mode
        if options.rest == "replicate" and rest_params and options.param_dtype is not None:
            replicated_rest.check_dtypes(model, dedicated, options.param_dtype)
        # the link policy comes from the backend DMuon's groups run on, never from where the
        # params happen to be (a meta-built model gets its backend's policy: link_backend)
        backend = None if options.link != "auto" else collectives.link_backend(
            collectives.default_backend(), {p.device.type for _, p, _ in named})
        resolved = options.resolve(backend=backend, joins_blocks=layout.joins_blocks,
                                   hsdp=topology.replicate_size > 1, allows_flat=layout.allows_flat,
                                   specs=specs, plan=layout.plan,
                                   rest_names=[n for n, _ in rest_params])
        digest = setup_digest(layout.agreed_plan, named, options.reshard_after_forward,
                              options.mp_policy, options.bucket_cap_bytes, resolved.coalescing,
                              rest_params, resolved.flat, rest_mode=options.rest)
    except Exception:  # a bad argument, or a user predicate that raised
        if dist.is_initialized():  # every rank still takes part in the agreement, then raises
            collectives.check_plan_agreement(None, SETUP_WHAT, mesh)
        raise
    collectives.check_plan_agreement(digest, SETUP_WHAT, mesh)
    start.from_first_rank([p for _, p, _ in named], mesh, layout.size)  # DDP's start (start.py)
    return DedicatedParams(model, named, topology, layout, resolved, mesh=mesh,
                           assignments=assignments)


#: What the setup agreement's digest covers, for its error message.
SETUP_WHAT = ("setup (ownership plan and hierarchy, reshard_after_forward, mp_policy, bucket_cap_mb, "
              "coalesce, rest or device type)")

#: At most this many params are named in the AdamW-matrices warning (the rest are counted).
WARN_NAMES = 8


def _warn_adamw_matrices(assignments) -> None:
    """Warn once, naming them, about the matrices that go to AdamW (``adamw_matrices``)."""
    missed = adamw_matrices(assignments)
    if not missed:
        return
    shown = "; ".join(f"{a.name} {a.shape}: {a.reason}" for a in missed[:WARN_NAMES])
    more = f"; and {len(missed) - WARN_NAMES} more" if len(missed) > WARN_NAMES else ""
    elems = sum(a.numel for a in missed)
    # a shared param's reason says how to dedicate it (a whole block); the others take params=
    fixable = sum(a.role != "shared" for a in missed)
    fix = ("" if not fixable else "Pass params= or predicate= to dedicate "
           + ("them; " if fixable == len(missed) else f"the {fixable} not shared; "))
    warnings.warn(
        f"dmuon.dedicate_params: {len(missed)} trainable params of at least 2 dims "
        f"({elems:,} elements) go to AdamW, not Muon: {shown}{more}. {fix}"
        "dm.assignments() lists every param and why.",
        stacklevel=3,
    )


def _policy_fields(mp_policy) -> dict | None:
    """A mixed-precision policy as plain data (read defensively: FSDP2's
    ``MixedPrecisionPolicy`` or any object with its attribute names)."""
    if mp_policy is None:
        return None
    fields = {}
    for key in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"):
        value = getattr(mp_policy, key, None)
        fields[key] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    fields["type"] = type(mp_policy).__name__
    return fields


def setup_digest(
    plan: OwnershipPlan,
    named: list[tuple[str, nn.Parameter, str]],
    reshard_after_forward: bool,
    mp_policy=None,
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_MB * 1024 * 1024,
    coalescing: Coalescing = Coalescing(0),
    rest_params: list[tuple[str, torch.Tensor]] = (),
    flat: bool = False,
    rest_mode: str = "wrapper",
) -> str:
    """sha256 (64 hex chars) of everything the ranks' collective schedules depend on.

    Covers the ownership plan (names, shapes, dtypes, mesh shape: :meth:`OwnershipPlan.digest`),
    ``reshard_after_forward`` (Z2 on one rank and Z3 on another would pair a backward
    re-broadcast with a reduce and hang), the mixed-precision policy (its dtypes set the
    message sizes), the bucket cap and the coalescing (:class:`~dmuon.ownership.buckets.Coalescing`:
    with the cap they set the buckets), each
    dedicated param's device type, ``rest_mode`` and the rest's names, shapes, dtypes and
    ``requires_grad`` in every mode (under ``rest="replicate"`` they set its all_reduce's size;
    under a wrapper a rest param of another shape on one rank broke FSDP2's first collective:
    gloo's ``EnforceNotMet``, a dead rank), and whether an HSDP mesh moves the dedicated params
    ``flat`` (its channels).

    Raises:
        ValueError: ``reshard_after_forward`` is not a bool.
    """
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"Invalid reshard_after_forward={reshard_after_forward!r}. Must be True (Z3: "
            "non-holders free after forward) or False (Z2: keep until the next step)."
        )
    setup = {
        "plan": plan.digest(),
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": _policy_fields(mp_policy),
        "bucket_cap_bytes": bucket_cap_bytes,
        "coalesce_bytes": [coalescing.target_bytes, coalescing.reduce_by_gather],
        "devices": sorted({p.device.type for _, p, _ in named}),
        "rest": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in rest_params],
        "rest_mode": rest_mode,
        "flat": flat,
    }
    text = json.dumps(setup, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
