"""The terminal report's layout: 120 columns with grouped headers, --wide for everything, the
new bytes / busiest-rank / time figures, and no import cycle between report and plots."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.report_builders import example_report
from verify.report.render import format_markdown, table_rows
from verify.report.terminal import TERMINAL_COLUMNS, compact_rows, format_table

ROOT = Path(__file__).resolve().parents[2]


def _with_new_figures(report: dict, scale: float = 1.0) -> dict:
    """Add wire / bytes / timing to every run (``scale`` blows the numbers up to GPT-2 size)."""
    for run in report["runs"]:
        w = run["world_size"]
        for key in ("p_m", "measured_avg_elems", "predicted_avg_elems", "closed_form_avg_elems"):
            run[key] = run[key] * scale if key != "p_m" else int(run[key] * scale)
        run["ratio_to_p_m"] = run["measured_avg_elems"] / run["p_m"]
        for ph in run["phases"].values():
            for key in ("measured_avg_elems", "predicted_avg_elems", "closed_form_avg_elems"):
                ph[key] = ph[key] * scale if ph[key] is not None else None
        per_rank = [{"rank": r, "sent_elems": run["measured_avg_elems"] * (1 + r / 8),
                     "recv_elems": run["measured_avg_elems"] * (1 + r / 10),
                     "sent_bytes": 0.0, "recv_bytes": 4.0 * run["measured_avg_elems"] * (1 + r / 10)}
                    for r in range(w)]
        busiest = per_rank[-1]
        run["wire"] = {"per_rank": per_rank, "busiest_rank": w - 1,
                       "max_recv_elems": busiest["recv_elems"], "max_sent_elems": busiest["sent_elems"],
                       "max_recv_bytes": busiest["recv_bytes"], "max_sent_bytes": 0.0,
                       "mean_recv_elems": run["measured_avg_elems"]}
        run["max_rank_elems"] = busiest["recv_elems"]
        by_phase = {name: {"float32": 4.0 * ph["measured_avg_elems"], "bfloat16": 2.0}
                    for name, ph in run["phases"].items()}
        by_phase["total"] = {"float32": 4.0 * run["measured_avg_elems"], "bfloat16": 2.0}
        run["bytes"] = {"measured_avg_bytes": by_phase, "predicted_avg_bytes": by_phase}
        run["timing"] = {"step_ms": 1234.5, "step_ms_per_step": [1234.5, 1300.0],
                         "exposed_comm_frac": 0.437, "exposed_comm_frac_max": 0.61,
                         "exposed_comm_source": "schedstat", "exposed_comm_reason": None}
    report["model"] = "examples.my_model:factory"
    report["skipped"] = [{"mode": "naive-hsdp", "reason": "HSDP runs on a 2 x W/2 mesh: needs an "
                          "even W >= 4, have W=3"}]
    return report


@pytest.mark.parametrize("scale", [1.0, 1300.0])  # TinyGPT, and a GPT-2-sized P_M (128 M)
def test_default_table_fits_120_columns(scale):
    text = format_table(_with_new_figures(example_report(), scale))
    widths = [len(line) for line in text.splitlines()]
    assert max(widths) <= TERMINAL_COLUMNS, text.splitlines()[widths.index(max(widths))]
    assert "FAIL dmuon-z3" in text and "skipped naive-hsdp: HSDP runs on a 2 x W/2 mesh" in text


def test_grouped_headers_and_new_columns():
    report = _with_new_figures(example_report())
    lines = format_table(report).splitlines()
    group = next(line for line in lines if "─" in line)
    assert "dedicated params per rank-step" in group and "time" in group and "checks" in group
    headers, rows = compact_rows(report)
    col = {h.replace("\n", " "): i for i, h in enumerate(headers)}
    total = next(r for r in rows if r[:2] == ["dmuon-z2", "total"])
    assert total[col["measured [elem]"]] == "147,456"
    assert total[col["pred /cf"]] == "=/="
    assert total[col["bytes [avg]"]] == "576.0 KiB"  # 147,456 · 4 B + 2 B of bf16
    assert total[col["peak /P_M"]] == "1.9500"  # rank 3 of 4: 1.3 × 1.5
    assert total[col["step [ms]"]] == "1234.5" and total[col["comm wait"]] == "44%"
    assert total[col["srcs ok"]] == "2/2"
    failed = next(r for r in rows if r[:2] == ["dmuon-z3", "total"])
    assert failed[col["srcs ok"]] == "1/2 fr" and failed[col["result"]] == "FAIL"
    bwd = next(r for r in rows if r[:2] == ["dmuon-z3", "backward"])
    assert bwd[col["pred /cf"]] == "≠/≠"


def test_wide_table_has_every_figure():
    report = _with_new_figures(example_report())
    headers, rows = table_rows(report)
    for h in ("measured avg [B bfloat16]", "measured avg [B float32]", "busiest rank",
              "busiest recv [elem]", "busiest sent [elem]", "busiest recv [B]", "step [ms]",
              "exposed comm [%]", "predicted avg [elem]", "formula"):
        assert h in headers
    total = next(r for r in rows if r[:2] == ["dmuon-z2", "total"])
    assert total[headers.index("busiest rank")] == "3"
    assert total[headers.index("exposed comm [%]")] == "43.7 (max 61.0)"
    wide = format_table(report, wide=True)
    assert max(len(line) for line in wide.splitlines()) > TERMINAL_COLUMNS
    md = format_markdown(report)
    assert "busiest recv [elem]" in md and "Model: `examples.my_model:factory`" in md
    assert "## Skipped modes" in md and "## Busiest rank" in md and "## Time per step" in md


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _verify_imports(path: Path) -> set[str]:
    """Dotted ``verify.*`` modules that ``path`` imports (function-level imports count too)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # annotation-only imports run no code: not an import edge
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verify"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_import_cycle_in_verify():
    graph = {_module_name(p): _verify_imports(p) for p in (ROOT / "verify").rglob("*.py")}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    assert "verify.report.render" not in graph["verify.report.plots"]

    def visit(node, stack):
        if node in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(node):] + [node])}")
        for nxt in graph.get(node, ()):
            visit(nxt, stack + [node])

    for module in graph:
        visit(module, [])


