"""``dmuon-verify check EVENTS... --against RUN``: compare parsed events with a predicted run.

``RUN`` is a mode folder written by ``make verify-traffic`` (``traces/<run-id>/<mode>/``,
holding ``layout.json``) or that ``layout.json`` itself. The prediction is
:func:`verify.traffic.predict.predict_step` repeated for the number of steps, plus the
calls a layout lists once per window (``window_calls``: EP's token all_to_alls).

The comparison is per rank: each rank's events against that rank's predicted calls, so a
dropped, duplicated or altered row is named individually (``missing``: the predicted call with
its module; ``unexpected``: the measured event with its ``source_ref``). The number of steps is
``--steps``, or inferred per rank (events of the rank / its predicted calls per step, rounded;
the median over the ranks given), so a damaged file does not stop the comparison. Ranks of the
layout without any event make a *partial rank set*: flagged and failed, with the given ranks
still compared.

Sources differ in what they know, so the comparison key adapts to the events given:
``(rank, op, count, dtype, group_size, root, in_elems, out_elems)`` always (``group_size``: see
below), the totals of an
all_to_all as :func:`tracer.events.all_to_all_elems` gives them (from its count where a source
records no totals, an NCCL log; ``None`` for other ops); ``phase`` when the events have one
(interposer); ``group_id`` when every event's group id is a rank list (interposer, Flight
Recorder; NCCL logs name communicators by commId instead). Those two are all or nothing: a
file where some events have a phase and others not is rejected up front, never compared on a
weaker key. ``group_size`` is resolved where a source left it blank (torch.profiler writes
no ``Group size`` for some calls, e.g. DDP's bucket all_reduce on gloo): from the event's
group id where that is a rank list; where some still have none, ``group_size`` leaves the
key and ``notes`` says so (the op, count, dtype and root still compare every call). Column types and required values are checked up front too
(:func:`tracer.events.read_parquet`, :func:`validate_events`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from tracer.events import CollectiveEvent, all_to_all_elems, read_parquet

from verify.traffic.predict import Expected, RunLayout
from verify.traffic.layouts import layout_from_dict

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
#: Fields every event needs for a comparison; ``count`` / ``dtype`` may be null on barriers.
REQUIRED_FIELDS = ("rank", "op")
SIZE_FIELDS = ("count", "dtype")
#: Optional key fields: used when every event has them, rejected when only some do.
ALL_OR_NONE_FIELDS = ("phase", "group_id")


def load_layout(path: str | Path) -> RunLayout:
    """The layout of a run folder or of a ``layout.json``.

    Raises:
        ValueError: no layout.json there, or it is malformed.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "layout.json"
    if not path.is_file():
        raise ValueError(
            f"Invalid --against {str(path)!r}: no layout.json. Must be a mode folder of a "
            "verify-traffic run (traces/<run-id>/<mode>/) or its layout.json."
        )
    try:
        return layout_from_dict(json.loads(path.read_text()))  # the class of its kind (a TP run's too)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"Invalid --against {str(path)!r}: not JSON ({exc}). Must be the "
                         "layout.json written by verify-traffic.") from None


def validate_events(events: Sequence[CollectiveEvent]) -> None:
    """Reject events a comparison would silently misread.

    Raises:
        ValueError: no events; a null ``rank`` (or a non-int one); a null ``count`` or
            ``dtype`` on anything but a barrier; ``phase`` or ``group_id`` set on some events
            and null on others. The message names how many rows and the first one's
            ``source_ref``.
    """
    if not events:
        raise ValueError("Invalid events: none given. Must be the events of at least one rank "
                         "(dmuon-trace ... --out, or a run's events_rank*.parquet).")
    for name in REQUIRED_FIELDS + SIZE_FIELDS:
        bad = [ev for ev in events if getattr(ev, name) is None
               and not (name in SIZE_FIELDS and ev.op == "barrier")
               and not (name == "count" and _uneven(ev))]
        if bad:
            raise ValueError(f"Invalid events: {len(bad)} event(s) with {name}=None (first: "
                             f"{bad[0].source_ref}). Must be set on every event"
                             f"{' but barriers' if name in SIZE_FIELDS else ''}"
                             f"{' and uneven all_to_alls (with in_elems, out_elems)' if name == 'count' else ''}"
                             " for a check.")
    bad = [ev for ev in events if type(ev.rank) is not int or ev.rank < 0]
    if bad:
        raise ValueError(f"Invalid events: rank={bad[0].rank!r} at {bad[0].source_ref}. Must "
                         "be an int >= 0.")
    for name in ALL_OR_NONE_FIELDS:
        unset = [ev for ev in events if not getattr(ev, name)]
        if unset and len(unset) < len(events):
            raise ValueError(
                f"Invalid events: {len(unset)} of {len(events)} event(s) have no {name} (first: "
                f"{unset[0].source_ref}). Must be set on every event or on none (a partly "
                f"missing {name} would weaken the comparison key unnoticed).")


