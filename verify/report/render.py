"""Render a verify-traffic report: report.json, report.md and traffic.png, and the tables and
formatters the terminal report (``verify.report.terminal``) shares.

Every function here is a pure function of the ``report`` dict, the content of report.json;
its keys, types, units and glossary are described once, in ``verify.report.schema``.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median

from tabulate import tabulate

from dmuon.annotate import PHASES
from tracer.events import SOURCES

from verify.report.checks import checks_of, failures, final_line, label, readings_equal, verdict_lines
from verify.report.schema import (
    COLLECTIVE_KEYS,
    OVERLAP_KEYS,
    PHASE_KEYS,
    READING_REL_TOL,
    RUN_KEYS,
    SCHEMA_VERSION,
    SOURCE_KEYS,
    TOP_KEYS,
    mode_label,
    validate_report,
)
from verify.traffic.formulas import MODES
from verify.report.memory_view import memory_md

__all__ = ["MODES", "READING_REL_TOL", "validate_report", "format_markdown",
           "report_json", "read_report", "write_report", "table_rows"]

#: Phase rows in display order: DMuon's own phases.
PHASE_ORDER: tuple[str, ...] = PHASES

#: Short column labels of the trace sources (``tracer.events.SOURCES``).
SOURCE_LABELS: dict[str, str] = {
    "interposer": "interposer",
    "flight_recorder": "fr",
    "nccl_log": "nccl",
    "nsys": "nsys",
    "profiler": "prof",
}

#: How many missing / unexpected collectives and source mismatches a failure listing shows.
MAX_LISTED = 20
MAX_MISMATCHES = 5

# ----------------------------------------------------------------------------- formatting


def fmt_elems(x: float | None) -> str:
    """Elements with thousands separators: integers exactly, fractions to 2 decimals, ``–``
    for None (``98304.0`` -> ``98,304``; ``43690.666`` -> ``43,690.67``)."""
    if x is None:
        return "–"
    if abs(x - round(x)) < 1e-9:
        return f"{round(x):,}"
    return f"{x:,.2f}"


def fmt_count(x: float) -> str:
    """A per-step count (calls): an integer as is, a fractional mean to 2 decimals."""
    return f"{round(x)}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def fmt_ratio(x: float | None) -> str:
    """A ratio to P_M with 4 decimals (e.g. ``1.5000``); ``–`` for None."""
    return "–" if x is None else f"{x:.4f}"


def fmt_bytes(b: float | None) -> str:
    """Bytes in binary units to 3-4 significant digits (``589824`` -> ``576.0 KiB``); ``–``
    for None."""
    if b is None:
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def _fmt_int_bytes(b: float | None) -> str:
    return "–" if b is None else fmt_elems(b)


def fmt_ms(timing: Mapping | None) -> str:
    return "–" if timing is None else f"{timing['step_ms']:.1f}"


def fmt_exposed(timing: Mapping | None, wide: bool = False) -> str:
    if timing is None or timing["exposed_comm_frac"] is None:
        return "–"
    frac = timing["exposed_comm_frac"]
    if wide:
        return f"{100 * frac:.1f} (max {100 * timing['exposed_comm_frac_max']:.1f})"
    return f"{100 * frac:.0f}%"


def phase_bytes(run: Mapping, phase: str) -> dict[str, float]:
    """Measured W-average dedicated bytes of ``phase`` (or ``"total"``) by dtype; {} without."""
    return dict(run.get("bytes", {}).get("measured_avg_bytes", {}).get(phase, {}))


def dtypes_of(report: Mapping) -> list[str]:
    return sorted({d for run in report["runs"]
                   for table in run.get("bytes", {}).values() for by in table.values() for d in by})


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f}"


def _sources_present(report: Mapping) -> list[str]:
    present = {name for run in report["runs"] for name in run["sources"]}
    return [s for s in SOURCES if s in present]


def _has_seed(report: Mapping) -> bool:
    return any(
        run["seed_avg_elems"] is not None
        or any(ph["seed_avg_elems"] is not None for ph in run["phases"].values())
        for run in report["runs"]
    )


def _phase_names(phases: Mapping[str, Mapping]) -> list[str]:
    """Known phases in :data:`PHASE_ORDER`, then any other (e.g. an untagged call) sorted."""
    return [n for n in PHASE_ORDER if n in phases] + sorted(n for n in phases
                                                            if n not in PHASE_ORDER)


def ordered_phases(phases: Mapping[str, Mapping]) -> list[tuple[str, Mapping]]:
    return [(name, phases[name]) for name in _phase_names(phases)]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def table_rows(report: Mapping) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the per-mode, per-phase table (one row per phase plus ``total``).

    Average columns (``... avg [elem]``) and the per-rank maximum (``max rank [elem]``) are
    separate; the maximum, NS calls and per-source counts are per run, so only on ``total``.

    Raises:
        ValueError: ``report`` does not follow the data model (see :func:`validate_report`).
    """
    validate_report(report)
    seed = _has_seed(report)
    sources = _sources_present(report)
    headers = ["mode", "phase", "measured avg [elem]", "predicted avg [elem]",
               "closed form avg [elem]", "formula"]
    if seed:
        headers.append("seed avg [elem]")
    dtypes = dtypes_of(report)
    headers += ["ratio to P_M"]
    headers += [f"measured avg [B {d}]" for d in dtypes]
    headers += ["busiest rank", "busiest recv [elem]", "busiest sent [elem]",
                "busiest recv [B]", "step [ms]", "exposed comm [%]", "collectives meas/pred",
                "NS calls/step meas/exp"]
    headers += [f"{SOURCE_LABELS[s]} [matched/events]" for s in sources]
    headers.append("result")

    rows: list[list[str]] = []
    for run in report["runs"]:
        p_m = run["p_m"]
        phases = ordered_phases(run["phases"])
        for name, ph in phases:
            row = [mode_label(run), name, fmt_elems(ph["measured_avg_elems"]),
                   fmt_elems(ph["predicted_avg_elems"]), fmt_elems(ph["closed_form_avg_elems"]), ""]
            if seed:
                row.append(fmt_elems(ph["seed_avg_elems"]))
            row += [fmt_ratio(ph["measured_avg_elems"] / p_m)]
            row += [_fmt_int_bytes(phase_bytes(run, name).get(d)) for d in dtypes]
            row += ["", "", "", "", "", "",
                    f"{fmt_count(ph['collectives_measured'])}/"
                    f"{fmt_count(ph['collectives_predicted'])}", ""]
            row += [""] * len(sources)
            row.append(verdict(ph["pass"]))
            rows.append(row)
        n_meas = sum(ph["collectives_measured"] for _, ph in phases)
        n_pred = sum(ph["collectives_predicted"] for _, ph in phases)
        row = [mode_label(run), "total", fmt_elems(run["measured_avg_elems"]),
               fmt_elems(run["predicted_avg_elems"]), fmt_elems(run["closed_form_avg_elems"]),
               run["closed_form"]]
        if seed:
            row.append(fmt_elems(run["seed_avg_elems"]))
        wire, timing = run.get("wire"), run.get("timing")
        row += [fmt_ratio(run["ratio_to_p_m"])]
        row += [_fmt_int_bytes(phase_bytes(run, "total").get(d)) for d in dtypes]
        row += ["–" if wire is None else str(wire["busiest_rank"]), fmt_elems(run["max_rank_elems"]),
                "–" if wire is None else fmt_elems(wire["max_sent_elems"]),
                "–" if wire is None else _fmt_int_bytes(wire["max_recv_bytes"]),
                fmt_ms(timing), fmt_exposed(timing, wide=True),
                f"{fmt_count(n_meas)}/{fmt_count(n_pred)}",
                f"{fmt_count(run['ns_calls_per_step'])}/{fmt_count(run['ns_calls_expected'])}"]
        for s in sources:
            src = run["sources"].get(s)
            if src is None:
                row.append("–")
            else:
                row.append(f"{src['matched']}/{src['events']}" + ("" if src["pass"] else " FAIL"))
        row.append(verdict(run["pass"]))
        rows.append(row)
    return headers, rows


