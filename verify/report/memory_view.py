"""DMuon's memory in the report: the report.md table and ``memory.png``, the companion of
``traffic.png`` (docs/verify.md, "Memory").

Both read ``runs[].memory`` (``verify.traffic.memory.memory_report``): per rank the measured
peak bytes of the dedicated params (forward, backward, between steps) and of DMuon's grad
buffers beside the bound predicted from the plan, and each rank's trace over the last
measured step (one sample per hook). Figures are printed in MB (10^6 bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tabulate import tabulate

from verify.report.schema import mode_label


def _mb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:.3f}"


def memory_runs(report: Mapping) -> list[Mapping]:
    """The runs of ``report`` that carry ``memory`` (DMuon modes of a current report)."""
    return [run for run in report["runs"] if run.get("memory")]


def memory_rows(report: Mapping) -> tuple[list[str], list[list[str]]]:
    """report.md's table: one row per (DMuon run, rank), measured / bound in MB."""
    headers = ["mode", "rank", "between steps", "peak forward", "peak backward", "bound (fwd/bwd)",
               "Z3 window (units)", "grad buffers", "grads bound", "CUDA max allocated"]
    rows = []
    for run in memory_runs(report):
        mem = run["memory"]
        for r in mem["ranks"]:
            m, b = r["measured"], r["bound"]
            rows.append([mode_label(run), str(r["rank"]), f"{_mb(m['between'])} / {_mb(b['between_bytes'])}",
                         _mb(m["forward"]), _mb(m["backward"]), _mb(b["peak_bytes"]),
                         f"{_mb(b['window_bytes'])} ({b['window_units']})" if mem["z3"] else "resident",
                         _mb(m["grads"]), _mb(b["grads_bytes"]), _mb(r["cuda_max_allocated_bytes"])])
    return headers, rows


def memory_md(report: Mapping) -> list[str]:
    """report.md's "Memory" section (empty where no run carries ``memory``)."""
    headers, rows = memory_rows(report)
    if not rows:
        return []
    return ["", "## DMuon memory per rank (MB)", "",
            "Bytes of the dedicated params' storages (held buckets and non-held compute copies) "
            "and of DMuon's grad buffers at every forward / backward hook, measured by the "
            "harness's hooks; the bound is predicted from the plan (`verify.traffic.memory`), "
            "gated by the `memory` check. Between steps: measured / predicted.",
            "", tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True,
                        colalign=("left",) + ("right",) * (len(headers) - 1)), "", "![DMuon memory per rank over one step](memory.png)"]


def plot_memory(report: Mapping, path: str | Path) -> Path | None:
    """``memory.png``: per DMuon run, each rank's dedicated bytes (solid) and grad-buffer bytes
    (dotted) at every hook of the last measured step, with the rank's bound (dashed). Returns
    ``path``, or ``None`` (nothing written) where no run carries ``memory``."""
    runs = memory_runs(report)
    if not runs:
        return None
    from tracer._compat import require

    Figure = require("matplotlib.figure", "verify's PNG charts (memory.png)").Figure
    fig = Figure(figsize=(10.0, 2.6 * len(runs) + 0.6), dpi=110)
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        mem = run["memory"]
        for rank, (trace, r) in enumerate(zip(mem["trace"], mem["ranks"])):
            color = f"C{rank % 10}"
            ax.plot([s[1] / 1e6 for s in trace], color=color, label=f"rank {rank}")
            ax.plot([s[2] / 1e6 for s in trace], color=color, linestyle=":", linewidth=0.9)
            ax.axhline(r["bound"]["peak_bytes"] / 1e6, color=color, linestyle="--", linewidth=0.7)
        ok = next((c["pass"] for c in run.get("checks", []) if c["check"] == "memory"), True)
        ax.set_title(f"{mode_label(run)}{'' if ok else ': FAIL memory'}", fontsize=9,
                     color="black" if ok else "red")
        ax.set_ylabel("MB")
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7, ncol=4, loc="upper right")
    axes[-1].set_xlabel("hook of the last measured step (solid: dedicated params, dotted: grad "
                        "buffers, dashed: bound)", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