def _uneven(ev: CollectiveEvent) -> bool:
    """An all_to_all with totals but no count (tracer.events.all_to_all_count)."""
    return ev.op == "all_to_all" and ev.in_elems is not None and ev.out_elems is not None


def _field(x, name: str):
    """``x.<name>`` of an event or a predicted call; the totals as comparison keys use them."""
    if name in ("in_elems", "out_elems"):
        pair = all_to_all_elems(x.op, x.count, x.group_size, x.in_elems, x.out_elems)
        return pair[0] if name == "in_elems" else pair[1]
    return getattr(x, name)


def _rank_list(group_id: str | None) -> bool:
    return bool(group_id) and all(p.isdigit() for p in group_id.split(","))


def resolve_group_sizes(events: Sequence[CollectiveEvent]) -> tuple[list[CollectiveEvent], list[str]]:
    """``events`` with a blank ``group_size`` filled from a rank-list ``group_id`` (its length),
    and the notes to show: one naming how many were filled, one where some stay blank."""
    filled, out = 0, []
    for ev in events:
        if ev.group_size is None and _rank_list(ev.group_id):
            ev, filled = ev.replace(group_size=len(ev.group_id.split(","))), filled + 1
        out.append(ev)
    notes = [f"group_size filled from the group's rank list on {filled} event(s)"] if filled else []
    blank = [ev for ev in out if ev.group_size is None]
    if blank:
        notes.append(f"group_size left out of the key: {len(blank)} of {len(out)} event(s) have "
                     f"none and no rank-list group id (first: {blank[0].source_ref})")
    return out, notes


def _key_fields(events: Sequence[CollectiveEvent]) -> tuple[str, ...]:
    fields = ["rank", "op", "count", "dtype", "root", "in_elems", "out_elems"]
    if events and all(ev.group_size is not None for ev in events):
        fields.insert(4, "group_size")
    if events and all(ev.phase for ev in events):
        fields.append("phase")
    if events and all(_rank_list(ev.group_id) for ev in events):
        fields.append("group_id")
    return tuple(fields)


def _infer_steps(meas: dict[int, list], pred: dict[int, list],
                 window: Counter | None = None) -> tuple[int, dict[int, int]]:
    """Steps per given rank (its events less its ``window`` calls, over its predicted calls
    per step, rounded, >= 1) and their median (low), >= 1."""
    window = window or Counter()
    per_rank = {r: max(1, round((len(evs) - window[r]) / len(pred[r]))) for r, evs in meas.items()
                if pred.get(r)}
    return (statistics.median_low(per_rank.values()) if per_rank else 1), per_rank


def _window(layout: RunLayout, steps: int | None, inferred: int) -> tuple[int, list[Expected]]:
    """The steps and the layout's :meth:`~RunLayout.window_calls` for them: ``steps`` where
    given; else ``inferred`` where the layout takes it, or the one step count its window
    holds (EP's routing records the measured steps' forwards).

    Raises:
        ValueError: the layout's window does not cover ``steps`` (or no count up to ``inferred``)."""
    if steps is not None:
        return steps, layout.window_calls(steps)
    fits = []
    for s in range(inferred, 0, -1):
        try:
            fits.append((s, layout.window_calls(s)))
        except ValueError:
            continue
        if s == inferred or fits[-1][1]:
            return fits[-1]
    return inferred, layout.window_calls(inferred)  # raises, naming what the window holds