#: The model-parallel sizes a run's layout reports (``RunLayout.report_fields``), by letter.
PARALLEL_SIZES = (("T", "tp_size"), ("E", "ep_size"), ("S", "pp_size"), ("C", "cp_size"))


def _parallel_cell(run: Mapping) -> str:
    """``"T2 E2"``: the run's model-parallel sizes other than 1 (:data:`PARALLEL_SIZES`); "–": none."""
    return " ".join(f"{letter}{run[key]}" for letter, key in PARALLEL_SIZES if run.get(key, 1) != 1) or "–"


def all_params_rows(report: Mapping, two_line: bool = False) -> tuple[list[str], list[list[str]]]:
    """The run table: per run its mesh (W, N, R and the model-parallel sizes T, E, S, C), how
    a DMuon HSDP run moved its dedicated params (``hierarchy``: flat or hierarchical,
    docs/traffic-model.md, "HSDP: flat or hierarchical"), P_M, all params' averages and the
    loss; ``two_line``: the terminal's headers."""
    headers = ["mode", "W", "N", "R", "T E S C", "hierarchy", "P_M [elem]", "all params measured avg [elem]",
               "all params predicted avg [elem]", "loss first", "loss last"]
    if two_line:
        headers = ["mode", "W", "N", "R", "T E\nS C", "hier-\narchy", "P_M\n[elem]", "all params\nmeasured\navg [elem]",
                   "all params\npredicted\navg [elem]", "loss\nfirst", "loss\nlast"]
    rows = [
        [run["mode"], run["world_size"], run["shard_size"], run["replicate_size"],
         _parallel_cell(run), _hierarchy_cell(run, two_line),
         fmt_elems(run["p_m"]), fmt_elems(run["total_measured_avg_elems"]),
         fmt_elems(run["total_predicted_avg_elems"]), _fmt_loss(run["loss_first"]),
         _fmt_loss(run["loss_last"])]
        for run in report["runs"]
    ]
    return headers, rows


