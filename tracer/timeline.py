"""Chrome-trace / Perfetto JSON timeline of collectives and DMuon spans, one process per rank.

Format: the Trace Event Format (the JSON object form, ``{"traceEvents": [...]}``) that
``chrome://tracing`` and https://ui.perfetto.dev load. Each collective and each span is a
complete event (``"ph": "X"``) with ``ts`` / ``dur`` in **microseconds** (floats, so ns
resolution survives); ``pid`` is the rank, named ``"rank N"`` by a ``process_name`` metadata
event; ``tid`` :data:`TID_COLLECTIVES` holds collectives and :data:`TID_SPANS` DMuon spans,
named by ``thread_name`` metadata events; :data:`TID_IN_FLIGHT` holds, for each asynchronous
collective whose handle was waited on (``t_waited_ns``), its in-flight interval from issue to
the wait's return (category ``in_flight``). Times are shifted so the earliest event starts at 0;
the shift (ns on the :func:`tracer.context.now_ns` clock) is ``otherData.origin_ns``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from tracer.context import Span
from tracer.events import CollectiveEvent

#: Track (``tid``) of collectives within a rank's process.
TID_COLLECTIVES = 0
#: Track (``tid``) of DMuon spans within a rank's process.
TID_SPANS = 1

#: Track (``tid``) of the in-flight intervals of waited asynchronous collectives.
TID_IN_FLIGHT = 2

#: CollectiveEvent fields copied into each collective's ``args``.
COLLECTIVE_ARGS = (
    "op", "count", "msg_bytes", "in_elems", "out_elems", "dtype", "group_id", "group_size", "group_rank", "seq", "root",
    "phase", "module", "source", "source_ref", "t_wait_start_ns", "t_waited_ns",
)


def _check_times(what: str, t_start_ns, t_end_ns) -> None:
    if t_start_ns is None or t_end_ns is None:
        raise ValueError(
            f"Invalid {what}: t_start_ns={t_start_ns}, t_end_ns={t_end_ns}. Must have both "
            "times to be placed on a timeline (interposer and nsys events do; NCCL-log and "
            "Flight-Recorder-on-gloo events do not)."
        )
    if t_end_ns < t_start_ns:
        raise ValueError(f"Invalid {what}: t_end_ns={t_end_ns} < t_start_ns={t_start_ns}.")


def write_chrome_trace(
    path: str | Path,
    per_rank: Mapping[int, tuple[Sequence[CollectiveEvent], Sequence[Span]]],
    *,
    name: str = "dmuon",
) -> Path:
    """Write ``per_rank`` as a Chrome-trace JSON file; returns the path.

    Args:
        path: output file (parent folders are created).
        per_rank: ``{rank: (collective events, DMuon spans)}``; times in ns on one clock per
            host (:func:`tracer.context.now_ns`, i.e. ``time.perf_counter_ns``).
        name: run name stored in ``otherData.name``.

    Raises:
        ValueError: a rank is not an int >= 0, or an event / span lacks ``t_start_ns`` /
            ``t_end_ns`` or ends before it starts.
    """
    starts = []
    for rank, (events, spans) in per_rank.items():
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"Invalid per_rank key {rank=!r}. Must be a world rank (int >= 0).")
        for ev in events:
            _check_times(f"CollectiveEvent {ev.source_ref!r} of rank {rank}",
                         ev.t_start_ns, ev.t_end_ns)
            starts.append(ev.t_start_ns)
        for sp in spans:
            _check_times(f"Span {sp.name!r} of rank {rank}", sp.t_start_ns, sp.t_end_ns)
            starts.append(sp.t_start_ns)
    origin_ns = min(starts, default=0)

    trace: list[dict] = []
    for rank in sorted(per_rank):
        events, spans = per_rank[rank]
        trace.append({"ph": "M", "name": "process_name", "pid": rank,
                      "args": {"name": f"rank {rank}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                      "args": {"sort_index": rank}})
        for tid, label in ((TID_COLLECTIVES, "collectives"), (TID_SPANS, "DMuon spans"),
                           (TID_IN_FLIGHT, "in flight (issue to wait return)")):
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                          "args": {"name": label}})
        for ev in events:
            trace.append({
                "ph": "X", "name": ev.op, "cat": "collective", "pid": rank,
                "tid": TID_COLLECTIVES, "ts": (ev.t_start_ns - origin_ns) / 1e3,
                "dur": (ev.t_end_ns - ev.t_start_ns) / 1e3,
                "args": {k: getattr(ev, k) for k in COLLECTIVE_ARGS},
            })
            if ev.t_waited_ns is not None:
                trace.append({
                    "ph": "X", "name": f"{ev.op} in flight", "cat": "in_flight", "pid": rank,
                    "tid": TID_IN_FLIGHT, "ts": (ev.t_start_ns - origin_ns) / 1e3,
                    "dur": ev.in_flight_ns / 1e3,
                    "args": {"source_ref": ev.source_ref, "phase": ev.phase, "module": ev.module,
                             "blocked_ns": ev.t_waited_ns - ev.t_wait_start_ns
                             if ev.t_wait_start_ns is not None else None},
                })
        for sp in spans:
            trace.append({
                "ph": "X", "name": sp.name, "cat": "dmuon", "pid": rank, "tid": TID_SPANS,
                "ts": (sp.t_start_ns - origin_ns) / 1e3,
                "dur": (sp.t_end_ns - sp.t_start_ns) / 1e3,
                "args": {"module": sp.module, "owner": sp.owner, "phase": sp.phase,
                         "thread_id": sp.thread_id},
            })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": trace, "displayTimeUnit": "ns",
           "otherData": {"name": name, "origin_ns": origin_ns}}
    path.write_text(json.dumps(doc))
    return path
