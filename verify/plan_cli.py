"""``dmuon-plan``: size a DMuon job before running it: NS balance, traffic, calls, memory, time.

Usage::

    dmuon-plan --model llama3-70b --mesh 128x8            # one (R, N) mesh, HSDP modes
    dmuon-plan --model llama3-8b --mesh 64                 # a 1-D mesh, DDP / FSDP2 modes
    dmuon-plan --model llama3-8b --sweep --png sweep.png   # W = 8 ... 1024, both mesh kinds
    dmuon-plan --model mypkg.models:make_model --mesh 16 --json

``--model`` is a preset of :mod:`verify.workload.presets` or ``pkg.module:factory`` (called under the
meta device: no memory). The Muon targets are :func:`dmuon.select.default_predicate`'s; FSDP2
wraps each element of the model's top-level ``nn.ModuleList`` (the blocks), then the root, as
the harness does; the naive baselines also wrap each Muon Linear. Traffic comes from
:func:`verify.traffic.scale.step_traffic`, the plan from :func:`dmuon.plan.plan_ownership`, times
from :class:`verify.traffic.scale.CostModel` (flags below; defaults printed with every table).
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

from dmuon.plan import OwnershipPlan, plan_ownership, specs_from_named_parameters
from dmuon.select import matrix_shapes, select_params

from verify.traffic.predict import RunLayout
from verify.workload.presets import PRESETS, resolve_model
from verify.traffic.scale import CostModel, layout_modes, ns_flops_busiest, split_ns_s, step_traffic

#: World sizes of ``--sweep``.
SWEEP_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)


class ModelLayout:
    """What every mesh of one model shares: its params, Muon targets and wrap units."""

    def __init__(self, model: nn.Module, name: str, dtype: str | None = "bfloat16") -> None:
        self.name = name
        self.muon_names = tuple(n for n, _, _ in select_params(model, None, None))
        # Muon's matrix of each target: a stack's slice, a conv weight's (out, in·k…) view
        matrices = matrix_shapes(model, self.muon_names)
        params = specs_from_named_parameters(model.named_parameters(), matrices)
        if dtype is not None:  # the dtype the collectives carry (e.g. bf16 params in training)
            params = [dataclasses.replace(p, dtype=dtype) for p in params]
        self.params = tuple(params)
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

    def layout(self, mode: str, r: int, n: int) -> RunLayout:
        if "ddp" in mode or mode.startswith("zero1"):
            units = ()
        else:
            units = (self.linears if mode.startswith("naive") else ()) + self.blocks + ("",)
        return RunLayout(
            mode="ddp-muon" if mode.startswith("zero1") else mode, replicate_size=r, shard_size=n,
            params=self.params, muon_names=self.muon_names, fsdp_modules=units,
            reshard_after_forward=mode.endswith("z3") or mode == "naive-hsdp",
        )


def parse_mesh(text: str) -> tuple[int, int]:
    """``"N"`` -> (1, N); ``"RxN"`` -> (R, N). Raises ``ValueError`` otherwise."""
    parts = text.lower().split("x")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or any(s < 1 for s in sizes):
        raise ValueError(
            f"Invalid mesh={text!r}. Must be N (a 1-D mesh of N ranks) or RxN (HSDP: R replicas "
            "of N-way shards), e.g. 64 or 128x8."
        )
    return (1, sizes[0]) if len(sizes) == 1 else (sizes[0], sizes[1])


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


def report(ml: ModelLayout, mesh: tuple[int, int], cm: CostModel) -> dict:
    """The JSON-able report of one mesh: NS balance and one row per applicable mode."""
    r, n = mesh
    t0 = time.perf_counter()
    plan = plan_ownership(ml.muon_specs, mesh)
    plan_s = time.perf_counter() - t0
    rows = []
    for mode in layout_modes(r):
        st = step_traffic(ml.layout(mode, r, n), plan, mode=mode)
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
            "ns_calls": st.ns_calls,
            "param_bytes_max": st.param_bytes_max,
            "momentum_bytes_max": st.momentum_bytes_max,
            "comm_s": comm,
            "ns_s": ns,
            "step_s": comm + ns,
        })
    return {
        "model": ml.name, "params": ml.n_params,
        # matrices Muon orthogonalizes (an expert stack of E counts E), in how many params
        "muon_matrices": sum(sp.matrices for sp in ml.muon_specs), "muon_params": len(ml.muon_names),
        "p_m": sum(p.numel for p in ml.muon_specs),
        "mesh": [r, n], "world_size": r * n, "plan_s": plan_s,
        "ns": _ns_report(plan, cm), "modes": rows,
    }


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def format_report(rep: dict, cm: CostModel) -> str:
    ns = rep["ns"]
    r, n = rep["mesh"]
    lines = [
        f"{rep['model']}: {rep['params'] / 1e9:.3f} B params, {rep['muon_matrices']} Muon "
        f"matrices in {rep.get('muon_params', rep['muon_matrices'])} params, P_M = {rep['p_m'] / 1e9:.3f} B elements; mesh {r}x{n} (W = {rep['world_size']}); "
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
        "ded GiB busiest", "all GiB/rank avg", "calls/step (busiest)", "NS calls",
        "param GiB/rank", "momentum GiB/rank", "comm ms", "NS ms", "step ms (no overlap)",
    ]
    body = [
        [
            m["mode"], m["closed_form"], f"{m['ded_avg_elems'] / rep['p_m']:.4f}",
            f"{m['ded_avg_elems'] / m['closed_form_elems']:.4f}" if m["closed_form_elems"] else "-",
            _gib(m["ded_avg_bytes"]), _gib(m["ded_max_bytes"]), _gib(m["total_avg_bytes"]),
            m["calls_max"], m["ns_calls"], _gib(m["param_bytes_max"]), _gib(m["momentum_bytes_max"]),
            _ms(m["comm_s"]), _ms(m["ns_s"]), _ms(m["step_s"]),
        ]
        for m in rep["modes"]
    ]
    lines.append(tabulate(body, headers=headers, tablefmt="github"))
    lines.append(
        "ded = dedicated (Muon-target) params; avg = W-average of f(n)·S per rank (SPEC §2), "
        "busiest = the rank with the most; 'vs closed' > 1 is FSDP2's dim-0 padding. Memory: "
        "dedicated params resident between steps (Z2 and DDP keep a full copy on every rank; "
        "Z3 keeps the owners' share) and Muon momentum. " + _cost_text(cm)
    )
    return "\n".join(lines)


def _cost_text(cm: CostModel) -> str:
    return (
        f"α-β: {cm.gpus_per_node} GPUs/node, intra {cm.intra_gbps:g} GB/s + {cm.intra_alpha_us:g} µs, "
        f"inter {cm.inter_gbps:g} GB/s + {cm.inter_alpha_us:g} µs per call, NS at {cm.tflops:g} TFLOP/s; "
        "calls serial, no overlap with compute."
    )


def sweep(ml: ModelLayout, cm: CostModel, worlds=SWEEP_WORLDS) -> list[dict]:
    """Reports over ``worlds``: a 1-D mesh and, above one node, HSDP with N = GPUs per node."""
    out = []
    for w in worlds:
        out.append(report(ml, (1, w), cm))
        g = cm.gpus_per_node
        if w > g and w % g == 0:
            out.append(report(ml, (w // g, g), cm))
    return out


def format_sweep(reports: list[dict], cm: CostModel) -> str:
    headers = ["W", "mesh", "mode", "ded GiB/rank avg", "calls/step", "NS ms", "comm ms",
               "step ms", "param GiB/rank", "idle owners", "NS max/bound"]
    body = []
    for rep in reports:
        ns = rep["ns"]
        for m in rep["modes"]:
            body.append([
                rep["world_size"], "x".join(map(str, rep["mesh"])), m["mode"], _gib(m["ded_avg_bytes"]),
                m["calls_max"], _ms(m["ns_s"]), _ms(m["comm_s"]), _ms(m["step_s"]),
                _gib(m["param_bytes_max"]), ns["idle_owners"],
                f"{ns['max_flops'] / ns['lower_bound_flops']:.3f}",
            ])
    head = reports[0]
    return (
        f"{head['model']}: {head['params'] / 1e9:.3f} B params, {head['muon_matrices']} Muon matrices\n"
        + tabulate(body, headers=headers, tablefmt="github") + "\n" + _cost_text(cm)
    )


def plot_sweep(reports: list[dict], path: str) -> None:
    """PNG: dedicated bytes per rank-step and NS time of the busiest rank against W, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for rep in reports:
        suffix = "" if rep["mesh"][0] == 1 else f" (Rx{rep['mesh'][1]})"
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
    ax_t.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{reports[0]['model']}: DMuon and baselines against W")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    d = CostModel()
    p = argparse.ArgumentParser(prog="dmuon-plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or pkg.module:factory")
    p.add_argument("--mesh", help="N (1-D) or RxN (HSDP); required unless --sweep")
    p.add_argument("--sweep", action="store_true", help=f"W = {SWEEP_WORLDS[0]}..{SWEEP_WORLDS[-1]}")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--png", metavar="PATH", help="plot bytes and NS time against W (sweeps the W range)")
    p.add_argument("--dtype", default="bfloat16",
                   help="dtype of every param in the collectives (default %(default)s; 'model' keeps the model's)")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--intra-gbps", type=float, default=d.intra_gbps, help="NVLink GB/s (default %(default)s)")
    p.add_argument("--inter-gbps", type=float, default=d.inter_gbps, help="per-GPU network GB/s (default %(default)s)")
    p.add_argument("--intra-alpha-us", type=float, default=d.intra_alpha_us)
    p.add_argument("--inter-alpha-us", type=float, default=d.inter_alpha_us)
    p.add_argument("--tflops", type=float, default=d.tflops, help="NS TFLOP/s (default %(default)s)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.sweep and not args.mesh:
            raise ValueError("Invalid arguments: give --mesh N or RxN, or --sweep.")
        cm = CostModel(
            gpus_per_node=args.gpus_per_node, intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps,
            intra_alpha_us=args.intra_alpha_us, inter_alpha_us=args.inter_alpha_us, tflops=args.tflops,
        )
        mesh = parse_mesh(args.mesh) if args.mesh else None
        ml = ModelLayout(resolve_model(args.model)(), args.model, None if args.dtype == "model" else args.dtype)
        swept = sweep(ml, cm) if args.sweep or args.png else None
        reports = swept if args.sweep else [report(ml, mesh, cm)]
    except ValueError as exc:
        print(f"dmuon-plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"cost_model": asdict(cm), "reports": reports}
        print(json.dumps(doc, indent=1))
    elif args.sweep:
        print(format_sweep(reports, cm))
    else:
        print(format_report(reports[0], cm))
    if args.png:
        plot_sweep(swept, args.png)
        if not args.json:
            print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