def _hierarchy_cell(run: Mapping, short: bool) -> str:
    """``run["hierarchy"]`` ("–" where absent: 1-D meshes, other modes); ``short`` (the terminal's
    120 columns) writes hierarchical as "hier"."""
    value = run.get("hierarchy", "–")
    return "hier" if short and value == "hierarchical" else value


def _fmt_loss(x: float | None) -> str:
    return "non-finite" if x is None else f"{x:.4f}"


def error_failures(report: Mapping) -> list[Mapping]:
    """The report's ``error`` failures: modes that raised (no run, so no table row)."""
    return [f for f in failures(report) if f["check"] == "error"]


def _count_cell(e: Mapping) -> str:
    """The count, or an uneven all_to_all's totals (``in 28,672 → out 24,576``)."""
    if e["count"] is not None:
        return f"{e['count']:,}"
    if e.get("in_elems") is not None and e.get("out_elems") is not None:
        return f"in {e['in_elems']:,} → out {e['out_elems']:,}"
    return "–"


def _collective_rows(entries: Sequence[Mapping]) -> list[list[str]]:
    return [
        [_dash(e["rank"]), _dash(e["phase"]), e["op"], _dash(e["group_id"]),
         _count_cell(e), _dash(e["dtype"]), _dash(e["root"]),
         _dash(e["module"]), f"×{e['n']}"]
        for e in entries[:MAX_LISTED]
    ]


def _dash(value: object) -> str:
    return "–" if value is None or value == "" else str(value)


_COLLECTIVE_HEADERS = ["rank", "phase", "op", "group", "count [elem/rank]", "dtype", "root",
                       "module", "×n"]


def failure_sections(run: Mapping, tablefmt: str) -> list[tuple[str, str]]:
    """``(title, body)`` pairs explaining why ``run`` failed: each failed check with its cause
    (``verify.report.checks``), then the evidence: failed phases, missing and unexpected
    collectives (first :data:`MAX_LISTED`), source mismatches (first :data:`MAX_MISMATCHES`
    per source, then a count of the rest)."""
    out: list[tuple[str, str]] = []
    failed = [c for c in checks_of(run) if not c["pass"]]
    if failed:
        out.append(("failed checks", "\n".join(f"- {label(c['check'], False)}: {c['detail']}"
                                               for c in failed)))
    bad_phases = [
        f"{name}: measured {fmt_elems(ph['measured_avg_elems'])} vs predicted "
        f"{fmt_elems(ph['predicted_avg_elems'])} elem, collectives "
        f"{fmt_count(ph['collectives_measured'])}/{fmt_count(ph['collectives_predicted'])}"
        for name, ph in ordered_phases(run["phases"]) if not ph["pass"]
    ]
    if bad_phases:
        out.append(("failed phases", "\n".join(f"- {line}" for line in bad_phases)))
    for kind in ("missing", "unexpected"):
        entries = run[kind]
        if not entries:
            continue
        calls = sum(e["n"] for e in entries)
        title = f"{kind} collectives ({len(entries)} entries, {calls} calls)"
        body = tabulate(_collective_rows(entries), headers=_COLLECTIVE_HEADERS, tablefmt=tablefmt)
        if len(entries) > MAX_LISTED:
            body += f"\n… and {len(entries) - MAX_LISTED} more entries"
        out.append((title, body))
    for name in SOURCES:
        src = run["sources"].get(name)
        if src is None or not src["mismatches"]:
            continue
        shown = src["mismatches"][:MAX_MISMATCHES]
        lines = [f"- {m}" for m in shown]
        rest = len(src["mismatches"]) - len(shown)
        if rest:
            lines.append(f"- … and {rest} more")
        title = (f"{name} mismatches ({len(src['mismatches'])}; matched {src['matched']}/"
                 f"{src['events']}, unmatched {src['unmatched']})")
        out.append((title, "\n".join(lines)))
    return out


