"""The prediction of a TP × EP run: attention tensor parallel on ``tp`` and experts on ``ep`` in
one model. Mesh ``("dp_shard", "ep", "tp")`` = N × E × T declared
``shard_dims=("dp_shard", "ep")``, W = N·E·T, rank (s, e, t) = world rank ``(s·E + e)·T + t``.

Derived from the documented protocol (``docs/protocol.md``, "Tensor parallelism", "Expert
parallelism" and "Other meshes"; ``docs/traffic-model.md``, "TP × EP") and the planner, never
from the runtime (this module imports ``dmuon.ownership.plan`` and nothing else of ``dmuon``).
It composes the TP kind (:mod:`verify.traffic.tp`) and the EP kind (:mod:`verify.traffic.ep`):

- **Per TP column** t (the N·E data-parallel ranks ``(*, *, t)``, column rank ``c = s·E + e``,
  world rank ``c·T + t``) the EP prediction of a layout whose TP matrices have their local
  shapes (dim d divided by T): the dense part (every Muon param but the expert stacks, the
  TP matrices' local shards included) as a plain DMuon on the ``(1, N·E)`` column, the expert
  stacks ``(X/E, a, b)`` per EP index e on the ``(1, N)`` ranks ``(*, e, t)``; one unit per block
  (a block's two kinds share it, Z3 keeps the last block of the merged order), no aligned
  groups (:func:`verify.traffic.ep.ep_part_calls`).
- **The plan** (docs/protocol.md, "Other meshes": slots ``(s_K, m)``, m the TP index; columns
  sharded on data dims first, each from the load the earlier left): the local stacks over the
  ``(1, N·T)`` slots (slot ``s·T + m``: owner s of every column ``(*, e, t)``), whose NS cost
  lands on the world slots ``(s·E + e)·T + m`` for every e; then the dense params with their
  full shapes over the ``(1, N·E·T)`` world slots from that load (slot ``c·T + m``: owner c,
  and for a TP matrix its NS rank m) (:meth:`TPEPRunLayout.plans`).
- **The rest** (``rest="wrapper"``: ``rest="replicate"`` is refused on a mesh with a
  model-parallel dim): FSDP2 on each TP column's N·E ranks (:mod:`verify.traffic.rules`).
- **DMuon's step 6** for the TP matrices: per TP group, its gather to and scatter from the
  NS rank (:func:`verify.traffic.tp.tp_step_calls`); **DTensor's** activation all_reduces
  (phase ``tp``, :func:`verify.traffic.tp.tp_activation_calls`).
- **The token all_to_all** (phase ``activations``) per EP group ``(s, *, t)`` (world ranks
  ``(s·E + e)·T + t`` in e order) from the recorded routing
  (:func:`verify.traffic.ep.predict_activations`, :meth:`TPEPRunLayout.ep_groups`).

Newton–Schulz per step across the mesh: once per TP matrix, T times per other dense matrix and
per expert (both replicated over TP: the owner steps them in every TP column).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from dmuon.ownership.plan import ParamSpec, plan_ownership
from tracer.events import group_id_from_ranks

from verify.traffic.ep import _PlannedLayout, ep_part_calls, ep_parts_form, merged_kept_block, predict_activations
from verify.traffic.formulas import ClosedForm
from verify.traffic.predict import ClosedFormCheck, Expected, RunLayout, _axis_calls, grad_clip_calls
from verify.traffic.rules import fsdp_calls
from verify.traffic.tp import _column_group, tp_activation_calls, tp_step_calls

#: Modes that run with TP × EP (``--tp T --ep E``): DMuon Z2 / Z3 on ``("dp_shard", "ep", "tp")``.
TPEP_MODES = ("dmuon-z2", "dmuon-z3")


def tpep_skip_reason(mode: str, world_size: int, tp: int, ep: int) -> str | None:
    """Why ``mode`` cannot run with ``--tp tp --ep ep`` at W = ``world_size`` (``None``: it
    can). The mesh is ``("dp_shard", "ep", "tp")`` of (W/(E·T), E, T): E·T must divide W."""
    if mode not in TPEP_MODES:
        return f"no TP x EP variant (--tp with --ep runs {', '.join(TPEP_MODES)})"
    if tp < 2 or ep < 2 or world_size % (tp * ep):
        return (f"TP x EP runs on a (W/(E·T), E, T) mesh: needs E, T >= 2 and E·T | W, have "
                f"W={world_size}, E={ep}, T={tp}")
    return None


@dataclass(frozen=True)
class TPEPRunLayout(RunLayout):
    """A :class:`RunLayout` on an ``N × E × T`` mesh (``shard_size`` = N, the ``dp_shard`` dim;
    ``replicate_size`` = 1).

    Attributes (besides RunLayout's; ``params`` keep their global shapes):
        tp_size: T, >= 2.
        ep_size: E, >= 2.
        tp_dims: ``(name, d)`` of every TP-sharded Muon param (``Shard(d)`` on ``mesh["tp"]``),
            as :class:`verify.traffic.tp.TPRunLayout`'s.
        tp_activations: ``(module, style, numel, dtype)`` per TP layer in model order, as
            :class:`verify.traffic.tp.TPRunLayout`'s.
        expert_names: the Muon params that are expert stacks (3-D, ``Shard(0)`` on ``mesh["ep"]``).
        ep_layers: ``(module, X, D, dtype)`` of each MoE layer, as
            :class:`verify.traffic.ep.EPRunLayout`'s.
        ep_routing: ``(module, counts)`` per forward of a MoE layer in the measured window,
            ``counts[rank]`` world rank ``rank``'s ``(X,)`` assignment counts, as
            :class:`verify.traffic.ep.EPRunLayout`'s.
    """

    kind: ClassVar[str] = "tpep"
    flat_allowed: ClassVar[bool] = False  # model-parallel and data-sharded: never flat

    tp_size: int = 1
    ep_size: int = 1
    tp_dims: tuple[tuple[str, int], ...] = ()
    tp_activations: tuple[tuple[str, str, int, str], ...] = ()
    expert_names: tuple[str, ...] = ()
    ep_layers: tuple[tuple[str, int, int, str], ...] = ()
    ep_routing: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tp_size", "ep_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise ValueError(f"Invalid {name}={v!r} for a TPEPRunLayout. Must be an int >= 2 (a run "
                                 "without both axes is a TPRunLayout or an EPRunLayout).")
        if self.mode not in TPEP_MODES:
            raise ValueError(f"Invalid mode={self.mode!r} for a TPEPRunLayout. Must be one of {TPEP_MODES}.")
        if self.replicate_size != 1:
            raise ValueError(f"Invalid replicate_size={self.replicate_size} for a TPEPRunLayout. Must be 1: "
                             "the TP x EP mesh ('dp_shard', 'ep', 'tp') has no replicate dim.")
        if self.dmuon_hierarchy == "flat" or self.dmuon_rest != "wrapper":
            raise ValueError(f"Invalid dmuon_hierarchy={self.dmuon_hierarchy!r}, dmuon_rest="
                             f"{self.dmuon_rest!r} for a TPEPRunLayout. Must be not 'flat' and 'wrapper': "
                             "dedicate_params refuses both others on a mesh with a model-parallel dim.")
        specs = {p.name: p for p in self.muon_specs()}
        experts = set(self.expert_names)
        for name in self.expert_names:
            p = specs.get(name)
            if p is None or len(p.shape) != 3 or p.shape[0] % self.ep_size:
                raise ValueError(f"Invalid expert stack {name!r} of shape {None if p is None else p.shape}: "
                                 f"must be a 3-D Muon param (X, a, b) with E={self.ep_size} dividing X.")
        for name, d in self.tp_dims:
            p = specs.get(name)
            if p is None or name in experts or d not in (0, 1) or len(p.shape) != 2 or p.shape[d] % self.tp_size:
                raise ValueError(f"Invalid TP param {name!r} (dim {d}, shape {None if p is None else p.shape}): "
                                 f"must be a 2-D Muon param, not an expert stack, sharded on dim 0 or 1 "
                                 f"that T={self.tp_size} divides.")

    @property
    def world_size(self) -> int:
        return self.shard_size * self.ep_size * self.tp_size

    def tp_names(self) -> dict[str, int]:
        return dict(self.tp_dims)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["tp_dims"] = [list(x) for x in self.tp_dims]
        d["tp_activations"] = [list(x) for x in self.tp_activations]
        d["expert_names"] = list(self.expert_names)
        d["ep_layers"] = [list(x) for x in self.ep_layers]
        d["ep_routing"] = [[m, [list(c) for c in counts]] for m, counts in self.ep_routing]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TPEPRunLayout:
        """Inverse of :meth:`to_dict` (:meth:`RunLayout.from_dict`'s errors; ``tp_size`` and
        ``ep_size`` required)."""
        cls.check_kind(d)
        missing = [k for k in ("tp_size", "ep_size") if k not in d]
        if missing:
            raise ValueError(f"Invalid layout for TPEPRunLayout.from_dict: missing {missing}. Must come "
                             "from TPEPRunLayout.to_dict (a layout.json of a --tp --ep run).")
        own = ("tp_size", "ep_size", "tp_dims", "tp_activations", "expert_names", "ep_layers",
               "ep_routing", "kind")
        base = RunLayout.from_dict({k: v for k, v in d.items() if k not in own})
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(RunLayout)},
                   tp_size=int(d["tp_size"]), ep_size=int(d["ep_size"]),
                   tp_dims=tuple((n, int(k)) for n, k in d.get("tp_dims", ())),
                   tp_activations=tuple((m, s, int(c), t) for m, s, c, t in d.get("tp_activations", ())),
                   expert_names=tuple(d.get("expert_names", ())),
                   ep_layers=tuple((m, int(x), int(w), t) for m, x, w, t in d.get("ep_layers", ())),
                   ep_routing=tuple((m, tuple(tuple(int(c) for c in row) for row in counts))
                                    for m, counts in d.get("ep_routing", ())))

    # ------------------------------ the kind's answers (RunLayout's class docstring)
    def predict_calls(self) -> list[Expected]:
        """Every call of one step on every rank but the token all_to_all: :func:`predict_tpep_step`."""
        return predict_tpep_step(self)

    def window_calls(self, steps: int) -> list[Expected]:
        """The token all_to_alls of the measured window (:func:`verify.traffic.ep.predict_activations`
        on this layout's EP groups, :meth:`ep_groups`)."""
        return predict_activations(self, steps)

    def ns_calls_per_step(self) -> int:
        """Newton–Schulz calls per step over all ranks: :func:`tpep_ns_calls_per_step`."""
        return tpep_ns_calls_per_step(self)

    def closed_form_check(self) -> ClosedFormCheck:
        """:func:`tpep_closed_form` at P_M; its kept-unit terms are inside."""
        return ClosedFormCheck(tpep_closed_form(self), self.p_m(), 0, 0)

    def dmuon_view(self) -> None:
        """``None``: the dedicated calls are two parts per TP column, not one layout."""
        return None

    def ns_plan(self) -> None:
        """``None``: a matrix replicated over TP runs its Newton–Schulz T times, not once."""
        return None

    def report_fields(self) -> dict:
        """``{"tp_size": T, "ep_size": E}``."""
        return {"tp_size": self.tp_size, "ep_size": self.ep_size}

    # ----------------------------------------------------------------------- parts
    def ep_groups(self) -> list[list[int]]:
        """The EP groups ``(s, *, t)``: world ranks ``(s·E + e)·T + t`` in e order."""
        e, t = self.ep_size, self.tp_size
        return [[(s * e + k) * t + m for k in range(e)] for s in range(self.shard_size) for m in range(t)]

    def local_stacks(self) -> list[ParamSpec]:
        """The expert stacks as one rank holds them: ``(X/E, a, b)``."""
        names = set(self.expert_names)
        return [dataclasses.replace(p, shape=(p.shape[0] // self.ep_size, *p.shape[1:]))
                for p in self.muon_specs() if p.name in names]

    def dense_specs(self) -> list[ParamSpec]:
        """Every Muon param but the expert stacks, with its global shape."""
        names = set(self.expert_names)
        return [p for p in self.muon_specs() if p.name not in names]

    def local_dense(self) -> list[ParamSpec]:
        """:meth:`dense_specs` with their per-rank shapes (a TP matrix's dim d divided by T)."""
        tp, out = self.tp_names(), []
        for p in self.dense_specs():
            if p.name in tp:
                shape = list(p.shape)
                shape[tp[p.name]] //= self.tp_size
                p = dataclasses.replace(p, shape=tuple(shape))
            out.append(p)
        return out

    def plans(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """``(expert_owner, dense_owner, ns_rank)`` (module docstring, "The plan"): an expert
        stack's owner s on its ``(1, N)`` column, a dense param's owner c on the ``(1, N·E)``
        column, a TP matrix's NS rank (its TP index m)."""
        n, e, t = self.shard_size, self.ep_size, self.tp_size
        load = [0.0] * self.world_size  # world slots (s·E + e)·T + m
        expert_owner: dict[str, int] = {}
        stacks = self.local_stacks()
        if stacks:
            xplan = plan_ownership(stacks, (1, n * t))
            for name, g in xplan.owner.items():
                s, m = divmod(g, t)
                expert_owner[name] = s
                for k in range(e):
                    load[(s * e + k) * t + m] += xplan.ns_cost[name]
        dplan = plan_ownership(self.dense_specs(), (1, n * e * t), initial_load=load if stacks else None)
        tp = self.tp_names()
        dense_owner, ns = {}, {}
        for name, g in dplan.owner.items():
            dense_owner[name], m = divmod(g, t)
            if name in tp:
                ns[name] = m
        return expert_owner, dense_owner, ns

    def _part(self, specs: list[ParamSpec], shard_size: int, owner: dict[str, int]) -> _PlannedLayout:
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunLayout)}
        base.update(params=tuple(specs), muon_names=tuple(p.name for p in specs), shard_size=shard_size,
                    dmuon_coalesce_bytes=0, dmuon_uneven_aligned=False, dmuon_hierarchy="hierarchical",
                    module_calls=(), fsdp_modules=(), ddp_buffers=(), frozen_names=(), qk_clip_heads=0,
                    grad_clips=0)
        return _PlannedLayout(**base, part_owner=tuple((p.name, owner[p.name]) for p in specs))

    def dense_part(self) -> _PlannedLayout:
        """One TP column's dense part: the local dense params on ``(1, N·E)``, owners from :meth:`plans`."""
        return self._part(self.local_dense(), self.shard_size * self.ep_size, self.plans()[1])

    def expert_part(self) -> _PlannedLayout:
        """One ``(*, e, t)`` column's expert part: the local stacks on ``(1, N)``."""
        return self._part(self.local_stacks(), self.shard_size, self.plans()[0])

    def rest_column(self) -> RunLayout:
        """One TP column as FSDP2 sees it: the params (local shapes) on ``(1, N·E)``."""
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunLayout)}
        tp = {p.name: p for p in self.local_dense()}
        base.update(params=tuple(tp.get(p.name, p) for p in self.params),
                    shard_size=self.shard_size * self.ep_size, dmuon_hierarchy="hierarchical")
        return RunLayout(**base)


def predict_tpep_step(layout: TPEPRunLayout) -> list[Expected]:
    """Every call of one step on every rank of a TP × EP run but the token all_to_all (module
    docstring)."""
    t_size = layout.tp_size
    kept = merged_kept_block(layout)
    dense, expert = layout.dense_part(), layout.expert_part()
    col = layout.rest_column()
    rest = fsdp_calls(col, set(layout.muon_names))
    out: list[Expected] = []
    for t in range(t_size):
        out += ep_part_calls(kept, dense, expert, layout.ep_size, to_world=lambda c, t=t: c * t_size + t)
        for c in range(col.world_size):
            for call in _axis_calls(col, c, rest):
                members = [m * t_size + t for m in _column_group(col, call)]
                out.append(dataclasses.replace(call, rank=c * t_size + t, group_id=group_id_from_ranks(members)))
    _, owner, ns = layout.plans()
    local = {p.name: p for p in layout.local_dense()}
    for rank in range(layout.world_size):
        out += tp_activation_calls(layout, rank)
        out += tp_step_calls(layout, rank, owner, ns, local)
        out += grad_clip_calls(layout, rank)
    return out


def tpep_ns_calls_per_step(layout: TPEPRunLayout) -> int:
    """NS calls per step over all ranks: once per TP matrix, T times per other dense matrix and
    per expert (every expert of a stack X once in each TP column)."""
    tp = layout.tp_names()
    return sum(p.matrices * (1 if p.name in tp else layout.tp_size) for p in layout.muon_specs())


def tpep_closed_form(layout: TPEPRunLayout) -> ClosedForm:
    """docs/traffic-model.md, "TP × EP", as factors of P_M per phase: the EP form of one TP
    column (:func:`verify.traffic.ep.ep_parts_form`: the mode's form at (N·E, 1) at
    P_D,loc = P_TP/T + P_D - P_TP, the local dense elements, plus the form at (N, 1) at P_X/E;
    Z3 terms at the kept block's local elements) plus in phase ``optimizer`` the TP gather and
    scatter, 2(T-1)/(T·W)·P_TP, with P_TP the TP-sharded Muon elements and W = N·E·T."""
    t, w, p_m = layout.tp_size, layout.world_size, layout.p_m() or 1
    tp = layout.tp_names()
    p_tp = sum(p.numel for p in layout.muon_specs() if p.name in tp)
    form = ep_parts_form(layout.mode, layout.shard_size, 1, layout.ep_size, layout.local_dense(),
                         layout.local_stacks(), merged_kept_block(layout), p_m, dense_label="P_D,loc")
    phases = dict(form.phases)
    phases["optimizer"] = phases.get("optimizer", 0.0) + 2 * (t - 1) / (t * w) * p_tp / p_m
    return ClosedForm(f"{form.text} + 2(T-1)/(T·W)·P_TP", phases)
