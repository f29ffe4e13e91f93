"""``dmuon-plan --pp S --microbatches M``: price a layout with S pipeline stages, each stage a
data-parallel (R, N) slice (× T with ``--tp``): W = S·R·N·T, a 4-D layout
``dp_replicate × dp_shard × tp × pp``.

The model's blocks (:attr:`verify.plan.cli.ModelLayout.blocks`'s rule, written on the params'
module names: :func:`verify.traffic.predict.dmuon_block`) are cut into S contiguous runs of
(nearly) equal count; params before the first block go to stage 0, after the last to stage
S - 1. Per stage the ordinary plan of its own params on its slice (``report_fn``: the mesh
report of :mod:`verify.plan.cli`, and with ``--tp`` its TP section): P_s, its dedicated
bytes per rank and step in each DMuon mode, NS balance, memory per rank. Under PP
(docs/traffic-model.md, "Pipeline parallelism"):

- a stage's dedicated params move once per step whatever M: Z2 2(N-1)/N·P_s; Z3 keeps its
  copies for the step, the same figure and Z2's memory while the step runs (the row of the
  Z2 counterpart, printed for both); freeing after every micro-batch instead would cost up to
  (2M+1)(N-1)/N·P_s (``z3_per_microbatch_elems``);
- the stage-to-stage send / recv: per boundary and micro-batch one activation of
  A = ``microbatch_tokens``·D elements forward and its grad back, D the model's
  ``config.d_model`` / ``hidden_size`` (each TP rank sends its full copy: no sequence
  parallelism); W-average received per rank and step 2M·A·(S-1)/S, a middle stage's ranks
  2M·A.
"""

from __future__ import annotations

import copy

from verify.plan.kind import PlanContext, PlanKind, given
from verify.plan.tp import tp_report
from verify.traffic.predict import dmuon_block

#: The held-for-the-step counterpart of each Z3 mode (docs/protocol.md, "Pipeline parallelism").
HELD = {"dmuon-z3": "dmuon-z2", "dmuon-hsdp-z3": "dmuon-hsdp-z2"}


def stage_names(ml, pp: int) -> list[tuple[str, ...]]:
    """The param names of each of the ``pp`` stages (module docstring).

    Raises:
        ValueError: the model has fewer blocks than ``pp`` stages.
    """
    blocks = [b for b in dict.fromkeys(dmuon_block(p.module) for p in ml.params)
              if b and b.split(".")[-1].isdigit()]
    if len(blocks) < pp:
        raise ValueError(f"Invalid --pp {pp} for --model {ml.name}: it has {len(blocks)} blocks "
                         "(ModuleList elements). Must be at most the block count (each stage at "
                         "least one block).")
    base, extra = divmod(len(blocks), pp)
    stage_of, start = {}, 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        for b in blocks[start:start + size]:
            stage_of[b] = s
        start += size
    out: list[list[str]] = [[] for _ in range(pp)]
    seen_block = False
    for p in ml.params:
        b = dmuon_block(p.module)
        if b in stage_of:
            seen_block = True
            out[stage_of[b]].append(p.name)
        else:
            out[pp - 1 if seen_block else 0].append(p.name)
    return [tuple(x) for x in out]


def stage_layout(ml, names: tuple[str, ...], s: int):
    """A copy of the :class:`verify.plan.cli.ModelLayout` ``ml`` holding stage ``s``'s params."""
    keep = set(names)
    sub = copy.copy(ml)
    sub.name = f"{ml.name} stage {s}"
    sub.params = tuple(p for p in ml.params if p.name in keep)
    sub.muon_names = tuple(n for n in ml.muon_names if n in keep)
    sub.muon_specs = tuple(p for p in ml.muon_specs if p.name in keep)
    sub.blocks = tuple(b for b in ml.blocks if any(n.startswith(b + ".") for n in keep))
    sub.linears = tuple(m for m in ml.linears if any(n.startswith(m + ".") for n in keep))
    sub.n_params = sum(p.numel for p in sub.params)
    sub.param_dtypes = {}
    for p in sub.params:
        sub.param_dtypes[p.dtype] = sub.param_dtypes.get(p.dtype, 0) + p.numel
    return sub