WIDE_LEGEND = (
    "avg [elem]: dedicated-param elements per rank per step, W-average of f(n)·S (docs/spec.md §2); "
    "max rank [elem]: busiest rank, same unit; ratio to P_M: measured avg / P_M."
)


def nvlink_lines(report: Mapping, tablefmt: str) -> list[str]:
    """The NVLink cross-check (``runs[].nvlink``, see ``verify/sources/nvlink.py``): one line when no
    run could read the counters, else a table per mode; nothing for reports without it."""
    entries = [(run["mode"], run["nvlink"]) for run in report["runs"] if run.get("nvlink")]
    if not entries:
        return []
    reasons = {e.get("reason") for _, e in entries if not e["available"]}
    if all(not e["available"] for _, e in entries) and len(reasons) == 1:
        return [f"NVLink counters (NVML, coarse cross-check): unavailable: {reasons.pop()}"]
    rows = [[mode, f"{e['tx_bytes']:,}", f"{e['modelled_wire_bytes']:,}",
             fmt_ratio(e["tx_to_model"]), str(e["links"])] if e["available"]
            else [mode, "unavailable", "", "", e.get("reason", "")] for mode, e in entries]
    headers = ["mode", "NVLink TX [bytes]", "modelled wire [bytes]", "TX / model", "links"]
    return ["NVLink counters (NVML, coarse cross-check; protocol overhead included):", "",
            tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)]


def tab(headers_rows: tuple[list[str], list[list]], tablefmt: str) -> str:
    headers, rows = headers_rows
    colalign = ("left",) + ("right",) * (len(headers) - 1)
    return tabulate(rows, headers=headers, tablefmt=tablefmt, colalign=colalign,
                    disable_numparse=True)


def indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# ----------------------------------------------------------------------------- markdown


def hsdp_reading_rows(report: Mapping) -> tuple[list[str], list[list[str]]]:
    """The HSDP replicate-term comparison: for each run with a seed reading, every phase
    whose seed reading differs from the W-average reading (the phases holding a replicate
    term: the replicate broadcast, and backward where the replicate-axis reduce is tagged
    there) and the total: measured vs the W-average reading (closed form) vs the seed's
    reading, and which one the measurement confirms. Empty rows when no run has one."""
    headers = ["mode", "term", "measured avg [elem]", "W-average reading [elem]",
               "seed reading [elem]", "measured / seed", "confirmed reading"]
    rows = []
    for run in report["runs"]:
        terms = [
            (name, ph["measured_avg_elems"], ph["closed_form_avg_elems"], ph["seed_avg_elems"])
            for name, ph in ordered_phases(run["phases"])
            if ph["seed_avg_elems"] is not None
            and not readings_equal(ph["seed_avg_elems"], ph["closed_form_avg_elems"])
        ]
        if run["seed_avg_elems"] is not None:
            terms.append(("total", run["measured_avg_elems"], run["closed_form_avg_elems"],
                          run["seed_avg_elems"]))
        for term, measured, w_avg, seed in terms:
            if readings_equal(measured, w_avg) and not readings_equal(measured, seed):
                verdict = "W-average"
            elif readings_equal(measured, seed) and not readings_equal(measured, w_avg):
                verdict = "seed"
            elif readings_equal(measured, seed):
                verdict = "both (equal here)"
            else:
                verdict = "neither"
            ratio = fmt_ratio(measured / seed) if seed else "–"
            rows.append([run["mode"], term, fmt_elems(measured), fmt_elems(w_avg),
                         fmt_elems(seed), ratio, verdict])
    return headers, rows


