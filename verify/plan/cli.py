"""``dmuon-plan``: size a DMuon job before running it: NS balance, traffic, calls, memory, time.

Usage::

    dmuon-plan --model llama3-70b --mesh 128x8            # one (R, N) mesh, HSDP modes
    dmuon-plan --model llama3-8b --mesh 64                 # a 1-D mesh, DDP / FSDP2 modes
    dmuon-plan --model llama3-8b --sweep --png sweep.png   # W = 8 ... 1024, both mesh kinds
    dmuon-plan --model mypkg.models:make_model --mesh 16 --json

``--model`` is a preset of :mod:`verify.workload.presets` or ``pkg.module:factory`` (called under the
meta device: no memory). The Muon targets are :func:`dmuon.ownership.select.default_predicate`'s; FSDP2
wraps each element of the model's top-level ``nn.ModuleList`` (the blocks), then the root, as
the harness does; the naive baselines also wrap each Muon Linear. Traffic comes from
:func:`verify.traffic.scale.step_traffic`, the plan from :func:`dmuon.ownership.plan.plan_ownership`, times
from :class:`verify.traffic.scale.CostModel` (flags below; defaults printed with every table).
Traffic accounting: docs/spec.md §2 and docs/traffic-model.md.

Input, bounds and warnings: :mod:`verify.plan.args`. ``--tp``, ``--ep``, ``--pp`` and ``--cp``
are the parallel kinds of :data:`KINDS` (:mod:`verify.plan.kind`): each checks its own flags and
W bound, may change the table's mesh and adds its section. Exit codes: 0 a plan was printed (a model
without Muon-target params gets an empty plan that says so); 2 bad input, one line on stderr
(bad flags, mesh or dtype; a factory that cannot be imported or raises; an unwritable
``--png``). Warnings go to stderr and keep exit 0. ``--json`` prints :func:`json_document`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import asdict

import torch.nn as nn
from tabulate import tabulate

from dmuon.ownership.plan import OwnershipPlan, plan_ownership, specs_from_named_parameters
from dmuon.ownership.select import matrix_shapes, select_params
from tracer._compat import require
from tracer.events import DTYPE_BYTES

from verify.plan import cp, ep, pp, tp
from verify.plan.kind import PlanContext
from verify.plan.memory import format_memory, memory_summary
from verify.plan.args import (
    DTYPES,
    MODEL_DTYPE,
    UsageError,
    mesh_warnings,
    parse_mesh,
)
from verify.plan.args import build_parser as _build_parser
from verify.traffic.predict import RunLayout
from verify.workload.presets import PRESETS, resolve_model
from verify.traffic.scale import CostModel, layout_modes, ns_flops_busiest, split_ns_s, step_traffic

__all__ = ["ModelLayout", "build_parser", "json_document", "main", "parse_mesh", "report"]

#: World sizes of ``--sweep``.
SWEEP_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)

#: The parallel kinds (:class:`verify.plan.kind.PlanKind`), in the order of their sections in
#: the report (JSON keys of ``reports[0]``, text under the table).
KINDS = (tp.KIND, ep.KIND, pp.KIND, cp.KIND)
#: The same kinds in the order their usage rules and world sizes are checked (the first error
#: wins) and their table meshes applied.
CHECK_ORDER = (pp.KIND, cp.KIND, ep.KIND, tp.KIND)


class ModelLayout:
    """What every mesh of one model shares: its params, Muon targets and wrap units.

    Raises:
        ValueError: a param dtype (after ``dtype``) is not in ``tracer.events.DTYPE_BYTES``.
    """

    def __init__(self, model: nn.Module, name: str, dtype: str | None = "bfloat16") -> None:
        self.name = name
        self.muon_names = tuple(n for n, _, _ in select_params(model, None, None))
        # Muon's matrix of each target: a stack's slice, a conv weight's (out, in·k…) view
        matrices = matrix_shapes(model, self.muon_names)
        params = specs_from_named_parameters(model.named_parameters(), matrices)
        if dtype is not None:  # the dtype the collectives carry (e.g. bf16 params in training)
            params = [dataclasses.replace(p, dtype=dtype) for p in params]
        unknown = sorted({p.dtype for p in params} - set(DTYPE_BYTES))
        if unknown:
            raise ValueError(f"Invalid model {name!r}: parameter dtypes {unknown} have no element "
                             f"size here. Must be among {sorted(DTYPE_BYTES)} (or pass --dtype).")
        self.params = tuple(params)
        #: elements per dtype the collectives carry
        self.param_dtypes: dict[str, int] = {}
        for p in self.params:
            self.param_dtypes[p.dtype] = self.param_dtypes.get(p.dtype, 0) + p.numel
        muon = set(self.muon_names)
        self.muon_specs = tuple(p for p in self.params if p.name in muon)
        blocks = [
            f"{child}.{i}"
            for child, mod in model.named_children()
            if isinstance(mod, nn.ModuleList)
            for i in range(len(mod))
        ]
        self.blocks = tuple(blocks)
        # the naive baselines' per-matrix units: the modules holding Muon params (not the root,
        # not a block already: a ModuleList of bare Linear), children before parents
        holders = dict.fromkeys(n.rpartition(".")[0] for n in self.muon_names)
        order = {m: i for i, m in enumerate(holders)}
        self.linears = tuple(sorted((m for m in holders if m and m not in self.blocks),
                                    key=lambda m: (-m.count("."), order[m])))
        self.n_params = sum(p.numel for p in self.params)

    def layout(self, mode: str, r: int, n: int, coalesce_bytes: int = 0) -> RunLayout:
        if "ddp" in mode or mode.startswith("zero1"):
            units = ()
        else:
            units = (self.linears if mode.startswith("naive") else ()) + self.blocks + ("",)
        return RunLayout(
            mode="ddp-muon" if mode.startswith("zero1") else mode, replicate_size=r, shard_size=n,
            params=self.params, muon_names=self.muon_names, fsdp_modules=units,
            reshard_after_forward=mode.endswith("z3") or mode == "naive-hsdp",
            dmuon_coalesce_bytes=coalesce_bytes if mode.startswith("dmuon") else 0,
        )


#: What ``report`` says for a model without Muon-target params.
NOTHING_TO_DEDICATE = (
    "no Muon-target params, so nothing to dedicate and no plan (dmuon.ownership.select.default_predicate "
    "takes trainable 2-D weights of hidden nn.Linear / HF Conv1D layers; convolutions, 3-D "
    "expert tensors, embeddings, norms, biases and the output head stay with AdamW)"
)


def _load_model(spec: str) -> nn.Module:
    """Build ``--model`` on the meta device.

    Raises:
        UsageError: it cannot be resolved or imported, or the factory raises (named, with its
            exception), or it returns no nn.Module.
    """
    try:
        build = resolve_model(spec)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    except Exception as exc:  # importing the user's module ran its code
        raise UsageError(f"Invalid --model {spec!r}: importing it raised "
                         f"{type(exc).__name__}: {exc}") from exc
    try:
        return build()
    except Exception as exc:  # the user's factory: any exception is a bad input here
        raise UsageError(f"Invalid --model {spec!r}: the factory raised "
                         f"{type(exc).__name__}: {exc}") from exc


def _ns_report(plan: OwnershipPlan, cm: CostModel) -> dict:
    load = plan.ns_load
    costs = list(plan.ns_cost.values())
    w = plan.world_size
    out = {
        "max_flops": max(load, default=0),
        "mean_flops": sum(load) / w,
        "max_over_mean": plan.ns_max_over_mean,
        "lower_bound_flops": max(max(costs, default=0), sum(costs) / w),
        "lower_bound_l2_flops": plan.ns_lower_bound(),
        "idle_owners": plan.idle_owners,
        "critical_path_s": cm.ns_s(max(load, default=0)),
    }
    if costs:
        big = max(plan.specs, key=lambda sp: (plan.ns_cost[sp.name], sp.name))
        out["largest_matrix"] = {"name": big.name, "shape": list(big.shape)}
        team = min(cm.gpus_per_node, w // len(costs))
        if team >= 2:
            # each matrix gets a team of `team` ranks of one node (column blocks + Gram all_reduce)
            split = max(sp.matrices * split_ns_s(*sp.matrix_shape, team, cm) for sp in plan.specs)
            out["split_ns"] = {"team": team, "critical_path_s": split}
    return out


def coalesce_target(cm: CostModel) -> int:
    """DMuon's unit target in bytes under coalesce="auto" on NCCL, from this cost model: units
    of up to α·bandwidth bytes (docs/traffic-model.md, "Coalescing"); "block" is one unit per
    block."""
    return int(cm.intra_alpha_us * 1e-6 * cm.intra_gbps * 1e9)


def report(ml: ModelLayout, mesh: tuple[int, int], cm: CostModel, memory: bool = True) -> dict:
    """The JSON-able report of one mesh: NS balance and one row per applicable mode; for a
    model without Muon-target params ``ns`` is None, ``modes`` is empty and ``note`` says why.
    ``mesh`` is ``{"replicate": R, "shard": N}``. With ``memory``, each DMuon mode's row has
    ``memory``: its per-rank memory summary (:func:`verify.plan.memory.memory_summary`)."""
    r, n = mesh
    # matrices Muon orthogonalizes (an expert stack of E counts E), in how many params
    head = {"model": ml.name, "params": ml.n_params,
            "muon_matrices": sum(sp.matrices for sp in ml.muon_specs), "muon_params": len(ml.muon_names),
            "p_m": sum(p.numel for p in ml.muon_specs), "mesh": {"replicate": r, "shard": n},
            "world_size": r * n}
    if not ml.muon_specs:
        return {**head, "plan_s": 0.0, "ns": None, "modes": [], "note": NOTHING_TO_DEDICATE}
    t0 = time.perf_counter()
    plan = plan_ownership(ml.muon_specs, mesh)
    plan_s = time.perf_counter() - t0
    rows = []
    target = coalesce_target(cm)
    for mode in layout_modes(r):
        layout = ml.layout(mode, r, n, target)
        st = step_traffic(layout, plan, mode=mode)
        per_block = step_traffic(ml.layout(mode, r, n), plan, mode=mode) if mode.startswith("dmuon") else st
        comm = cm.busiest_comm_s(st)
        ns = cm.ns_s(ns_flops_busiest(st, plan))
        rows.append({
            "mode": mode,
            "closed_form": st.closed_form_text(),
            "closed_form_elems": st.closed_form_elems(),
            "ded_avg_elems": st.ded_avg_elems,
            "ded_avg_bytes": st.ded_avg_bytes,
            "ded_max_bytes": st.ded_max_bytes,
            "total_avg_bytes": st.total_avg_bytes,
            "calls_max": st.calls_max,
            "calls_avg": st.calls_avg,
            "calls_max_per_block": per_block.calls_max,
            "coalesce_bytes": target if mode.startswith("dmuon") else None,
            "ns_calls": st.ns_calls,
            "param_bytes_max": st.param_bytes_max,
            "momentum_bytes_max": st.momentum_bytes_max,
            "comm_s": comm,
            "ns_s": ns,
            "step_s": comm + ns,
        })
        if memory and mode.startswith("dmuon"):
            rows[-1]["memory"] = memory_summary(layout, plan)
    return {**head, "plan_s": plan_s, "ns": _ns_report(plan, cm), "modes": rows}


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _mesh_text(rep: dict) -> str:
    return f"{rep['mesh']['replicate']}x{rep['mesh']['shard']}"


def format_report(rep: dict, cm: CostModel) -> str:
    ns = rep["ns"]
    if ns is None:
        return (f"{rep['model']}: {rep['params']:,} params, mesh {_mesh_text(rep)} "
                f"(W = {rep['world_size']}): {rep['note']}.")
    lines = [
        f"{rep['model']}: {rep['params'] / 1e9:.3f} B params, {rep['muon_matrices']} Muon "
        f"matrices in {rep['muon_params']} params, P_M = {rep['p_m'] / 1e9:.3f} B elements; mesh {_mesh_text(rep)} (W = {rep['world_size']}); "
        f"planned in {rep['plan_s']:.3f} s",
        f"NS load (FLOPs, ns_steps=5): max/mean {ns['max_over_mean']:.3f}; max / bound "
        f"max(largest, total/W) = {ns['max_flops'] / ns['lower_bound_flops']:.3f}; max / L2 bound "
        f"{ns['max_flops'] / ns['lower_bound_l2_flops']:.3f}; idle owners {ns['idle_owners']}; "
        f"NS critical path {_ms(ns['critical_path_s'])} ms at {cm.tflops:g} TFLOP/s",
    ]
    if "split_ns" in ns:
        sp = ns["split_ns"]
        verb = "cut it to" if sp["critical_path_s"] < ns["critical_path_s"] else "lengthen it to"
        lines.append(
            f"  split NS (model): teams of {sp['team']} ranks per matrix would {verb} "
            f"{_ms(sp['critical_path_s'])} ms (not implemented: see docs/scaling.md)"
        )
    headers = [
        "mode", "closed form", "ded elems/rank ÷ P_M", "vs closed", "ded GiB/rank avg",
        "ded GiB busiest", "all GiB/rank avg", "calls/step busiest (DMuon: per block -> coalesced)", "NS calls",
        "param GiB/rank", "momentum GiB/rank", "comm ms", "NS ms", "step ms (no overlap)",
    ]
    body = [
        [
            m["mode"], m["closed_form"], f"{m['ded_avg_elems'] / rep['p_m']:.4f}",
            f"{m['ded_avg_elems'] / m['closed_form_elems']:.4f}" if m["closed_form_elems"] else "-",
            _gib(m["ded_avg_bytes"]), _gib(m["ded_max_bytes"]), _gib(m["total_avg_bytes"]),
            _calls(m), m["ns_calls"], _gib(m["param_bytes_max"]), _gib(m["momentum_bytes_max"]),
            _ms(m["comm_s"]), _ms(m["ns_s"]), _ms(m["step_s"]),
        ]
        for m in rep["modes"]
    ]
    lines.append(tabulate(body, headers=headers, tablefmt="github"))
    lines.append(
        "ded = dedicated (Muon-target) params; avg = W-average of f(n)·S per rank (docs/spec.md §2, "
        "docs/traffic-model.md), "
        "busiest = the rank with the most; 'vs closed' > 1 is FSDP2's dim-0 padding. Memory: "
        "dedicated params resident between steps (Z2 and DDP keep a full copy on every rank; "
        "Z3 keeps the owners' share) and Muon momentum. " + _cost_text(cm)
    )
    memory = format_memory(rep)
    if memory:
        lines += ["", memory]
    return "\n".join(lines)


def _calls(m: dict) -> str:
    """Calls per step of the busiest rank; DMuon modes: per block -> coalesced."""
    if m["calls_max_per_block"] == m["calls_max"]:
        return str(m["calls_max"])
    return f"{m['calls_max_per_block']} -> {m['calls_max']}"


def _cost_text(cm: CostModel) -> str:
    return (
        f"α-β: {cm.gpus_per_node} GPUs/node, intra {cm.intra_gbps:g} GB/s + {cm.intra_alpha_us:g} µs, "
        f"inter {cm.inter_gbps:g} GB/s + {cm.inter_alpha_us:g} µs per call, NS at {cm.tflops:g} TFLOP/s; "
        "calls serial, no overlap with compute."
    )


def sweep(ml: ModelLayout, cm: CostModel, worlds=None) -> list[dict]:
    """Reports over ``worlds`` (default :data:`SWEEP_WORLDS`, read at call time): a 1-D mesh
    and, above one node, HSDP with N = GPUs per node."""
    worlds = SWEEP_WORLDS if worlds is None else worlds
    out = []
    for w in worlds:  # no memory summaries: --sweep shows none (a --mesh report has them)
        out.append(report(ml, (1, w), cm, memory=False))
        g = cm.gpus_per_node
        if w > g and w % g == 0:
            out.append(report(ml, (w // g, g), cm, memory=False))
    return out


def format_sweep(reports: list[dict], cm: CostModel) -> str:
    headers = ["W", "mesh", "mode", "ded GiB/rank avg", "calls/step", "NS ms", "comm ms",
               "step ms", "param GiB/rank", "idle owners", "NS max/bound"]
    body = []
    for rep in reports:
        ns = rep["ns"]
        for m in rep["modes"]:
            body.append([
                rep["world_size"], _mesh_text(rep), m["mode"], _gib(m["ded_avg_bytes"]),
                _calls(m), _ms(m["ns_s"]), _ms(m["comm_s"]), _ms(m["step_s"]),
                _gib(m["param_bytes_max"]), ns["idle_owners"],
                f"{ns['max_flops'] / ns['lower_bound_flops']:.3f}",
            ])
    head = reports[0]
    if head["ns"] is None:
        return f"{head['model']}: {head['params']:,} params: {head['note']}."
    return (
        f"{head['model']}: {head['params'] / 1e9:.3f} B params, {head['muon_matrices']} Muon matrices\n"
        + tabulate(body, headers=headers, tablefmt="github") + "\n" + _cost_text(cm)
    )


def plot_sweep(reports: list[dict], path: str) -> None:
    """PNG (whatever ``path``'s suffix): dedicated bytes per rank-step and NS time of the
    busiest rank against W, per mode.

    Raises:
        OSError: ``path`` cannot be written.
    """
    matplotlib = require("matplotlib", "dmuon-plan --plot")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "dmuon-plan --plot")

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for rep in reports:
        suffix = "" if rep["mesh"]["replicate"] == 1 else f" (Rx{rep['mesh']['shard']})"
        for m in rep["modes"]:
            series.setdefault(m["mode"] + suffix, []).append(
                (rep["world_size"], m["ded_avg_bytes"] / 2**30, m["ns_s"] * 1e3)
            )
    for label, pts in series.items():
        ws = [p[0] for p in pts]
        ax_b.plot(ws, [p[1] for p in pts], marker="o", label=label)
        ax_t.plot(ws, [p[2] for p in pts], marker="o", label=label)
    for ax, ylabel in ((ax_b, "dedicated GiB per rank-step (W-average)"), (ax_t, "NS ms, busiest rank")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("W (ranks)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    if series:
        ax_t.legend(fontsize=7, ncol=2)
    else:
        fig.text(0.5, 0.5, "nothing to dedicate: no Muon-target params", ha="center")
    fig.suptitle(f"{reports[0]['model']}: DMuon and baselines against W")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """dmuon-plan's parser (:func:`verify.plan.args.build_parser`); its errors raise
    :class:`verify.plan.args.UsageError`."""
    return _build_parser(CostModel(), PRESETS, SWEEP_WORLDS)


#: Version of :func:`json_document`'s layout (1: the unversioned one, ``mesh`` as ``[R, N]``).
SCHEMA_VERSION = 2

#: ``units`` of the JSON: key suffix or field -> unit.
UNITS: dict[str, str] = {
    "*_elems": "elements per rank per training step; ded_*: of the dedicated (Muon-target) "
               "params; *_avg_*: W-average of f(n)·S (docs/traffic-model.md), *_max_*: busiest rank",
    "*_bytes": "bytes per rank per training step at element_bytes (ded_*: dedicated params, "
               "total_*: all params; *_avg_*: W-average, *_max_*: busiest rank)",
    "param_bytes_max": "bytes of dedicated params resident on the fullest rank between steps",
    "momentum_bytes_max": "bytes of Muon momentum on the fullest rank",
    "*_s": "seconds (α-β cost model with cost_model's parameters; plan_s: wall time to plan)",
    "*_flops": "floating-point operations of Newton–Schulz per training step (ns_steps=5)",
    "*_gbps": "GB/s (1e9 bytes per second)",
    "*_us": "microseconds per call",
    "tflops": "1e12 FLOP/s",
    "params": "elements of all parameters",
    "p_m": "elements of the Muon-target parameters",
    "muon_matrices": "count of Muon-target matrices",
    "muon_params": "count of params holding them (an expert stack of E matrices is one param)",
    "world_size": "ranks (W = replicate × shard)",
    "mesh": "ranks per axis: replicate (R, across nodes in HSDP) and shard (N)",
    "replicate": "ranks on the replicate axis (R; 1 for a 1-D mesh)",
    "shard": "ranks on the shard axis (N)",
    "gpus_per_node": "GPUs",
    "element_bytes": "bytes per element of dtype (null: mixed dtypes, see param_dtypes)",
    "param_dtypes": "elements per dtype the collectives carry",
    "calls_max": "collective calls per training step of the busiest rank",
    "calls_avg": "collective calls per training step, mean over ranks",
    "calls_max_per_block": "calls_max with DMuon's coalesce='block' (one unit per block): the before of coalescing",
    "coalesce_bytes": "DMuon's unit target in bytes (coalesce='auto': intra α x intra bandwidth); null for other modes",
    "ns_calls": "Newton–Schulz calls per training step, all ranks together",
    "max_over_mean": "ratio of the busiest owner's NS FLOPs to the mean",
    "idle_owners": "ranks that own no matrix",
    "team": "ranks sharing one matrix's NS (modelled split)",
    "shape": "elements per dimension",
    "memory": "a DMuon mode's memory per rank (verify.plan.memory, docs/scaling.md 'Memory per "
              "rank'): min / median / max over the ranks of each figure, and the busiest rank's",
    "min": "the smallest over the ranks, each figure on its own",
    "median": "the median over the ranks, each figure on its own",
    "max": "the largest over the ranks, each figure on its own",
    "busiest": "the rank with the largest sum_bytes, with all its figures",
    "rank": "world rank",
    "z3": "true: Z3 (reshard after forward), false: Z2 / DDP (resident)",
    "prefetch_depth": "DMuon's prefetch_depth, in buckets, the window assumes",
    "window_units": "units the widest window spans",
    "params_held_bytes": "bytes of dedicated params the rank holds",
    "window_bytes": "bytes of non-held compute copies alive at once (Z3 window; Z2/DDP: all)",
    "grads_held_bytes": "bytes of DMuon's grad buffers of held buckets",
    "grads_in_flight_bytes": "bound, in bytes, on non-held grad buffers alive at once",
    "momentum_bytes": "bytes of Muon momentum of the matrices the rank owns",
    "adamw_rest_bytes": "bytes of AdamW's exp_avg + exp_avg_sq of the rank's part of the rest",
    "sum_bytes": "bytes of the figures above together",
    "pp": "--pp: pipeline stages S (in mesh), or the PP section (verify/plan/pp.py)",
    "tp": "tensor-parallel degree T",
    "microbatches": "micro-batches per training step (M)",
    "microbatch_tokens": "tokens of one micro-batch on one data-parallel rank",
    "width": "the model's hidden width D (elements per token of an activation); null: not stated",
    "stages": "one entry per pipeline stage, in order",
    "stage": "the stage's index (0 = first)",
    "blocks": "names of the stage's blocks (ModuleList elements)",
    "p_s": "elements of the stage's Muon-target parameters (P_s)",
    "cp": "--cp: the context-parallel degree C, or the CP section (verify/plan/cp.py)",
    "n_eff": "ranks of DMuon's shard group, N·C (cp declared a shard dim)",
    "cp_tokens": "tokens of one rank's part of its sequences per training step",
    "kv_width": "elements per token of K (and of V): n_kv_heads·head_dim; null: not stated",
    "layers": "attention layers (L)",
    "kv_closed_form": "the K/V exchange's closed form (elements received per rank per step)",
    "p2p": "the stage-to-stage send/recv of activations and their grads (not DMuon's); null: not sized",
}


def json_document(reports: list[dict], cm: CostModel, ml: ModelLayout, dtype: str,
                  warnings: list[str]) -> dict:
    """What ``--json`` prints: ``schema_version``, ``model``, ``dtype`` (the dtype the
    collectives carry; ``mixed`` under ``--dtype model`` with several), ``element_bytes``,
    ``param_dtypes``, ``units`` (:data:`UNITS`), ``warnings``, ``cost_model`` and ``reports``
    (one per mesh, :func:`report`)."""
    kinds = sorted(ml.param_dtypes)
    if dtype == MODEL_DTYPE:
        dtype = kinds[0] if len(kinds) == 1 else "mixed" if kinds else MODEL_DTYPE
    size = DTYPES.get(dtype, DTYPE_BYTES.get(dtype))
    return {"schema_version": SCHEMA_VERSION, "model": ml.name, "dtype": dtype,
            "element_bytes": size, "param_dtypes": dict(ml.param_dtypes), "units": UNITS,
            "warnings": warnings, "cost_model": asdict(cm), "reports": reports}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _plan(args) -> tuple[list[dict], list[dict] | None, CostModel, ModelLayout, list[str]]:
    """The reports of ``args``, the sweep (for ``--png``), the cost model, the model layout
    and the warnings. Raises :class:`UsageError` / ``ValueError`` on bad input."""
    if not args.sweep and not args.mesh:
        raise UsageError("Invalid arguments: give --mesh N or RxN, or --sweep.")
    cm = CostModel(
        gpus_per_node=args.gpus_per_node, intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps,
        intra_alpha_us=args.intra_alpha_us, inter_alpha_us=args.inter_alpha_us, tflops=args.tflops,
    )
    mesh = table_mesh = args.mesh
    given = [kind for kind in CHECK_ORDER if kind.given(args)]
    for kind in given:
        error = kind.refusal(args) or kind.world_error(args, table_mesh)
        if error:
            raise UsageError(error)
        if table_mesh:
            table_mesh = kind.table_mesh(args, table_mesh)
    warnings = mesh_warnings(table_mesh, cm.gpus_per_node, {"tp": args.tp}) if table_mesh else []
    model = _load_model(args.model)
    ml = ModelLayout(model, args.model, None if args.dtype == MODEL_DTYPE else args.dtype)
    ctx = PlanContext(args=args, ml=ml, config=getattr(model, "config", None), mesh=mesh,
                      table_mesh=table_mesh, coalesce_bytes=coalesce_target(cm),
                      dtype_bytes=DTYPES.get(args.dtype), tflops=cm.tflops,
                      report=lambda sub, sub_mesh: report(sub, sub_mesh, cm))
    early = {kind.flag: kind.section(ctx) for kind in given if kind.before_table}
    swept = sweep(ml, cm) if args.sweep or args.png else None
    reports = swept if args.sweep else [report(ml, table_mesh, cm)]
    for kind in KINDS:  # each given kind's section (verify/plan/{tp,ep,pp,cp}.py)
        if kind in given:
            reports[0][kind.flag] = early[kind.flag] if kind.flag in early else kind.section(ctx)
    return reports, swept, cm, ml, warnings


def main(argv=None) -> int:
    """Run dmuon-plan; returns the exit code (module docstring)."""
    try:
        args = build_parser().parse_args(argv)
        reports, swept, cm, ml, warnings = _plan(args)
    except SystemExit as exc:  # --help
        return exc.code or 0
    except ValueError as exc:  # UsageError, or a ValueError of the planner on this input
        print(f"dmuon-plan: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.png:
        try:
            plot_sweep(swept, args.png)
        except OSError as exc:
            print(f"dmuon-plan: Invalid --png {args.png!r}: cannot write it "
                  f"({_one_line(exc.strerror or exc)}).", file=sys.stderr)
            return 2
    for line in warnings:  # after the last bad-input check: exit 2 prints one line only
        print(f"dmuon-plan: warning: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps(json_document(reports, cm, ml, args.dtype, warnings), indent=1))
    elif args.sweep:
        print(format_sweep(reports, cm))
    else:
        print(format_report(reports[0], cm))
        for kind in KINDS:
            if kind.flag in reports[0]:
                print(kind.format(reports[0][kind.flag]))
    if args.png and not args.json:
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
