"""``dmuon-plan --tp T``: DMuon × tensor parallelism on an (R, N, T) mesh.

Derived from the documented protocol (``docs/protocol.md``, "Tensor parallelism";
``docs/traffic-model.md``, "Tensor parallelism"), not from the runtime. Which matrices are
TP-sharded: every Muon matrix of a 2-D param one of whose dims T divides (torchtitan's plan
shards every block Linear with ``ColwiseParallel`` / ``RowwiseParallel``; an output dim that
T divides is taken as ``Shard(0)``, else the input dim as ``Shard(1)``); the others (3-D expert
stacks, conv weights, dims T divides neither, and a MoE layer's router beside its expert stacks,
which torchtitan leaves unsharded: :func:`tp_dims`) are replicated over TP and stepped in every
TP column.

Figures per rank per step, elements (``*_elems``) on the W-average of docs/spec.md §2:

- ``dp_elems``: DMuon's data-parallel terms at P_loc = P_TP/T + P_rep, Z3's kept unit
  included: − (N-1)/N·P_loc^L, P_loc^L (``p_loc_kept_elems``) the local elements of the unit
  Z3 keeps from its forward into the backward (:func:`verify.traffic.predict.kept_elems` of
  one TP column, as :func:`verify.traffic.tp.tp_closed_form` takes it; 0 under Z2);
- ``tp_gather_elems`` = ``tp_scatter_elems`` = (T-1)/(T·W)·P_TP (phase ``optimizer``);
- ``ns_max_over_mean``: the NS balance of the plan over the W = R·N·T ranks (the planner on
  ``(R, N·T)`` slots, ``dmuon.ownership.plan.plan_ownership``), where a replicated matrix
  counts on every rank of its owner's TP group.
"""

from __future__ import annotations

import dataclasses

from dmuon.ownership.plan import plan_ownership
from tracer.events import DTYPE_BYTES

from verify.plan.args import UsageError
from verify.plan.kind import PlanContext, PlanKind
from verify.traffic.predict import RunLayout, kept_elems
from verify.traffic.tp import TPRunLayout

def _dp_factor(mode: str, r: int, n: int) -> tuple[str, float]:
    """DMuon's data-parallel closed form of ``mode`` on (R, N): (text, factor of P_loc)."""
    if mode == "dmuon-z2":
        return "2(N-1)/N", 2 * (n - 1) / n
    if mode == "dmuon-z3":
        return "3(N-1)/N", 3 * (n - 1) / n
    w = r * n
    if mode == "dmuon-hsdp-z2":
        return "2(RN-1)/(RN)", 2 * (w - 1) / w
    return "(2(RN-1)/(RN) + (N-1)/N)", 2 * (w - 1) / w + (n - 1) / n  # dmuon-hsdp-z3


def tp_modes(r: int) -> tuple[str, ...]:
    """DMuon's modes on an (R, N, T) mesh: Z2 / Z3 (R = 1) or the HSDP ones (R > 1)."""
    return ("dmuon-z2", "dmuon-z3") if r == 1 else ("dmuon-hsdp-z2", "dmuon-hsdp-z3")


def tp_sharded(spec, t: int) -> int | None:
    """The dim (0 or 1) a Muon param is TP-sharded on under the module docstring's rule, or
    ``None`` (replicated over TP)."""
    if len(spec.shape) != 2 or spec.matrices != 1:
        return None
    if spec.shape[0] % t == 0:
        return 0
    return 1 if spec.shape[1] % t == 0 else None


def tp_dims(specs, t: int) -> dict[str, int]:
    """Muon param name -> the dim it is TP-sharded on, for those of ``specs`` that are: the
    :func:`tp_sharded` ones but a MoE layer's router (a matrix of X rows in the module that
    holds X-expert stacks (X, a, b) beside it), which torchtitan's plan leaves unsharded."""
    specs = list(specs)
    routers = {(sp.module.rpartition(".")[0], sp.shape[0]) for sp in specs if len(sp.shape) == 3}
    return {sp.name: d for sp in specs if (d := tp_sharded(sp, t)) is not None
            and (sp.module.rpartition(".")[0], sp.shape[0]) not in routers}