def qk_clip_rows(report: Mapping) -> tuple[list[str], list[list[str]]]:
    """``--qk-clip``: per run its ``qk_clip`` phase (``verify.measure.qk_clip.run_entry``): τ, the
    heads, the message of one all_reduce (MAX, fp32), calls per step measured / predicted, the
    W-average bytes per rank per step measured / predicted (all of them: the maxima are not
    dedicated-param traffic, which the per-phase table counts), the heads the clip scaled per
    step (warm-up, then measured), and whether calls and bytes equal the prediction; a mode
    without QK-clip (a baseline) is ``n/a`` (why: :func:`qk_clip_not_run`). Empty rows without
    ``--qk-clip``."""
    headers = ["mode", "τ", "heads", "msg [B]", "calls/step meas/pred", "measured avg [B]",
               "predicted avg [B]", "heads clipped per step", "result"]
    rows = []
    for run in report["runs"]:
        q = run.get("qk_clip")
        if q is None:
            continue
        if not q["applies"]:
            rows.append([run["mode"], f"{q['tau']:g}", "–", "–", "–", "–", "–", "–", "n/a"])
            continue
        rows.append([run["mode"], f"{q['tau']:g}", str(q["heads"]), _fmt_int_bytes(q["msg_bytes"]),
                     f"{fmt_count(q['calls_measured_per_step'])}/"
                     f"{fmt_count(q['calls_predicted_per_step'])}",
                     fmt_elems(q["measured_avg_bytes"]), fmt_elems(q["predicted_avg_bytes"]),
                     " ".join(map(str, q["clipped_per_step"])), verdict(q["pass"])])
    return headers, rows


def qk_clip_not_run(report: Mapping) -> list[str]:
    """``"<reason>: <modes>"`` per reason of the runs whose ``qk_clip`` does not apply."""
    by_reason: dict[str, list[str]] = {}
    for run in report["runs"]:
        q = run.get("qk_clip")
        if q is not None and not q["applies"]:
            by_reason.setdefault(q["reason"], []).append(run["mode"])
    return [f"{why}: {', '.join(modes)}" for why, modes in by_reason.items()]


def overlap_rows(report: Mapping) -> tuple[list[str], list[list[str]]]:
    """Per run with ``replicate_overlap`` entries: how the async replicate broadcast hid
    behind compute. ``issue→wait`` is ``waited_ns - issued_ns`` (both from the start of the
    step that issued the broadcast); ``wait`` is ``wait_dur_ns``, the time the next forward
    pre-hook blocked (near 0: fully hidden). Times in µs."""
    headers = ["mode", "broadcasts", "median issue→wait [µs]", "median wait [µs]",
               "max wait [µs]", "total wait / rank [µs]"]
    rows = []
    for run in report["runs"]:
        entries = run["replicate_overlap"]
        if not entries:
            continue
        leads = [e["waited_ns"] - e["issued_ns"] for e in entries]
        waits = [e["wait_dur_ns"] for e in entries]
        ranks = {e["rank"] for e in entries}
        rows.append([run["mode"], len(entries), _us(median(leads)), _us(median(waits)),
                     _us(max(waits)), _us(sum(waits) / len(ranks))])
    return headers, rows


_ACCOUNTING = (
    "**Accounting.** Every figure in *elem* counts elements of the dedicated (Muon-target) "
    "parameters moved per rank per training step, averaged over the steady-state steps. For one "
    "collective call over a group of n ranks, S is nccl-tests' total array size (the message for "
    "all_reduce, broadcast and reduce; n × the per-rank count for all_gather and "
    "reduce_scatter) and f(n)·S is what a bandwidth-optimal algorithm delivers to an average "
    "member, with f = 2(n-1)/n for all_reduce and (n-1)/n for every other collective "
    "(nccl-tests `doc/PERFORMANCE.md`). A rank's figure is the sum of f(n)·S over the calls it "
    "takes part in; *avg* columns are the mean over all W ranks (total link traffic / W, "
    "docs/spec.md §2), *max rank* is the busiest rank (load balance) and is never averaged in. "
    "*predicted* is the exact list of collectives derived from the ownership plan and the "
    "model's shapes; *closed form* is the formula of docs/spec.md §2 (derived in "
    "docs/traffic-model.md) evaluated at P_M; *ratio to P_M* "
    "is measured avg / P_M. Multiply by the dtype size for bytes."
)


