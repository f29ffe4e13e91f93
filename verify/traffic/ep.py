"""The prediction of an expert-parallel (EP) run: mesh ``("shard", "ep")`` = N × E or
``("replicate", "shard", "ep")`` = R × N × E, W = R·N·E, rank (r, s, e) = world rank
``(r·N + s)·E + e``.

Derived from the documented protocol (``docs/protocol.md``, "Expert parallelism";
``docs/traffic-model.md``, "Expert parallelism") and the planner, never from the runtime (this
module imports ``dmuon.ownership.plan`` and nothing else of ``dmuon``):

- **Expert stacks** (3-D Muon params ``(X, a, b)``, ``Shard(0)`` on ``mesh["ep"]``): per EP
  column e (world ranks ``(r·N + s)·E + e``), every DMuon call of the plain prediction
  (:func:`verify.traffic.predict.predict_step`) on an ``(R, N)`` layout of the local stacks
  ``(X/E, a, b)``, owners from the planner over ``(R, N)`` (the same owner ``r·N + s`` in
  every column).
- **Dense params** (every other Muon param): the plain prediction on the ``(R, N·E)`` mesh of
  all W ranks (shard axis ``(r, ·, ·)``, replicate axis ``(·, s, e)``: the world ranks
  themselves), owners from the planner over ``(R, N·E)`` started from the expert load of
  each rank (``plan_ownership(initial_load=)``: a column owner's X/E-matrix NS cost on each
  of its E world ranks).
- **Units**: one per block, no aligned groups (``coalesce`` joins no blocks on an EP mesh:
  both parts are predicted at ``coalesce="block"``); a block's two kinds share its unit, so
  Z3 keeps the unit of the last block of the merged order (the recorded block order, else
  model order) for both kinds, and re-broadcasts in backward everything else. The divisor W
  of both kinds changes no byte.
- **The rest** (``rest="replicate"``): one world all_reduce per dtype of the trainable rest
  in backward (:func:`verify.traffic.rules.rest_calls`).
- **The token all_to_all** (phase ``activations``, no dedicated share), from the routing the
  harness recorded (:attr:`EPRunLayout.ep_routing`: per forward of each MoE layer in the
  measured window, each rank's per-expert assignment counts ``(X,)``), per EP group
  ``(r, s, ·)`` and layer forward (``examples/ep_moe.py``): the counts' all_to_all (int64,
  X per rank, X/E per peer); the dispatch (rank e sends ``Σ counts_e[j·X/E:(j+1)·X/E]`` rows
  of D to EP rank j, receives ``Σ counts_j[e·X/E:(e+1)·X/E]`` from it); the combine (its
  transpose); in backward the two transposes (a dispatch-shaped and a combine-shaped call).
  These differ per step, so they are the layout's :meth:`EPRunLayout.window_calls`, not a
  step's calls.

NS runs once per expert per step across the mesh (X per stack) and once per dense matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from dmuon.ownership.plan import OwnershipPlan, ParamSpec, plan_ownership
from tracer.events import all_to_all_count, group_id_from_ranks

from verify.traffic.formulas import ClosedForm, closed_form
from verify.traffic.predict import (
    ClosedFormCheck,
    Expected,
    RunLayout,
    dmuon_block,
    dmuon_block_sequence,
    dmuon_model_blocks,
    predict_step,
)
from verify.traffic.rules import rest_calls
from verify.traffic.tp import _column_group

#: Modes that run with EP (``--ep E``): DMuon Z2 / Z3, and HSDP on (2, W/(2E), E).
EP_MODES = ("dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")
#: The phase of the token all_to_all (the harness's tag, ``verify.modes.ep``).
ACTIVATIONS = "activations"


def ep_skip_reason(mode: str, world_size: int, ep: int) -> str | None:
    """Why ``mode`` cannot run with ``--ep ep`` at W = ``world_size`` (``None``: it can).
    The mesh is (W/E, E) ``("shard", "ep")``; HSDP's (2, W/(2E), E) needs 2E to divide W."""
    if mode not in EP_MODES:
        return f"no expert-parallel variant (--ep runs {', '.join(EP_MODES)})"
    if "hsdp" in mode and world_size % (2 * ep):
        return f"HSDP x EP runs on a (2, W/(2E), E) mesh: needs 2E | W, have W={world_size}, E={ep}"
    return None


