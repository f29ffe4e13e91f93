"""Who owns each dedicated matrix, as the traffic shows it, against the harness's expectation.

DMuon's owner of a matrix broadcasts it (forward, Z3 backward, HSDP replicate) and receives
its reduce: a per-owner bucket's call has the owner's group rank as root / src / dst. An
aligned group (one call per channel for a whole unit) has no root; there a member's part of
the forward call (an all_gather's count, an all_to_all's input total / n) is what the
matrices it holds add up to. The harness knows both from its own bucketing
(:func:`verify.traffic.predict.layout_buckets`), so where a missing predicted call and an
unexpected measured one differ only by their root, or by which member sends which part, the
difference names the matrices and the two ranks: ``owner of blocks.0.mlp.fc1.weight:
expected rank 1, traffic shows rank 2``.

A mismatch that changes sizes too (a bucket cut differently) is not an owner finding; the
``collectives`` check reports it. Group ids are the sorted world ranks
(:func:`tracer.events.group_id_from_ranks`), so a group rank maps to a world rank directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tracer.events import group_id_from_ranks
from verify.traffic.predict import DMuonBucket, Expected, RunLayout, layout_buckets, shard_ranks

#: Ops whose root is a DMuon bucket's owner (on gloo a reduce runs as a gather).
ROOTED_OPS = ("broadcast", "reduce", "gather")
#: Ops of an aligned group's forward call (all_to_all where the members' parts differ).
ALIGNED_OPS = ("all_gather", "all_to_all")


def _world(group_id: str, group_rank: int) -> int:
    return [int(r) for r in group_id.split(",")][group_rank]


def _axis_index(key: tuple, n: int):
    """The owner's index on the call's axis: ``g % n`` on the rank's shard group, else
    (the replicate group) ``g // n``."""
    rank, group_id = key[0], key[3]
    if group_id == group_id_from_ranks(shard_ranks(rank, n)):
        return lambda b: b.owner % n
    return lambda b: b.owner // n


def _part(key: tuple) -> int | None:
    """A member's own part of an aligned forward call: an all_gather's count, an all_to_all's
    input total over the group size (its part repeated to every member)."""
    _, _, op, group_id, count, _, _, in_elems, _ = key
    n = len(group_id.split(","))
    if op == "all_gather":
        return count
    return in_elems // n if in_elems is not None and in_elems % n == 0 else None


def _rooted(buckets: list[DMuonBucket], n: int, key: tuple, module: str | None) -> tuple[str, ...]:
    """Names of the per-owner bucket of ``module`` a predicted rooted call moves (count =
    numel, plus one usage element per param for a reduce), its root on the call's axis."""
    _, _, op, _, count, _, root, _, _ = key
    for b in buckets:
        if b.module != module or b.aligned:
            continue
        extra = 0 if op == "broadcast" else len(b.names)
        if b.numel + extra == count and _axis_index(key, n)(b) == root:
            return b.names
    return ()


def owner_findings(layout: RunLayout, predicted: Iterable[Expected], missing: Counter,
                   unexpected: Counter) -> list[dict]:
    """Owner mismatches a run's traffic shows (module docstring), one entry per matrix:
    ``{"param", "expected_rank", "traffic_rank", "phase", "op"}`` (world ranks), first
    finding per matrix, in the order found.

    ``missing`` / ``unexpected``: the comparison's multisets of call keys
    (:func:`verify.compare.event_key`); ``predicted``: the run's predicted calls (for the
    modules of missing keys and the parts of aligned calls).
    """
    view = layout.dmuon_view()  # None: not DMuon, or no single layout of its owners (TP)
    if view is None:
        return []
    n = view.shard_size
    buckets = layout_buckets(view)
    module_of = {e.key(): e.module for e in predicted}
    left = Counter(unexpected)
    found: dict[str, dict] = {}

    def note(names, expected: int, shown: int, phase: str, op: str) -> None:
        for name in names:
            found.setdefault(name, {"param": name, "expected_rank": expected, "traffic_rank": shown,
                                    "phase": phase, "op": op})

    for key in sorted(missing, key=str):
        rank, phase, op, group_id, count, dtype, root, _, _ = key
        if op not in ROOTED_OPS or root is None:
            continue
        for u in sorted(left, key=str):
            if left[u] and u[:6] == key[:6] and u[6] is not None and u[6] != root:
                names = _rooted(buckets, n, key, module_of.get(key))
                note(names, _world(group_id, root), _world(group_id, u[6]), phase, op)
                left[u] -= 1
                break
    _aligned(layout, predicted, missing, left, buckets, n, note)
    return list(found.values())


def _aligned(layout, predicted, missing, unexpected, buckets, n, note) -> None:
    """Aligned forward calls: a member whose measured part equals exactly one other member's
    predicted part shows that member's matrices (module docstring). Only where one unit's
    call is missing per (rank, group, dtype), so that the pairing is unambiguous."""
    signature = lambda k: (k[0], k[1], k[3], k[5])  # noqa: E731 - rank, phase, group, dtype
    miss = [k for k in missing if k[1] == "forward" and k[2] in ALIGNED_OPS]
    extra = [k for k in unexpected if unexpected[k] and k[1] == "forward" and k[2] in ALIGNED_OPS]
    per_sig = Counter(signature(k) for k in miss)
    module_of = {e.key(): e.module for e in predicted}
    for key in miss:
        if per_sig[signature(key)] != 1:
            continue
        shown = [u for u in extra if signature(u) == signature(key)]
        if len(shown) != 1:
            continue
        module, group_id = module_of.get(key), key[3]
        members = [int(r) for r in group_id.split(",")]
        parts = {}  # group rank -> predicted part of this unit's forward call
        for e in predicted:
            if e.module == module and e.phase == "forward" and e.group_id == group_id and e.op in ALIGNED_OPS:
                parts[members.index(e.rank)] = _part(e.key())
        measured = _part(shown[0])
        me = members.index(key[0])
        if measured is None or measured == parts.get(me):
            continue
        holders = [g for g, p in parts.items() if p == measured]
        if len(holders) != 1:
            continue
        g = holders[0]
        on_axis = _axis_index(key, n)
        names = [x for b in buckets if b.module == module and b.aligned and on_axis(b) == g for x in b.names]
        note(names, members[g], members[me], "forward", shown[0][2])
