"""What verify-traffic and ``verify.run.record`` add to a compared run (one place for both).

- :func:`add_figures`: the busiest rank and bytes (``verify.traffic.wire``), step time and exposed
  communication (``verify.measure.steptime``), and ``max_rank_elems`` = the busiest rank's received
  dedicated elements per step.
- :func:`interposer_source`: report.json's ``sources["interposer"]`` entry from the
  comparison's missing / unexpected lists.
- :func:`params_report`: report.json's ``params``: every param of the model, to Muon or to
  AdamW, with its elements and the reason (``dmuon.ownership.select``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tracer.events import CollectiveEvent

from verify.traffic.predict import RunLayout
from verify.measure.steptime import StepTime, timing_report
from verify.traffic.wire import dedicated_traffic

#: How many missing / unexpected entries ``interposer_source`` lists of each kind.
MAX_SOURCE_MISMATCHES = 10


def add_figures(run: dict, layout: RunLayout, events: Sequence[CollectiveEvent], steps: int,
                step_times: list[list[StepTime]], device: str) -> dict:
    """Add ``wire``, ``bytes``, ``timing`` and the busiest ``max_rank_elems`` to ``run`` (the
    dict of ``verify.compare.compare_run``) and return it.

    Args:
        events: every rank's interposer events over ``steps`` measured steps.
        step_times: per rank, its measured steps (``verify.measure.steptime.StepTime``).
        device: ``"cpu"`` or ``"cuda"``.
    """
    run.update(dedicated_traffic(layout, list(events), steps))
    run["max_rank_elems"] = run["wire"]["max_recv_elems"]
    run["timing"] = timing_report(step_times, device)
    return run


def params_report(assignments: Sequence) -> dict:
    """report.json ``params`` from ``dmuon.ownership.select.Assignment`` rows (``DedicatedParams.
    assignments()`` or ``dmuon.ownership.select.assign_params``): the Muon params (with Muon's matrix
    shape) and the AdamW params, each with its elements and reason, and the two totals."""
    out: dict = {"muon_elems": 0, "adamw_elems": 0, "muon": [], "adamw": []}
    for a in assignments:
        entry = {"name": a.name, "shape": list(a.shape), "numel": int(a.numel), "reason": a.reason}
        if a.matrix is not None:
            entry["matrix"] = list(a.matrix)
        out[a.optimizer].append(entry)
        out[f"{a.optimizer}_elems"] += int(a.numel)
    return out


def interposer_source(run: dict, n_events: int) -> dict:
    """``sources["interposer"]``: the interposer's events against the prediction."""
    unexpected = sum(u["n"] for u in run["unexpected"])
    missing = sum(m["n"] for m in run["missing"])
    return {
        "events": n_events,
        "matched": n_events - unexpected,
        "unmatched": unexpected + missing,
        "pass": unexpected == 0 and missing == 0,
        "mismatches": [f"missing {m}" for m in run["missing"][:MAX_SOURCE_MISMATCHES]]
        + [f"unexpected {u}" for u in run["unexpected"][:MAX_SOURCE_MISMATCHES]],
    }
