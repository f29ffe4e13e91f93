"""``dmuon-plan --ep E``: DMuon × expert parallelism on an (R, N, E) mesh, W = R·N·E.

Derived from the documented EP protocol (docs/traffic-model.md, "Expert parallelism"), not
from the runtime. An **expert stack** is a 3-D Muon param ``(X, a, b)`` in the stack layout
(X matrices of a × b, ``ParamSpec.matrix`` ``None``); EP shards it ``Shard(0)`` over the
``"ep"`` axis, so rank (r, s, e) holds the local stack ``(X/E, a, b)`` of experts
``[e·X/E, (e+1)·X/E)``. Every other Muon param is **dense**: identical on all W ranks.

- **Plan** (:func:`plan_ep`): the local stacks are planned over the column mesh (R, N) by
  :func:`dmuon.ownership.plan.plan_ownership` (cost: X/E matrices of a × b); owner (r, s) of a
  local stack owns it in every column e, so its load lands on world ranks (r, s, e) for every
  e. The dense params are then planned over the W slots of the data-parallel mesh
  (R, N·E) on top of that load (``plan_ownership(initial_load=)``: its greedy LPT from the
  expert loads, without the MULTIFIT retry).
- **Traffic** per mode: the dense part is a plain DMuon over (R, N·E) at P_D, the expert part
  a plain DMuon over each column's (R, N) at P_X/E (:func:`verify.traffic.scale.step_traffic`
  on each part's own layout and plan); world rank (r, s, e) issues the dense calls of shard
  index s·E + e and the expert calls of column shard index s. Figures are the dedicated ones
  only (the rest's FSDP2 calls are not counted here; the table above has them).
- **NS**: once per expert per step across the mesh (X per stack) and once per dense matrix;
  balance = max / mean of the per-rank FLOPs over the W ranks.
- **Memory** per rank (:func:`verify.plan.memory.rank_memory` of each part, summed per world
  rank; rest AdamW from the whole model on (R, N·E)): Z2 holds P_D + P_X/E, Z3 the owned
  share plus each part's prefetch window.
- **Activations** (the token all_to_all over the EP group, not P_M): sized per routed token
  from the model's ``config.moe.top_k`` and ``config.d_model`` when it has them (the presets).

World rank of (r, s, e) = (r·N + s)·E + e; the dense slot of the (R, N·E) plan is that rank.

**TP × EP** (``tp`` = T > 1; docs/traffic-model.md, "TP × EP"; the mesh R × N × E × T,
torchtitan's ``dp_shard × ep × tp`` with ``shard_dims=("dp_shard", "ep")``, docs/protocol.md,
"Other meshes"; world rank
((r·N + s)·E + e)·T + t): a dense Muon matrix one of whose dims T divides is TP-sharded
but a MoE layer's router (:func:`verify.plan.tp.tp_dims`, as torchtitan leaves it
unsharded); the other dense params and the expert stacks are replicated
over TP. Each TP column (the R·N·E ranks of one t) is the EP layout above with every
TP matrix at its local shape (n/T), so its figures are the ones above at P_D,loc = P_TP/T +
P_rep; the T columns are alike. The plan (docs/protocol.md, "Other meshes": slots (r, s_K, m),
m the TP index, columns sharded on data dims first): the local stacks over the slots (R, N·T),
slot (r·N + s)·T + m making (r, s) their column owner; each stack's cost on the world ranks
(r, s, e, m) for every e; then the dense params over the W = R·N·E·T world slots from that load
(slot g: column owner g // T and, for a TP matrix, NS rank g). The NS work itself: each stack
in every column (e, t) of its owner, a matrix replicated over TP on each rank of its owner's
TP group. The TP step adds per TP matrix a gather and a scatter on its owner's TP group
(:func:`verify.plan.tp.tp_step_traffic`), 2(T-1)/(T·W)·P_TP on the W-average. NS runs once per
TP matrix and in every TP column for a replicated matrix and for each expert. Memory and the
token all_to_all are not sized under TP (``None``).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from tabulate import tabulate

from dmuon.ownership.plan import OwnershipPlan, ParamSpec, plan_ownership

from verify.plan.args import UsageError
from verify.plan.kind import PlanContext, PlanKind, given
from verify.plan.memory import FIELDS, adamw_rest_bytes, rank_memory
from verify.plan.tp import tp_dims, tp_local, tp_modes, tp_step_traffic
from verify.traffic.formulas import closed_form
from verify.traffic.predict import RunLayout
from verify.traffic.scale import StepTraffic, step_traffic

__all__ = ["KIND", "EPKind", "EPPlan", "TPStep", "tp_column", "ep_report", "expert_stacks", "format_ep", "part_traffic", "plan_ep", "rank_traffic",
           "split_specs"]


def expert_stacks(specs) -> list[ParamSpec]:
    """The expert stacks among Muon ``specs``: 3-D, stack layout (module docstring)."""
    return [sp for sp in specs if len(sp.shape) == 3 and sp.matrix_shape == tuple(sp.shape[-2:])]


def split_specs(specs, e: int) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """``(dense, local_stacks)`` of the Muon ``specs`` at EP degree ``e``; a local stack is
    its expert stack with dim 0 divided by ``e`` (same name, dtype, module).

    Raises:
        UsageError: no expert stack, or a stack whose X ``e`` does not divide.
    """
    stacks = expert_stacks(specs)
    if not stacks:
        raise UsageError(
            f"Invalid --ep {e}: the model has no expert stacks (3-D Muon params (X, a, b)), so "
            "nothing to shard over 'ep'. Use a model whose experts are 3-D params (e.g. the "
            "preset deepseek-v3-like-stacked), or drop --ep.")
    bad = [sp for sp in stacks if sp.shape[0] % e]
    if bad:
        sp = bad[0]
        raise UsageError(
            f"Invalid --ep {e} for expert stack {sp.name!r} of shape {tuple(sp.shape)}: X = "
            f"{sp.shape[0]} experts must be divisible by E = {e} (each EP rank holds X/E of "
            f"them). Give an --ep that divides {sp.shape[0]}.")
    names = {sp.name for sp in stacks}
    dense = [sp for sp in specs if sp.name not in names]
    local = [dataclasses.replace(sp, shape=(sp.shape[0] // e, *sp.shape[1:])) for sp in stacks]
    return dense, local


@dataclass(frozen=True)
class EPPlan:
    """The two-level plan on an (R, N, E) mesh (with ``tp`` = T: (R, N, E, T)).

    Attributes:
        mesh: (R, N, E).
        expert: owners of the local stacks on the slots (R, N·T): owner slot (r·N + s)·T + m,
            column owner index r·N + s (T = 1: the column mesh (R, N)).
        dense: owners of the dense params on (R, N·E·T): owner index = world rank.
        tp: T.
    """

    mesh: tuple[int, int, int]
    expert: OwnershipPlan
    dense: OwnershipPlan
    tp: int = 1

    @property
    def world_size(self) -> int:
        r, n, e = self.mesh
        return r * n * e * self.tp

    def column_rank(self, rank: int) -> int:
        """The column owner index r·N + s of world rank (r, s, e[, t])."""
        return rank // (self.mesh[2] * self.tp)

    def expert_load(self) -> list[float]:
        """NS FLOPs per column owner index r·N + s and step: its local stacks (of all its T
        slots), which it runs in every column (e, t)."""
        xl, t = self.expert.ns_load, self.tp
        return [sum(xl[c * t + m] for m in range(t)) for c in range(len(xl) // t)]

    def ns_load(self) -> list[float]:
        """NS FLOPs per world rank and step: its column owner's local stacks plus its dense
        matrices."""
        xl, dl = self.expert_load(), self.dense.ns_load
        return [xl[self.column_rank(g)] + dl[g] for g in range(self.world_size)]


def plan_ep(dense: list[ParamSpec], local_stacks: list[ParamSpec], mesh: tuple[int, int, int],
            tp: int = 1) -> EPPlan:
    """Plan the local stacks over (R, N), then the dense params over (R, N·E) on top of the
    expert load of every world rank (module docstring: LPT from initial loads). With ``tp`` =
    T (module docstring, "TP × EP"): the stacks over the slots (R, N·T), a stack's cost on the
    world ranks (r, s, e, m) of its slot's TP index m for every e, then the dense params over
    the W = R·N·E·T world slots."""
    r, n, e = mesh
    expert = plan_ownership(local_stacks, (r, n * tp))
    xl = expert.ns_load
    # world rank (r, s, e, m) -> the load of its stack slot (r·N + s)·T + m
    load = [xl[g // (e * tp) * tp + g % tp] for g in range(r * n * e * tp)]
    dense_plan = plan_ownership(dense, (r, n * e * tp), initial_load=load)
    return EPPlan(mesh=(r, n, e), expert=expert, dense=dense_plan, tp=tp)


@dataclass(frozen=True)
class _PartLayout(RunLayout):
    """One part's layout whose ``plan()`` is the EP plan's (the predictors ask the layout)."""

    part_plan: OwnershipPlan | None = None

    def plan(self) -> OwnershipPlan:
        return self.part_plan


def _part(base: RunLayout, specs: list[ParamSpec], plan: OwnershipPlan) -> _PartLayout:
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(RunLayout)}
    fields.update(params=tuple(specs), muon_names=tuple(sp.name for sp in specs))
    return _PartLayout(**fields, part_plan=plan)


def _per_shard(st: StepTraffic, attr: str) -> list[float]:
    """``attr`` of the tally every rank of shard index s issues, for each s."""
    base = getattr(st.common, attr)
    return [base + (getattr(st.extra[s], attr) if s in st.extra else 0) for s in range(st.shard_size)]


def _form_text(mode: str) -> str:
    if mode == "dmuon-z2":
        return "2(NE-1)/(NE)·P_D + 2(N-1)/N·P_X/E"
    if mode == "dmuon-z3":
        return "3(NE-1)/(NE)·P_D − (NE-1)/(NE)·P_D^L + 3(N-1)/N·P_X/E − (N-1)/N·P_X^L"
    if mode == "dmuon-hsdp-z2":
        return "2(W-1)/W·P_D + 2(RN-1)/(RN)·P_X/E"
    return ("(2(W-1)/W + (NE-1)/(NE))·P_D − (NE-1)/(NE)·P_D^L + (2(RN-1)/(RN) + (N-1)/N)·P_X/E "
            "− (N-1)/N·P_X^L")


def part_traffic(ml, plan: EPPlan, mode: str, coalesce_bytes: int, dense, local):
    """``(dense layout, expert layout, dense StepTraffic, expert StepTraffic)`` of ``mode``:
    the dense part on (R, N·E), one column's expert part on (R, N) at the local shapes."""
    r, n, e = plan.mesh
    lay_d = _part(ml.layout(mode, r, n * e, coalesce_bytes), dense, plan.dense)
    lay_x = _part(ml.layout(mode, r, n, coalesce_bytes), local, plan.expert)
    return lay_d, lay_x, step_traffic(lay_d, plan.dense), step_traffic(lay_x, plan.expert)


