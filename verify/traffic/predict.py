"""The exact collective list of one training step, per rank and phase, from shapes alone.

Inputs are a :class:`RunLayout` (the model's parameter shapes, the Muon targets, the mesh,
how the non-Muon params are wrapped); the output is every call each rank must issue in one
step (op, group, per-rank count, dtype, root, phase) plus how many of its elements belong
to Muon-target params (``dedicated_count``, used to attribute fused buckets).

What is modelled (torch 2.13, measured on gloo by the harness):

- DMuon, derived here from the documented protocol (``docs/protocol.md``: its terms and
  steps 1-7; why: docs/spec.md §1) and the planner's output alone, never from the runtime's
  code: a *bucket* is the dedicated params of one unit (a run of consecutive blocks, each a
  ``ModuleList`` element) with the same global owner and dtype, cut at
  ``bucket_cap_mb`` and ordered unit by unit in the recorded execution order
  (:func:`dmuon_buckets`, :func:`dmuon_block_sequence`); per bucket a
  forward broadcast over the shard axis from its holder; Z3 re-broadcast in backward, except
  for the last unit in that order, which Z3 keeps allocated from its forward into the backward
  (:func:`kept_unit`); reduce to the holder over the shard axis, then (HSDP) to the owner over
  the replicate axis; (HSDP) the owner's replicate broadcast after the step; under Z3, a block
  whose forward runs more than once per forward (weight sharing, ``RunLayout.module_calls``)
  is broadcast again for every further run unless its unit is the kept one
  (``docs/protocol.md`` steps 2-3, :func:`dmuon_broadcasts`). Independence: this module imports
  ``dmuon.ownership.plan`` (ParamSpec, OwnershipPlan, plan_ownership) and nothing else of ``dmuon``, so a
  bucketing bug in the runtime is not reproduced here (``tests/verify/test_predict.py`` checks it).
- FSDP2 and DDP: the rules in :mod:`verify.traffic.rules` (shared with the aggregate
  predictor :mod:`verify.traffic.scale`), attributed here to each rank's groups.
- DMuon's replicated rest (``RunLayout.dmuon_rest == "replicate"``): no DDP or FSDP2 call at
  all; one world all_reduce per dtype of the trainable rest in backward
  (:func:`verify.traffic.rules.rest_calls`). Its one-time first-forward broadcast (phase
  ``setup``) is not part of a step, like DMuon's block-order agreement and DDP's bucket
  rebuild: the harness measures after warm-up steps.
- DMuon on an HSDP mesh, flat or hierarchical (``dedicate_params(hierarchy=...)``,
  ``RunLayout.dmuon_hierarchy``; docs/traffic-model.md, "HSDP: flat or hierarchical"):
  hierarchical is the protocol above; flat moves the dedicated params as on a 1-D mesh of
  all W ranks (owner g = world rank g, no replicate channel or phase), so its calls are the
  hierarchical rule's on the (1, W) view of the layout (:func:`dmuon_layout`); which one a
  run uses is :func:`dmuon_hierarchy`, from the harness's own backend table
  (:func:`dmuon_flattens`) and unit derivation (:func:`layout_buckets`). FSDP2's calls for
  the rest stay on the (R, N) mesh either way.
- Naive baselines: one all_gather per Muon param in the optimizer step (``full_tensor()``
  of the Shard(0) gradient; per-rank count ceil(d0/N)·(d1·…), an expert stack or a conv
  weight included).
- Muon params of any shape: a param is ``ParamSpec.matrices`` matrices of
  ``ParamSpec.matrix_shape`` (a 3-D expert stack E, a conv weight one); the collectives move
  whole params, so only the Newton–Schulz count (:func:`ns_calls_per_step`) sees matrices.

Mixed precision (``RunLayout.mp_param_dtype`` / ``mp_reduce_dtype``, the semantics of FSDP2's
``MixedPrecisionPolicy``; ``reduce_dtype`` defaults to ``param_dtype`` when only that is set):
DMuon's forward / backward broadcasts travel in param_dtype, its reduces (both mesh axes) in
reduce_dtype, the HSDP replicate broadcast of the updated params in their own (fp32 master)
dtype; FSDP2's all_gathers in param_dtype, its reduce_scatters and the HSDP replicate
all_reduce in reduce_dtype. DDP's all_reduce and the naive step all_gather (of the sharded
grad, which FSDP2 casts back to the param's dtype) keep the params' dtype. Element counts never
change; only the dtype (and so the bytes) of a call does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple


from dmuon.ownership.plan import OwnershipPlan, ParamSpec, plan_ownership
from tracer.events import DTYPE_BYTES, all_to_all_count, all_to_all_elems, group_id_from_ranks

from verify.traffic.formulas import MODES, ClosedForm, avg_elems, closed_form, closed_form_p_m
from verify.traffic.rules import (
    AxisCall,
    ddp_buckets,
    ddp_calls,
    fsdp_calls,
    fsdp_groups,
    padded_shard_numel,
    rest_calls,
)


#: ``dedicate_params``' ``rest`` values (``RunLayout.dmuon_rest``).
DMUON_REST_MODES = ("wrapper", "replicate")

#: ``dedicate_params``' ``hierarchy`` values (``RunLayout.dmuon_hierarchy``).
DMUON_HIERARCHIES = ("auto", "hierarchical", "flat")

#: "No limit" for the byte targets below (``coalesce="all"``, NCCL's aligned groups).
NO_LIMIT = 2**63 - 1


class ClosedFormCheck(NamedTuple):
    """What a run's measured W-averages are gated against (:meth:`RunLayout.closed_form_check`):
    ``form`` evaluated at ``p_m`` (elements: P_M, or P_M^pad for the padded baselines), its reuse
    term at ``p_m_reused`` (P_M^r) and its kept-unit term at ``p_m_kept`` (P_M^L)."""

    form: ClosedForm
    p_m: int
    p_m_reused: int
    p_m_kept: int


@dataclass(frozen=True)
class RunLayout:
    """Everything the predictor needs about one run (no tensors, no process groups).

    Attributes:
        mode: one of :data:`verify.traffic.formulas.MODES`.
        replicate_size: R (1 for 1-D meshes).
        shard_size: N.
        params: every parameter of the model in ``named_parameters()`` order.
        muon_names: the Muon targets (dedicated in DMuon modes).
        fsdp_modules: modules wrapped with ``fully_shard`` in wrap order ("" = root, last).
        reshard_after_forward: FSDP2's and DMuon's Z3 flag.
        ddp_bucket_cap_bytes: DDP's ``bucket_cap_mb`` in bytes.
        ddp_first_bucket_cap_bytes: DDP's first-bucket cap in bytes; ``None`` when
            ``bucket_cap_mb`` was given explicitly (torch 2.13 then uses the same cap),
            1 MiB for DDP's defaults (:func:`ddp_buckets`).
        dmuon_bucket_cap_bytes: DMuon's ``bucket_cap_mb`` in bytes (``dmuon_buckets``).
        dmuon_coalesce_bytes: DMuon's unit target in bytes (``dedicate_params``' ``coalesce``,
            :func:`dmuon_coalesce_bytes`); 0: one unit per block.
        dmuon_reduce_by_gather: DMuon's reduces run as gathers and its aligned
            reduce_scatters as all_to_alls (:func:`dmuon_reduce_by_gather`: gloo).
        dmuon_uneven_aligned: a unit's dtype group with one bucket per owner is aligned even
            when the buckets' sizes differ, each channel then moving as an all_gather where
            every member's part is equal and as an all_to_all where not
            (:func:`dmuon_uneven_aligned`: gloo; needs ``dmuon_reduce_by_gather``).
        root_auto_reshard: the root was wrapped without ``reshard_after_forward`` (FSDP2 then
            keeps it unsharded after forward).
        mp_param_dtype: mixed precision's param dtype (torch name, e.g. ``"bfloat16"``) or
            ``None`` (no mixed precision): the dtype of DMuon's broadcasts and FSDP2's
            all_gathers (module docstring).
        mp_reduce_dtype: the dtype of gradient reductions; ``None`` means ``mp_param_dtype``
            (FSDP2's default), or the params' own dtype when that is ``None`` too.
        dmuon_block_order: DMuon's blocks in the order their forward first ran in the first
            step, as the harness recorded it with its own hooks (``verify.measure.block_order``);
            ``()`` = model order (also when the ranks' orders disagree). DMuon numbers its
            buckets by it (:func:`dmuon_block_sequence`); the calls of a step, a multiset,
            depend on it only through the unit Z3 keeps, the last one (:func:`kept_unit`).
        module_calls: ``(module, calls)`` of the DMuon blocks and ``fully_shard`` modules
            whose forward ran more than once in one forward (weight sharing), as the
            harness counted them with its own hooks (``verify.measure.block_order``); every other
            module ran once. Z3 broadcasts a reused block again per run; FSDP2 all_gathers a
            reused module again (:mod:`verify.traffic.rules`).
        ddp_buffers: ``(dtype, numel)`` of the buffers DDP broadcasts from rank 0 before
            every forward (``broadcast_buffers=True``), in ``named_buffers()`` order; ``()``
            when the module has none or the mode has no DDP.
        frozen_names: params with ``requires_grad=False``: DDP leaves them out of its
            buckets; FSDP2 still all_gathers them but reduces only params with a grad
            (:mod:`verify.traffic.rules`). Never dedicated.
        dmuon_rest: DMuon's ``dedicate_params(rest=...)``: ``"wrapper"`` (DDP or FSDP2 handles
            the non-dedicated params: ``fsdp_modules``, or DDP in ``dmuon-ddp``) or
            ``"replicate"`` (DMuon all-reduces them itself and nothing wraps the model:
            ``fsdp_modules`` and ``ddp_buffers`` must be empty; DMuon modes only).
        dmuon_hierarchy: DMuon's ``dedicate_params(hierarchy=...)`` as requested, one of
            :data:`DMUON_HIERARCHIES`; what it resolves to is :func:`dmuon_hierarchy`.
        dmuon_auto_flat: the harness's backend table entry for ``hierarchy="auto"``
            (:func:`dmuon_flattens`: gloo); ``False`` in layouts written before the knob,
            which all ran hierarchical.
        qk_clip_heads: query heads whose per-step max logit MuonClip's QK-clip packs into its
            one MAX all_reduce (Σ n_heads over the attention layers, counted by the harness
            from the model's own config); 0: no QK-clip. DMuon modes only.
        grad_clips: calls of DMuon's ``opt.clip_grad_norm_`` per step (counted by the harness
            where the user's script calls it: ``verify.run.record.TrafficWindow``); each is one
            all_reduce over all W ranks of one fp32 element, phase ``optimizer``, no Muon
            payload (:func:`grad_clip_calls`; docs/traffic-model.md, "Clipping"). DMuon modes only.
        label: the run's name where it is a variant of ``mode`` (``"dmuon-z3[block]"``,
            :mod:`verify.modes.variants`), ``""`` for the mode itself; reports name the run
            by it. The knobs the variant overrides are in the fields above.

    A layout *kind* (this class: ``"dense"``, a data-parallel mesh; ``verify.traffic.tp.TPRunLayout``:
    ``"tp"``) answers the harness's questions itself: :meth:`predict_calls`,
    :meth:`window_calls`, :meth:`ns_calls_per_step`, :meth:`closed_form_check`, :meth:`dmuon_view`,
    :meth:`ns_plan`,
    :meth:`report_fields`, :attr:`flat_allowed`, :meth:`to_dict` / :meth:`from_dict`
    (``verify.traffic.layouts.layout_from_dict`` picks the class by :attr:`kind`); a new kind
    is one more subclass (docs/verify.md, "Layout kinds").
    """

    #: The kind's name, written as ``layout.json``'s ``"kind"`` (``verify.traffic.layouts``).
    kind: ClassVar[str] = "dense"
    #: Whether DMuon may move this kind's dedicated params flat on an HSDP mesh
    #: (:func:`dmuon_hierarchy`; docs/traffic-model.md, "HSDP: flat or hierarchical").
    flat_allowed: ClassVar[bool] = True

    mode: str
    replicate_size: int
    shard_size: int
    params: tuple[ParamSpec, ...]
    muon_names: tuple[str, ...]
    fsdp_modules: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    ddp_bucket_cap_bytes: int = 25 * 1024 * 1024
    ddp_first_bucket_cap_bytes: int | None = None
    dmuon_bucket_cap_bytes: int = 25 * 1024 * 1024
    dmuon_coalesce_bytes: int = 0
    dmuon_reduce_by_gather: bool = False
    dmuon_uneven_aligned: bool = False
    root_auto_reshard: bool = True
    mp_param_dtype: str | None = None
    mp_reduce_dtype: str | None = None
    dmuon_block_order: tuple[str, ...] = ()
    module_calls: tuple[tuple[str, int], ...] = ()
    ddp_buffers: tuple[tuple[str, int], ...] = ()
    frozen_names: tuple[str, ...] = ()
    dmuon_rest: str = "wrapper"
    dmuon_hierarchy: str = "auto"
    dmuon_auto_flat: bool = False
    qk_clip_heads: int = 0
    grad_clips: int = 0
    label: str = ""

    def calls_of(self, module: str) -> int:
        """How many times ``module``'s forward runs per forward (:attr:`module_calls`; 1)."""
        for name, calls in self.module_calls:
            if name == module:
                return calls
        return 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Invalid mode={self.mode!r}. Must be one of {MODES}.")
        if self.label and not self.label.startswith(self.mode + "["):
            raise ValueError(f"Invalid label={self.label!r} for mode={self.mode!r}. Must be "
                             f"'' or a variant '{self.mode}[...]' (verify.modes.variants).")
        for name in ("mp_param_dtype", "mp_reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_BYTES:
                raise ValueError(
                    f"Invalid {name}={value!r}. Must be None or a torch dtype name among "
                    f"{sorted(DTYPE_BYTES)} (str(torch.bfloat16) without 'torch.')."
                )
        if self.dmuon_uneven_aligned and not self.dmuon_reduce_by_gather:
            raise ValueError("Invalid layout: dmuon_uneven_aligned=True with "
                             "dmuon_reduce_by_gather=False. Must reduce by gather: an uneven "
                             "group's reduce is an all_to_all (no uneven reduce_scatter).")
        if self.dmuon_hierarchy not in DMUON_HIERARCHIES:
            raise ValueError(f"Invalid dmuon_hierarchy={self.dmuon_hierarchy!r}. Must be one of "
                             f"{DMUON_HIERARCHIES}.")
        if isinstance(self.qk_clip_heads, bool) or not isinstance(self.qk_clip_heads, int) or (
                self.qk_clip_heads < 0) or (self.qk_clip_heads and not self.is_dmuon):
            raise ValueError(f"Invalid qk_clip_heads={self.qk_clip_heads!r} with mode={self.mode!r}. "
                             "Must be an int >= 0, and 0 outside the DMuon modes (QK-clip is "
                             "DMuon's step post-hook).")
        if isinstance(self.grad_clips, bool) or not isinstance(self.grad_clips, int) or (
                self.grad_clips < 0) or (self.grad_clips and not self.is_dmuon):
            raise ValueError(f"Invalid grad_clips={self.grad_clips!r} with mode={self.mode!r}. "
                             "Must be an int >= 0, and 0 outside the DMuon modes (it counts "
                             "DMuon's own clip_grad_norm_).")
        if self.dmuon_rest not in DMUON_REST_MODES:
            raise ValueError(f"Invalid dmuon_rest={self.dmuon_rest!r}. Must be one of {DMUON_REST_MODES}.")
        if self.dmuon_rest == "replicate" and (not self.is_dmuon or self.fsdp_modules or self.ddp_buffers):
            raise ValueError(
                f"Invalid layout: dmuon_rest='replicate' with mode={self.mode!r}, "
                f"fsdp_modules={self.fsdp_modules!r}, ddp_buffers={self.ddp_buffers!r}. Must be a "
                "DMuon mode with nothing wrapped (DMuon replicates the rest itself)."
            )

    def cast_dtype(self, own: str) -> str:
        """Dtype of a param's forward / backward gather or broadcast (mixed precision)."""
        return self.mp_param_dtype or own

    def reduce_dtype(self, own: str) -> str:
        """Dtype of a param's gradient reduction (mixed precision, FSDP2's default rule)."""
        return self.mp_reduce_dtype or self.mp_param_dtype or own

    @property
    def world_size(self) -> int:
        return self.replicate_size * self.shard_size

    @property
    def run_name(self) -> str:
        """The run's name in reports: :attr:`label` for a variant, else :attr:`mode`."""
        return self.label or self.mode

    @property
    def is_dmuon(self) -> bool:
        return self.mode.startswith("dmuon-")

    def to_dict(self) -> dict:
        """JSON-able form (written as ``<run>/<mode>/layout.json``)."""
        d = dataclasses.asdict(self)
        d["params"] = [dataclasses.asdict(p) for p in self.params]
        d["kind"] = self.kind
        return d

    @classmethod
    def check_kind(cls, d: dict) -> None:
        """Raise unless ``d`` (a :meth:`to_dict`) is of this class's :attr:`kind`; a ``d``
        without ``"kind"`` (written before it) counts as this class's.

        Raises:
            ValueError: ``d["kind"]`` is another kind's.
        """
        if d.get("kind", cls.kind) != cls.kind:
            raise ValueError(
                f"Invalid layout for {cls.__name__}.from_dict: kind={d['kind']!r}, this class reads "
                f"kind={cls.kind!r}. Must be loaded by verify.traffic.layouts.layout_from_dict, "
                "which picks the class of its kind."
            )

    @classmethod
    def from_dict(cls, d: dict) -> RunLayout:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a key is missing or the mode is unknown, the layout has a
                finite ``dmuon_aligned_max_bytes`` (an older DMuon's limit), or its ``"kind"``
                is another class's (``layout.json`` files written before ``"kind"`` are
                ``"dense"``).
        """
        cls.check_kind(d)
        if d.get("dmuon_aligned_max_bytes", NO_LIMIT) != NO_LIMIT:
            raise ValueError(
                f"Invalid layout: dmuon_aligned_max_bytes={d['dmuon_aligned_max_bytes']}, a limit on "
                "an aligned group's buckets that DMuon and this predictor no longer have (gloo's "
                "64 KiB, removed when its groups became all_to_alls). Must come from a current "
                "run: run make verify-traffic again."
            )
        try:
            params = tuple(
                ParamSpec(name=p["name"], shape=tuple(p["shape"]), dtype=p["dtype"], module=p["module"],
                          matrix=tuple(p["matrix"]) if p.get("matrix") else None)
                for p in d["params"]
            )
            fields = {f.name for f in dataclasses.fields(cls)} - {"params"}
            kwargs = {k: d[k] for k in fields if k in d}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"Invalid layout: missing or malformed {exc}. Must come from RunLayout.to_dict.") from exc
        kwargs["muon_names"] = tuple(kwargs.get("muon_names", ()))
        kwargs["fsdp_modules"] = tuple(kwargs.get("fsdp_modules", ()))
        kwargs["dmuon_block_order"] = tuple(kwargs.get("dmuon_block_order", ()))
        kwargs["module_calls"] = tuple((m, int(c)) for m, c in kwargs.get("module_calls", ()))
        kwargs["ddp_buffers"] = tuple((d, int(n)) for d, n in kwargs.get("ddp_buffers", ()))
        kwargs["frozen_names"] = tuple(kwargs.get("frozen_names", ()))
        return cls(params=params, **kwargs)

    def muon_specs(self) -> list[ParamSpec]:
        names = set(self.muon_names)
        return [p for p in self.params if p.name in names]

    def plan(self) -> OwnershipPlan:
        """The ownership plan DMuon computes for this layout (the same pure function)."""
        return plan_ownership(self.muon_specs(), (self.replicate_size, self.shard_size))

    def p_m(self) -> int:
        """P_M: elements of the Muon-target params."""
        return sum(p.numel for p in self.muon_specs())

    # -------------------------------------------- the kind's answers (class docstring)
    def predict_calls(self) -> list[Expected]:
        """Every call of one step on every rank: :func:`predict_step`."""
        return predict_step(self)

    def window_calls(self, steps: int) -> list[Expected]:
        """Calls of the whole measured window of ``steps`` steps that differ from step to step
        (each listed once per run; the comparison adds them to :meth:`predict_calls` times
        ``steps``): none for this kind (``verify.traffic.ep.EPRunLayout``: the token all_to_all)."""
        return []

    def ns_calls_per_step(self) -> int:
        """Newton–Schulz calls per step over all ranks: :func:`ns_calls_per_step`."""
        return ns_calls_per_step(self)

    def closed_form_check(self) -> ClosedFormCheck:
        """The closed form the run is gated against and where to evaluate it:
        :func:`run_closed_form` at :func:`verify.traffic.formulas.closed_form_p_m` (P_M, or
        P_M^pad for the padded baselines), :func:`reused_elems`, :func:`kept_elems`."""
        specs = self.muon_specs()
        numels = owner_numels(specs, self.plan()) if self.mode == "zero1-muon" else None
        p_m = closed_form_p_m(self.mode, [s.shape for s in specs], self.shard_size, numels)
        return ClosedFormCheck(run_closed_form(self), p_m, reused_elems(self), kept_elems(self))

    def all_closed_forms(self) -> dict[str, float]:
        """Phase -> closed form of every element moved in that phase (not only the dedicated
        ones), W-average per step, for the phases this kind prices that way (gated with the
        dedicated form): none for this kind (``verify.traffic.pp.PPRunLayout``: the P2P)."""
        return {}

    def dmuon_view(self) -> RunLayout | None:
        """The one data-parallel layout DMuon's dedicated calls are predicted on, whose buckets
        (:func:`layout_buckets`) name its units and owners (:func:`dmuon_layout`: this layout,
        or its flat (1, W) view); ``None`` outside the DMuon modes."""
        return dmuon_layout(self) if self.is_dmuon else None

    def ns_plan(self) -> OwnershipPlan | None:
        """The plan whose owners run each Muon matrix's Newton–Schulz once (the NS balance
        check, ``verify.compare.ns_balance``, in the owner modes): :meth:`plan`."""
        return self.plan()

    def report_fields(self) -> dict:
        """report.json ``runs[]`` keys describing the mesh beyond W, N, R: ``{"tp_size": 1}``."""
        return {"tp_size": 1}


@dataclass(frozen=True)
class Expected:
    """One predicted call on one rank (``count`` in NCCL's per-rank convention).

    An all_to_all also has ``in_elems`` / ``out_elems`` (this rank's input and output
    totals, as :mod:`tracer.events` records them), ``self_elems`` (its own chunk, which it
    neither sends nor receives) and their Muon-target parts ``dedicated_in_elems`` /
    ``dedicated_out_elems``, ``dedicated_count`` being the part of ``self_elems``; its
    ``count`` follows :func:`tracer.events.all_to_all_count` (``None`` when uneven). In the
    even case ``self_elems == count`` and ``in_elems == out_elems == group_size * count``.
    """

    rank: int
    phase: str
    op: str
    group_id: str
    group_size: int
    count: int | None
    dtype: str
    root: int | None
    module: str | None
    dedicated_count: int
    in_elems: int | None = None
    out_elems: int | None = None
    self_elems: int | None = None
    dedicated_in_elems: int | None = None
    dedicated_out_elems: int | None = None

    def key(self) -> tuple:
        """The identity compared with measured events (module is for messages only):
        ``(rank, phase, op, group_id, count, dtype, root, in_elems, out_elems)``, the totals
        ``None`` but for all_to_all (:func:`tracer.events.all_to_all_elems`)."""
        return (self.rank, self.phase, self.op, self.group_id, self.count, self.dtype, self.root,
                *all_to_all_elems(self.op, self.count, self.group_size, self.in_elems, self.out_elems))

    @property
    def uneven(self) -> bool:
        """An all_to_all whose own chunk is known (the predictor's all_to_alls)."""
        return self.op == "all_to_all" and self.self_elems is not None

    def avg_elems(self) -> float:
        """This member's f(n)·S (:func:`verify.traffic.formulas.avg_elems`); an all_to_all:
        the elements it sends, ``in_elems - self_elems``."""
        return avg_elems(self.op, self.count, self.group_size, in_elems=self.in_elems,
                         self_elems=self.self_elems)

    def dedicated_avg_elems(self) -> float:
        """The Muon-target part of :meth:`avg_elems`."""
        if self.uneven:
            return float(self.dedicated_in_elems - self.dedicated_count)
        return self.avg_elems() * self.dedicated_count / self.count if self.count else 0.0

    def dedicated_share(self) -> float:
        """:meth:`dedicated_avg_elems` / :meth:`avg_elems` (0 for a call that moves nothing)."""
        total = self.avg_elems()
        return self.dedicated_avg_elems() / total if total else 0.0


def shard_ranks(rank: int, n: int) -> list[int]:
    """World ranks of ``rank``'s shard group (row of the (R, N) mesh)."""
    r = rank // n
    return [r * n + j for j in range(n)]


def replicate_ranks(rank: int, n: int, r_size: int) -> list[int]:
    """World ranks of ``rank``'s replicate group (column of the (R, N) mesh)."""
    s = rank % n
    return [i * n + s for i in range(r_size)]


#: ``coalesce="auto"``'s unit target per backend, from the documented α-β defaults
#: (docs/traffic-model.md, "Coalescing": α·bandwidth; gloo 2 ms x 1 GB/s, NCCL 10 µs x
#: 360 GB/s), written here independently of ``dmuon/ownership/buckets.py``.
DMUON_AUTO_COALESCE_BYTES = {"gloo": 2_000_000, "nccl": 3_600_000}
#: Backends on which a unit's dtype group with one bucket per owner is aligned whatever the
#: buckets' sizes (docs/traffic-model.md, "Aligned groups"): those that reduce by gather,
#: where an uneven group moves as all_to_alls; NCCL's groups stay equal.
DMUON_UNEVEN_ALIGNED = frozenset({"gloo"})


def dmuon_uneven_aligned(backend: str) -> bool:
    """Whether DMuon aligns groups of unequal buckets on ``backend``."""
    return backend in DMUON_UNEVEN_ALIGNED


#: Backends on which DMuon reduces by gather (``docs/protocol.md`` step 4): each
#: reduce is a gather to the same root, each aligned reduce_scatter an all_to_all, same counts.
DMUON_REDUCE_BY_GATHER = frozenset({"gloo"})


def dmuon_reduce_by_gather(backend: str) -> bool:
    """Whether DMuon's reductions run as gathers / all_to_alls on ``backend``."""
    return backend in DMUON_REDUCE_BY_GATHER


#: Backends on which ``hierarchy="auto"`` moves the dedicated params flat over all W ranks of
#: an HSDP mesh when they form one unit (docs/traffic-model.md, "HSDP: flat or
#: hierarchical"), written here independently of the runtime's table; NCCL and any other
#: backend stay hierarchical.
DMUON_AUTO_FLAT = frozenset({"gloo"})


def dmuon_flattens(backend: str) -> bool:
    """Whether ``hierarchy="auto"`` may go flat on ``backend`` (``RunLayout.dmuon_auto_flat``)."""
    return backend in DMUON_AUTO_FLAT


#: ``dedicate_params(link=...)`` values: ``"auto"`` or a backend whose link policy DMuon then
#: follows on any backend (docs/user-guide.md, "Link policy").
DMUON_LINKS = ("auto", "nccl", "gloo")


def dmuon_policy_backend(link: str, backend: str) -> str:
    """The backend whose entries of this module's tables (coalescing target, reduce by gather,
    uneven aligned groups, flat HSDP) describe DMuon under ``dedicate_params(link=link)`` on a
    process group of ``backend``: ``link`` unless ``"auto"``.

    Raises:
        ValueError: ``link`` is not one of :data:`DMUON_LINKS`.
    """
    if link not in DMUON_LINKS:
        raise ValueError(f"Invalid link={link!r}. Must be one of {DMUON_LINKS}.")
    return backend if link == "auto" else link


def dmuon_coalesce_bytes(coalesce: str | int, backend: str) -> int:
    """The unit target of ``dedicate_params(coalesce=...)`` (docs/traffic-model.md)."""
    if coalesce == "auto":
        return DMUON_AUTO_COALESCE_BYTES.get(backend, DMUON_AUTO_COALESCE_BYTES["nccl"])
    return {"block": 0, "all": NO_LIMIT}.get(coalesce, coalesce)


@dataclass(frozen=True)
class DMuonBucket:
    """One predicted DMuon bucket: what one broadcast / reduce of the protocol moves.

    Attributes:
        module: its unit, named by the unit's first block (:func:`dmuon_block`; "" for the
            root); without coalescing the block holding the params.
        owner: global owner index g = r * N + s (``OwnershipPlan.owner``).
        dtype: the params' own dtype (torch name).
        names: member params in model order.
        numel: elements of all members.
        blocks: the unit's blocks.
        aligned: one bucket per owner in its unit and dtype (of equal numel and param count
            unless the layout aligns uneven groups), moved by one call per channel
            (``docs/protocol.md``).
    """

    module: str
    owner: int
    dtype: str
    names: tuple[str, ...]
    numel: int
    blocks: tuple[str, ...] = ()
    aligned: bool = False


def dmuon_block(module: str) -> str:
    """The block of a dedicated param of ``module`` (``dmuon/ownership/buckets.py``'s rule, written
    here independently): the longest prefix of the dotted name ending in an integer
    component (a ``ModuleList`` element), else the module itself (``""`` = root)."""
    parts = module.split(".") if module else []
    ends = [k for k in range(1, len(parts) + 1) if parts[k - 1].isdigit()]
    return ".".join(parts[: ends[-1]]) if ends else module


def dmuon_block_sequence(model_blocks: Sequence[str], recorded: Sequence[str]) -> tuple[str, ...]:
    """The block order DMuon's buckets follow after the first step (``docs/protocol.md``,
    step 7; ``dmuon/runtime/order.py``'s rule, written here independently).

    ``model_blocks``: the blocks in model order; ``recorded``: blocks in the order their
    forward first ran (repeats and non-blocks ignored). Model order when the recorded blocks
    already follow it; else the recorded blocks, then the others in model order, unless some
    driver (a dotted prefix of a block name, the block included, not the root) would not
    cover a contiguous run of blocks, in which case model order again.
    """
    model = list(model_blocks)
    ran: list[str] = []
    for b in recorded:
        if b in model and b not in ran:
            ran.append(b)
    positions = [model.index(b) for b in ran]
    if positions == sorted(positions):
        return tuple(model)
    candidate = ran + [b for b in model if b not in ran]
    drivers = {".".join(b.split(".")[:k]) for b in model if b for k in range(1, b.count(".") + 2)}
    for d in drivers:
        covered = [i for i, b in enumerate(candidate) if b == d or b.startswith(d + ".")]
        if covered != list(range(covered[0], covered[0] + len(covered))):
            return tuple(model)
    return tuple(candidate)


def agreed_block_order(recorded_per_rank: Sequence[Sequence[str]],
                       model_blocks: Sequence[str]) -> tuple[str, ...]:
    """``RunLayout.dmuon_block_order`` from every rank's recording: rank 0's when every rank
    derives the same order (:func:`dmuon_block_sequence`), else ``()`` (DMuon's ranks
    disagree and keep model order)."""
    derived = {dmuon_block_sequence(model_blocks, r) for r in recorded_per_rank}
    return tuple(recorded_per_rank[0]) if len(derived) == 1 else ()


def dmuon_model_blocks(specs: Sequence[ParamSpec]) -> tuple[str, ...]:
    """The blocks (:func:`dmuon_block`) of the dedicated params ``specs``, in model order."""
    return tuple(dict.fromkeys(dmuon_block(s.module) for s in specs))


def dmuon_units(specs: Sequence[ParamSpec], target_bytes: int) -> list[tuple[str, ...]]:
    """DMuon's candidate units (docs/traffic-model.md, "Coalescing"): blocks in model order,
    each joining the previous unit while that unit's bytes plus its own stay <=
    ``target_bytes``. :func:`dmuon_buckets` then splits a unit that saves no call."""
    sizes: dict[str, int] = {}
    for spec in specs:
        block = dmuon_block(spec.module)
        sizes[block] = sizes.get(block, 0) + spec.numel * DTYPE_BYTES[spec.dtype]
    units: list[list[str]] = []
    total = 0
    for block, size in sizes.items():
        if not units or total + size > target_bytes:
            units.append([])
            total = 0
        units[-1].append(block)
        total += size
    return [tuple(u) for u in units]


def dmuon_buckets(specs: Sequence[ParamSpec], plan: OwnershipPlan,
                  cap_bytes: int = 25 * 1024 * 1024,
                  block_order: Sequence[str] = (), coalesce_bytes: int = 0,
                  uneven_aligned: bool = False) -> list[DMuonBucket]:
    """DMuon's buckets from the documented rule (docs/spec.md §1, ``dmuon/ownership/buckets.py``).

    A bucket is the dedicated params of one block (:func:`dmuon_block`) with the same global
    owner and dtype, in model order, cut into runs of at most ``cap_bytes`` bytes (a param
    larger than the cap alone); one collective per bucket and phase. Written independently
    of the runtime's own bucketing code, which is what this prediction checks. Returned in
    DMuon's index order: model order, or, when ``block_order`` (the recorded execution
    order, ``RunLayout.dmuon_block_order``) yields another block sequence
    (:func:`dmuon_block_sequence`), block by block in that sequence, model order within a
    block. The comparison is a multiset: the order matters to it only through the last
    unit, which Z3 keeps (:func:`kept_unit`).

    Raises:
        ValueError: a spec has no owner in ``plan``, or ``cap_bytes`` < 1.
    """
    if cap_bytes < 1:
        raise ValueError(f"Invalid {cap_bytes=}. Must be >= 1 (DMuon's bucket_cap_mb in bytes).")
    for spec in specs:
        if spec.name not in plan.owner:
            raise ValueError(
                f"Invalid spec {spec.name!r}: not in the ownership plan. Must be one of the "
                f"planned params {list(plan.owner)[:3]}...; plan and specs must come from the "
                "same layout."
            )
    units = dmuon_units(specs, coalesce_bytes)
    if coalesce_bytes > 0:  # a unit of several blocks stays only if it needs fewer calls
        singles = [(b,) for u in units for b in u]
        per_block = _calls_by_unit(_grouped(specs, plan, cap_bytes, singles, False))
        joined = _calls_by_unit(_grouped(specs, plan, cap_bytes, units, True, uneven_aligned))
        units = [piece for u in units for piece in
                 ([u] if len(u) == 1 or joined[u[0]] < sum(per_block[b] for b in u) else [(b,) for b in u])]
    buckets = _grouped(specs, plan, cap_bytes, units, coalesce_bytes > 0, uneven_aligned)
    model = dmuon_model_blocks(specs)
    sequence = dmuon_block_sequence(model, block_order)
    if sequence != model:
        buckets.sort(key=lambda b: min(sequence.index(x) for x in b.blocks))
    return buckets


def _grouped(specs: Sequence[ParamSpec], plan: OwnershipPlan, cap_bytes: int,
             units: Sequence[tuple[str, ...]], may_align: bool,
             uneven_aligned: bool = False) -> list[DMuonBucket]:
    """The buckets of ``units`` (model order): per (unit, owner, dtype), cut at ``cap_bytes``;
    when ``may_align``, aligned where a unit's dtype has exactly one bucket per owner (none
    cut by the cap), of equal size and param count unless ``uneven_aligned``."""
    unit_of = {block: unit for unit in units for block in unit}
    members: dict[tuple[str, int, str], list[list[ParamSpec]]] = {}
    for spec in specs:
        key = (unit_of[dmuon_block(spec.module)][0], plan.owner[spec.name], spec.dtype)
        runs = members.setdefault(key, [[]])
        size = spec.numel * DTYPE_BYTES[spec.dtype]
        if runs[-1] and sum(p.numel * DTYPE_BYTES[p.dtype] for p in runs[-1]) + size > cap_bytes:
            runs.append([])
        runs[-1].append(spec)
    world = plan.mesh_shape[0] * plan.mesh_shape[1]
    aligned: set[tuple[str, str]] = set()  # (unit, dtype) groups moved by one call per channel
    if may_align and world > 1:
        owners: dict[tuple[str, str], list[int]] = {}  # O(buckets), not O(groups · W)
        for u, g, d in members:
            owners.setdefault((u, d), []).append(g)
        for (unit, dtype), gs in owners.items():
            runs = [members[(unit, g, dtype)] for g in gs]
            if len(gs) != world or not all(len(r) == 1 for r in runs):
                continue
            sizes = {(sum(p.numel for p in r[0]), len(r[0])) for r in runs}
            if uneven_aligned or len(sizes) == 1:
                aligned.add((unit, dtype))
    return [
        DMuonBucket(unit, owner, dtype, tuple(p.name for p in ps), sum(p.numel for p in ps),
                    unit_of[unit], (unit, dtype) in aligned)
        for (unit, owner, dtype), runs in members.items()
        for ps in runs
    ]


def _calls_by_unit(buckets: list[DMuonBucket]) -> dict[str, int]:
    """Unit -> its calls per channel: one per aligned (unit, dtype) group, one per other bucket."""
    calls: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    for b in buckets:
        if b.aligned and (b.module, b.dtype) in seen:
            continue
        seen.add((b.module, b.dtype))
        calls[b.module] = calls.get(b.module, 0) + 1
    return calls


def _dmuon_calls(layout: RunLayout, rank: int) -> list[Expected]:
    n, r_size = layout.shard_size, layout.replicate_size
    s_me = rank % n
    sid = group_id_from_ranks(shard_ranks(rank, n))
    rid = group_id_from_ranks(replicate_ranks(rank, n, r_size))
    out: list[Expected] = []

    def add(phase, op, gid, gsize, b, dtype, root, extra=0, times=1):
        out.extend([Expected(rank, phase, op, gid, gsize, b.numel + extra, dtype, root, b.module, b.numel)] * times)

    buckets = layout_buckets(layout)
    kept = kept_unit(layout, buckets)
    # step 4's reductions: reduce / reduce_scatter, or (gloo) gather / all_to_all, same counts
    reduce, reduce_scatter = (("gather", "all_to_all") if layout.dmuon_reduce_by_gather
                              else ("reduce", "reduce_scatter"))
    grouped: dict[tuple[str, str], list[DMuonBucket]] = {}
    for b in buckets:
        if b.aligned:
            grouped.setdefault((b.module, b.dtype), []).append(b)
            continue
        r_own, s_own = divmod(b.owner, n)
        cast, red = layout.cast_dtype(b.dtype), layout.reduce_dtype(b.dtype)
        forward, backward = dmuon_broadcasts(layout, b, kept)
        add("forward", "broadcast", sid, n, b, cast, s_own, times=forward)
        add("backward", "broadcast", sid, n, b, cast, s_own, times=backward)
        # a reduce carries the grads, then one usage element per param (docs/protocol.md
        # step 4): count numel + params, dedicated payload numel
        usage = len(b.names)
        add("backward", reduce, sid, n, b, red, s_own, usage)
        if r_size > 1 and s_me == s_own:
            add("backward", reduce, rid, r_size, b, red, r_own, usage)
            add("replicate", "broadcast", rid, r_size, b, b.dtype, r_own)
    # an aligned group: one bucket per owner g = r·N + s, c_g elements and u_g params; one call
    # per channel moves them all. Shard index s holds the R buckets of owners (., s): its part
    # of the shard channels is H_s = sum_r c_(rN+s) (reduce: plus the usage elements); a
    # replicate group's part of rank (r, s) is owner r·N + s's bucket.
    r_me = rank // n
    for (unit, dtype), group in grouped.items():
        owned = {b.owner: b for b in group}
        elems = [owned[g].numel for g in range(n * r_size)]
        params = [len(owned[g].names) for g in range(n * r_size)]
        held = [sum(elems[r * n + s] for r in range(r_size)) for s in range(n)]
        held_usage = [held[s] + sum(params[r * n + s] for r in range(r_size)) for s in range(n)]
        column = [elems[r * n + s_me] for r in range(r_size)]  # this rank's replicate group
        column_usage = [column[r] + params[r * n + s_me] for r in range(r_size)]
        cast, red = layout.cast_dtype(dtype), layout.reduce_dtype(dtype)
        by_gather = layout.dmuon_reduce_by_gather

        def put(phase, gid, gsize, dt, call, times=1):
            out.extend([Expected(rank, phase, group_id=gid, group_size=gsize, dtype=dt, root=None,
                                 module=unit, **call)] * times)

        forward, backward = dmuon_broadcasts(layout, group[0], kept)  # one unit: every member alike
        put("forward", sid, n, cast, _gathered(held, s_me), times=forward)
        put("backward", sid, n, cast, _gathered(held, s_me), times=backward)
        put("backward", sid, n, red, _summed(held_usage, held, s_me, by_gather))
        if r_size > 1:
            put("backward", rid, r_size, red, _summed(column_usage, column, r_me, by_gather))
            put("replicate", rid, r_size, dtype, _gathered(column, r_me))
    return out


def _gathered(parts: Sequence[int], me: int) -> dict:
    """The fields of member ``me``'s call that gives every member all ``parts`` (part i from
    group rank i): an all_gather where they are equal (count = one part), else an
    all_to_all of this member's part repeated to every peer (in_elems n·part, out_elems the
    sum, its own chunk its part). Every element is dedicated."""
    n, mine = len(parts), parts[me]
    if len(set(parts)) == 1:
        return dict(op="all_gather", count=mine, dedicated_count=mine)
    in_elems, out_elems = n * mine, sum(parts)
    return dict(op="all_to_all", count=all_to_all_count(in_elems, out_elems, n), in_elems=in_elems,
                out_elems=out_elems, self_elems=mine, dedicated_count=mine,
                dedicated_in_elems=in_elems, dedicated_out_elems=out_elems)


def _summed(parts: Sequence[int], dedicated: Sequence[int], me: int, by_gather: bool) -> dict:
    """The fields of member ``me``'s call after which group rank i holds the sum of every
    member's part i (``dedicated``: each part's Muon-target elements, the rest are usage
    elements): a reduce_scatter (count = one part; equal parts only), or, reducing by
    gather, an all_to_all of every part to its group rank (in_elems the sum, out_elems n
    times this member's part, its own chunk its part), summed locally."""
    n, mine = len(parts), parts[me]
    if not by_gather:
        if len(set(parts)) != 1:
            raise ValueError(f"Invalid aligned group with parts {list(parts)}: unequal parts need "
                             "a reduce by gather (RunLayout.dmuon_uneven_aligned).")
        return dict(op="reduce_scatter", count=mine, dedicated_count=dedicated[me])
    in_elems, out_elems = sum(parts), n * mine
    return dict(op="all_to_all", count=all_to_all_count(in_elems, out_elems, n), in_elems=in_elems,
                out_elems=out_elems, self_elems=mine, dedicated_count=dedicated[me],
                dedicated_in_elems=sum(dedicated), dedicated_out_elems=n * dedicated[me])


def layout_buckets(layout: RunLayout, plan: OwnershipPlan | None = None) -> list[DMuonBucket]:
    """:func:`dmuon_buckets` of ``layout`` (its cap, coalescing, uneven rule
    and recorded block order): DMuon's buckets in the index order of the measured steps.
    ``plan``: ``layout.plan()`` if omitted."""
    plan = layout.plan() if plan is None else plan
    return dmuon_buckets(layout.muon_specs(), plan, layout.dmuon_bucket_cap_bytes, layout.dmuon_block_order,
                         layout.dmuon_coalesce_bytes, layout.dmuon_uneven_aligned)


def dmuon_hierarchy(layout: RunLayout) -> str | None:
    """How DMuon moves ``layout``'s dedicated params on its mesh (docs/traffic-model.md, "HSDP:
    flat or hierarchical"): ``"flat"`` or ``"hierarchical"`` for a DMuon mode on a 2-D
    ``(R, N)`` mesh, ``None`` where the knob changes nothing (a 1-D mesh, a non-DMuon mode).

    ``layout.dmuon_hierarchy`` when it names one; ``"auto"``: flat iff the harness's backend
    table allows it (``layout.dmuon_auto_flat``, :func:`dmuon_flattens`) and the dedicated
    params form exactly one unit, i.e. every bucket of :func:`layout_buckets` (the coalescing
    rule's final units, after a multi-block unit that saves no call was split) has the same
    unit; hierarchical otherwise. A kind that never moves flat (``layout.flat_allowed``
    False: ``verify.traffic.tp.TPRunLayout``, which refuses ``"flat"``) is always hierarchical."""
    if not layout.is_dmuon or layout.replicate_size == 1:
        return None
    if not layout.flat_allowed:
        return "hierarchical"
    if layout.dmuon_hierarchy != "auto":
        return layout.dmuon_hierarchy
    if not layout.dmuon_auto_flat:  # the backend never flattens: no units to derive
        return "hierarchical"
    return "flat" if len({b.module for b in layout_buckets(layout)}) == 1 else "hierarchical"


def dmuon_flat(layout: RunLayout) -> bool:
    """Whether DMuon moves ``layout``'s dedicated params flat (:func:`dmuon_hierarchy`)."""
    return dmuon_hierarchy(layout) == "flat"


def dmuon_layout(layout: RunLayout) -> RunLayout:
    """The layout DMuon's own calls are predicted on: ``layout`` itself, or, flat
    (:func:`dmuon_flat`), its view as a 1-D mesh of all W ranks, R = 1 and N = W
    (docs/traffic-model.md, "HSDP: flat or hierarchical"): shard channel = the world, no
    replicate calls, owner g = world rank g. The planner assigns owners over the W ranks
    whatever the mesh's shape, so the (1, W) plan has the same owners as the (R, N) one
    (``tests/verify/test_predict_flat.py``). Only DMuon's dedicated calls use the view;
    FSDP2's calls for the rest keep ``layout``'s (R, N)."""
    if not dmuon_flat(layout):
        return layout
    return dataclasses.replace(layout, replicate_size=1, shard_size=layout.world_size)


def run_closed_form(layout: RunLayout) -> ClosedForm:
    """The closed form ``layout``'s run is checked against (docs/spec.md §2):
    :func:`verify.traffic.formulas.closed_form` at ``layout``'s N and R, flat where DMuon moved
    the dedicated params flat (:func:`dmuon_flat`: the 1-D form at N = W). Evaluate it at
    :func:`verify.traffic.formulas.closed_form_p_m`, :func:`reused_elems`, :func:`kept_elems`."""
    return closed_form(layout.mode, layout.shard_size, layout.replicate_size, flat=dmuon_flat(layout))


def kept_unit(layout: RunLayout, buckets: Sequence[DMuonBucket]) -> str | None:
    """The unit Z3 keeps allocated from its forward into the backward, given ``buckets`` in
    index order (:func:`layout_buckets`): the unit of the last bucket index
    (``docs/protocol.md`` step 2; a forward with grad enabled, as every forward the
    harness measures). ``None`` under Z2 (nothing is freed) or without buckets."""
    if not layout.reshard_after_forward or not buckets:
        return None
    return buckets[-1].module


def dmuon_broadcasts(layout: RunLayout, bucket: DMuonBucket, kept: str | None) -> tuple[int, int]:
    """``(forward, backward)``: how many broadcasts (an aligned group: all_gathers) move
    ``bucket`` per step, ``kept`` being :func:`kept_unit` (``docs/protocol.md``
    steps 1-3).

    Z2: (1, 0), the buckets stay valid. Z3: a unit is freed once all its blocks ran, so a
    block that runs again in the same forward (weight sharing) gets it broadcast again: one
    forward broadcast per run, the most runs of any of its blocks; then one backward
    re-broadcast. The kept unit stays valid from its forward into the backward, reruns
    included: (1, 0)."""
    if not layout.reshard_after_forward or bucket.module == kept:
        return 1, 0
    return unit_runs(layout, bucket), 1


def unit_runs(layout: RunLayout, bucket: DMuonBucket) -> int:
    """How many times ``bucket``'s unit runs per forward: the most runs of any of its blocks
    (:meth:`RunLayout.calls_of`)."""
    return max(layout.calls_of(block) for block in bucket.blocks)


def _axis_calls(layout: RunLayout, rank: int, calls: list[AxisCall]) -> list[Expected]:
    """The shared FSDP2 / DDP rules (:mod:`verify.traffic.rules`) as this rank's calls."""
    n, r_size = layout.shard_size, layout.replicate_size
    gid = {
        "shard": group_id_from_ranks(shard_ranks(rank, n)),
        "replicate": group_id_from_ranks(replicate_ranks(rank, n, r_size)),
        "world": group_id_from_ranks(range(layout.world_size)),
    }
    return [
        Expected(rank, c.phase, c.op, gid[c.axis], c.group_size, c.count, c.dtype, c.root,
                 c.module, c.dedicated_count)
        for c in calls
    ]


def _naive_step_calls(layout: RunLayout, rank: int) -> list[Expected]:
    n = layout.shard_size
    sid = group_id_from_ranks(shard_ranks(rank, n))
    out = []
    for p in layout.muon_specs():
        c = padded_shard_numel(p.shape, n)
        out.append(Expected(rank, "optimizer", "all_gather", sid, n, c, p.dtype, None, p.name, c))
    return out


def owner_numels(specs: Sequence[ParamSpec], plan: OwnershipPlan) -> list[int]:
    """Elements of the matrices each global owner g holds under ``plan`` (index g)."""
    totals = [0] * plan.world_size
    for p in specs:
        totals[plan.owner[p.name]] += p.numel
    return totals


def zero1_chunk_elems(layout: RunLayout) -> int:
    """ZeRO-1-style Muon's per-rank chunk C: the largest total of one owner's matrices."""
    return max(owner_numels(layout.muon_specs(), layout.plan()))


def _zero1_step_calls(layout: RunLayout, rank: int) -> list[Expected]:
    """reduce_scatter then all_gather of the owner-aligned flat buffer, C elements per rank."""
    wid = group_id_from_ranks(range(layout.world_size))
    c = zero1_chunk_elems(layout)
    dtype = layout.muon_specs()[0].dtype
    return [Expected(rank, "optimizer", op, wid, layout.world_size, c, dtype, None, None, c)
            for op in ("reduce_scatter", "all_gather")]


def predict_step(layout: RunLayout) -> list[Expected]:
    """Every call of one training step on every rank (forward, backward, optimizer[, replicate]
    [, qk_clip]);
    DMuon's dedicated calls on :func:`dmuon_layout` (flat HSDP: the 1-D rule over all W)."""
    out: list[Expected] = []
    dedicated = set(layout.muon_names) if layout.is_dmuon else set()
    own = dmuon_layout(layout) if layout.is_dmuon else layout  # flat: the (1, W) view
    for rank in range(layout.world_size):
        if layout.is_dmuon:
            out += _dmuon_calls(own, rank)
        if layout.is_dmuon and layout.dmuon_rest == "replicate":  # nothing wraps the model
            out += _axis_calls(layout, rank, rest_calls(layout))
        elif layout.mode == "zero1-muon":
            out += _axis_calls(layout, rank, ddp_calls(layout, set(layout.muon_names)))
            out += _zero1_step_calls(layout, rank)
        elif layout.mode in ("ddp-muon", "dmuon-ddp"):
            out += _axis_calls(layout, rank, ddp_calls(layout, dedicated))
        else:
            out += _axis_calls(layout, rank, fsdp_calls(layout, dedicated))
        if layout.mode.startswith("naive-"):
            out += _naive_step_calls(layout, rank)
        out += qk_clip_calls(layout, rank)
        out += grad_clip_calls(layout, rank)
    return out


def grad_clip_calls(layout: RunLayout, rank: int) -> list[Expected]:
    """DMuon's ``clip_grad_norm_`` on ``rank`` per step, :attr:`RunLayout.grad_clips` times:
    one all_reduce (SUM of the owners' p-th powers, or MAX for the inf-norm) over all W ranks of
    one fp32 element, phase ``optimizer``, no Muon payload (docs/traffic-model.md, "Clipping");
    ``[]`` where the script clips nothing."""
    world = group_id_from_ranks(list(range(layout.world_size)))
    return [Expected(rank, "optimizer", "all_reduce", world, layout.world_size, 1, "float32",
                     None, None, 0)] * layout.grad_clips


def qk_clip_calls(layout: RunLayout, rank: int) -> list[Expected]:
    """MuonClip's QK-clip on ``rank`` per step: one all_reduce (MAX) over all W ranks of the
    per-head maxima, fp32, ``count = qk_clip_heads`` (4 bytes a head), phase ``qk_clip``, no
    Muon payload; ``[]`` without QK-clip (docs/traffic-model.md, "QK-clip")."""
    if not layout.qk_clip_heads:
        return []
    world = group_id_from_ranks(list(range(layout.world_size)))
    return [Expected(rank, "qk_clip", "all_reduce", world, layout.world_size, layout.qk_clip_heads,
                     "float32", None, None, 0)]


def ns_calls_per_step(layout: RunLayout) -> int:
    """Matrices orthogonalized per step over all ranks: once each for DMuon and ZeRO-1, W
    times otherwise. A param holds ``ParamSpec.matrices`` (an expert stack of E: E)."""
    matrices = sum(p.matrices for p in layout.muon_specs())
    owned_once = layout.is_dmuon or layout.mode == "zero1-muon"
    return matrices if owned_once else matrices * layout.world_size


def reused_elems(layout: RunLayout) -> int:
    """P_M^r: the Muon elements moved again because their unit runs more than once per
    forward, ``sum((calls - 1) * elements)`` over the Muon params, where calls is how many
    times the unit that moves the param runs (:attr:`RunLayout.module_calls`): DMuon's unit
    in the DMuon modes (:func:`unit_runs`), except the unit Z3 keeps allocated
    (:func:`kept_unit`: it stays valid between its runs, ``docs/protocol.md`` step 2);
    the ``fully_shard`` module holding the param in the FSDP2 baselines, whose elements count
    padded on dim 0 to a multiple of N as their closed form does
    (``verify.traffic.formulas.PADDED_MODES``). 0 in the DDP and ZeRO-1 modes, and when
    nothing runs twice. The closed forms add a multiple of it
    (``verify.traffic.formulas.ClosedForm.reuse_phases``; 0 for the modes that never re-send)."""
    if not layout.module_calls:
        return 0
    if layout.is_dmuon:
        buckets = layout_buckets(layout)
        kept = kept_unit(layout, buckets)
        return sum((unit_runs(layout, b) - 1) * b.numel for b in buckets if b.module != kept)
    if not layout.fsdp_modules:
        return 0
    n, muon = layout.shard_size, set(layout.muon_names)
    return sum(
        (layout.calls_of(module) - 1) * n * padded_shard_numel(p.shape, n)
        for module, members in fsdp_groups(layout, set())
        for p in members
        if p.name in muon
    )


def kept_elems(layout: RunLayout) -> int:
    """P_M^L: the Muon elements of the unit DMuon's Z3 keeps allocated from its forward into
    the backward (:func:`kept_unit`, ``docs/protocol.md`` step 2), which therefore
    gets no backward re-broadcast. 0 outside the DMuon modes and under Z2. The closed forms
    add a multiple of it (``verify.traffic.formulas.ClosedForm.kept_phases``)."""
    if not layout.is_dmuon:
        return 0
    buckets = layout_buckets(layout)
    kept = kept_unit(layout, buckets)
    return sum(b.numel for b in buckets if b.module == kept)