def format_markdown(report: Mapping) -> str:
    """report.md: header, accounting note, the per-mode table, the all-params table, the HSDP
    replicate-term comparison and overlap (when HSDP runs exist), the traffic chart, and the
    failure listings.

    Raises:
        ValueError: ``report`` does not follow the data model (see :func:`validate_report`).
    """
    headers, rows = table_rows(report)
    colalign = ("left", "left") + ("right",) * (len(headers) - 2)
    md = [
        f"# verify-traffic report `{report['run_id']}`: {verdict(report['pass'])}",
        "",
        f"**{final_line(report)}**",
        "",
        "| run id | created (UTC) | torch | backend | W | warm-up steps | measured steps |",
        "|---|---|---|---|---|---|---|",
        f"| `{report['run_id']}` | {report['created_utc']} | {report['torch_version']} | "
        f"{report['backend']} | {report['world_size']} | {report['steps_warmup']} | "
        f"{report['steps_measured']} |",
        "",
        _ACCOUNTING,
        "",
        f"Model: `{report.get('model', 'tinygpt')}`.",
        "",
        "## Dedicated-param traffic per mode and phase",
        "",
        tabulate(rows, headers=headers, tablefmt="github", colalign=colalign,
                 disable_numparse=True),
        "",
        "## All params (dedicated + AdamW-stepped) and loss",
        "",
        tab(all_params_rows(report), "github"),
        "",
        "![ratio to P_M per mode](traffic.png)" if load_plots() is not None
        else "(no traffic.png: matplotlib is not installed here)",
    ]
    md += _params_md(report)
    md += _busiest_and_time_md(report)
    h_headers, h_rows = hsdp_reading_rows(report)
    if h_rows:
        md += [
            "",
            "## HSDP replicate term: which reading holds",
            "",
            "The seed document prices the replicate-axis reduce and the replicate broadcast at "
            "(R-1)/R·P_M each. Under the W-average accounting each dedicated param takes part in "
            "one reduce and one broadcast over R ranks, (R-1)·P_M/W = (R-1)/(N·R)·P_M per rank "
            "each, so DMuon-HSDP Z2 totals 2(W-1)/W. The measurement decides:",
            "",
            tabulate(h_rows, headers=h_headers, tablefmt="github", disable_numparse=True,
                     colalign=("left", "left") + ("right",) * 4 + ("left",)),
        ]
    q_headers, q_rows = qk_clip_rows(report)
    if q_rows:
        md += [
            "",
            "## QK-clip (MuonClip): phase qk_clip",
            "",
            "One all_reduce (MAX) per rank and step over all W ranks of every head's fp32 max "
            "logit (docs/traffic-model.md, \"QK-clip\"). Bytes per rank per step, W-average of "
            "f(n)·S; they are not dedicated-param traffic (0 in the table above). Whether each "
            "call matches is the `collectives` check's.",
            "",
            tab((q_headers, q_rows), "github"),
        ]
        md += ["", *(f"n/a: {line}" for line in qk_clip_not_run(report))]
    o_headers, o_rows = overlap_rows(report)
    if o_rows:
        md += [
            "",
            "## HSDP replicate broadcast overlap",
            "",
            "Issued after the optimizer step, waited in the owning layer's next forward "
            "pre-hook; times from step start.",
            "",
            tab((o_headers, o_rows), "github"),
        ]
    md += node_bytes_md(report)
    md += memory_md(report)
    nvlink = nvlink_lines(report, "github")
    if nvlink:
        md += ["", "## NVLink counters", ""] + nvlink
    timelines = [(run["mode"], run["timeline"]) for run in report["runs"] if run["timeline"]]
    if timelines:
        md += ["", "## Timelines (Chrome trace JSON)", ""]
        md += [f"- {mode}: [`{path}`]({path})" for mode, path in timelines]
    md += ["", "## Checks", "", "```", *verdict_lines(report), final_line(report), "```"]
    failed = [run for run in report["runs"] if not run["pass"]]
    errors = error_failures(report)
    if failed or errors:
        md += ["", "## Failures"]
        for f in errors:
            md += ["", f"### {f['mode']}", "", f"- {label('error', False)}: {f['detail']}"]
        for run in failed:
            md += ["", f"### {mode_label(run)} (W={run['world_size']}, N={run['shard_size']}, "
                       f"R={run['replicate_size']})"]
            for title, body in failure_sections(run, "github"):
                md += ["", f"**{title}**", "", body]
    return "\n".join(md) + "\n"


