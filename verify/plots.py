"""PNG charts of a verify-traffic run: traffic ratio per mode, and a one-step timeline.

Both draw on a bare :class:`matplotlib.figure.Figure` (Agg canvas, no pyplot, no window, no
global state), so they are safe in worker processes and CI.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dmuon.annotate import Span
from tracer.events import OPS, CollectiveEvent
from .report_schema import validate_report

#: Colour of each collective op (matplotlib's ``tab20`` by position in ``tracer.events.OPS``:
#: one colour each for up to 20 ops).
_OP_COLORS = {op: matplotlib.colormaps["tab20"](i % 20) for i, op in enumerate(OPS)}
#: Span colours: pastel, so that spans never read as one of the (saturated) op colours.
_SPAN_PALETTE = ("#b3cde3", "#ccebc5", "#decbe4", "#fed9a6", "#ffffcc", "#e5d8bd", "#fddaec",
                 "#f2f2f2", "#fbb4ae")
_SERIES = (  # (key, legend label, colour, hatch)
    ("measured", "measured", "#1f77b4", None),
    ("predicted", "predicted (exact collective list)", "#ff7f0e", None),
    ("closed_form", "closed form (SPEC §2)", "#2ca02c", None),
    ("seed", "seed document's reading", "#d62728", "//"),
)


def traffic_series(report: Mapping) -> list[dict]:
    """Per run, the ratios to P_M that :func:`plot_traffic` draws.

    Returns:
        One dict per run, in report order: ``mode``, ``pass``, ``formula`` (the closed form),
        ``busiest`` (the busiest rank's received dedicated elements / P_M under NCCL's
        algorithms, ``verify.wire``; None in reports without it) and ``ratios``: ``{"measured", "predicted", "closed_form", "seed"}``, each the run's
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
            "mode": run["mode"],
            "pass": run["pass"],
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
    modes get a red ``FAIL`` label. Returns ``path``.

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
                   label="busiest rank, NCCL ring/chain (verify/wire.py)")
    ax.set_xticks(range(len(series)))
    ax.set_xticklabels([f"{s['mode']}\n{s['formula']}" + ("" if s["pass"] else "\nFAIL")
                        for s in series], fontsize=7)
    for tick, s in zip(ax.get_xticklabels(), series):
        tick.set_color("black" if s["pass"] else "red")
    ax.set_ylabel("dedicated traffic per rank per step / P_M  (W-average)")
    ax.set_title(f"verify-traffic {report['run_id']} ({report['backend']}, "
                 f"W={report['world_size']}): {'PASS' if report['pass'] else 'FAIL'}")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


@dataclass(frozen=True, slots=True)
class TimelineBar:
    """One drawn bar of :func:`plot_timeline`, times in ns clipped to the window."""

    rank: int
    kind: str  # "span" or "collective"
    lane: int  # 0-based lane inside (rank, kind); overlapping items get separate lanes
    key: str  # span name or collective op: picks the colour
    label: str  # text drawn in the bar: span module, or collective phase
    t_start_ns: int
    t_end_ns: int


def _assign_lanes(
    items: list[tuple[int, int, str, str]], rank: int, kind: str
) -> list[TimelineBar]:
    """Greedy interval lanes: each item goes to the first lane free at its start."""
    lane_end: list[int] = []
    bars = []
    for t0, t1, key, label in sorted(items, key=lambda it: (it[0], -it[1])):
        for lane, end in enumerate(lane_end):
            if end <= t0:
                break
        else:
            lane = len(lane_end)
            lane_end.append(t1)
        lane_end[lane] = t1
        bars.append(TimelineBar(rank, kind, lane, key, label, t0, t1))
    return bars


def timeline_bars(
    per_rank: Mapping[int, tuple[Sequence[CollectiveEvent], Sequence[Span]]],
    t0_ns: int | None = None,
    t1_ns: int | None = None,
) -> tuple[list[TimelineBar], int, int, int]:
    """Lay out the timeline of :func:`plot_timeline` without drawing it.

    Returns:
        ``(bars, t0_ns, t1_ns, n_untimed)``: the bars inside the window (clipped to it), the
        window (defaults: earliest start, latest end) and how many collectives had no times.

    Raises:
        ValueError: ``per_rank`` is empty or malformed, the window is empty, or nothing timed
            falls inside it.
    """
    if not per_rank:
        raise ValueError("Invalid per_rank={}. Must map each rank to (events, spans).")
    timed: dict[int, dict[str, list[tuple[int, int, str, str]]]] = {}
    n_untimed = 0
    for rank, value in per_rank.items():
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"Invalid per_rank[{rank!r}]={value!r:.80}. Must be a tuple "
                             "(list[CollectiveEvent], list[Span]).")
        events, spans = value
        items = {"span": [], "collective": []}
        for s in spans:
            label = s.module or ""
            items["span"].append((s.t_start_ns, s.t_end_ns, s.name, label))
        for ev in events:
            if ev.t_start_ns is None or ev.t_end_ns is None:
                n_untimed += 1
                continue
            items["collective"].append((ev.t_start_ns, ev.t_end_ns, ev.op, ev.phase or ""))
        timed[rank] = items
    all_items = [it for items in timed.values() for lst in items.values() for it in lst]
    if t0_ns is None:
        t0_ns = min((it[0] for it in all_items), default=0)
    if t1_ns is None:
        t1_ns = max((it[1] for it in all_items), default=0)
    if t1_ns <= t0_ns:
        raise ValueError(f"Invalid timeline window t0_ns={t0_ns}, t1_ns={t1_ns}. Must have "
                         "t1_ns > t0_ns (and at least one timed span or collective).")
    bars: list[TimelineBar] = []
    for rank in sorted(timed):
        for kind in ("span", "collective"):
            clipped = [(max(a, t0_ns), min(b, t1_ns), key, label)
                       for a, b, key, label in timed[rank][kind] if b >= t0_ns and a <= t1_ns]
            bars += _assign_lanes(clipped, rank, kind)
    if not bars:
        raise ValueError(f"Invalid timeline window [{t0_ns}, {t1_ns}] ns: no span or collective "
                         "falls inside it. Must overlap the recorded step.")
    return bars, t0_ns, t1_ns, n_untimed


