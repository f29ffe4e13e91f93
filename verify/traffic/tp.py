"""The prediction of a tensor-parallel (TP) run: mesh ``("shard", "tp")`` = N × T or
``("replicate", "shard", "tp")`` = R × N × T, W = R·N·T, rank ``(r·N + s)·T + t``.

Derived from the documented protocol (``docs/protocol.md``, "Tensor parallelism";
``docs/traffic-model.md``, "Tensor parallelism") and the planner, never from the runtime
(this module imports ``dmuon.ownership.plan`` and nothing else of ``dmuon``):

- **Per TP column** t (world ranks ``(r·N + s)·T + t``), every data-parallel call of the plain
  prediction (:func:`verify.traffic.predict.predict_step`) on a layout whose TP params have
  their local shapes (dim d divided by T): FSDP2's all_gathers / reduce_scatters of the
  local shards, DMuon's broadcasts and reduces of buckets of local shards, the naive step's
  all_gather over the shard axis; HSDP's replicate-axis calls. DMuon's owners come from the TP
  plan: the planner on the full matrices over ``(R, N·T)`` slots, slot ``s·T + t_o`` of row r
  = owner ``r·N + s``, NS rank t_o.
- **DMuon's step** (phase ``optimizer``, the owner's TP group ``{s·T + t'}``): per NS rank
  t_o (and dtype) with at least one TP param of that owner, one ``gather`` to group rank t_o
  and one ``scatter`` from it, count = the sum of those params' n/T.
- **The naive TP baseline's step**: after the shard-axis all_gather of each Muon param's
  grad, a TP param's TP shards are all_gathered over its TP group (count n/T) on every rank.
- **DTensor's TP calls** (phase ``tp``): per forward run of a ``RowwiseParallel`` layer one
  all_reduce of its output (Partial -> Replicate), per backward of a ``ColwiseParallel`` layer
  one all_reduce of its input's grad (Partial -> Replicate), over the TP group, of the numel
  listed in :attr:`TPRunLayout.tp_activations` (batch rows x sequence x features, from the
  shapes). They move activations: no dedicated share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from dmuon.ownership.plan import OwnershipPlan, ParamSpec, plan_ownership
from tracer.events import group_id_from_ranks

from verify.traffic.formulas import ClosedForm, closed_form
from verify.traffic.predict import ClosedFormCheck, Expected, RunLayout, kept_elems, predict_step

#: Modes that run with TP (``--tp T``): DMuon Z2 / Z3 and the naive FSDP2 × TP baselines.
TP_MODES = ("naive-fsdp2-z2", "naive-fsdp2-z3", "dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")


def tp_skip_reason(mode: str, world_size: int, tp: int) -> str | None:
    """Why ``mode`` cannot run with ``--tp tp`` at W = ``world_size`` (``None``: it can).
    HSDP × TP runs on a (2, W/(2T), T) mesh: it needs W/T even and >= 4."""
    if mode not in TP_MODES:
        return f"no tensor-parallel variant (--tp runs {', '.join(TP_MODES)})"
    dp = world_size // tp
    if "hsdp" in mode and (dp < 4 or dp % 2):
        return f"HSDP x TP runs on a (2, W/(2T), T) mesh: needs W/T even and >= 4, have W/T={dp}"
    return None


@dataclass(frozen=True)
class TPRunLayout(RunLayout):
    """A :class:`RunLayout` on an ``R × N × T`` mesh (``replicate_size`` = R, ``shard_size`` = N).

    Attributes (besides RunLayout's, whose ``params`` keep their full shapes):
        tp_size: T, >= 2 (a run without TP is a :class:`RunLayout`).
        tp_dims: ``(name, d)`` of every TP-sharded param (``Shard(d)`` on ``mesh["tp"]``).
        tp_activations: ``(module, style, numel, dtype)`` per TP layer in model order:
            ``style`` ``"colwise"`` (numel = its input's per-rank elements: the backward
            all_reduce) or ``"rowwise"`` (its output's: the forward all_reduce).
    """

    kind: ClassVar[str] = "tp"
    flat_allowed: ClassVar[bool] = False  # a TP mesh's params move hierarchically

    tp_size: int = 1
    tp_dims: tuple[tuple[str, int], ...] = ()
    tp_activations: tuple[tuple[str, str, int, str], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 2:
            raise ValueError(f"Invalid tp_size={self.tp_size!r} for a TPRunLayout. Must be an int >= 2 "
                             "(T; a run without tensor parallelism is a RunLayout).")
        if self.dmuon_hierarchy == "flat":
            raise ValueError("Invalid dmuon_hierarchy='flat' with tp_size > 1. Must be 'auto' or "
                             "'hierarchical': DMuon moves a TP mesh's params hierarchically "
                             "(docs/traffic-model.md, \"HSDP: flat or hierarchical\").")

    @property
    def world_size(self) -> int:
        return self.replicate_size * self.shard_size * self.tp_size

    def tp_names(self) -> dict[str, int]:
        return dict(self.tp_dims)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["tp_dims"] = [list(x) for x in self.tp_dims]
        d["tp_activations"] = [list(x) for x in self.tp_activations]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TPRunLayout:
        """Inverse of :meth:`to_dict` (:meth:`RunLayout.from_dict`'s errors; ``tp_size`` required)."""
        cls.check_kind(d)
        base = RunLayout.from_dict({k: v for k, v in d.items()
                                    if k not in ("tp_size", "tp_dims", "tp_activations", "kind")})
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(RunLayout)},
                   tp_size=int(d["tp_size"]),
                   tp_dims=tuple((n, int(k)) for n, k in d.get("tp_dims", ())),
                   tp_activations=tuple((m, s, int(c), t) for m, s, c, t in d.get("tp_activations", ())))

    # ------------------------------ the kind's answers (RunLayout's class docstring)
    def predict_calls(self) -> list[Expected]:
        """Every call of one step on every rank: :func:`predict_tp_step`."""
        return predict_tp_step(self)

    def ns_calls_per_step(self) -> int:
        """Newton–Schulz calls per step over all ranks: :func:`tp_ns_calls_per_step`."""
        return tp_ns_calls_per_step(self)

    def closed_form_check(self) -> ClosedFormCheck:
        """:func:`tp_closed_form` at P_M: exact there (the harness refuses FSDP2 padding under
        TP), no reuse term, and its P_loc^L term already inside, so ``p_m_kept`` (one column's
        kept elements, :func:`verify.traffic.predict.kept_elems`) is only reported."""
        return ClosedFormCheck(tp_closed_form(self), self.p_m(), 0, kept_elems(self.column()))

    def dmuon_view(self) -> None:
        """``None``: DMuon's dedicated calls are predicted per TP column on the local shapes
        (:meth:`column`), not on one layout whose buckets name the full matrices' owners."""
        return None

    def ns_plan(self) -> None:
        """``None``: a matrix replicated over TP runs its Newton–Schulz on T ranks, not once
        on one owner (:func:`tp_ns_calls_per_step`)."""
        return None

    def report_fields(self) -> dict:
        """``{"tp_size": T}``."""
        return {"tp_size": self.tp_size}

    # ----------------------------------------------------------------------- plan
    def full_plan(self) -> OwnershipPlan:
        """The planner on the full matrices over ``(R, N·T)`` slots (the documented TP plan)."""
        return plan_ownership(self.muon_specs(), (self.replicate_size, self.shard_size * self.tp_size))

    def ns_rank(self) -> dict[str, int]:
        """TP param -> the TP index t_o of its Newton–Schulz rank."""
        tp, plan = self.tp_names(), self.full_plan()
        return {n: plan.owner[n] % (self.shard_size * self.tp_size) % self.tp_size for n in tp}

    def local_specs(self) -> tuple[ParamSpec, ...]:
        """Every param with its per-rank (local) shape: a TP param's dim d divided by T."""
        tp = self.tp_names()
        out = []
        for p in self.params:
            if p.name in tp:
                shape = list(p.shape)
                shape[tp[p.name]] //= self.tp_size
                p = dataclasses.replace(p, shape=tuple(shape))
            out.append(p)
        return tuple(out)

    def column(self) -> _ColumnLayout:
        """The data-parallel layout of one TP column: local shapes, owners from the TP plan."""
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunLayout)}
        base["params"] = self.local_specs()
        base["dmuon_hierarchy"] = "hierarchical"  # a TP mesh never moves flat
        return _ColumnLayout(**base, tp_plan_owner=tuple(self._dp_owner().items()))

    def _dp_owner(self) -> dict[str, int]:
        nt, t = self.shard_size * self.tp_size, self.tp_size
        out = {}
        for name, g in self.full_plan().owner.items():
            r, sp = divmod(g, nt)
            out[name] = r * self.shard_size + sp // t
        return out