def node_bytes_md(report: Mapping) -> list[str]:
    """report.md section of a run over more than one node (``run["nodes"]``,
    ``verify.run.nodes.node_traffic``): per mode and node its ranks, the bytes its ranks send
    and receive per step (all collectives) and the part to / from another node; the groups
    whose bytes cross; and the trace files collected to rank 0."""
    runs = [run for run in report["runs"] if run.get("nodes")]
    if not runs:
        return []
    rows = [[run["mode"], e["node"], e["host"], ",".join(map(str, e["ranks"])),
             fmt_bytes(e["sent_bytes"]), fmt_bytes(e["recv_bytes"]),
             fmt_bytes(e["inter_node_sent_bytes"]), fmt_bytes(e["inter_node_recv_bytes"])]
            for run in runs for e in run["nodes"]["per_node"]]
    md = ["", "## Nodes: bytes between nodes", "",
          "Bytes per step of every measured collective, under the per-rank wire model "
          "(verify/traffic/wire.py; verify/run/nodes.py); `between` = sent to / received from "
          "a rank on another node.", "",
          tab((["mode", "node", "host", "ranks", "sent [B]", "recv [B]", "sent between [B]",
                "recv between [B]"], rows), "github"), ""]
    md += [f"- {run['mode']}: {run['nodes']['inter_node_share']:.1%} of the bytes cross nodes, "
           f"in groups {', '.join('{' + g + '}' for g in run['nodes']['spanning_groups']) or 'none'}"
           + (f"; {run['nodes']['unplaced_events']} event(s) without a group peer left out"
              if run["nodes"]["unplaced_events"] else "") for run in runs]
    collected = (report.get("nodes") or {}).get("collected")
    if collected:
        md += [f"- trace files from ranks {collected['ranks']} sent to rank 0: "
               f"{collected['files']} file(s), {fmt_bytes(collected['bytes'])}"
               + (f"; {collected['error']}" if collected["error"] else "")]
    return md


#: report.md lists at most this many params (report.json has them all).
MAX_PARAM_ROWS = 200


def _params_md(report: Mapping) -> list[str]:
    """Markdown section: which params go to Muon and which to AdamW, with elements and why."""
    params = report.get("params")
    if not params:
        return []
    rows = [[f"`{e['name']}`", "×".join(map(str, e["shape"])), fmt_count(e["numel"]), kind,
             e["reason"]]
            for kind in ("muon", "adamw") for e in params[kind]]
    md = ["", "## Muon and AdamW params", "",
          f"Muon: {len(params['muon'])} params, {fmt_count(params['muon_elems'])} elements "
          f"(P_M); AdamW: {len(params['adamw'])} params, {fmt_count(params['adamw_elems'])} "
          "elements. The selection is DMuon's default (docs/selection.md), the same in every "
          "mode.", "",
          tab((["param", "shape", "elements", "optimizer", "reason"], rows[:MAX_PARAM_ROWS]),
              "github")]
    if len(rows) > MAX_PARAM_ROWS:
        md += ["", f"({len(rows) - MAX_PARAM_ROWS} more in report.json)"]
    return md


def _busiest_and_time_md(report: Mapping) -> list[str]:
    """Markdown sections: skipped modes, per-rank wire traffic, time per step."""
    md: list[str] = []
    if report.get("skipped"):
        md += ["", "## Skipped modes", ""]
        md += [f"- `{e['mode']}`: {e['reason']}" for e in report["skipped"]]
    wired = [run for run in report["runs"] if "wire" in run]
    if wired:
        rows = [[run["mode"], e["rank"], fmt_elems(e["sent_elems"]), fmt_elems(e["recv_elems"]),
                 fmt_elems(e["sent_bytes"]), fmt_elems(e["recv_bytes"]),
                 "busiest" if e["rank"] == run["wire"]["busiest_rank"] else ""]
                for run in wired for e in run["wire"]["per_rank"]]
        md += ["", "## Busiest rank", "",
               "Dedicated-param elements and bytes each rank sends and receives per step under "
               "NCCL's algorithms (ring for all_reduce / all_gather / reduce_scatter, a pipelined "
               "chain for broadcast / reduce; docs/traffic-model.md, verify/traffic/wire.py). The mean "
               "of *recv* over the ranks is the W-average above; the busiest rank receives most.",
               "", tab((["mode", "rank", "sent [elem]", "recv [elem]", "sent [B]", "recv [B]", ""],
                         rows), "github")]
    timed = [run for run in report["runs"] if "timing" in run]
    if timed:
        rows = [[run["mode"], fmt_ms(run["timing"]),
                 " / ".join(f"{ms:.1f}" for ms in run["timing"]["step_ms_per_step"]),
                 fmt_exposed(run["timing"], wide=True),
                 run["timing"]["exposed_comm_reason"] or run["timing"]["exposed_comm_source"]]
                for run in timed]
        md += ["", "## Time per step", "",
               "Median over the measured steps of the slowest rank's step; exposed communication "
               "is the share of the step the training thread is blocked (mean over ranks, max in "
               "brackets; verify/measure/steptime.py). Timings on a shared CPU machine are noisy.", "",
               tab((["mode", "step [ms]", "steps [ms]", "exposed comm [%]", "source"], rows),
                    "github")]
    return md


