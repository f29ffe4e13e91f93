"""Per-rank wire traffic: what each rank sends and receives under the algorithm NCCL runs.

The W-average of docs/spec.md §2 (``verify.traffic.formulas``) says how much traffic a mode
moves in total; it cannot say which rank is busiest. This module charges every call to the
ranks that actually send and receive under NCCL's algorithms (nccl-tests
``doc/PERFORMANCE.md`` derives the same per-rank volumes for its bus-bandwidth factors;
docs/traffic-model.md, "Busiest rank"):

- all_reduce: ring (reduce-scatter then all-gather, 2(n-1) steps of S/n): every member sends
  and receives 2(n-1)/n·S.
- all_gather, reduce_scatter, all_to_all: ring / pairwise, every member sends and receives
  (n-1)·count = (n-1)/n·S.
- an uneven all_to_all (members' chunks of different sizes: DMuon's gloo aligned groups,
  docs/traffic-model.md "Aligned groups"; no single count): each member sends its input but
  its own chunk, ``in_elems - self_elems``, and receives its output but its own chunk,
  ``out_elems - self_elems``. No source records the own chunk: a measured all_to_all takes
  ``self_elems`` from the predicted call it matches by key, the way its dedicated share
  comes from the prediction. Its Muon-target part may differ by direction (a reduce's chunk
  for group rank i holds the usage elements of the params i owns), so ``share`` may give a
  ``(sent, received)`` pair of fractions.
- broadcast: a pipelined chain along the ring starting at the root, root -> root+1 -> … ->
  root-1 (group ranks mod n). The root sends S and receives nothing, the tail receives S and
  sends nothing, every other member receives and forwards S.
- reduce: the same chain run towards the root, root+1 -> … -> root-1 -> root: the head sends
  S, the root receives S, every other member receives and forwards S.
- gather / scatter: the root receives / sends (n-1)·count, every other member sends / receives
  count. send / recv: the message. barrier: nothing.

The ring order is taken as the group-rank order. On a real node NCCL's topology search picks
the ring (NCCL_DEBUG=INFO prints it as ``Channel 00/02 : 0 1 2 3``); the per-rank volumes of
all_reduce / all_gather / reduce_scatter do not depend on it, for broadcast and reduce only
*which* member is the chain's tail or head does. NCCL may pick its tree algorithm for large
all_reduces across nodes; this model is the ring's.

Summed over the members of one call, elements received equal n·f(n)·S, so the mean over all W
ranks of this model's received elements is exactly the W-average of ``verify.traffic.formulas`` (a test
asserts it); the busiest rank's figure is the maximum instead of the mean. For an uneven
all_to_all the W-average charges each member what it sends, and the sum of what the members
send is the sum of what they receive, so the mean stays the W-average.

Units: elements of the dedicated (Muon-target) params and bytes (elements × dtype size), per
rank per step. A fused call (a DDP bucket, an FSDP2 group) is charged its dedicated share from
the prediction, as in ``verify.compare``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from tracer.events import DTYPE_BYTES, CollectiveEvent

from verify.traffic.formulas import avg_elems

#: What ``wire_report()["algorithm"]`` says, per op: the model used for it.
ALGORITHMS: dict[str, str] = {
    "all_reduce": "ring",
    "all_gather": "ring",
    "reduce_scatter": "ring",
    "all_to_all": "pairwise",
    "broadcast": "pipelined chain from the root",
    "reduce": "pipelined chain to the root",
    "gather": "direct to the root",
    "scatter": "direct from the root",
    "send": "point-to-point",
    "recv": "point-to-point",
    "barrier": "no payload",
}


def member_wire_elems(op: str, count: int | None, group_size: int, group_rank: int,
                      root: int | None, *, in_elems: int | None = None,
                      out_elems: int | None = None,
                      self_elems: int | None = None) -> tuple[float, float]:
    """``(sent, received)`` elements of one member of one call (see the module docstring).

    Args:
        op: one of :data:`ALGORITHMS`.
        count: NCCL's per-rank count (``tracer.events``); ``None`` for an uneven all_to_all.
        group_size: n, members of the call's group.
        group_rank: this member's rank in the group, in [0, n).
        root: the root's group rank (broadcast, reduce, gather, scatter), else ignored.
        in_elems, out_elems, self_elems: an all_to_all's input and output totals and its own
            chunk; with all three, ``(in_elems - self_elems, out_elems - self_elems)``.

    Raises:
        ValueError: unknown op, a group rank outside [0, n), or a rooted op without a root.
    """
    n = group_size
    if op not in ALGORITHMS:
        raise ValueError(f"Invalid {op=}. Must be one of {sorted(ALGORITHMS)}.")
    if not 0 <= group_rank < max(n, 1):
        raise ValueError(f"Invalid {group_rank=} for group_size={n}. Must be in [0, {n}).")
    if op == "all_to_all" and None not in (in_elems, out_elems, self_elems):
        return float(in_elems - self_elems), float(out_elems - self_elems)
    if op == "send":
        return float(count), 0.0
    if op == "recv":
        return 0.0, float(count)
    if op == "barrier" or n <= 1:
        return 0.0, 0.0
    if op == "all_reduce":
        v = 2.0 * (n - 1) / n * count
        return v, v
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        v = float((n - 1) * count)
        return v, v
    if root is None or not 0 <= root < n:
        raise ValueError(f"Invalid {root=} for {op} over {n} ranks. Must be a group rank in [0, {n}).")
    pos = (group_rank - root) % n  # place along the ring, starting at the root
    s = float(count)
    if op == "broadcast":
        return (s if pos < n - 1 else 0.0), (s if pos > 0 else 0.0)
    if op == "reduce":
        return (s if pos > 0 else 0.0), (s if pos != 1 else 0.0)
    if op == "gather":
        return (0.0, (n - 1) * s) if pos == 0 else (s, 0.0)
    return ((n - 1) * s, 0.0) if pos == 0 else (0.0, s)  # scatter


Share = float | Sequence[float]  # one fraction, or (sent, received) fractions


def wire_report(events: Iterable[CollectiveEvent], *, world_size: int, steps: int,
                share: Callable[[CollectiveEvent], Share],
                self_elems: Callable[[CollectiveEvent], int | None] | None = None) -> dict:
    """Per-rank sent / received dedicated traffic per step, and the busiest rank.

    Args:
        events: every rank's measured events over ``steps`` steps (each rank's own copy).
        world_size: W; ranks without events count as zero.
        steps: measured steps (> 0).
        share: the dedicated fraction of an event's elements (0 for unmatched events), or a
            ``(sent, received)`` pair of fractions.
        self_elems: an all_to_all's own chunk (from its matched prediction; module
            docstring), or ``None``: then an all_to_all is charged by its count (even).

    Returns:
        ``{"algorithm", "per_rank", "busiest_rank", "max_recv_elems", "max_sent_elems",
        "max_recv_bytes", "max_sent_bytes", "mean_recv_elems"}``: ``per_rank`` lists, for
        ranks 0..W-1, ``{"rank", "sent_elems", "recv_elems", "sent_bytes", "recv_bytes"}``;
        the busiest rank receives the most (lowest rank on a tie); ``mean_recv_elems`` is the
        W-average (equal to docs/spec.md §2's figure).

    Raises:
        ValueError: ``steps`` < 1, ``world_size`` < 1, an event without rank, group size or
            group rank, a rank outside [0, W), or a dtype of unknown size.
    """
    if steps < 1 or world_size < 1:
        raise ValueError(f"Invalid {steps=}, {world_size=}. Must both be >= 1.")
    sums = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # rank -> sent, recv, sent B, recv B
    for ev in events:
        if ev.rank is None or ev.group_size is None or ev.group_rank is None:
            raise ValueError(f"Invalid event {ev.source_ref or ev}: rank, group_size and "
                             "group_rank are needed for the per-rank wire model.")
        if not 0 <= ev.rank < world_size:
            raise ValueError(f"Invalid event rank={ev.rank} ({ev.source_ref}). Must be in [0, {world_size}).")
        frac = share(ev)
        frac_sent, frac_recv = (frac, frac) if isinstance(frac, (int, float)) else frac
        own = self_elems(ev) if self_elems is not None and ev.op == "all_to_all" else None
        if not (frac_sent or frac_recv) or not (ev.count or own is not None):
            continue
        if ev.dtype not in DTYPE_BYTES:
            raise ValueError(f"Invalid event dtype={ev.dtype!r} ({ev.source_ref}). Must be one "
                             f"of {sorted(DTYPE_BYTES)} to count bytes.")
        sent, recv = member_wire_elems(ev.op, ev.count, ev.group_size, ev.group_rank, ev.root,
                                       in_elems=ev.in_elems, out_elems=ev.out_elems,
                                       self_elems=own)
        size = DTYPE_BYTES[ev.dtype]
        acc = sums[ev.rank]
        acc[0] += frac_sent * sent
        acc[1] += frac_recv * recv
        acc[2] += frac_sent * sent * size
        acc[3] += frac_recv * recv * size
    per_rank = []
    for r in range(world_size):
        s, rc, sb, rb = (v / steps for v in sums[r])
        per_rank.append({"rank": r, "sent_elems": s, "recv_elems": rc, "sent_bytes": sb,
                         "recv_bytes": rb})
    busiest = max(per_rank, key=lambda e: (e["recv_elems"], -e["rank"]))
    return {
        "algorithm": dict(ALGORITHMS),
        "per_rank": per_rank,
        "busiest_rank": busiest["rank"],
        "max_recv_elems": busiest["recv_elems"],
        "max_sent_elems": max(e["sent_elems"] for e in per_rank),
        "max_recv_bytes": max(e["recv_bytes"] for e in per_rank),
        "max_sent_bytes": max(e["sent_bytes"] for e in per_rank),
        "mean_recv_elems": sum(e["recv_elems"] for e in per_rank) / world_size,
    }



def avg_bytes_by_phase(calls: Iterable[Sequence], *,
                       world_size: int, steps: int) -> dict[str, dict[str, float]]:
    """W-average dedicated bytes per rank per step, by phase and dtype.

    Args:
        calls: ``(phase, op, count, group_size, dtype, share)`` per call and member (a measured
            event or a predicted call), ``share`` its dedicated fraction; a 7th item, where
            given and not ``None``, is the call's f(n)·S in elements when ``(op, count,
            group_size)`` cannot give it (an uneven all_to_all: the elements it sends).
        world_size, steps: W and the number of steps the calls cover.

    Returns:
        ``{phase: {dtype: bytes}}`` plus ``"total"``: the sum of f(n)·S·share·dtype size over
        the calls, divided by W·steps (``verify.traffic.formulas``'s accounting, in bytes). Phases
        without dedicated traffic are left out; ``None`` phases are named ``"untagged"``.

    Raises:
        ValueError: a dtype of unknown size carries dedicated traffic.
    """
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for phase, op, count, group_size, dtype, frac, *given in calls:
        elems = given[0] if given and given[0] is not None else None
        if not frac or not (count or elems):
            continue
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"Invalid dtype={dtype!r} of a {op} in phase {phase!r}. Must be "
                             f"one of {sorted(DTYPE_BYTES)} to count bytes.")
        if elems is None:
            elems = avg_elems(op, count, group_size)
        b = elems * frac * DTYPE_BYTES[dtype] / (world_size * steps)
        out[phase or "untagged"][dtype] += b
        out["total"][dtype] += b
    return {ph: dict(d) for ph, d in out.items()}


def dedicated_traffic(layout, events: list[CollectiveEvent], steps: int) -> dict:
    """The report's ``wire`` and ``bytes`` entries of one run.

    Args:
        layout: the run's :class:`verify.traffic.predict.RunLayout`.
        events: every rank's interposer events over ``steps`` measured steps.
        steps: measured steps (> 0).

    Returns:
        ``{"wire": wire_report(...), "bytes": {"measured_avg_bytes": {phase: {dtype: B}},
        "predicted_avg_bytes": {...}}}``; the dedicated share of each call, and an
        all_to_all's own chunk, come from the prediction
        (``layout.predict_calls()``: ``verify.traffic.predict.predict_step``,
        ``verify.traffic.tp.predict_tp_step`` for a TP layout), unmatched events count as 0.
    """
    from verify.compare import event_key, measured_avg_elems

    predicted = layout.predict_calls()  # its kind's prediction (TP layouts too)
    by_key = {e.key(): e for e in predicted}

    def share_of(ev: CollectiveEvent) -> float:
        e = by_key.get(event_key(ev))
        return 0.0 if e is None else e.dedicated_share()

    def wire_share_of(ev: CollectiveEvent) -> Share:
        e = by_key.get(event_key(ev))
        if e is None:
            return 0.0
        if not e.uneven:
            return e.dedicated_share()
        sent, recv = e.in_elems - e.self_elems, e.out_elems - e.self_elems
        return ((e.dedicated_in_elems - e.dedicated_count) / sent if sent else 0.0,
                (e.dedicated_out_elems - e.dedicated_count) / recv if recv else 0.0)

    def self_of(ev: CollectiveEvent) -> int | None:
        e = by_key.get(event_key(ev))
        return None if e is None else e.self_elems

    w = layout.world_size
    measured = avg_bytes_by_phase(
        ((ev.phase, ev.op, ev.count, ev.group_size or 1, ev.dtype, share_of(ev),
          measured_avg_elems(ev, self_of(ev))) for ev in events),
        world_size=w, steps=steps)
    expected = avg_bytes_by_phase(
        ((e.phase, e.op, e.count, e.group_size, e.dtype, e.dedicated_share(), e.avg_elems())
         for e in predicted),
        world_size=w, steps=1)
    return {
        "wire": wire_report(events, world_size=w, steps=steps, share=wire_share_of,
                            self_elems=self_of),
        "bytes": {"measured_avg_bytes": measured, "predicted_avg_bytes": expected},
    }