@dataclass(frozen=True)
class _PlannedLayout(RunLayout):
    """One part's data-parallel layout whose plan is given (the EP plan's owners)."""

    part_owner: tuple[tuple[str, int], ...] = ()

    def plan(self) -> OwnershipPlan:
        return OwnershipPlan(mesh_shape=(self.replicate_size, self.shard_size),
                             specs=tuple(self.muon_specs()), owner=dict(self.part_owner))


@dataclass(frozen=True)
class EPRunLayout(RunLayout):
    """A :class:`RunLayout` on an ``R × N × E`` mesh (``replicate_size`` = R, ``shard_size`` = N).

    Attributes (besides RunLayout's; ``params`` keep their global shapes):
        ep_size: E, >= 2 (a run without EP is a :class:`RunLayout`).
        expert_names: the Muon params that are expert stacks (3-D, ``Shard(0)`` on
            ``mesh["ep"]``), in model order.
        ep_layers: ``(module, X, D, dtype)`` of each MoE layer: its experts, the token width
            and the dtype of the rows its all_to_all moves.
        ep_routing: ``(module, counts)`` per forward of a MoE layer in the measured window,
            in issue order; ``counts[rank]`` is world rank ``rank``'s ``(X,)`` per-expert
            assignment counts (token-expert pairs) of that forward.
    """

    kind: ClassVar[str] = "ep"
    flat_allowed: ClassVar[bool] = False  # dedicate_params refuses hierarchy="flat" on EP

    ep_size: int = 1
    expert_names: tuple[str, ...] = ()
    ep_layers: tuple[tuple[str, int, int, str], ...] = ()
    ep_routing: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        e = self.ep_size
        if isinstance(e, bool) or not isinstance(e, int) or e < 2:
            raise ValueError(f"Invalid ep_size={e!r} for an EPRunLayout. Must be an int >= 2 (E; "
                             "a run without expert parallelism is a RunLayout).")
        if self.mode not in EP_MODES:
            raise ValueError(f"Invalid mode={self.mode!r} for an EPRunLayout. Must be one of {EP_MODES}.")
        if self.dmuon_hierarchy == "flat":
            raise ValueError("Invalid dmuon_hierarchy='flat' with ep_size > 1. Must be 'auto' or "
                             "'hierarchical': dedicate_params refuses 'flat' on a mesh with an 'ep' axis.")
        if self.dmuon_rest != "replicate":
            raise ValueError(f"Invalid dmuon_rest={self.dmuon_rest!r} with ep_size > 1. Must be "
                             "'replicate' (the tested way to handle an EP model's rest).")
        specs = {p.name: p for p in self.muon_specs()}
        for name in self.expert_names:
            p = specs.get(name)
            if p is None or len(p.shape) != 3 or p.shape[0] % e:
                raise ValueError(f"Invalid expert stack {name!r} of shape {None if p is None else p.shape}: "
                                 f"must be a 3-D Muon param (X, a, b) with E={e} dividing X.")

    @property
    def world_size(self) -> int:
        return self.replicate_size * self.shard_size * self.ep_size

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["expert_names"] = list(self.expert_names)
        d["ep_layers"] = [list(x) for x in self.ep_layers]
        d["ep_routing"] = [[m, [list(c) for c in counts]] for m, counts in self.ep_routing]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EPRunLayout:
        """Inverse of :meth:`to_dict` (:meth:`RunLayout.from_dict`'s errors; ``ep_size`` required)."""
        cls.check_kind(d)
        if "ep_size" not in d:
            raise ValueError("Invalid layout for EPRunLayout.from_dict: missing ep_size. Must come "
                             "from EPRunLayout.to_dict (a layout.json of an --ep run).")
        own = ("ep_size", "expert_names", "ep_layers", "ep_routing", "kind")
        base = RunLayout.from_dict({k: v for k, v in d.items() if k not in own})
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(RunLayout)},
                   ep_size=int(d["ep_size"]), expert_names=tuple(d.get("expert_names", ())),
                   ep_layers=tuple((m, int(x), int(w), t) for m, x, w, t in d.get("ep_layers", ())),
                   ep_routing=tuple((m, tuple(tuple(int(c) for c in row) for row in counts))
                                    for m, counts in d.get("ep_routing", ())))

    # ------------------------------ the kind's answers (RunLayout's class docstring)
    def predict_calls(self) -> list[Expected]:
        """Every DMuon and rest call of one step on every rank (module docstring); the token
        all_to_all is in :meth:`window_calls`."""
        return predict_ep_step(self)

    def window_calls(self, steps: int) -> list[Expected]:
        """The token all_to_alls of the whole measured window (``steps`` steps), from
        :attr:`ep_routing`: :func:`predict_activations`."""
        return predict_activations(self, steps)

    def closed_form_check(self) -> ClosedFormCheck:
        """:func:`ep_closed_form` at P_M (= P_D + P_X); its kept-unit terms are inside."""
        return ClosedFormCheck(ep_closed_form(self), self.p_m(), 0, 0)

    def dmuon_view(self) -> None:
        """``None``: the dedicated calls are two parts (dense, per-column expert), not one layout."""
        return None

    def ns_plan(self) -> None:
        """``None``: an expert stack's NS runs on one owner per column, not one owner per matrix."""
        return None

    def report_fields(self) -> dict:
        """``{"tp_size": 1, "ep_size": E}``."""
        return {"tp_size": 1, "ep_size": self.ep_size}

    # ----------------------------------------------------------------------- parts
    def _base(self, **changes) -> dict:
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunLayout)}
        base.update(dmuon_coalesce_bytes=0, dmuon_uneven_aligned=False, dmuon_hierarchy="hierarchical",
                    module_calls=(), **changes)
        return base

    def local_stacks(self) -> list[ParamSpec]:
        """The expert stacks as one rank holds them: ``(X/E, a, b)``."""
        names = set(self.expert_names)
        return [dataclasses.replace(p, shape=(p.shape[0] // self.ep_size, *p.shape[1:]))
                for p in self.muon_specs() if p.name in names]

    def dense_specs(self) -> list[ParamSpec]:
        names = set(self.expert_names)
        return [p for p in self.muon_specs() if p.name not in names]

    def expert_plan(self) -> OwnershipPlan:
        """The local stacks planned over the column mesh ``(R, N)``."""
        return plan_ownership(self.local_stacks(), (self.replicate_size, self.shard_size))

    def dense_plan(self) -> OwnershipPlan:
        """The dense params over ``(R, N·E)`` from the expert load of every world rank."""
        e, n = self.ep_size, self.shard_size
        xp = self.expert_plan()
        load = [0.0] * self.world_size
        for name, g in xp.owner.items():
            for k in range(e):
                load[g * e + k] += xp.ns_cost[name]
        return plan_ownership(self.dense_specs(), (self.replicate_size, n * e), initial_load=load)

    def dense_part(self) -> _PlannedLayout:
        specs = self.dense_specs()
        return _PlannedLayout(**self._base(params=tuple(specs), muon_names=tuple(p.name for p in specs),
                                           shard_size=self.shard_size * self.ep_size),
                              part_owner=tuple(self.dense_plan().owner.items()))

    def expert_part(self) -> _PlannedLayout:
        specs = self.local_stacks()
        return _PlannedLayout(**self._base(params=tuple(specs), muon_names=tuple(p.name for p in specs)),
                              part_owner=tuple(self.expert_plan().owner.items()))

    def kept_block(self) -> str | None:
        """The unit Z3 keeps (both kinds): :func:`merged_kept_block`."""
        return merged_kept_block(self)

    def ep_groups(self) -> list[list[int]]:
        """The EP groups ``(r, s, ·)``, world ranks in e order: E consecutive ranks each."""
        e = self.ep_size
        return [list(range(base, base + e)) for base in range(0, self.world_size, e)]


def merged_kept_block(layout: RunLayout) -> str | None:
    """The unit Z3 keeps when a block's params move over two columns (both kinds share the
    block's unit): the last block of the merged order (the recorded block order, else model
    order) of all of ``layout``'s Muon params; ``None`` under Z2."""
    if not layout.reshard_after_forward or not layout.muon_names:
        return None
    model = dmuon_model_blocks(layout.muon_specs())
    return dmuon_block_sequence(model, layout.dmuon_block_order)[-1]


def _part_calls(kept: str | None, part: RunLayout) -> list[Expected]:
    """The plain prediction of ``part``; under Z3 the plain rule keeps the part's own last
    unit, so where that is not the merged kept unit ``kept`` (:func:`merged_kept_block`) its
    forward broadcasts are repeated in backward."""
    calls = predict_step(part)
    specs = part.muon_specs()
    if kept is None or not specs:
        return calls
    own_last = dmuon_block_sequence(dmuon_model_blocks(specs), part.dmuon_block_order)
    own_last = [b for b in own_last if any(dmuon_block(p.module) == b for p in specs)][-1]
    if own_last == kept:
        return calls
    again = [dataclasses.replace(c, phase="backward") for c in calls
             if c.phase == "forward" and c.module == own_last]
    return calls + again


def ep_part_calls(kept: str | None, dense: RunLayout, expert: RunLayout, e_size: int,
                  to_world=None) -> list[Expected]:
    """DMuon's calls of one step of the two parts of an EP mesh (module docstring): ``dense``'s
    on its ``(R, N·E)`` ranks, ``expert``'s on its ``(R, N)`` ranks once per EP index e (column
    rank ``r·N + s`` -> ``(r·N + s)·E + e``), both with the merged kept unit ``kept``
    (:func:`_part_calls`). ``to_world``: the world rank of an ``(R, N·E)`` rank (identity:
    they are the world ranks; ``verify.traffic.tpep``: one TP column's); groups are remapped
    member by member."""
    to_world = to_world or (lambda c: c)

    def moved(c: Expected, rank: int, members: list[int]) -> Expected:
        return dataclasses.replace(c, rank=to_world(rank),
                                   group_id=group_id_from_ranks([to_world(m) for m in members]))

    out = [moved(c, c.rank, _column_group(dense, c)) for c in _part_calls(kept, dense)]
    for c in _part_calls(kept, expert):
        members = _column_group(expert, c)
        out += [moved(c, c.rank * e_size + e, [m * e_size + e for m in members]) for e in range(e_size)]
    return out


def predict_ep_step(layout: EPRunLayout) -> list[Expected]:
    """Every call of one step on every rank but the token all_to_all (module docstring)."""
    out = ep_part_calls(layout.kept_block(), layout.dense_part(), layout.expert_part(), layout.ep_size)
    world = group_id_from_ranks(range(layout.world_size))
    for rank in range(layout.world_size):
        out += [Expected(rank, c.phase, c.op, world, c.group_size, c.count, c.dtype, c.root, c.module,
                         c.dedicated_count) for c in rest_calls(layout)]
    return out


def _a2a(rank: int, gid: str, size: int, module: str, dtype: str, in_elems: int, out_elems: int,
         self_elems: int) -> Expected:
    return Expected(rank, ACTIVATIONS, "all_to_all", gid, size, all_to_all_count(in_elems, out_elems, size),
                    dtype, None, module, 0, in_elems=in_elems, out_elems=out_elems, self_elems=self_elems,
                    dedicated_in_elems=0, dedicated_out_elems=0)


def predict_activations(layout: EPRunLayout, steps: int) -> list[Expected]:
    """The token all_to_alls of ``steps`` measured steps on every rank (module docstring).

    Raises:
        ValueError: :attr:`EPRunLayout.ep_routing` does not hold one forward per MoE layer
            per step, names an unknown layer, or a counts row is not ``(X,)`` per world rank.
    """
    layers = {m: (x, d, t) for m, x, d, t in layout.ep_layers}
    routing = layout.ep_routing
    if len(routing) != steps * len(layers):
        raise ValueError(f"Invalid ep_routing of {len(routing)} layer forwards for {steps} steps of "
                         f"{len(layers)} MoE layers. Must hold one entry per layer per measured step "
                         "(recorded by verify.modes.ep.RoutingRecorder).")
    e_size, w = layout.ep_size, layout.world_size
    groups = layout.ep_groups()
    out: list[Expected] = []
    for module, counts in routing:
        if module not in layers:
            raise ValueError(f"Invalid ep_routing entry {module!r}: not a MoE layer of ep_layers {sorted(layers)}.")
        x, d, dtype = layers[module]
        if len(counts) != w or any(len(row) != x for row in counts):
            raise ValueError(f"Invalid ep_routing counts of {module!r}: must be W={w} rows of X={x}.")
        local = x // e_size
        for group in groups:  # one EP group, world ranks in e order
            gid = group_id_from_ranks(group)
            for me, rank in enumerate(group):
                out.append(_a2a(rank, gid, e_size, module, "int64", x, x, local))
                send = [sum(counts[rank][j * local:(j + 1) * local]) * d for j in range(e_size)]
                recv = [sum(counts[group[j]][me * local:(me + 1) * local]) * d for j in range(e_size)]
                mine = send[me]
                for _ in range(2):  # forward dispatch + the combine's transpose in backward
                    out.append(_a2a(rank, gid, e_size, module, dtype, sum(send), sum(recv), mine))
                for _ in range(2):  # forward combine + the dispatch's transpose in backward
                    out.append(_a2a(rank, gid, e_size, module, dtype, sum(recv), sum(send), mine))
    return out


def ep_closed_form(layout: EPRunLayout) -> ClosedForm:
    """docs/traffic-model.md, "Expert parallelism", as factors of P_M = P_D + P_X per phase:
    the mode's form of docs/spec.md §2 at (N·E, R) evaluated at P_D (its Z3 term at P_D^L,
    the dense elements of the kept unit) plus the form at (N, R) at P_X/E (Z3: P_X^L, the
    local stack elements of the kept unit)."""
    return ep_parts_form(layout.mode, layout.shard_size, layout.replicate_size, layout.ep_size,
                         layout.dense_specs(), layout.local_stacks(), layout.kept_block(), layout.p_m())


def ep_parts_form(mode: str, n: int, r: int, e: int, dense: list[ParamSpec], stacks: list[ParamSpec],
                  kept: str | None, p_m: int, dense_label: str = "P_D") -> ClosedForm:
    """:func:`ep_closed_form` from its pieces, as factors of ``p_m`` per phase: the mode's form
    at (N·E, R) at the elements of ``dense`` (labelled ``dense_label``) plus the form at (N, R)
    at those of ``stacks`` (the local stacks, ``P_X/E``); their Z3 terms at the elements of the
    block ``kept`` (:func:`merged_kept_block`)."""
    p_m = p_m or 1
    out: dict[str, float] = {}
    texts = []
    for specs, form, label in ((dense, closed_form(mode, n * e, r), dense_label),
                               (stacks, closed_form(mode, n, r), "P_X/E")):
        p = sum(s.numel for s in specs) / p_m
        k = sum(s.numel for s in specs if kept is not None and dmuon_block(s.module) == kept) / p_m
        for ph in {*form.phases, *(form.kept_phases or {})}:
            out[ph] = out.get(ph, 0.0) + form.at(ph, p, p_m_kept=k)
        terms = form.terms_text(p_m_kept=k).replace("P_M^L", label.replace("/E", "") + "^L")
        texts.append(_part_text(form.text + terms.replace("P_M", label), label))
    return ClosedForm(" + ".join(texts), out)


def _part_text(text: str, label: str) -> str:
    """A part's form as printed: the plain form's N and W renamed to the part's mesh (dense:
    N·E and W; expert: N and R·N) and applied to ``label``."""
    if label != "P_X/E":
        text = text.replace("(N-1)/N", "(NE-1)/(NE)")
    else:
        text = text.replace("(W-1)/W", "(RN-1)/(RN)")
    head, sep, tail = text.partition(" − ")
    head = f"({head})" if " + " in head else head
    return f"{head}·{label}" + (f" − {tail}" if sep else "")