# ----------------------------------------------------------------------------- files


def _ordered(obj: Mapping, spec: Mapping[str, tuple], order_rest: Sequence[str] = ()) -> dict:
    known = [k for k in spec if k in obj]
    rest_known = [k for k in order_rest if k in obj and k not in known]
    extra = sorted(k for k in obj if k not in known and k not in rest_known)
    return {k: obj[k] for k in known + rest_known + extra}


def canonical_report(report: Mapping) -> dict:
    """``report`` with keys in the data-model order (``schema_version`` first where present,
    extra keys after, sorted): the stable key order of report.json. Values are not changed."""
    top = _ordered(report, {"schema_version": (int,), **TOP_KEYS})
    runs = []
    for run in report["runs"]:
        r = _ordered(run, RUN_KEYS)
        r["phases"] = {name: _ordered(ph, PHASE_KEYS) for name, ph in
                       ordered_phases(run["phases"])}
        r["missing"] = [_ordered(e, COLLECTIVE_KEYS) for e in run["missing"]]
        r["unexpected"] = [_ordered(e, COLLECTIVE_KEYS) for e in run["unexpected"]]
        r["sources"] = {name: _ordered(s, SOURCE_KEYS)
                        for name, s in _ordered(run["sources"], {}, SOURCES).items()}
        r["replicate_overlap"] = [_ordered(e, OVERLAP_KEYS) for e in run["replicate_overlap"]]
        runs.append(r)
    top["runs"] = runs
    return top


def report_json(report: Mapping) -> str:
    """report.json text: validated, ``schema_version`` (:data:`SCHEMA_VERSION`) first, then the
    canonical key order, indent 2, strict JSON (no NaN). The file follows
    ``verify/report/report.schema.json`` (``verify.report.schema_json``).

    Raises:
        ValueError: ``report`` does not follow the data model (see :func:`validate_report`).
    """
    validate_report(report)
    stamped = {"schema_version": SCHEMA_VERSION, **report}
    text = json.dumps(canonical_report(stamped), indent=2, allow_nan=False, ensure_ascii=False)
    return text + "\n"


def read_report(path: str | Path) -> dict:
    """Load and validate a report.json written by :func:`write_report`.

    Raises:
        ValueError: the file is not JSON or does not follow the data model.
    """
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"Invalid report file {str(path)!r}: not JSON ({exc}). Must be a "
                         "report.json written by verify.report.render.write_report.") from exc
    validate_report(report)
    return report


@functools.cache
def load_plots():
    """The module ``verify.report.plots``, or ``None`` where matplotlib (the ``plots`` extra)
    cannot be imported; then says once on stderr that the run writes every file but its PNGs."""
    try:
        from verify.report import plots
    except ModuleNotFoundError as exc:
        print(f"verify-traffic: writing no PNG (traffic.png, memory.png, timelines); every other "
              f"file is written. {exc}", file=sys.stderr, flush=True)
        return None
    return plots


def write_report(report: Mapping, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md, junit.xml (``verify.report.junit``: one test case per
    mode × check) and traffic.png into ``out_dir`` (created if needed).

    Returns:
        ``{"json": path, "markdown": path, "junit": path, "traffic_png": path}``, and
        ``"memory_png"`` where a run carries DMuon's memory (``verify.report.memory_view``);
        without matplotlib no PNG (:func:`load_plots`) and no ``*_png`` key.

    Raises:
        ValueError: ``report`` does not follow the data model (see :func:`validate_report`).
    """
    from verify.report.junit import junit_xml
    from verify.report.memory_view import plot_memory

    text = report_json(report)  # validates before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md",
             "junit": out / "junit.xml", "traffic_png": out / "traffic.png"}
    paths["json"].write_text(text, encoding="utf-8")
    paths["markdown"].write_text(format_markdown(report), encoding="utf-8")
    paths["junit"].write_text(junit_xml(report), encoding="utf-8")
    plots = load_plots()  # matplotlib only when plotting; None without it (said once)
    if plots is None:
        del paths["traffic_png"]
        return paths
    plots.plot_traffic(report, paths["traffic_png"])
    if plot_memory(report, out / "memory.png") is not None:  # DMuon runs' bytes per rank
        paths["memory_png"] = out / "memory.png"
    return paths
