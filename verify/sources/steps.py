"""Every step a trace source recorded, not only the compared window: each must be complete.

The source checks (:func:`tracer.crosscheck.crosscheck`) pair a source's calls one to one with
the interposer's over the measured window, so a call the source lost inside the window fails.
A source that records more than the window holds more steps: the Flight Recorder keeps the
whole process lifetime in its ring buffer, so a run's dump also holds the mode's warm-up
steps. A call it lost there was counted nowhere (``fr_window`` drops everything before the
window, and ``crosscheck``'s ``"tail"`` / seq alignments count it in ``outside_window``). This
module checks each of those steps against the prediction.

Steps. The runner marks the start of every step of a mode, and the end of its last, on the
host's system clock (``time.time_ns()``, ns since the Unix epoch: the clock the Flight
Recorder's ``time_created_ns`` reads, ``tracer.fr.parse``); a source event belongs to step
``s`` when ``marks[s] <= t_start_ns < marks[s + 1]`` (:func:`split_steps`). Calls before the
first mark (building the mode: DDP's broadcast of the params, process-group setup) belong to
no step and are not checked: the prediction is per step.

Completeness (:func:`step_completeness`). Per step and rank, the predicted calls of one step
(``layout.predict_calls()``) as the source records them (its
:class:`tracer.crosscheck.SourceProfile`: gloo's Flight Recorder writes a reduce_scatter as an
all_reduce of ``group_size * count``; ops it never records are not asked for), as a multiset
keyed by ``(rank, group_id, op, count, dtype, in_elems, out_elems)``, must all be in the step.
Each predicted call the step lacks is named: source, step, rank, op, group, size, and how many
of how many were recorded. Calls a layout lists per window (``window_calls``: EP's token
all_to_all, whose sizes come from routing the harness records in the window only) are asked
for per step by ``(rank, group_id, op)`` count, of any size, together with the step's own
calls of that op. A step may hold *more* than the prediction
outside the window (one-time calls: DDP rebuilds its buckets after the first backward and
broadcasts the new order in the next forward); extra calls in the window fail the window's
one-to-one check.

Explicit rules for steps a source legitimately lacks, reported in ``steps_not_recorded`` with
the reason, never silently:

- a source that by design records only the window (torch.profiler and the NCCL log: started
  and stopped with the window; the interposer too) has no other step; the runner does not ask;
- steps the Flight Recorder's ring buffer no longer holds: it keeps the last
  ``TORCH_FR_BUFFER_SIZE`` entries (:data:`tracer.fr.dump.DEFAULT_BUFFER_ENTRIES` under
  ``make verify-traffic``) and numbers them from ``record_id`` 0, so a dump whose oldest entry
  is not number 0 has overwritten older ones, and every step that began before its oldest kept
  entry may be partial (:func:`evicted_steps`).

The steps are read up to the window's end. The runner also finds the window's start from the
Flight Recorder's own seq (``fr_window``, as the window check does); an event that the seq and
the marks put on different sides of it fails the source, so a step boundary on a clock that
jumped cannot hide a loss. Step P after the window and the checkpoint round trip
(``verify.measure.numerics``, ``verify.measure.resume``) are not read from a trace source; their
values are compared bit for bit.

Step 0 is compared like every other step, but for DDP's gradient all_reduces: DDP cuts its
first step's buckets in parameter order and rebuilds them in the order the grads were ready
after the first backward, so in step 0 those are asked for as their total elements per
``(rank, group, op, dtype)`` (:func:`ddp_bucket`), whatever the cut. Measured on the default run
(TinyGPT, W = 4, gloo): every warm-up step of every mode holds the whole prediction, step 0
included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from tracer.crosscheck import SourceProfile
from tracer.events import CollectiveEvent, all_to_all_elems

#: Modes whose model DDP wraps (its gradient buckets: :func:`ddp_bucket`).
DDP_MODES = ("ddp-muon", "zero1-muon", "dmuon-ddp")


def ddp_bucket(layout, e) -> bool:
    """``e`` (a predicted call) is one of DDP's gradient-bucket all_reduces: a backward
    all_reduce of no module in a mode DDP wraps (not DMuon's replicated rest)."""
    return (getattr(layout, "mode", None) in DDP_MODES and getattr(layout, "dmuon_rest", None) != "replicate"
            and e.phase == "backward" and e.op == "all_reduce" and e.module is None)


def split_steps(events: Sequence[CollectiveEvent], marks_ns: Sequence[int]
                ) -> tuple[dict[int, list[CollectiveEvent]], list[CollectiveEvent]]:
    """``events`` by step: ``({step: events}, outside)``, step ``s`` holding those with
    ``marks_ns[s] <= t_start_ns < marks_ns[s + 1]`` (every step present, maybe empty);
    ``outside``: before the first mark, at or after the last, or without a time.

    Args:
        events: one source's events (``t_start_ns`` on the marks' clock, ns).
        marks_ns: each step's start and the last step's end, non-decreasing, >= 2 marks.

    Raises:
        ValueError: fewer than 2 marks, or marks that decrease.
    """
    if len(marks_ns) < 2 or any(b < a for a, b in zip(marks_ns, marks_ns[1:])):
        raise ValueError(f"Invalid marks_ns={list(marks_ns)!r}. Must be >= 2 non-decreasing "
                         "times (each step's start, then the last step's end).")
    steps: dict[int, list[CollectiveEvent]] = {s: [] for s in range(len(marks_ns) - 1)}
    outside = []
    for ev in events:
        t = ev.t_start_ns
        if t is None or t < marks_ns[0] or t >= marks_ns[-1]:
            outside.append(ev)
            continue
        s = next(i for i in range(len(marks_ns) - 1) if t < marks_ns[i + 1])
        steps[s].append(ev)
    return steps, outside


def evicted_steps(marks_ns: Sequence[int], oldest_kept_ns: int | None, wrapped: bool) -> list[int]:
    """Steps a ring buffer that ``wrapped`` (held as many entries as its size) may have lost in
    part: those that began before its oldest kept entry (``oldest_kept_ns``; ``None``: it kept
    nothing, so every step)."""
    if not wrapped:
        return []
    return [s for s in range(len(marks_ns) - 1)
            if oldest_kept_ns is None or marks_ns[s] <= oldest_kept_ns]


def _recorded_key(rank: int, group_id: str | None, op: str, count: int | None, dtype: str | None,
                  group_size: int | None, in_elems: int | None, out_elems: int | None) -> tuple:
    if op == "barrier":
        return (rank, group_id, op, None, None, None, None)
    return (rank, group_id, op, count, dtype, *all_to_all_elems(op, count, group_size, in_elems, out_elems))


def _as_recorded(e, profile: SourceProfile) -> tuple | None:
    """A predicted call's key as ``profile``'s source records it (``None``: never recorded)."""
    if e.op in profile.unobserved_ops:
        return None
    eq = profile.equivalence_for(e.op)
    if eq is None:
        return _recorded_key(e.rank, e.group_id, e.op, e.count, e.dtype, e.group_size,
                             e.in_elems, e.out_elems)
    scale = e.group_size if eq.count_scale == "group_size" else 1
    return _recorded_key(e.rank, e.group_id, eq.other_op, None if e.count is None else e.count * scale,
                         e.dtype, e.group_size, None, None)


def _event_key(ev: CollectiveEvent) -> tuple:
    return _recorded_key(ev.rank, ev.group_id, ev.op, ev.count, ev.dtype, ev.group_size,
                         ev.in_elems, ev.out_elems)


def _size_text(key: tuple) -> str:
    _, _, op, count, dtype, in_elems, out_elems = key
    if op == "barrier":
        return ""
    size = f"in_elems={in_elems} out_elems={out_elems}" if in_elems is not None else f"count={count}"
    return f" {size} {dtype}"


def step_completeness(
    layout,
    steps: Mapping[int, Sequence[CollectiveEvent]],
    *,
    source: str,
    profile: SourceProfile,
    window_steps: int,
    not_recorded: Mapping[int, str] | None = None,
) -> dict:
    """Check every step ``source`` recorded against one step's prediction (module docstring).

    Args:
        layout: the run's layout (``predict_calls()``, ``window_calls(steps)``).
        steps: ``{step: that step's events of every rank}`` (:func:`split_steps`).
        source: the source's name, for the messages.
        profile: how the source records calls (:func:`tracer.crosscheck.profile_for`).
        window_steps: the steps ``layout.window_calls`` covers (the measured steps).
        not_recorded: ``{step: reason}`` of steps the source legitimately lacks (not checked).

    Returns:
        ``{"steps_checked": [step, ...], "steps_not_recorded": {"<step>": reason},
        "incomplete": [{"step", "rank", "op", "group_id", "count", "dtype", "in_elems",
        "out_elems", "predicted", "recorded", "missing", "unit"}], "lines": [text, ...],
        "pass"}``: ``predicted`` / ``recorded`` / ``missing`` count calls of that key on that
        rank in that step (``unit`` ``"calls"``; per-window calls: ``"calls of any size"``, by
        ``(rank, group, op)`` with the step's own calls of that op; step 0's DDP buckets:
        ``"elements"``, their total, ``count`` then the total); ``lines`` name each (``"step 2 rank 1: 1 of 4 x all_gather count=4096 float32
        group 0,1,2,3 missing in flight_recorder"``).

    Raises:
        ValueError: ``window_steps`` < 1.
    """
    if window_steps < 1:
        raise ValueError(f"Invalid {window_steps=}. Must be >= 1 (the measured steps).")
    not_recorded = dict(not_recorded or {})
    predicted = layout.predict_calls()
    want = Counter(k for k in (_as_recorded(e, profile) for e in predicted) if k is not None)
    issued = {_as_recorded(e, profile): e for e in predicted
              if profile.equivalence_for(e.op) is not None}  # recorded as another op
    buckets = Counter(k for e in predicted if ddp_bucket(layout, e)
                      for k in [_as_recorded(e, profile)] if k is not None)
    bucket_total = Counter()  # step 0: DDP's bucket elements per (rank, group, op, dtype)
    for k, n in buckets.items():
        bucket_total[(*k[:3], k[4])] += n * k[3]
    per_window = Counter(k[:3] for k in (_as_recorded(e, profile) for e in layout.window_calls(window_steps))
                         if k is not None)
    want_ops = {}  # per step by (rank, group, op): the window's share plus the step's own of that op
    for k, n in per_window.items():
        if n >= window_steps:
            want_ops[k] = n // window_steps + sum(m for w, m in want.items() if w[:3] == k)
    checked, incomplete, lines = [], [], []
    for step in sorted(steps):
        if step in not_recorded:
            continue
        checked.append(step)
        got = Counter(_event_key(ev) for ev in steps[step])
        got_ops = Counter()
        for k, n in got.items():
            got_ops[k[:3]] += n
        exact = want - buckets if step == 0 else want
        gaps = [(k, n, got[k]) for k, n in exact.items() if got[k] < n]
        if step == 0 and bucket_total:  # DDP's first buckets: their total elements
            got_total = Counter()
            for k, n in got.items():
                if (*k[:3], k[4]) in bucket_total:
                    got_total[(*k[:3], k[4])] += n * (k[3] or 0)
            gaps += [((*k[:3], t, k[3], None, None), t, got_total[k], "elements")
                     for k, t in bucket_total.items() if got_total[k] < t]
        gaps += [((*k, None, None, None, None), n, got_ops[k], "calls of any size")
                 for k, n in want_ops.items() if got_ops[k] < n]
        for key, n, have, *unit in sorted(gaps, key=lambda g: (g[0][0], str(g[0]))):
            rank, group_id, op, count, dtype, in_elems, out_elems = key
            incomplete.append(dict(step=step, rank=rank, op=op, group_id=group_id, count=count,
                                   dtype=dtype, in_elems=in_elems, out_elems=out_elems,
                                   predicted=n, recorded=have, missing=n - have,
                                   unit=unit[0] if unit else "calls"))
            if unit == ["calls of any size"]:  # per-window calls (EP's tokens), by count
                lines.append(f"step {step} rank {rank}: {n - have} of {n} x {op} (any size) "
                             f"group {group_id} missing in {source}")
            elif unit:  # step 0's DDP buckets, by their total elements
                lines.append(f"step {step} rank {rank}: {n - have} of {n} elements of DDP's "
                             f"bucket {op}s ({dtype}) group {group_id} missing in {source}")
            else:
                e = issued.get(key)
                lines.append(f"step {step} rank {rank}: {n - have} of {n} x {op}{_size_text(key)} "
                             f"group {group_id} missing in {source}"
                             + (f" (a {e.op} count={e.count}, as {source} records it)" if e else ""))
    return {"steps_checked": checked,
            "steps_not_recorded": {str(s): why for s, why in sorted(not_recorded.items())},
            "incomplete": incomplete, "lines": lines, "pass": not incomplete}