def rank_traffic(st_d: StepTraffic, st_x: StepTraffic, mesh: tuple[int, int, int],
                 t: int = 1) -> dict[str, list]:
    """Per world rank (r, s, e[, t]), in rank order: ``calls``, ``ded_avg_elems`` and
    ``ded_avg_bytes`` of one step, the dense tally of shard index s·E + e plus the expert
    tally of column shard index s (every replica r alike, as in ``StepTraffic``; with
    ``t`` = T, every TP index alike: the tallies of one TP column, without the TP step)."""
    r, n, e = mesh
    out = {}
    for attr in ("calls", "ded_avg_elems", "ded_avg_bytes"):
        d, x = _per_shard(st_d, attr), _per_shard(st_x, attr)
        out[attr] = [d[s * e + k] + x[s] for s in range(n) for k in range(e) for _ in range(t)] * r
    return out


@dataclass(frozen=True)
class TPStep:
    """The ``tp`` axis of a TP × EP layout (R, N, E, T): T, W = R·N·E·T, P_TP (the TP-sharded
    dense elements, full shapes) and DMuon's step-6 gathers and scatters per world rank
    (:func:`verify.plan.tp.tp_step_traffic`)."""

    t: int
    world_size: int
    p_tp: int
    per_rank: dict[str, list]

    def add_to(self, row: dict, per_rank: dict[str, list]) -> dict:
        """``row`` (one TP column's figures, ``per_rank`` its tallies on all W ranks) with the
        TP step added: on the W-average 2(T-1)/(T·W)·P_TP (docs/traffic-model.md, "Tensor
        parallelism"), per rank the tally."""
        t, w = self.t, self.world_size
        gather = (t - 1) / (t * w) * self.p_tp
        ranks = {k: [a + b for a, b in zip(v, self.per_rank[k])] for k, v in per_rank.items()}
        step = {k: sum(v) / w for k, v in self.per_rank.items()}
        return {**row,
                # one column's form (its W is R·N·E) at the local shapes, plus the TP step
                "closed_form": row["closed_form"].replace("P_D", "P_D,loc").replace("(W-1)/W", "(RNE-1)/(RNE)")
                + " + 2(T-1)/(T·W)·P_TP",
                "closed_form_elems": row["closed_form_elems"] + 2 * gather,
                "ded_avg_elems": row["ded_avg_elems"] + step["ded_avg_elems"],
                "ded_avg_bytes": row["ded_avg_bytes"] + step["ded_avg_bytes"],
                "ded_max_bytes": max(ranks["ded_avg_bytes"]),
                "calls_avg": row["calls_avg"] + step["calls"],
                "calls_max": int(max(ranks["calls"])),
                "tp_gather_elems": gather, "tp_scatter_elems": gather}