def tp_local(spec, dim: int, t: int):
    """``spec`` at its per-rank shape: dim ``dim`` divided by ``t``."""
    shape = list(spec.shape)
    shape[dim] //= t
    return dataclasses.replace(spec, shape=tuple(shape))


def tp_step_traffic(specs, owner: dict[str, int], t: int, w: int) -> dict[str, list]:
    """DMuon's step-6 gathers and scatters (channel ``tp``,
    docs/protocol.md, "Tensor parallelism") per world rank of one step: ``calls``,
    ``ded_avg_elems`` and ``ded_avg_bytes`` (lists of ``w``).

    ``specs``: the TP-sharded Muon params (full shapes; n/T per rank). ``owner``: param name ->
    its slot g of the W-slot plan: the NS rank is world rank g,
    the data-parallel owner column rank g // T; the TP group of g is ranks T·(g // T) + k. Per
    group, per (NS rank, dtype) of the TP params its column rank owns: one gather and one
    scatter of the local counts c, each charging every member (T-1)/T·c (docs/traffic-model.md,
    "Tensor parallelism"). ``t`` = 1: no TP group, zeros.
    """
    out = {"calls": [0] * w, "ded_avg_elems": [0.0] * w, "ded_avg_bytes": [0.0] * w}
    if t == 1:
        return out
    counts: dict[tuple[int, int, str], int] = {}
    for sp in specs:
        key = (owner[sp.name] // t, owner[sp.name] % t, sp.dtype)
        counts[key] = counts.get(key, 0) + sp.numel // t
    for (col, _, dtype), c in counts.items():
        for k in range(t):
            out["calls"][col * t + k] += 2
            out["ded_avg_elems"][col * t + k] += 2 * (t - 1) / t * c
            out["ded_avg_bytes"][col * t + k] += 2 * (t - 1) / t * c * DTYPE_BYTES[dtype]
    return out


def tp_layout(layout: RunLayout, t: int) -> TPRunLayout:
    """``layout`` (full shapes, on (R, N)) on the (R, N, T) mesh, its TP params those of
    :func:`tp_dims`."""
    dims = tuple(tp_dims(layout.muon_specs(), t).items())
    base = {f.name: getattr(layout, f.name) for f in dataclasses.fields(RunLayout)}
    return TPRunLayout(**base, tp_size=t, tp_dims=dims)


def tp_report(ml, mesh: tuple[int, int], t: int, *, coalesce_bytes: int) -> dict:
    """The TP section of one mesh: the plan's NS balance over W = R·N·T and, per mode, the
    data-parallel and TP step terms (module docstring).

    Args:
        ml: the model (:class:`verify.plan.cli.ModelLayout`: ``muon_specs`` and
            ``layout(mode, r, n, coalesce_bytes)``, the layout the report's table uses).
        mesh: (R, N).
        t: T.
        coalesce_bytes: DMuon's unit target in bytes (the table's, ``coalesce="auto"``);
            units form over the local shards' bytes, which sets Z3's kept unit P_loc^L.
    """
    muon_specs = ml.muon_specs
    r, n = mesh
    w = r * n * t
    tp_names = set(tp_dims(muon_specs, t))
    p_m = sum(sp.numel for sp in muon_specs)
    p_tp = sum(sp.numel for sp in muon_specs if sp.name in tp_names)
    p_rep = p_m - p_tp
    p_loc = p_tp / t + p_rep
    plan = plan_ownership(list(muon_specs), (r, n * t))
    load = [0.0] * w  # NS cost per rank (r, s, t) in slot order r·N·T + s·T + t
    for sp in muon_specs:
        g = plan.owner[sp.name]
        cost = plan.ns_cost[sp.name]
        if sp.name in tp_names:
            load[g] += cost
        else:  # replicated: its owner (r, s) in every TP column
            base = g - g % t
            for k in range(t):
                load[base + k] += cost
    mean = sum(load) / w if w else 0.0
    gather = (t - 1) / (t * w) * p_tp
    modes = []
    for mode in tp_modes(r):
        text, factor = _dp_factor(mode, r, n)
        # Z3 keeps its last unit from forward into backward: no backward re-broadcast of its
        # local elements (docs/traffic-model.md, "Tensor parallelism")
        kept = kept_elems(tp_layout(ml.layout(mode, r, n, coalesce_bytes), t).column())
        dp = factor * p_loc - (n - 1) / n * kept
        kept_text = " − (N-1)/N · P_loc^L" if kept else ""
        modes.append({
            "mode": mode,
            "closed_form": f"{text} · P_loc{kept_text} + 2(T-1)/(T·W) · P_TP",
            "p_loc_kept_elems": kept,
            "dp_elems": dp,
            "tp_gather_elems": gather,
            "tp_scatter_elems": gather,
            "ded_avg_elems": dp + 2 * gather,
            "ns_calls": sum(sp.matrices for sp in muon_specs if sp.name in tp_names)
            + t * sum(sp.matrices for sp in muon_specs if sp.name not in tp_names),
        })
    return {
        "tp": t, "world_size": w, "mesh": {"replicate": r, "shard": n, "tp": t},
        "p_m": p_m, "p_tp": p_tp, "p_rep": p_rep, "p_loc": p_loc,
        "tp_matrices": len(tp_names), "replicated_matrices": len(muon_specs) - len(tp_names),
        "ns_max_over_mean": max(load) / mean if mean else 0.0,
        "ns_idle_ranks": sum(1 for x in load if x == 0),
        "modes": modes,
    }


def format_tp(rep: dict) -> str:
    """The TP section as text."""
    m = rep["mesh"]
    p_m = rep["p_m"] or 1
    lines = [
        f"tensor parallel: mesh {m['replicate']}x{m['shard']}x{m['tp']} (R x N x T, W = "
        f"{rep['world_size']}); {rep['tp_matrices']} TP-sharded Muon params (P_TP = "
        f"{rep['p_tp']:,} elements), {rep['replicated_matrices']} replicated over TP (P_rep = "
        f"{rep['p_rep']:,}); P_loc = P_TP/T + P_rep = {rep['p_loc']:,.0f}",
        f"  NS balance over all W ranks (planner on (R, N·T) slots): max/mean "
        f"{rep['ns_max_over_mean']:.3f}, idle ranks {rep['ns_idle_ranks']}",
    ]
    for mode in rep["modes"]:
        lines.append(
            f"  {mode['mode']}: {mode['closed_form']} = {mode['ded_avg_elems'] / p_m:.4f}·P_M "
            f"(data-parallel {mode['dp_elems'] / p_m:.4f}, gather {mode['tp_gather_elems'] / p_m:.4f}"
            f", scatter {mode['tp_scatter_elems'] / p_m:.4f}); NS calls/step {mode['ns_calls']}")
    lines.append("  (docs/traffic-model.md, 'Tensor parallelism'; DTensor's own activation "
                 "collectives are not included)")
    return "\n".join(lines)


class TPKind(PlanKind):
    """``--tp T`` (:mod:`verify.plan.kind`): the TP section of the table's mesh; it refuses
    ``--sweep`` and a model without Muon targets once the model is built."""

    flag = "tp"
    world_formula = "R·N·T"
    world_fix = (" (dmuon-plan's bound: time and memory grow with W); give a smaller --tp or "
                 "--mesh.")

    def section(self, ctx: PlanContext) -> dict:
        if ctx.args.sweep or not ctx.ml.muon_specs:
            raise UsageError("Invalid --tp with --sweep or a model without Muon targets. Give "
                             "--mesh RxN with --tp T (the mesh is R x N x T).")
        return tp_report(ctx.ml, ctx.table_mesh, self.degree(ctx.args), coalesce_bytes=ctx.coalesce_bytes)

    def format(self, section: dict) -> str:
        return format_tp(section)


KIND = TPKind()
