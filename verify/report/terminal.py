"""The terminal report of verify-traffic: a per-mode, per-phase table that fits
:data:`TERMINAL_COLUMNS` with grouped headers (``--wide``: every column of
:func:`verify.report.render.table_rows`), the all-params table, skipped modes, and failure listings.

Keys, units and glossary: ``verify.report.schema``. Built with tabulate; group labels
are drawn over the columns' dash rule (:func:`grouped`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from tabulate import tabulate

from verify.report.checks import label, verdict_lines
from verify.report.render import (
    SOURCE_LABELS,
    WIDE_LEGEND,
    all_params_rows,
    error_failures,
    failure_sections,
    fmt_bytes,
    fmt_count,
    fmt_elems,
    fmt_exposed,
    fmt_ms,
    fmt_ratio,
    indent,
    nvlink_lines,
    ordered_phases,
    phase_bytes,
    qk_clip_not_run,
    qk_clip_rows,
    readings_equal,
    tab,
    table_rows,
    validate_report,
    verdict,
)
from verify.report.schema import mode_label


#: Width the default terminal table fits in (``--wide`` lifts it).
TERMINAL_COLUMNS = 120

#: Compact table: (header, group) per column; groups are drawn as one line above the headers.
_COMPACT = (
    ("mode", ""), ("phase", ""),
    ("measured\n[elem]", "traffic"), ("pred\n/cf", "traffic"), ("ratio\n/P_M", "traffic"),
    ("bytes\n[avg]", "traffic"), ("peak\n/P_M", "traffic"),
    ("step\n[ms]", "time"), ("comm\nwait", "time"),
    ("NS\ncalls", "checks"), ("srcs\nok", "checks"), ("result", "checks"),
)
_GROUP_LABELS = {"traffic": "dedicated params per rank-step", "time": "time", "checks": "checks"}

_COMPACT_LEGEND = (
    "measured: W-average of f(n)·S (docs/spec.md §2) in elements; pred/cf: '=' when it equals the "
    "predicted collective list / the closed form ('≠' otherwise, '–' no closed form); bytes: "
    "the same in bytes (all dtypes); peak: the busiest rank's received elements under NCCL's ring / "
    "chain algorithms (verify/traffic/wire.py) / P_M; step: median over measured steps of the slowest "
    "rank; comm wait: exposed communication, the share of the step the training thread is "
    "blocked (verify/measure/steptime.py); "
    "NS calls meas/exp; sources: matched sources / sources. --wide shows every column."
)


def _mark(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "–"
    return "=" if readings_equal(a, b) else "≠"


def _sources_cell(run: Mapping) -> str:
    srcs = run["sources"]
    bad = [SOURCE_LABELS.get(name, name) for name, src in srcs.items() if not src["pass"]]
    cell = f"{len(srcs) - len(bad)}/{len(srcs)}"
    return cell + (" " + ",".join(bad) if bad else "")


def compact_rows(report: Mapping) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the default terminal table (:data:`_COMPACT`, fits
    :data:`TERMINAL_COLUMNS`): per phase the measured average and its checks, per run
    (``total`` row) bytes, the busiest rank, time, NS calls and sources. The mode alone: a
    flat HSDP run's ``(flat)`` (:func:`verify.report.schema.mode_label`) would not fit; the
    run table below it has a hierarchy column.

    Raises:
        ValueError: ``report`` does not follow the data model (see :func:`validate_report`).
    """
    validate_report(report)
    rows = []
    for run in report["runs"]:
        p_m = run["p_m"]
        for name, ph in ordered_phases(run["phases"]):
            rows.append([run["mode"], name, fmt_elems(ph["measured_avg_elems"]),
                         f"{_mark(ph['measured_avg_elems'], ph['predicted_avg_elems'])}/"
                         f"{_mark(ph['measured_avg_elems'], ph['closed_form_avg_elems'])}",
                         fmt_ratio(ph["measured_avg_elems"] / p_m),
                         fmt_bytes(sum(phase_bytes(run, name).values()) or None),
                         "", "", "", "", "", verdict(ph["pass"])])
        timing = run.get("timing")
        rows.append([run["mode"], "total", fmt_elems(run["measured_avg_elems"]),
                     f"{_mark(run['measured_avg_elems'], run['predicted_avg_elems'])}/"
                     f"{_mark(run['measured_avg_elems'], run['closed_form_avg_elems'])}",
                     fmt_ratio(run["ratio_to_p_m"]),
                     fmt_bytes(sum(phase_bytes(run, "total").values()) or None),
                     fmt_ratio(run["max_rank_elems"] / p_m) if "wire" in run else "–",
                     fmt_ms(timing), fmt_exposed(timing),
                     f"{fmt_count(run['ns_calls_per_step'])}/{fmt_count(run['ns_calls_expected'])}",
                     _sources_cell(run), verdict(run["pass"])])
    return [h for h, _ in _COMPACT], rows