def tp_column(plan: EPPlan, dense: list[ParamSpec], tp: dict[str, int]) -> tuple[EPPlan, list[ParamSpec], TPStep | None]:
    """One TP column of ``plan`` (module docstring, "TP × EP"), ``tp`` the TP-sharded dense
    params (:func:`verify.plan.tp.tp_dims`): ``(the column's EP plan on (R, N, E), the dense params at their local
    shapes, the TP step)``; the column's owners are the slots' column ranks (slot // T).
    T = 1: ``(plan, dense, None)``."""
    t = plan.tp
    if t == 1:
        return plan, list(dense), None
    r, n, e = plan.mesh
    local = [tp_local(sp, tp[sp.name], t) if sp.name in tp else sp for sp in dense]
    column = EPPlan(mesh=(r, n, e), expert=OwnershipPlan(
        mesh_shape=(r, n), specs=plan.expert.specs,
        owner={name: j // t for name, j in plan.expert.owner.items()}), dense=OwnershipPlan(
        mesh_shape=(r, n * e), specs=tuple(local),
        owner={name: g // t for name, g in plan.dense.owner.items()}))
    sharded = [sp for sp in dense if sp.name in tp]
    w = plan.world_size
    return column, local, TPStep(t, w, sum(sp.numel for sp in sharded),
                                 tp_step_traffic(sharded, plan.dense.owner, t, w))


def _mode_row(mode: str, ml, plan: EPPlan, dense, local, coalesce_bytes: int, tp: TPStep | None = None) -> dict:
    """One mode's row. ``plan``: the EP plan of one TP column, ``dense`` at its local shapes;
    ``tp``: the TP step (``None``: no TP). With TP the T columns are alike and the memory is
    not sized (``None``: the NS rank's full-shape momentum is not modelled here)."""
    r, n, e = plan.mesh
    lay_d, lay_x, st_d, st_x = part_traffic(ml, plan, mode, coalesce_bytes, dense, local)
    p_d, p_x_loc = st_d.p_m, st_x.p_m
    form_d = closed_form(mode, n * e, r).total_at(p_d, 0, st_d.p_m_kept)
    form_x = closed_form(mode, n, r).total_at(p_x_loc, 0, st_x.p_m_kept)
    per_rank = rank_traffic(st_d, st_x, plan.mesh, 1 if tp is None else tp.t)
    row = {
        "mode": mode,
        "closed_form": _form_text(mode),
        "closed_form_elems": form_d + form_x,
        "dense_elems": st_d.ded_avg_elems,
        "expert_elems": st_x.ded_avg_elems,
        "p_d_kept_elems": st_d.p_m_kept,
        "p_x_kept_elems": st_x.p_m_kept,
        "ded_avg_elems": st_d.ded_avg_elems + st_x.ded_avg_elems,
        "ded_avg_bytes": st_d.ded_avg_bytes + st_x.ded_avg_bytes,
        "ded_max_bytes": max(per_rank["ded_avg_bytes"]),
        "calls_avg": st_d.calls_avg + st_x.calls_avg,
        "calls_max": int(max(per_rank["calls"])),
        "memory": None if tp else _memory(ml, mode, plan, lay_d, lay_x, coalesce_bytes),
    }
    return row if tp is None else tp.add_to(row, per_rank)


def _memory(ml, mode: str, plan: EPPlan, lay_d, lay_x, coalesce_bytes: int) -> dict:
    """Per world rank: each part's :func:`rank_memory` summed, the rest's AdamW states from
    the whole model on (R, N·E); min / median / max per figure and the busiest rank."""
    r, n, e = plan.mesh
    dense = rank_memory(lay_d, plan.dense)
    expert = rank_memory(lay_x, plan.expert)
    rest = adamw_rest_bytes(ml.layout(mode, r, n * e, coalesce_bytes))
    keys = [k for k, _ in FIELDS]
    parts = keys[:-1]  # every figure but sum_bytes
    rows = []
    for g in range(plan.world_size):
        d, x = dense[g], expert[plan.column_rank(g)]
        row = {k: d[k] + x[k] for k in parts if k != "adamw_rest_bytes"}
        row["adamw_rest_bytes"] = rest[g]
        row["sum_bytes"] = sum(row[k] for k in parts)
        rows.append(row)
    busiest = max(range(len(rows)), key=lambda g: (rows[g]["sum_bytes"], -g))
    stats = {name: {k: fn([row[k] for row in rows]) for k in keys}
             for name, fn in (("min", min), ("median", statistics.median), ("max", max))}
    return {"z3": mode.endswith("z3"), **stats, "busiest": {"rank": busiest, **rows[busiest]}}


def _activations(config, stacks: list[ParamSpec], e: int, dtype_bytes: int | None) -> dict | None:
    """The token all_to_all of one routed token per rank and step (docs/traffic-model.md,
    "Expert parallelism"), uniform routing; ``None`` without ``config.moe.top_k`` and
    ``config.d_model``."""
    moe = getattr(config, "moe", None)
    k, d = getattr(moe, "top_k", None), getattr(config, "d_model", None)
    if not isinstance(k, int) or not isinstance(d, int) or dtype_bytes is None:
        return None
    layers = len({sp.module for sp in stacks})
    x = stacks[0].shape[0]
    per_layer = 4 * k * d * dtype_bytes * (e - 1) / e  # dispatch + combine, forward + backward
    return {
        "moe_layers": layers, "top_k": k, "d_model": d, "element_bytes": dtype_bytes,
        "calls_per_step": 5 * layers,
        "bytes_per_token_per_layer": per_layer,
        "bytes_per_token": per_layer * layers,
        "count_bytes_per_step": 8 * x * (e - 1) / e * layers,
    }


def ep_report(ml, mesh: tuple[int, int], e: int, *, coalesce_bytes: int, config=None,
              dtype_bytes: int | None = None, tflops: float | None = None, tp: int = 1) -> dict:
    """The EP section of one mesh (module docstring; with ``tp`` > 1 its "TP × EP").

    Args:
        ml: the model (:class:`verify.plan.cli.ModelLayout`).
        mesh: (R, N); the job's mesh is (R, N, E), with ``tp`` = T (R, N, E, T).
        e: E >= 1.
        tp: T >= 1: the dense Muon matrices T divides a dim of are TP-sharded
            (:func:`verify.plan.tp.tp_dims`), the rest and the expert stacks replicated
            over TP.
        coalesce_bytes: DMuon's unit target in bytes (the table's, ``coalesce="auto"``); on an
            EP mesh DMuon joins no blocks (``docs/protocol.md``, "Expert parallelism":
            one unit per block, its dense and expert buckets side by side), so the EP section
            prices both parts at target 0 whatever is given.
        config: the model's ``config`` (``moe.top_k``, ``d_model``) for the activations row.
        dtype_bytes: bytes per element of the activations (the plan's dtype).
        tflops: NS rate (TFLOP/s) for ``ns_critical_path_s``.

    Raises:
        UsageError: no expert stack, or E does not divide a stack's X.
    """
    r, n = mesh
    dense, local = split_specs(ml.muon_specs, e)
    plan = plan_ep(dense, local, (r, n, e), tp)
    w = plan.world_size
    load = plan.ns_load()
    sharded = tp_dims(ml.muon_specs, tp) if tp > 1 else {sp.name: 0 for sp in dense}
    replicated = [sp for sp in dense if sp.name not in sharded]
    for sp in replicated:  # NS in every TP column: on each rank of its owner's TP group
        g = plan.dense.owner[sp.name]
        for k in range(tp):
            if k != g % tp:
                load[g - g % tp + k] += plan.dense.ns_cost[sp.name]
    mean = sum(load) / w
    stacks = expert_stacks(ml.muon_specs)
    column, dense_col, step = tp_column(plan, dense, sharded)
    p_x = sum(sp.numel for sp in stacks)
    # any dense plan on top of the fixed expert loads: the busiest column owner's load, the
    # largest dense matrix on the least-loaded rank, the mean
    xl = plan.expert_load()
    bound = max(max(xl), min(xl) + max(plan.dense.ns_cost.values(), default=0), mean)
    rep = {
        "ep": e, "world_size": w,
        "mesh": {"replicate": r, "shard": n, "ep": e, **({"tp": tp} if step else {})},
        "expert_stacks": len(stacks), "experts": sorted({sp.shape[0] for sp in stacks}),
        "p_d": sum(sp.numel for sp in dense), "p_x": p_x, "p_x_local": p_x // e,
        # NS: a TP matrix once, a matrix replicated over TP and every expert in each TP column
        "ns_calls": sum(sp.matrices * (1 if sp.name in sharded else tp) for sp in dense)
        + tp * sum(sp.matrices for sp in stacks),
        "ns_max_over_mean": max(load) / mean if mean else 0.0,
        "ns_max_flops": max(load),
        "ns_critical_path_s": max(load) / (tflops * 1e12) if tflops else None,
        "ns_bound_ratio": max(load) / bound if bound else 0.0,
        "ns_idle_ranks": sum(1 for x in load if x == 0),
        "modes": [_mode_row(mode, ml, column, dense_col, local, 0, step) for mode in tp_modes(r)],
        "activations": None if step else _activations(config, stacks, e, dtype_bytes),
        "units": EP_UNITS,
    }
    if step:
        rep.update(tp=tp, p_tp=step.p_tp, p_d_local=sum(sp.numel for sp in dense_col),
                   units={**EP_UNITS, **TP_EP_UNITS})
    return rep


#: ``units`` of the EP section's JSON (``reports[0].ep``): field -> unit.
EP_UNITS: dict[str, str] = {
    "p_d": "elements of the dense Muon params (identical on all W ranks)",
    "p_x": "elements of the expert stacks, global (X·a·b summed)",
    "p_x_local": "elements of the expert stacks one rank holds (P_X/E)",
    "experts": "X of the stacks (experts per stack)",
    "expert_stacks": "count of 3-D expert-stack params",
    "*_elems": "elements per rank per training step, W-average (dense_elems: dense part, "
               "expert_elems: expert part; *_kept_elems: elements of Z3's kept unit)",
    "*_bytes": "bytes (ded_avg_bytes: W-average per rank-step, ded_max_bytes: busiest rank; "
               "memory: per rank)",
    "calls_max": "DMuon's collective calls per training step of the busiest rank",
    "calls_avg": "DMuon's collective calls per training step, mean over ranks",
    "ns_calls": "Newton–Schulz calls per training step, all ranks together",
    "ns_max_flops": "NS FLOPs per step of the busiest rank (ns_steps=5)",
    "ns_critical_path_s": "seconds of the busiest rank's NS at the cost model's TFLOP/s",
    "ns_bound_ratio": "busiest NS load over max(busiest column owner, least-loaded rank + "
                      "largest dense matrix, mean)",
    "activations": "the token all_to_all per routed token per rank (bytes_per_token*: per "
                   "step, uniform routing), count_bytes_per_step, calls_per_step",
}


#: ``units`` the EP section adds with ``--tp`` (TP × EP).
TP_EP_UNITS: dict[str, str] = {
    "tp": "tensor-parallel degree T (the mesh is R x N x E x T)",
    "p_tp": "elements of the TP-sharded dense Muon params, full shapes (P_TP)",
    "p_d_local": "elements of the dense Muon params one rank holds (P_D,loc = P_TP/T + the rest)",
    "tp_*_elems": "the TP step's gather / scatter, elements per rank per step, W-average",
    "memory": "null: not sized with --tp (the NS rank's full-shape momentum is not modelled)",
    "activations": "null: not sized with --tp",
}


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def format_ep(rep: dict) -> str:
    """The EP section as text (with ``tp``: the TP × EP layout's)."""
    m, tp = rep["mesh"], rep.get("tp")
    mesh = f"{m['replicate']}x{m['shard']}x{m['ep']}" + (f"x{tp} (R x N x E x T" if tp else " (R x N x E")
    dense = (f"dense P_D = {rep['p_d']:,}" if not tp else
             f"dense P_D = {rep['p_d']:,} of which P_TP = {rep['p_tp']:,} TP-sharded, "
             f"P_D,loc = {rep['p_d_local']:,} per rank")
    lines = [
        f"expert parallel: mesh {mesh}, W = "
        f"{rep['world_size']:,}); {rep['expert_stacks']} expert stacks of X = "
        f"{'/'.join(map(str, rep['experts']))} (P_X = {rep['p_x']:,} elements, P_X/E = "
        f"{rep['p_x_local']:,} per rank), {dense}",
        f"  plan: stacks over {'(R, N·T) slots' if tp else '(R, N) columns'}, then dense over "
        f"(R, N·E{'·T' if tp else ''}) on that "
        f"load (LPT); NS once per expert{' and TP matrix, a replicated matrix or expert in each TP column' if tp else ''}: "
        f"{rep['ns_calls']:,} calls/step; NS max/mean {rep['ns_max_over_mean']:.3f}, "
        f"max / bound {rep['ns_bound_ratio']:.3f} (bound: max(busiest column owner, least-loaded "
        f"rank + largest dense matrix, mean)), idle ranks {rep['ns_idle_ranks']}"
        + (f", NS critical path {rep['ns_critical_path_s'] * 1e3:.1f} ms"
           if rep["ns_critical_path_s"] is not None else ""),
    ]
    p_d, d_name = (rep["p_d_local"], "P_D,loc") if tp else (rep["p_d"], "P_D")
    headers = ["mode", "closed form (W-average)", f"÷ ({d_name} + P_X/E)", "vs closed", f"dense ÷ {d_name}",
               "expert ÷ P_X/E", "ded GiB/rank avg", "ded GiB busiest", "calls/step busiest",
               "calls/step avg"]
    body = []
    unit = (p_d + rep["p_x_local"]) or 1
    for row in rep["modes"]:
        body.append([
            row["mode"], row["closed_form"], f"{row['ded_avg_elems'] / unit:.4f}",
            f"{row['ded_avg_elems'] / row['closed_form_elems']:.4f}" if row["closed_form_elems"] else "-",
            f"{row['dense_elems'] / p_d:.4f}" if p_d else "-",
            f"{row['expert_elems'] / rep['p_x_local']:.4f}",
            _gib(row["ded_avg_bytes"]), _gib(row["ded_max_bytes"]), row["calls_max"],
            f"{row['calls_avg']:.1f}",
        ])
    lines.append(tabulate(body, headers=headers, tablefmt="github"))
    if tp:
        lines += [f"  (with --tp: dense and expert per TP column; the TP step's gather and scatter, "
                  f"2(T-1)/(T·W)·P_TP, in the total, bytes and calls; the calls of DTensor's own TP "
                  f"collectives not)",
                  "  memory per rank and activations: not sized with --tp (the NS ranks' full-shape "
                  "momentum and the token routing under TP are not modelled here)"]
    else:
        lines += _memory_lines(rep) + [_activations_line(rep["activations"])]
    above = ("the table and the tensor-parallel section above are the same W without EP (their N "
             "is N·E)" if tp else "the table above is the same W without EP")
    doc = "TP × EP" if tp else "Expert parallelism"
    lines.append(f"  (docs/traffic-model.md, '{doc}'; {above}: every rank holds all X "
                 "experts of each stack)")
    return "\n".join(lines)


def _memory_lines(rep: dict) -> list[str]:
    mem_rows = []
    for row in rep["modes"]:
        mem = row["memory"]
        big = mem["busiest"]
        for i, (stat, label) in enumerate((("min", "min"), ("median", "median"), ("max", "max"),
                                           ("busiest", f"busiest: rank {big['rank']}"))):
            mem_rows.append([row["mode"] if i == 0 else "", label,
                             *(_gib(mem[stat][k]) for k, _ in FIELDS)])
    return ["  Memory per rank with EP, GiB (dense part + the rank's column's expert part, "
            "verify.plan.memory per part; prefetch_depth 1):",
            tabulate(mem_rows, headers=["mode", "ranks", *(h for _, h in FIELDS)], tablefmt="github")]


def _activations_line(act: dict | None) -> str:
    if act:
        return (f"  activations (token all_to_all over the EP group, not P_M; uniform routing): "
                f"{act['calls_per_step']} calls/step ({act['moe_layers']} MoE layers x 5); "
                f"4·k·D·b·(E-1)/E = {act['bytes_per_token_per_layer'] / 2**10:,.1f} KiB per routed token "
                f"per layer, {act['bytes_per_token'] / 2**20:,.2f} MiB per token per step (x T tokens "
                f"per rank), + {act['count_bytes_per_step']:,.0f} B of counts")
    return ("  activations: not sized (the model states no config.moe.top_k / d_model); "
            "4·k·D·b·(E-1)/E bytes per routed token per MoE layer")


class EPKind(PlanKind):
    """``--ep E`` (:mod:`verify.plan.kind`): with ``--mesh`` and optionally ``--tp`` (TP × EP);
    the table is the same W without EP (and without TP), the mesh (R, N·E); the section is
    computed before the table (a bad E for the model exits first)."""

    flag = "ep"
    times = {"tp": "T"}  # TP x EP
    world_formula = "R·N·E"
    world_fix = "; give a smaller --ep or --mesh."
    before_table = True

    def refusal(self, args) -> str | None:
        if args.sweep:
            return self._with(args, "--sweep", "Give --mesh N or RxN with --ep E [--tp T] (the mesh "
                                               "is R x N x E x T).")
        return None

    def table_mesh(self, args, mesh: tuple[int, int]) -> tuple[int, int]:
        return mesh[0], mesh[1] * self.degree(args)

    def section(self, ctx: PlanContext) -> dict:
        return ep_report(ctx.ml, ctx.mesh, self.degree(ctx.args), coalesce_bytes=ctx.coalesce_bytes,
                         config=ctx.config, dtype_bytes=ctx.dtype_bytes, tflops=ctx.tflops,
                         tp=ctx.args.tp)

    def format(self, section: dict) -> str:
        return format_ep(section)


KIND = EPKind()