def test_plots_import_does_not_load_report():
    code = "import sys, verify.report.plots; assert 'verify.report.render' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_traffic_chart_marks_the_busiest_rank(tmp_path):
    from verify.report.plots import plot_traffic, traffic_series

    report = _with_new_figures(example_report())
    series = {s["mode"]: s for s in traffic_series(report)}
    assert series["dmuon-z2"]["busiest"] == pytest.approx(1.95)
    assert all(s["busiest"] is None for s in traffic_series(example_report()))
    assert plot_traffic(report, tmp_path / "t.png").stat().st_size > 10_000


def test_a_flat_hsdp_run_says_so_on_its_lines():
    """``run["hierarchy"]`` (verify.compare): the flat run's mode lines read
    ``dmuon-hsdp-z2 (flat)`` in the wide and Markdown tables and its FAIL line, and the run
    table has a hierarchy column; the 120-column table (mode alone) still fits."""
    from verify.report.schema import validate_report

    report = _with_new_figures(example_report(), 1300.0)
    runs = {run["mode"]: run for run in report["runs"]}
    runs["dmuon-hsdp-z2"]["hierarchy"] = "flat"
    runs["dmuon-hsdp-z3"]["hierarchy"] = "hierarchical"
    runs["dmuon-hsdp-z2"]["ns_calls_per_step"] += 1  # a failed check: the FAIL section
    runs["dmuon-hsdp-z2"]["pass"] = False
    report["pass"] = False
    text = format_table(report)
    assert max(len(line) for line in text.splitlines()) <= TERMINAL_COLUMNS
    assert "FAIL dmuon-hsdp-z2 (flat) (W=4, N=2, R=2)" in text
    _, rows = compact_rows(report)
    assert ["dmuon-hsdp-z2", "total"] in [r[:2] for r in rows]
    hierarchy = [line.split() for line in text.splitlines() if line.startswith("dmuon-hsdp-z")]
    assert ["dmuon-hsdp-z2", "4", "2", "2", "–", "flat"] in [words[:6] for words in hierarchy]
    md = format_markdown(report)
    assert "| dmuon-hsdp-z2 (flat) | total" in md.replace("  ", " ")
    _, wide = table_rows(report)
    assert any(r[0] == "dmuon-hsdp-z2 (flat)" for r in wide)
    assert "flat" in md and "hierarchical" in md  # the run table's hierarchy column
    runs["dmuon-hsdp-z2"]["hierarchy"] = "ring"
    with pytest.raises(ValueError, match="hierarchy='ring'. Must be one of"):
        validate_report(report)


def test_the_run_table_names_every_model_parallel_size():
    """A TP x EP run's row reads ``T2 E2`` (W = N·R·T·E); it used to show T alone, so its W, N,
    R, T did not multiply to W. PP and CP runs show S and C."""
    from verify.report.render import _parallel_cell

    assert _parallel_cell({"tp_size": 2, "ep_size": 2}) == "T2 E2"
    assert _parallel_cell({"tp_size": 1, "pp_size": 2, "microbatches": 4}) == "S2"
    assert _parallel_cell({"tp_size": 1, "cp_size": 2}) == "C2"
    assert _parallel_cell({"tp_size": 1}) == "–"
