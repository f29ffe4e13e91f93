"""PNG charts of a verify-traffic run: traffic ratio per mode, and a one-step timeline.

Both draw on a bare :class:`matplotlib.figure.Figure` (Agg canvas, no pyplot, no window, no
global state), so they are safe in worker processes and CI.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tracer._compat import require
from tracer.context import Span
from tracer.events import OPS, CollectiveEvent
from verify.measure.compute_spans import BACKWARD, FORWARD
from verify.report.checks import checks_of
from verify.report.schema import mode_label, validate_report

_PNGS = "verify's PNG charts (traffic.png, timelines)"
matplotlib = require("matplotlib", _PNGS)
Figure = require("matplotlib.figure", _PNGS).Figure
Patch = require("matplotlib.patches", _PNGS).Patch

#: Colour of each collective op: matplotlib's ``tab10`` (saturated hues, so that a light
#: in-flight shade of one never reads as another) by position in ``tracer.events.OPS``, black
#: after the tenth.
_OP_COLORS = {op: matplotlib.colormaps["tab10"](i) if i < 10 else "black"
              for i, op in enumerate(OPS)}
#: Span colours: pastel and hatched, so that spans never read as one of the (saturated) op
#: colours or their in-flight shades.
_SPAN_PALETTE = ("#b3cde3", "#ccebc5", "#decbe4", "#fed9a6", "#ffffcc", "#e5d8bd", "#fddaec",
                 "#f2f2f2", "#fbb4ae")
_SERIES = (  # (key, legend label, colour, hatch)
    ("measured", "measured", "#1f77b4", None),
    ("predicted", "predicted (exact collective list)", "#ff7f0e", None),
    ("closed_form", "closed form (docs/spec.md §2)", "#2ca02c", None),
    ("seed", "seed document's reading", "#d62728", "//"),
)


def traffic_series(report: Mapping) -> list[dict]:
    """Per run, the ratios to P_M that :func:`plot_traffic` draws.

    Returns:
        One dict per run, in report order: ``mode`` (its label,
        :func:`verify.report.schema.mode_label`: ``(flat)`` for a flat HSDP run), ``pass``, ``failed`` (names of its failed
        checks, ``verify.report.checks``), ``formula`` (the closed form),
        ``busiest`` (the busiest rank's received dedicated elements / P_M under NCCL's
        algorithms, ``verify.traffic.wire``; None in reports without it) and ``ratios``: ``{"measured", "predicted", "closed_form", "seed"}``, each the run's
        ``*_avg_elems / p_m`` (``seed`` is None where the run has no seed reading).

    Raises:
        ValueError: ``report`` does not follow the data model.
    """
    validate_report(report)
    out = []
    for run in report["runs"]:
        p_m = run["p_m"]
        seed = run["seed_avg_elems"]
        out.append({
            "mode": mode_label(run),
            "pass": run["pass"],
            "failed": [c["check"] for c in checks_of(run) if not c["pass"]],
            "formula": run["closed_form"],
            "busiest": run["max_rank_elems"] / p_m if "wire" in run else None,
            "ratios": {
                "measured": run["measured_avg_elems"] / p_m,
                "predicted": run["predicted_avg_elems"] / p_m,
                "closed_form": run["closed_form_avg_elems"] / p_m,
                "seed": None if seed is None else seed / p_m,
            },
        })
    return out


def plot_traffic(report: Mapping, path: str | Path) -> Path:
    """Bar chart (PNG) of dedicated-param traffic / P_M per mode: measured, predicted and closed
    form side by side, plus the seed document's reading where a run has one (HSDP). Failed
    modes get a red ``FAIL`` label naming the failed checks; a report whose every mode raised
    gets a note instead of bars. Returns ``path``.

    Raises:
        ValueError: ``report`` does not follow the data model.
    """
    series = traffic_series(report)
    path = Path(path)
    fig = Figure(figsize=(max(8.0, 1.3 * len(series) + 2), 5.0), dpi=120)
    ax = fig.add_subplot()
    width = 0.8 / len(_SERIES)
    for k, (key, label, color, hatch) in enumerate(_SERIES):
        xs = [i + (k - (len(_SERIES) - 1) / 2) * width for i in range(len(series))]
        vals = [s["ratios"][key] for s in series]
        present = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if not present:
            continue
        bars = ax.bar([x for x, _ in present], [v for _, v in present], width, label=label,
                      color=color, hatch=hatch, edgecolor="black", linewidth=0.4)
        ax.bar_label(bars, fmt="%.3g", fontsize=6, padding=1)
    # the busiest rank beside the averages: a black tick over the measured bar
    k_measured = next(k for k, (key, *_) in enumerate(_SERIES) if key == "measured")
    peaks = [(i + (k_measured - (len(_SERIES) - 1) / 2) * width, s["busiest"])
             for i, s in enumerate(series) if s["busiest"] is not None]
    if peaks:
        ax.scatter([x for x, _ in peaks], [v for _, v in peaks], marker="_", s=220,
                   linewidths=2.0, color="black", zorder=3,
                   label="busiest rank, NCCL ring/chain (verify/traffic/wire.py)")
    ax.set_xticks(range(len(series)))
    ax.set_xticklabels([f"{s['mode']}\n{s['formula']}"
                        + ("" if s["pass"] else "\nFAIL: " + ", ".join(s["failed"]))
                        for s in series], fontsize=7)
    for tick, s in zip(ax.get_xticklabels(), series):
        tick.set_color("black" if s["pass"] else "red")
    ax.set_ylabel("dedicated traffic per rank per step / P_M  (W-average)")
    ax.set_title(f"verify-traffic {report['run_id']} ({report['backend']}, "
                 f"W={report['world_size']}): {'PASS' if report['pass'] else 'FAIL'}")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if series:
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no mode finished (see report.md, Failures)", ha="center",
                transform=ax.transAxes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


#: Colours of the harness's compute spans (``verify.measure.compute_spans``): forward, backward.
_COMPUTE_COLORS = {FORWARD: "#4d4d4d", BACKWARD: "#9e9e9e"}
#: Opacity of a collective's in-flight part (issue return to wait call); its issue call and
#: its blocked wait are drawn opaque.
_IN_FLIGHT_ALPHA = 0.3
#: Row of the DMuon spans within a rank (compute comes first, the channels after).
_SPAN_ROW = "DMuon spans"


@dataclass(frozen=True, slots=True)
class TimelineBar:
    """One drawn bar of :func:`plot_timeline`, times in ns clipped to the window.

    A collective's bar runs from its issue to the return of its wait (``t_waited_ns``) when
    its handle was waited on, else to the return of the issue; ``t_issued_ns`` and
    ``t_wait_start_ns`` split it into the issue call (opaque), the time in flight (light) and
    the blocked wait (opaque).
    """

    rank: int
    kind: str  # "compute" (harness block spans), "span" (DMuon spans) or "collective"
    row: str  # "compute", "DMuon spans", or the collective's channel ("broadcast", ...)
    lane: int  # 0-based lane inside (rank, row); overlapping items get separate lanes
    key: str  # span name or collective op: picks the colour
    label: str  # text drawn in the bar: span / collective module (collective: else phase)
    t_start_ns: int
    t_end_ns: int
    t_issued_ns: int | None = None  # collectives: the issue call's return
    t_wait_start_ns: int | None = None  # waited asynchronous collectives: wait() called

    @property
    def in_flight(self) -> bool:
        """Whether the bar is a waited asynchronous collective (issue to wait return)."""
        return self.t_wait_start_ns is not None


@dataclass(frozen=True, slots=True)
class _Item:
    kind: str
    row: str
    key: str
    label: str
    t_start_ns: int
    t_end_ns: int
    t_issued_ns: int | None = None
    t_wait_start_ns: int | None = None

    def clip(self, t0_ns: int, t1_ns: int) -> _Item:
        def c(t):
            return None if t is None else min(max(t, t0_ns), t1_ns)

        return _Item(self.kind, self.row, self.key, self.label, c(self.t_start_ns),
                     c(self.t_end_ns), c(self.t_issued_ns), c(self.t_wait_start_ns))


def _assign_lanes(items: list[_Item], rank: int) -> list[TimelineBar]:
    """Greedy interval lanes: each item goes to the first lane free at its start."""
    lane_end: list[int] = []
    bars = []
    for it in sorted(items, key=lambda it: (it.t_start_ns, -it.t_end_ns)):
        for lane, end in enumerate(lane_end):
            if end <= it.t_start_ns:
                break
        else:
            lane = len(lane_end)
            lane_end.append(it.t_end_ns)
        lane_end[lane] = it.t_end_ns
        bars.append(TimelineBar(rank, it.kind, it.row, lane, it.key, it.label, it.t_start_ns,
                                it.t_end_ns, it.t_issued_ns, it.t_wait_start_ns))
    return bars


def _channels(per_rank: Mapping[int, tuple[Sequence[CollectiveEvent], Sequence[Span]]]
              ) -> dict[tuple[str, str | None], str]:
    """Row name of each (op, group_id): the op, plus the group where one op uses several."""
    groups: dict[str, set] = {}
    for events, _ in per_rank.values():
        for ev in events:
            groups.setdefault(ev.op, set()).add(ev.group_id)
    return {(op, g): op if len(gs) == 1 else f"{op} [{g}]"
            for op, gs in groups.items() for g in gs}


def _items(events: Sequence[CollectiveEvent], spans: Sequence[Span],
           channel: Mapping[tuple[str, str | None], str]) -> tuple[list[_Item], int]:
    items, n_untimed = [], 0
    issues = sorted(ev.t_start_ns for ev in events if ev.t_start_ns is not None)
    for s in spans:
        if s.name in _COMPUTE_COLORS:
            items.append(_Item("compute", "compute", s.name, s.module or "", s.t_start_ns,
                               s.t_end_ns))
        elif not _issues_inside(issues, s):  # else its collectives' rows show it
            items.append(_Item("span", _SPAN_ROW, s.name, s.module or "", s.t_start_ns,
                               s.t_end_ns))
    for ev in events:
        if ev.t_start_ns is None or ev.t_end_ns is None:
            n_untimed += 1
            continue
        end = ev.t_waited_ns if ev.t_waited_ns is not None else ev.t_end_ns
        wait = (ev.t_wait_start_ns if ev.t_wait_start_ns is not None else ev.t_waited_ns) \
            if ev.t_waited_ns is not None else None
        items.append(_Item("collective", channel[(ev.op, ev.group_id)], ev.op,
                           ev.module or ev.phase or "", ev.t_start_ns, end, ev.t_end_ns, wait))
    return items, n_untimed


def _issues_inside(issues: list[int], span: Span) -> bool:
    """Whether a collective was issued inside ``span`` (``issues``: sorted issue times)."""
    i = bisect.bisect_left(issues, span.t_start_ns)
    return i < len(issues) and issues[i] <= span.t_end_ns


def _row_order(rows: set[str]) -> list[str]:
    """compute, DMuon spans, then the channels in :data:`tracer.events.OPS` order."""
    def key(row: str):
        if row == "compute":
            return (0, 0, row)
        if row == _SPAN_ROW:
            return (1, 0, row)
        return (2, OPS.index(row.split(" ")[0]), row)

    return sorted(rows, key=key)


def timeline_bars(
    per_rank: Mapping[int, tuple[Sequence[CollectiveEvent], Sequence[Span]]],
    t0_ns: int | None = None,
    t1_ns: int | None = None,
) -> tuple[list[TimelineBar], int, int, int]:
    """Lay out the timeline of :func:`plot_timeline` without drawing it.

    Spans named ``compute.forward`` / ``compute.backward`` (``verify.measure.compute_spans``) go to the
    row ``compute``; other spans to ``DMuon spans``, except those inside which a collective of
    the rank was issued (``dmuon.broadcast``, ``dmuon.reduce``: the issue call is drawn on the
    collective's row); collectives to one row per channel (op,
    and group where an op uses several); a waited asynchronous collective runs to its
    ``t_waited_ns`` (:class:`TimelineBar`).

    Returns:
        ``(bars, t0_ns, t1_ns, n_untimed)``: the bars inside the window (clipped to it), the
        window (defaults: earliest start, latest end) and how many collectives had no times.

    Raises:
        ValueError: ``per_rank`` is empty or malformed, the window is empty, or nothing timed
            falls inside it.
    """
    if not per_rank:
        raise ValueError("Invalid per_rank={}. Must map each rank to (events, spans).")
    for rank, value in per_rank.items():
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"Invalid per_rank[{rank!r}]={value!r:.80}. Must be a tuple "
                             "(list[CollectiveEvent], list[Span]).")
    channel = _channels(per_rank)
    timed: dict[int, list[_Item]] = {}
    n_untimed = 0
    for rank, (events, spans) in per_rank.items():
        timed[rank], n = _items(events, spans, channel)
        n_untimed += n
    all_items = [it for items in timed.values() for it in items]
    if t0_ns is None:
        t0_ns = min((it.t_start_ns for it in all_items), default=0)
    if t1_ns is None:
        t1_ns = max((it.t_end_ns for it in all_items), default=0)
    if t1_ns <= t0_ns:
        raise ValueError(f"Invalid timeline window t0_ns={t0_ns}, t1_ns={t1_ns}. Must have "
                         "t1_ns > t0_ns (and at least one timed span or collective).")
    bars: list[TimelineBar] = []
    for rank in sorted(timed):
        inside = [it.clip(t0_ns, t1_ns) for it in timed[rank]
                  if it.t_end_ns >= t0_ns and it.t_start_ns <= t1_ns]
        for row in _row_order({it.row for it in inside}):
            bars += _assign_lanes([it for it in inside if it.row == row], rank)
    if not bars:
        raise ValueError(f"Invalid timeline window [{t0_ns}, {t1_ns}] ns: no span or collective "
                         "falls inside it. Must overlap the recorded step.")
    return bars, t0_ns, t1_ns, n_untimed


def _pieces(b: TimelineBar) -> list[tuple[int, int, float]]:
    """``(start, end, alpha)`` parts of a bar: a waited collective's opaque issue call, light
    time in flight and opaque blocked wait; anything else one opaque piece."""
    if not b.in_flight:
        return [(b.t_start_ns, b.t_end_ns, 1.0)]
    return [(b.t_start_ns, b.t_issued_ns, 1.0),
            (b.t_issued_ns, b.t_wait_start_ns, _IN_FLIGHT_ALPHA),
            (b.t_wait_start_ns, b.t_end_ns, 1.0)]


def plot_timeline(
    path: str | Path,
    per_rank: Mapping[int, tuple[Sequence[CollectiveEvent], Sequence[Span]]],
    *,
    title: str,
    t0_ns: int | None = None,
    t1_ns: int | None = None,
) -> Path:
    """PNG timeline of one step: per rank, a ``compute`` row (the blocks' forward and
    backward, ``verify.measure.compute_spans``), a row of DMuon spans that issue no collective
    (``dmuon.annotate.Span``: Newton–Schulz, replicate waits; pastel, labelled by module) and one row per collective channel (op; op and group where an op uses
    several groups), coloured by op. A waited asynchronous collective is drawn from its issue
    to the return of its wait: the issue call and the blocked wait opaque, the time in flight
    light, so a broadcast that runs while a block computes shows as a light bar beside that
    block's forward. Overlapping items of a row share its height in sub-lanes. Times are
    ``time.perf_counter_ns`` (all ranks of one host share the clock), plotted relative to
    ``t0_ns``. Returns ``path``.

    Raises:
        ValueError: see :func:`timeline_bars`.
    """
    bars, t0_ns, t1_ns, n_untimed = timeline_bars(per_rank, t0_ns, t1_ns)
    window = t1_ns - t0_ns
    unit, scale = ("ms", 1e6) if window >= 5e6 else ("µs", 1e3)
    lanes: dict[tuple[int, str], int] = {}
    for b in bars:
        lanes[(b.rank, b.row)] = max(lanes.get((b.rank, b.row), 0), b.lane + 1)
    # y layout: ranks top to bottom; inside a rank one unit-high row per row name, its
    # sub-lanes sharing the height
    y_row: dict[tuple[int, str], float] = {}
    ticks, boundaries, y = [], [], 0.0
    for rank in sorted(per_rank):
        for row in _row_order({r for (rk, r) in lanes if rk == rank}):
            y_row[(rank, row)] = y
            ticks.append((y, f"rank {rank}  {row}"))
            y += 1.0
        boundaries.append(y - 0.5)
        y += 0.5
    span_names = sorted({b.key for b in bars if b.kind == "span"})
    span_colors = {n: _SPAN_PALETTE[i % len(_SPAN_PALETTE)] for i, n in enumerate(span_names)}

    fig_w_in, dpi = 12.0, 120
    fig = Figure(figsize=(fig_w_in, max(3.0, 0.3 * y + 1.8)), dpi=dpi)
    ax = fig.add_subplot()
    min_w = window * 0.0015
    px_per_ns = 0.72 * fig_w_in * dpi / window  # the axes take about 3/4 of the width
    for b in bars:
        n = lanes[(b.rank, b.row)]
        height = 0.84 / n
        yy = y_row[(b.rank, b.row)] - 0.42 + (b.lane + 0.5) * height
        if b.kind == "compute":
            color = _COMPUTE_COLORS[b.key]
        else:
            color = span_colors[b.key] if b.kind == "span" else _OP_COLORS[b.key]
        hatch = "////" if b.kind == "span" else None
        for a, e, alpha in _pieces(b):
            if e - a <= 0 and alpha < 1:
                continue
            ax.barh(yy, max(e - a, min_w) / scale, left=(a - t0_ns) / scale, height=height,
                    color=color, alpha=alpha, hatch=hatch, edgecolor="0.4" if hatch else "none",
                    linewidth=0.3 if hatch else 0)
        if b.in_flight:  # one outline round the whole interval
            ax.barh(yy, (b.t_end_ns - b.t_start_ns) / scale, left=(b.t_start_ns - t0_ns) / scale,
                    height=height, fill=False, edgecolor=color, linewidth=0.6)
        prefix = {"compute": {FORWARD: "fwd ", BACKWARD: "bwd "}.get(b.key, ""),
                  "span": b.key.removeprefix("dmuon.") + " "}.get(b.kind, "")
        text = (prefix + b.label).strip()
        # label only when it fits: about 5 px per character at font size 6 and 120 dpi
        fontsize = 6 if n == 1 else 5
        if text and (b.t_end_ns - b.t_start_ns) * px_per_ns >= 5 * len(text) + 4 and height > 0.2:
            ax.text((b.t_start_ns - t0_ns + (b.t_end_ns - b.t_start_ns) / 2) / scale, yy, text,
                    ha="center", va="center", fontsize=fontsize, clip_on=True,
                    color="white" if b.kind == "compute" and b.key == FORWARD else "black")
    for boundary in boundaries[:-1]:
        ax.axhline(boundary, color="0.5", linewidth=0.6)
    ax.set_yticks([t for t, _ in ticks])
    ax.set_yticklabels([label for _, label in ticks], fontsize=7)
    ax.set_ylim(y - 0.5, -0.6)
    ax.set_xlim(0, window / scale)
    ax.set_xlabel(f"time since t0 [{unit}]")
    handles = [Patch(color=_COMPUTE_COLORS[n], label=f"block {n.removeprefix('compute.')}")
               for n in _COMPUTE_COLORS if any(b.key == n for b in bars)]
    handles += [Patch(facecolor=span_colors[n], hatch="////", edgecolor="0.4", label=n)
                for n in span_names]
    handles += [Patch(color=_OP_COLORS[op], label=op) for op in OPS
                if any(b.kind == "collective" and b.key == op for b in bars)]
    if any(b.in_flight for b in bars):
        handles += [Patch(color="0.3", label="issue call / blocked wait"),
                    Patch(color="0.3", alpha=_IN_FLIGHT_ALPHA, label="in flight (issue to wait)")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    note = f" ({n_untimed} collectives without times not drawn)" if n_untimed else ""
    ax.set_title(title + note, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