@dataclass(frozen=True)
class _ColumnLayout(RunLayout):
    """One TP column's data-parallel layout; its plan's owners are the TP plan's."""

    tp_plan_owner: tuple[tuple[str, int], ...] = ()

    def plan(self) -> OwnershipPlan:
        return OwnershipPlan(mesh_shape=(self.replicate_size, self.shard_size),
                             specs=tuple(self.muon_specs()), owner=dict(self.tp_plan_owner))


def _world(layout: TPRunLayout, col_rank: int, t: int) -> int:
    """World rank of column rank ``col_rank`` (``r·N + s``) of TP column t."""
    return col_rank * layout.tp_size + t


def tp_group(layout: TPRunLayout, rank: int) -> list[int]:
    """World ranks of ``rank``'s TP group, in t order."""
    base = rank - rank % layout.tp_size
    return [base + k for k in range(layout.tp_size)]


def predict_tp_step(layout: TPRunLayout) -> list[Expected]:
    """Every call of one step on every rank of a TP run (module docstring)."""
    t_size = layout.tp_size
    col = layout.column()
    col_calls = predict_step(col)
    out: list[Expected] = []
    for t in range(t_size):
        for e in col_calls:
            members = _column_group(col, e)
            ranks = [_world(layout, m, t) for m in members]
            out.append(dataclasses.replace(e, rank=_world(layout, e.rank, t),
                                           group_id=group_id_from_ranks(ranks)))
    tp = layout.tp_names()
    local = {p.name: p for p in layout.local_specs()}
    owner, ns = layout._dp_owner(), layout.ns_rank()
    for rank in range(layout.world_size):
        gid = group_id_from_ranks(tp_group(layout, rank))
        out += tp_activation_calls(layout, rank)
        if layout.is_dmuon:
            out += tp_step_calls(layout, rank, owner, ns, local)
        elif layout.mode.startswith("naive-"):
            for p in layout.muon_specs():
                if p.name in tp:
                    c = local[p.name].numel
                    out.append(Expected(rank, "optimizer", "all_gather", gid, t_size, c, p.dtype, None, p.name, c))
    return out


