"""``dmuon-trace check EVENTS... --against RUN``: compare parsed events with a predicted run.

``RUN`` is a mode folder written by ``make verify-traffic`` (``traces/<run-id>/<mode>/``,
holding ``layout.json``) or that ``layout.json`` itself. The prediction is
:func:`verify.predict.predict_step` times the number of steps, which is inferred from the
event count (or given with ``--steps``).

Sources differ in what they know, so the comparison key adapts to the events given:
``(rank, op, count, dtype, group_size, root)`` always; ``phase`` only when every event has
one (interposer); ``group_id`` only when every event's group id is a rank list (interposer,
Flight Recorder; NCCL logs name communicators by commId instead).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tracer.events import CollectiveEvent, read_parquet

from .predict import Expected, RunLayout, predict_step

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


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
    return RunLayout.from_dict(json.loads(path.read_text()))


def _key_fields(events: Sequence[CollectiveEvent]) -> tuple[str, ...]:
    fields = ["rank", "op", "count", "dtype", "group_size", "root"]
    if events and all(ev.phase for ev in events):
        fields.append("phase")
    if events and all(ev.group_id and all(p.isdigit() for p in ev.group_id.split(",")) for ev in events):
        fields.append("group_id")
    return tuple(fields)


def check_events(
    events: Sequence[CollectiveEvent], layout: RunLayout, steps: int | None = None
) -> dict:
    """Multiset comparison of ``events`` with ``steps`` predicted steps.

    Returns:
        ``{"pass", "steps", "key", "events", "predicted", "missing", "unexpected"}`` with
        missing / unexpected as lists of ``(key dict, n)``.

    Raises:
        ValueError: ``steps`` cannot be inferred (event count not a multiple of a step).
    """
    predicted: list[Expected] = predict_step(layout)
    if steps is None:
        if not predicted or len(events) % len(predicted):
            raise ValueError(
                f"Invalid events: {len(events)} events is not a whole number of predicted "
                f"steps of {len(predicted)} calls. Pass --steps, or give the events of whole steps."
            )
        steps = len(events) // len(predicted)
    fields = _key_fields(events)
    meas = Counter(tuple(getattr(ev, f) for f in fields) for ev in events)
    pred = Counter()
    for e in predicted:
        pred[tuple(getattr(e, f) for f in fields)] += steps
    missing, unexpected = pred - meas, meas - pred
    as_rows = lambda c: [(dict(zip(fields, k)), n) for k, n in sorted(c.items(), key=str)]
    return {
        "pass": not missing and not unexpected,
        "steps": steps,
        "key": list(fields),
        "events": len(events),
        "predicted": sum(pred.values()),
        "missing": as_rows(missing),
        "unexpected": as_rows(unexpected),
    }


def _run(args: argparse.Namespace) -> int:
    try:
        layout = load_layout(args.against)
        events = [ev for path in args.events for ev in read_parquet(path)]
        result = check_events(events, layout, args.steps)
    except (ValueError, OSError) as exc:
        print(f"dmuon-trace check: {exc}")
        return EXIT_BAD_INPUT
    print(
        f"{layout.mode}: {result['events']} events vs {result['predicted']} predicted over "
        f"{result['steps']} step(s), key {result['key']}"
    )
    for name in ("missing", "unexpected"):
        rows = result[name]
        if rows:
            print(f"{name} ({sum(n for _, n in rows)}):")
            for key, n in rows[:20]:
                print(f"  {n} x {key}")
            if len(rows) > 20:
                print(f"  ... and {len(rows) - 20} more kinds")
    print("PASS" if result["pass"] else "FAIL")
    return EXIT_OK if result["pass"] else EXIT_MISMATCH


def register_cli(subparsers) -> None:
    """Add ``check`` to ``dmuon-trace``."""
    p = subparsers.add_parser(
        "check",
        help="compare events (Parquet) with a predicted run; exit 1 on mismatch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("events", nargs="+", help="events Parquet files (from dmuon-trace nccl/fr/nsys or a run's events_rank*.parquet)")
    p.add_argument("--against", required=True, help="a mode folder of a verify-traffic run, or its layout.json")
    p.add_argument("--steps", type=int, default=None, help="steps the events cover (default: inferred)")
    p.set_defaults(func=_run)