def plot_timeline(
    path: str | Path,
    per_rank: Mapping[int, tuple[Sequence[CollectiveEvent], Sequence[Span]]],
    *,
    title: str,
    t0_ns: int | None = None,
    t1_ns: int | None = None,
) -> Path:
    """PNG timeline of one step: per rank, DMuon spans (``dmuon.annotate.Span``, grey tones,
    labelled by module) above its collectives (``CollectiveEvent`` ``t_start_ns..t_end_ns``,
    coloured by op, labelled by phase). Overlapping items get their own lanes, so an async
    HSDP replicate broadcast issued after the step and waited in the next forward shows as a
    bar running beside the forward spans. Times are ``time.perf_counter_ns`` (all ranks of one
    host share the clock), plotted relative to ``t0_ns``. Returns ``path``.

    Raises:
        ValueError: see :func:`timeline_bars`.
    """
    bars, t0_ns, t1_ns, n_untimed = timeline_bars(per_rank, t0_ns, t1_ns)
    window = t1_ns - t0_ns
    unit, scale = ("ms", 1e6) if window >= 5e6 else ("µs", 1e3)
    lanes = {}
    for b in bars:
        lanes[(b.rank, b.kind)] = max(lanes.get((b.rank, b.kind), 0), b.lane + 1)
    # y layout: ranks top to bottom; inside a rank, span lanes then collective lanes.
    y_of: dict[tuple[int, str, int], float] = {}
    y, rank_centres, boundaries = 0.0, [], []
    for rank in sorted(per_rank):
        top = y
        for kind in ("span", "collective"):
            for lane in range(lanes.get((rank, kind), 0)):
                y_of[(rank, kind, lane)] = y
                y += 1.0
        rank_centres.append(((top + y - 1) / 2 if y > top else top, rank))
        boundaries.append(y - 0.2)  # middle of the gap before the next rank
        y += 0.6
    span_names = sorted({b.key for b in bars if b.kind == "span"})
    span_colors = {n: _SPAN_PALETTE[i % len(_SPAN_PALETTE)] for i, n in enumerate(span_names)}

    fig_w_in, dpi = 12.0, 120
    fig = Figure(figsize=(fig_w_in, max(3.0, 0.32 * y + 1.6)), dpi=dpi)
    ax = fig.add_subplot()
    min_w = window * 0.002
    px_per_ns = 0.75 * fig_w_in * dpi / window  # the axes take about 3/4 of the width
    for b in bars:
        x0 = (b.t_start_ns - t0_ns) / scale
        w = max(b.t_end_ns - b.t_start_ns, min_w) / scale
        color = span_colors[b.key] if b.kind == "span" else _OP_COLORS[b.key]
        yy = y_of[(b.rank, b.kind, b.lane)]
        ax.barh(yy, w, left=x0, height=0.8, color=color, edgecolor="black", linewidth=0.3)
        text = b.label if b.kind == "collective" else f"{b.key.removeprefix('dmuon.')} {b.label}"
        text = text.strip()
        # label only when it fits: about 5 px per character at font size 6 and 120 dpi
        if text and (b.t_end_ns - b.t_start_ns) * px_per_ns >= 5 * len(text) + 4:
            ax.text(x0 + w / 2, yy, text, ha="center", va="center", fontsize=6, clip_on=True)
    for boundary in boundaries[:-1]:
        ax.axhline(boundary, color="0.6", linewidth=0.5)
    ax.set_yticks([c for c, _ in rank_centres])
    ax.set_yticklabels([f"rank {r}" for _, r in rank_centres])
    ax.invert_yaxis()
    ax.set_xlim(0, window / scale)
    ax.set_xlabel(f"time since t0 [{unit}]")
    handles = [Patch(color=span_colors[n], label=n) for n in span_names]
    handles += [Patch(color=_OP_COLORS[op], label=op) for op in OPS
                if any(b.kind == "collective" and b.key == op for b in bars)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    note = f" ({n_untimed} collectives without times not drawn)" if n_untimed else ""
    ax.set_title(title + note, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