def tp_activation_calls(layout: RunLayout, rank: int) -> list[Expected]:
    """DTensor's own all_reduces of activations on ``rank`` in one step (phase ``tp``, no
    dedicated share; module docstring), over its TP group (:func:`tp_group`), from
    ``layout.tp_activations`` and ``layout.tp_size`` (a :class:`TPRunLayout` or any kind with
    those fields and TP groups of consecutive ranks)."""
    t_size = layout.tp_size
    gid = group_id_from_ranks(tp_group(layout, rank))
    out = []
    for module, style, numel, dtype in layout.tp_activations:
        phase = "forward" if style == "rowwise" else "backward"
        runs = layout.calls_of(module) if phase == "forward" else 1
        out += [Expected(rank, "tp", "all_reduce", gid, t_size, numel, dtype, None, module, 0)] * runs
    return out


def tp_step_calls(layout: RunLayout, rank: int, owner: dict[str, int], ns: dict[str, int],
                  local: dict[str, ParamSpec]) -> list[Expected]:
    """DMuon's step-6 gather and scatter on ``rank``'s TP group (module docstring): per NS rank
    t_o (``ns``: TP param -> t_o) and dtype of the TP params whose column owner (``owner``: name
    -> ``r·N + s`` of the column, the column rank being ``rank // T``) is this rank's column
    rank, one ``gather`` to t_o and one ``scatter`` from it, count the sum of their local
    numels (``local``: name -> local spec)."""
    t_size = layout.tp_size
    col_rank = rank // t_size
    gid = group_id_from_ranks(tp_group(layout, rank))
    counts: dict[tuple[int, str], int] = {}
    for p in layout.muon_specs():
        if p.name in ns and owner[p.name] == col_rank:
            key = (ns[p.name], p.dtype)
            counts[key] = counts.get(key, 0) + local[p.name].numel
    out = []
    for (root, dtype), c in sorted(counts.items()):
        out.append(Expected(rank, "optimizer", "gather", gid, t_size, c, dtype, root, None, c))
        out.append(Expected(rank, "optimizer", "scatter", gid, t_size, c, dtype, root, None, c))
    return out