def grouped(table: str, groups: Sequence[str], labels: Mapping[str, str]) -> str:
    """``table`` (tabulate ``simple``) with a line of group labels above its header: each
    label centred over its run of adjacent columns, dashes filling the span (cut to fit).

    Args:
        groups: the group of each column (``""``: none), in column order.
    """
    lines = table.splitlines()
    rule = next(i for i, line in enumerate(lines) if line and set(line) <= {"-", " "})
    spans, pos = [], 0
    for run in lines[rule].split(" "):
        if run:
            spans.append((pos, pos + len(run)))
        pos += len(run) + 1
    if len(spans) != len(groups):
        raise AssertionError(f"table has {len(spans)} columns, groups name {len(groups)}")
    top = [" "] * len(lines[rule])
    i = 0
    while i < len(groups):
        j = i
        while j + 1 < len(groups) and groups[j + 1] == groups[i]:
            j += 1
        if groups[i]:
            start, end = spans[i][0], spans[j][1]
            text = f" {labels.get(groups[i], groups[i])} "[: end - start]
            lead = (end - start - len(text)) // 2
            fill = "─" * lead + text + "─" * (end - start - len(text) - lead)
            top[start:end] = fill
        i = j + 1
    return "\n".join(["".join(top).rstrip()] + lines)


def _wrap(text: str, width: int = TERMINAL_COLUMNS, indent: str = "") -> str:
    return "\n".join(textwrap.wrap(text, width=width, initial_indent=indent,
                                   subsequent_indent=indent, break_on_hyphens=False))


def _wrap_kept(line: str) -> str:
    """``line`` wrapped to :data:`TERMINAL_COLUMNS`, keeping its indent (+4 on continuations)."""
    lead = line[: len(line) - len(line.lstrip())]
    return "\n".join(textwrap.wrap(line.strip(), width=TERMINAL_COLUMNS, initial_indent=lead,
                                   subsequent_indent=lead + "    ", break_on_hyphens=False))


def format_table(report: Mapping, *, wide: bool = False) -> str:
    """The terminal report: the per-mode, per-phase table (compact, fitting
    :data:`TERMINAL_COLUMNS`, with grouped headers; ``wide``: every column of
    :func:`table_rows`), the all-params table, skipped modes, for each failed run the
    reasons (see :func:`failure_sections`), each mode that raised, and the ``checks:`` block
    (one line per check, ``verify.report.checks.verdict_lines``). Text lines are wrapped to fit
    unless ``wide``; the final PASS / FAIL line is the caller's (``checks.final_line``).

    Raises:
        ValueError: ``report`` does not follow the data model (see :func:`validate_report`).
    """
    if wide:
        headers, rows = table_rows(report)
        colalign = ("left", "left") + ("right",) * (len(headers) - 2)
        main = tabulate(rows, headers=[_two_line(h) for h in headers], tablefmt="simple",
                        colalign=colalign, disable_numparse=True)
        legend = WIDE_LEGEND
    else:
        headers, rows = compact_rows(report)
        colalign = ("left", "left") + ("right",) * (len(headers) - 2)
        main = grouped(tabulate(rows, headers=headers, tablefmt="simple", colalign=colalign,
                                disable_numparse=True), [g for _, g in _COMPACT], _GROUP_LABELS)
        legend = _wrap(_COMPACT_LEGEND)
    model = f" model={report['model']}" if "model" in report else ""
    title = (f"verify-traffic {report['run_id']}: backend={report['backend']} "
             f"W={report['world_size']}{model} torch {report['torch_version']}, "
             f"{report['steps_measured']} measured steps after {report['steps_warmup']} "
             f"warm-up -> {verdict(report['pass'])}")
    parts = [title if wide else _wrap(title), main, legend, "",
             tab(all_params_rows(report, two_line=True), "simple")]
    for entry in report.get("skipped", []):
        parts.append(_wrap(f"skipped {entry['mode']}: {entry['reason']}"))
    q_headers, q_rows = qk_clip_rows(report)
    if q_rows:  # --qk-clip: the phase's own bytes (not dedicated-param traffic)
        applies = [r for r in q_rows if r[-1] != "n/a"]
        parts.append("")
        if applies:
            parts += ["qk_clip phase (MuonClip's all_reduce MAX of per-head fp32 maxima; bytes "
                      "per rank-step, W-average):", tab((q_headers, applies), "simple")]
        parts += [_wrap(f"qk_clip n/a: {line}") for line in qk_clip_not_run(report)]
    nvlink = nvlink_lines(report, "simple")
    if nvlink:
        parts += [""] + (nvlink if wide else [_wrap(line) if line else line for line in nvlink])
    for run in report["runs"]:
        if run["pass"]:
            continue
        parts += ["", f"FAIL {mode_label(run)} (W={run['world_size']}, N={run['shard_size']}, "
                      f"R={run['replicate_size']})"]
        for title, body in failure_sections(run, "simple"):
            body = indent(body, "    ")
            if not wide:
                body = "\n".join(line if len(line) <= TERMINAL_COLUMNS else _wrap_kept(line)
                                 for line in body.splitlines())
            parts += [f"  {title}:", body]
    for f in error_failures(report):
        line = f"  {label('error', False)}: {f['detail']}"
        parts += ["", f"FAIL {f['mode']}", line if wide else _wrap_kept(line)]
    lines = verdict_lines(report)
    parts += ["", "checks:", *(lines if wide else map(_wrap_kept, lines))]
    return "\n".join(parts) + "\n"


def _two_line(header: str) -> str:
    """A terminal header on two lines: the unit (``[...]``) or the ``meas/...`` pair below."""
    if " [" in header:
        i = header.rindex(" [")
    elif header.endswith((" meas/pred", " meas/exp")):
        i = header.rindex(" ")
    else:
        return header
    return header[:i] + "\n" + header[i + 1:]