def _width(config) -> int | None:
    for attr in ("d_model", "hidden_size", "n_embd"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def pp_report(ml, mesh: tuple[int, int], pp: int, microbatches: int, *, report_fn, tp: int = 1,
              tp_fn=None, config=None, microbatch_tokens: int = 4096,
              dtype_bytes: int | None = 2) -> dict:
    """The ``--pp`` section (module docstring) of ``ml`` on stages of ``mesh`` = (R, N).

    Args:
        report_fn: ``(stage ModelLayout, mesh) -> dict``, the mesh report
            (:func:`verify.plan.cli.report`).
        tp, tp_fn: the TP degree and ``(stage ModelLayout, mesh, tp) -> dict`` (the TP section).
        config: the model's ``config`` (its width D, for the P2P).
        microbatch_tokens: tokens of one micro-batch on one data-parallel rank.
        dtype_bytes: bytes per element of activations and params (``None``: mixed, the P2P
            priced in elements only).

    Raises:
        ValueError: ``pp`` < 2, ``microbatches`` < 1, or fewer blocks than stages.
    """
    if pp < 2 or microbatches < 1:
        raise ValueError(f"Invalid --pp {pp} / --microbatches {microbatches}. Must be >= 2 / >= 1.")
    r, n = mesh
    stages = []
    for s, names in enumerate(stage_names(ml, pp)):
        sub = stage_layout(ml, names, s)
        rep = report_fn(sub, mesh)
        rows = {m["mode"]: m for m in rep["modes"]}
        tp_rows = ({m["mode"]: m for m in tp_fn(sub, mesh, tp)["modes"]}
                   if tp > 1 and tp_fn is not None and sub.muon_specs else {})
        modes = []
        for mode in [m for m in rows if m.startswith("dmuon-") and m != "dmuon-ddp"]:
            held = rows[HELD.get(mode, mode)]
            src = tp_rows.get(HELD.get(mode, mode), held)
            mem = held.get("memory") or {}
            modes.append({
                "mode": mode,
                "ded_avg_elems": src["ded_avg_elems"],
                "ded_avg_bytes": held["ded_avg_bytes"] if tp == 1 else None,
                "ded_max_bytes": held["ded_max_bytes"] if tp == 1 else None,
                "calls_max": held["calls_max"],
                "memory_busiest_bytes": (mem.get("busiest") or {}).get("sum_bytes"),
            })
        p_s = rep["p_m"]
        stages.append({
            "stage": s, "blocks": list(sub.blocks), "params": sub.n_params, "p_s": p_s,
            "muon_matrices": rep["muon_matrices"],
            "ns": None if rep["ns"] is None else {k: rep["ns"][k] for k in (
                "max_over_mean", "max_flops", "lower_bound_flops", "idle_owners", "critical_path_s")},
            "modes": modes,
            "z3_per_microbatch_elems": (2 * microbatches + 1) * (n - 1) / n * p_s,
        })
    d = _width(config)
    act = microbatch_tokens * d if d is not None else None
    p2p = None if act is None else {
        "activation_elems": act, "avg_recv_elems": 2 * microbatches * act * (pp - 1) / pp,
        "middle_rank_recv_elems": 2 * microbatches * act if pp > 2 else microbatches * act,
        "avg_recv_bytes": None if dtype_bytes is None else 2 * microbatches * act * (pp - 1) / pp * dtype_bytes}
    return {"pp": pp, "microbatches": microbatches, "tp": tp, "world_size": pp * r * n * tp,
            "mesh": {"pp": pp, "replicate": r, "shard": n, "tp": tp}, "stages": stages,
            "microbatch_tokens": microbatch_tokens, "width": d, "p2p": p2p}


def format_pp(rep: dict) -> str:
    """The ``--pp`` section as text."""
    m = rep["mesh"]
    gib = 2**30
    lines = [f"pipeline parallel: mesh {m['pp']}x{m['replicate']}x{m['shard']}x{m['tp']} "
             f"(pp x dp_replicate x dp_shard x tp, W = {rep['world_size']}), M = {rep['microbatches']} "
             "micro-batches; each stage's DMuon on its own (R, N) slice, once per step whatever M "
             "(Z3 keeps its copies for the step: Z2's figures)"]
    for st in rep["stages"]:
        ns = st["ns"]
        bal = ("no Muon matrices" if ns is None else
               f"NS max/mean {ns['max_over_mean']:.3f}, max/bound {ns['max_flops'] / ns['lower_bound_flops']:.3f}, "
               f"idle owners {ns['idle_owners']}")
        blocks = st["blocks"]
        span = f"{blocks[0]}..{blocks[-1]}" if len(blocks) > 1 else (blocks[0] if blocks else "-")
        lines.append(f"  stage {st['stage']}: blocks {span}, P_s = {st['p_s']:,} ({st['muon_matrices']} "
                     f"matrices); {bal}")
        for row in st["modes"]:
            p_s = st["p_s"] or 1
            size = ("" if row["ded_avg_bytes"] is None else
                    f", {row['ded_avg_bytes'] / gib:.3f} GiB/rank avg, {row['ded_max_bytes'] / gib:.3f} busiest")
            mem = row["memory_busiest_bytes"]
            lines.append(f"    {row['mode']}: {row['ded_avg_elems'] / p_s:.4f}·P_s per rank-step{size}; "
                         f"calls/step busiest {row['calls_max']}"
                         + (f"; memory busiest rank {mem / gib:.3f} GiB" if mem is not None else ""))
        lines.append(f"    (Z3 freeing after every micro-batch instead: up to "
                     f"{st['z3_per_microbatch_elems'] / (st['p_s'] or 1):.4f}·P_s = (2M+1)(N-1)/N·P_s)")
    p2p = rep["p2p"]
    if p2p is None:
        lines.append("  stage-to-stage send/recv: not sized (the model states no config.d_model / "
                     "hidden_size)")
    else:
        size = "" if p2p["avg_recv_bytes"] is None else f" = {p2p['avg_recv_bytes'] / gib:.3f} GiB"
        lines.append(f"  stage-to-stage send/recv (not DMuon's): A = {rep['microbatch_tokens']} tokens x D="
                     f"{rep['width']} = {p2p['activation_elems']:,} elements per micro-batch; received per "
                     f"rank-step 2M·A·(S-1)/S = {p2p['avg_recv_elems']:,.0f} elements{size} (W-average), "
                     f"{p2p['middle_rank_recv_elems']:,} on a middle stage's rank")
    if rep["tp"] > 1:
        lines.append("  (with --tp: per-rank elements from the TP section's rule per stage; bytes and "
                     "memory as the table above, on the stage's (R, N) slice without TP)")
    return "\n".join(lines)


class PPKind(PlanKind):
    """``--pp S`` (:mod:`verify.plan.kind`): with ``--mesh`` (the stage's slice) and
    optionally ``--tp``; not with ``--ep`` or ``--sweep``."""

    flag = "pp"
    times = {"tp": "T"}
    world_formula = "S·R·N"

    def refusal(self, args) -> str | None:
        if args.sweep or given(args, "ep") or not args.mesh:
            return self._with(args, "--ep" if given(args, "ep") else "--sweep or no --mesh",
                              "Give --mesh N or RxN (each stage's data-parallel slice) with --pp S "
                              "[--tp T]: the mesh is S x R x N x T.")
        return None

    def section(self, ctx: PlanContext) -> dict:
        args = ctx.args
        return pp_report(
            ctx.ml, ctx.table_mesh, self.degree(args), args.microbatches, report_fn=ctx.report,
            tp=args.tp, tp_fn=lambda sub, mesh, t: tp_report(sub, mesh, t, coalesce_bytes=ctx.coalesce_bytes),
            config=ctx.config, microbatch_tokens=args.microbatch_tokens, dtype_bytes=ctx.dtype_bytes)

    def format(self, section: dict) -> str:
        return format_pp(section)


KIND = PPKind()