def _column_group(col: RunLayout, e: Expected) -> list[int]:
    """Column ranks of the group of a column call (shard row, replicate column or the world)."""
    from verify.traffic.predict import replicate_ranks, shard_ranks

    n, r = col.shard_size, col.replicate_size
    for ranks in (shard_ranks(e.rank, n), replicate_ranks(e.rank, n, r), list(range(n * r))):
        if group_id_from_ranks(ranks) == e.group_id:
            return ranks
    raise ValueError(f"Invalid column call {e}: its group is not a shard, replicate or world group.")


def tp_ns_calls_per_step(layout: TPRunLayout) -> int:
    """NS calls per step over all ranks: DMuon once per TP matrix and T times per matrix
    replicated over TP (once per column); the naive baselines W times every matrix."""
    specs = layout.muon_specs()
    if not layout.is_dmuon:
        return layout.world_size * sum(p.matrices for p in specs)
    tp = layout.tp_names()
    return sum(p.matrices * (1 if p.name in tp else layout.tp_size) for p in specs)


def tp_closed_form(layout: TPRunLayout) -> ClosedForm:
    """The closed form of docs/traffic-model.md, "Tensor parallelism", for ``layout``, as
    factors of P_M per phase (so that :meth:`ClosedForm.at` evaluates it at P_M): the mode's
    data-parallel form of docs/spec.md §2 (:func:`verify.traffic.formulas.closed_form` at N, R)
    evaluated at P_loc = P_TP/T + P_rep (its Z3 term in P_M^L at P_loc^L, the local elements
    of the unit Z3 keeps: :func:`verify.traffic.predict.kept_elems` of one TP column), plus in
    phase ``optimizer``

    - DMuon: the gather and the scatter, 2(T-1)/(T·W)·P_TP;
    - the naive baseline: the TP all_gather of every full gradient, (T-1)/T·P_TP;

    with P_TP the TP-sharded Muon elements and W = R·N·T.
    """
    n, r, t, w = layout.shard_size, layout.replicate_size, layout.tp_size, layout.world_size
    tp = layout.tp_names()
    specs = layout.muon_specs()
    p_m = sum(p.numel for p in specs) or 1
    p_tp = sum(p.numel for p in specs if p.name in tp)
    loc = (p_tp / t + (p_m - p_tp)) / p_m
    base = closed_form(layout.mode, n, r)
    kept = kept_elems(layout.column()) / p_m
    phases = {ph: base.at(ph, loc, p_m_kept=kept) for ph in base.phases}
    if layout.is_dmuon:
        step, text = 2 * (t - 1) / (t * w) * p_tp / p_m, "2(T-1)/(T·W)·P_TP"
    else:
        step, text = (t - 1) / t * p_tp / p_m, "(T-1)/T·P_TP"
    phases["optimizer"] = phases.get("optimizer", 0.0) + step
    local_terms = base.terms_text(p_m_kept=kept).replace("P_M^", "P_loc^")
    return ClosedForm(f"{base.text}·P_loc{local_terms} + {text}", phases)