def check_events(
    events: Sequence[CollectiveEvent], layout: RunLayout, steps: int | None = None
) -> dict:
    """Per-rank multiset comparison of ``events`` with ``steps`` predicted steps.

    Returns:
        ``{"pass", "steps", "steps_by_rank", "key", "events", "predicted", "ranks",
        "absent_ranks", "partial", "missing", "unexpected", "missing_calls",
        "unexpected_calls", "notes"}``: ``missing`` / ``unexpected`` are lists of ``(key dict, n)``;
        ``missing_calls`` has one dict per missing key (``n`` and the predicted ``modules``),
        ``unexpected_calls`` one per surplus key (``n`` and the surplus events'
        ``source_refs``); ``predicted`` counts the given ranks' calls.

    Raises:
        ValueError: ``steps`` is not an int >= 1, or the events fail :func:`validate_events`.
    """
    if steps is not None and (type(steps) is not int or steps < 1):
        raise ValueError(f"Invalid {steps=}. Must be an int >= 1 (or None to infer it).")
    validate_events(events)
    events, notes = resolve_group_sizes(events)
    fields = _key_fields(events)
    key = lambda x: tuple(_field(x, f) for f in fields)  # noqa: E731
    pred: dict[int, list[Expected]] = defaultdict(list)
    for e in layout.predict_calls():  # its kind's prediction (TP layouts too)
        pred[e.rank].append(e)
    meas: dict[int, list[CollectiveEvent]] = defaultdict(list)
    for ev in events:
        meas[ev.rank].append(ev)
    inferred, _ = _infer_steps(meas, pred)
    steps, window = _window(layout, steps, inferred)  # calls listed once per window (EP's all_to_all)
    per_window = Counter(e.rank for e in window)
    _, steps_by_rank = _infer_steps(meas, pred, per_window)
    missing, unexpected, missing_calls, unexpected_calls = Counter(), Counter(), [], []
    for rank in sorted(meas):
        want = Counter()
        modules: dict[tuple, set] = defaultdict(set)
        for e in pred.get(rank, []):
            want[key(e)] += steps
            modules[key(e)].add(e.module or "")
        for e in window:
            if e.rank == rank:
                want[key(e)] += 1
                modules[key(e)].add(e.module or "")
        seen: dict[tuple, list[CollectiveEvent]] = defaultdict(list)
        for ev in meas[rank]:
            seen[key(ev)].append(ev)
        for k in sorted(set(want) | set(seen), key=str):
            n = want[k] - len(seen.get(k, ()))
            if n > 0:
                missing[k] += n
                missing_calls.append({**dict(zip(fields, k)), "n": n,
                                      "modules": sorted(m for m in modules[k] if m)})
            elif n < 0:
                unexpected[k] += -n
                unexpected_calls.append({**dict(zip(fields, k)), "n": -n,
                                         "source_refs": [ev.source_ref for ev in seen[k][n:]]})
    as_rows = lambda c: [(dict(zip(fields, k)), n) for k, n in sorted(c.items(), key=str)]  # noqa: E731
    absent = [r for r in range(layout.world_size) if r not in meas]
    return {
        "pass": not missing and not unexpected and not absent,
        "steps": steps,
        "steps_by_rank": steps_by_rank,
        "key": list(fields),
        "events": len(events),
        "predicted": steps * sum(len(pred.get(r, [])) for r in meas) + sum(per_window[r] for r in meas),
        "ranks": sorted(meas),
        "absent_ranks": absent,
        "partial": bool(absent),
        "missing": as_rows(missing),
        "unexpected": as_rows(unexpected),
        "missing_calls": missing_calls,
        "unexpected_calls": unexpected_calls,
        "notes": notes,
    }


def _describe(call: dict, fields: Sequence[str]) -> str:
    rank = call["rank"]
    what = " ".join(f"{f}={call[f]}" for f in fields if f not in ("rank", "op") and call[f] is not None)
    return f"rank {rank}: {call['n']} x {call['op']} {what}"


def report_lines(result: dict, mode: str, limit: int = 20) -> list[str]:
    """The human-readable verdict of :func:`check_events` (named calls, capped at ``limit``)."""
    fields = result["key"]
    lines = [f"{mode}: {result['events']} events vs {result['predicted']} predicted over "
             f"{result['steps']} step(s) on ranks {result['ranks']}, key {fields}"]
    lines += [f"note: {n}" for n in result.get("notes", ())]
    if len(set(result["steps_by_rank"].values())) > 1:
        lines.append(f"ranks disagree on the step count (events / predicted per step): "
                     f"{result['steps_by_rank']}")
    if result["partial"]:
        lines.append(f"partial rank set: no events for ranks {result['absent_ranks']} of the "
                     f"layout's {len(result['ranks']) + len(result['absent_ranks'])}; pass every "
                     "rank's events file")
    for name, extra in (("missing_calls", "modules"), ("unexpected_calls", "source_refs")):
        calls = result[name]
        if not calls:
            continue
        lines.append(f"{name.split('_')[0]} ({sum(c['n'] for c in calls)}):")
        for call in calls[:limit]:
            refs = call[extra]
            shown = ", ".join(refs[:3]) + (f", ... ({len(refs)} in all)" if len(refs) > 3 else "")
            lines.append(f"  {_describe(call, fields)}" + (f" [{extra[:-1]}: {shown}]" if refs else ""))
        if len(calls) > limit:
            lines.append(f"  ... and {len(calls) - limit} more kinds")
    lines.append("PASS" if result["pass"] else "FAIL")
    return lines


def _run(args: argparse.Namespace) -> int:
    try:
        layout = load_layout(args.against)
        events = [ev for path in args.events for ev in read_parquet(path)]
        result = check_events(events, layout, args.steps)
    except (ValueError, OSError) as exc:
        print(f"dmuon-verify check: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(report_lines(result, layout.mode)))
    return EXIT_OK if result["pass"] else EXIT_MISMATCH


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be an int >= 1")
    return value


def register_cli(subparsers) -> None:
    """Add ``check`` to ``dmuon-verify``."""
    p = subparsers.add_parser(
        "check",
        help="compare events (Parquet) with a predicted run; exit 1 on mismatch",
        description=__doc__,
        epilog="exit status: 0 pass; 1 mismatch or partial rank set; 2 bad input or arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("events", nargs="+", help="events Parquet files (from dmuon-trace nccl/fr/nsys or a run's events_rank*.parquet)")
    p.add_argument("--against", required=True, help="a mode folder of a verify-traffic run, or its layout.json")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="steps the events cover, >= 1 (default: inferred per rank)")
    p.set_defaults(func=_run)
