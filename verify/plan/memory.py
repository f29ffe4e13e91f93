"""``dmuon-plan``'s memory per rank of each DMuon mode at scale (docs/scaling.md, "Memory per
rank"; the model: docs/verify.md, "Memory").

Per world rank, in bytes, every tensor in the plan's dtype (``--dtype``):

- ``params_held_bytes``: the dedicated params it holds (its owned matrices; hierarchical
  HSDP: those of its shard index), :func:`verify.traffic.memory.predict_memory`'s
  ``held_bytes``;
- ``window_bytes``: the non-held compute copies it holds at once in forward or backward:
  Z3's window (``prefetch_depth`` buckets ahead), Z2's and DMuon-DDP's every non-held copy
  (resident);
- ``grads_held_bytes`` / ``grads_in_flight_bytes``: DMuon's flat grad buffers of the held
  buckets, and the bound on non-held ones alive at once (two adjacent units);
- ``momentum_bytes``: Muon momentum of the matrices it owns (the owner only, param-shaped);
- ``adamw_rest_bytes``: ``exp_avg`` + ``exp_avg_sq`` of the params DMuon steps with AdamW
  (not dedicated, trainable), shaped like this rank's part of them: FSDP2's ``torch.chunk``
  of dim 0 over the shard axis (HSDP: N, 1-D: W; rank ``r·N + s`` has chunk ``s``), the whole
  param under DDP; the 0-d ``step`` counters (4 B a param) are left out;
- ``sum_bytes``: their total, all alive at once at worst.

Not counted: the non-dedicated params and grads themselves (FSDP2's or DDP's), activations,
a collective's staging buffers and the allocator's slack.
"""

from __future__ import annotations

import math
from collections import Counter

from tabulate import tabulate

from dmuon.ownership.plan import OwnershipPlan
from tracer.events import DTYPE_BYTES
from verify.traffic.memory import predict_memory
from verify.traffic.predict import RunLayout

#: (JSON key, table header) of each per-rank figure, in table order.
FIELDS: tuple[tuple[str, str], ...] = (
    ("params_held_bytes", "params held"),
    ("window_bytes", "window (Z3) / resident (Z2)"),
    ("grads_held_bytes", "grads held"),
    ("grads_in_flight_bytes", "grads in flight"),
    ("momentum_bytes", "Muon momentum"),
    ("adamw_rest_bytes", "rest AdamW"),
    ("sum_bytes", "sum"),
)


def adamw_rest_bytes(layout: RunLayout) -> list[int]:
    """Per world rank, bytes of AdamW's two states of ``layout``'s non-dedicated trainable
    params on that rank (module docstring). FSDP2's chunks: ``c = ceil(rows / n)`` rows on
    shards ``0 .. rows // c - 1``, the remainder on the next, none after (O(n + params))."""
    skip = set(layout.muon_names) | set(layout.frozen_names)
    n = layout.shard_size if layout.fsdp_modules else 1  # DDP, rest="replicate": whole params
    step = [0] * (n + 1)  # per-shard bytes as differences: shard s has sum(step[: s + 1])
    for p in layout.params:
        if p.name in skip:
            continue
        shape = tuple(p.shape) or (1,)
        rows, row_bytes = shape[0], math.prod(shape[1:]) * DTYPE_BYTES[p.dtype]
        if rows == 0 or row_bytes == 0:
            continue
        chunk = -(-rows // n)
        full, left = divmod(rows, chunk)
        step[0] += chunk * row_bytes
        step[full] += (left - chunk) * row_bytes
        step[full + 1 if full < n else n] -= left * row_bytes
    per_shard, total = [], 0
    for s in range(n):
        total += step[s]
        per_shard.append(2 * total)
    return [per_shard[rank % n] for rank in range(layout.world_size)]


def _rank_figures(layout: RunLayout, plan: OwnershipPlan, prefetch_depth: int):
    """Per world rank: ``(rank, figures)``, ``figures`` the values of :data:`FIELDS` then
    ``window_units`` (errors: :func:`rank_memory`'s)."""
    bounds = predict_memory(layout, prefetch_depth)
    if bounds is None or plan.world_size != layout.world_size:
        raise ValueError(f"Invalid rank_memory(mode={layout.mode!r}, plan of W={plan.world_size}). "
                         f"Must be a DMuon mode and the plan of its W={layout.world_size} ranks.")
    for b, momentum, rest in zip(bounds, plan.bytes_load, adamw_rest_bytes(layout)):
        parts = (b.held_bytes, b.window_bytes, b.grads_held_bytes,
                 b.grads_bytes - b.grads_held_bytes, momentum, rest)
        yield b.rank, (*parts, sum(parts), b.window_units)


def rank_memory(layout: RunLayout, plan: OwnershipPlan, prefetch_depth: int = 1) -> list[dict]:
    """Every world rank's figures of :data:`FIELDS` (bytes), ``window_units`` and ``rank``,
    for a DMuon ``layout`` and its ``plan`` (the owners of ``layout.muon_specs()`` on its
    mesh).

    Raises:
        ValueError: ``layout`` is not a DMuon mode, ``plan`` has another world size, or
            ``prefetch_depth`` is not an int >= 0 (``predict_memory``'s).
    """
    keys = [k for k, _ in FIELDS] + ["window_units"]
    return [{"rank": rank, **dict(zip(keys, figures))}
            for rank, figures in _rank_figures(layout, plan, prefetch_depth)]


def _median(counts: Counter) -> float:
    """The median of a multiset given as value -> count (the mean of the middle two when
    the count is even)."""
    total, seen, below = sum(counts.values()), 0, None
    for value in sorted(counts):
        seen += counts[value]
        if below is not None:  # the lower middle was the previous value
            return (below + value) / 2
        if 2 * seen > total:
            return value
        if 2 * seen == total:
            below = value
    return 0 if below is None else below


def memory_summary(layout: RunLayout, plan: OwnershipPlan, prefetch_depth: int = 1) -> dict:
    """The report's ``memory`` of one DMuon mode: ``{"prefetch_depth", "z3", "min",
    "median", "max", "busiest"}``; ``min`` / ``median`` / ``max`` map each key of
    :data:`FIELDS` to its statistic over the W ranks, each key on its own (``median``: the
    mean of the middle two when W is even); ``busiest`` is the rank with the largest
    ``sum_bytes`` (the lowest such rank) with :func:`rank_memory`'s figures. Ranks with the
    same figures are counted together (W = 2**20 stays fast). Errors: :func:`rank_memory`'s."""
    keys = [k for k, _ in FIELDS] + ["window_units"]
    counts: Counter = Counter()
    busiest = None
    for rank, figures in _rank_figures(layout, plan, prefetch_depth):
        counts[figures] += 1
        if busiest is None or figures[len(FIELDS) - 1] > busiest[1][len(FIELDS) - 1]:
            busiest = (rank, figures)
    stats: dict[str, dict] = {"min": {}, "median": {}, "max": {}}
    for i, (key, _) in enumerate(FIELDS):
        column: Counter = Counter()
        for figures, n in counts.items():
            column[figures[i]] += n
        stats["min"][key], stats["max"][key] = min(column), max(column)
        stats["median"][key] = _median(column)
    return {"prefetch_depth": prefetch_depth, "z3": layout.reshard_after_forward, **stats,
            "busiest": {"rank": busiest[0], **dict(zip(keys, busiest[1]))}}


def format_memory(rep: dict) -> str:
    """The table of :func:`memory_summary` of ``rep``'s DMuon modes (GiB), with what each
    column counts; ``""`` when ``rep`` has none."""
    modes = [m for m in rep["modes"] if m.get("memory")]
    if not modes:
        return ""
    body = []
    for m in modes:
        mem = m["memory"]
        big = mem["busiest"]
        for i, (stat, label) in enumerate((("min", "min"), ("median", "median"), ("max", "max"),
                                           ("busiest", f"busiest: rank {big['rank']}"))):
            body.append([m["mode"] if i == 0 else "", label,
                         *(f"{mem[stat][k] / 2**30:.2f}" for k, _ in FIELDS)])
    depth = modes[0]["memory"]["prefetch_depth"]
    return (
        f"Memory per rank, GiB (every tensor in the plan's dtype; verify.traffic.memory."
        f"predict_memory on this plan, prefetch_depth {depth}):\n"
        + tabulate(body, headers=["mode", "ranks", *(h for _, h in FIELDS)], tablefmt="github")
        + "\nparams held: dedicated params the rank holds (owned; hierarchical HSDP: its shard "
        "index's); window: non-held compute copies alive at once in forward/backward (Z3: the "
        "prefetch window, Z2 and DDP: all, resident); grads: DMuon's grad buffers of held "
        "buckets, and the bound on non-held ones in flight (two adjacent units); momentum: of "
        "the matrices it owns; rest AdamW: exp_avg + exp_avg_sq of its FSDP2 chunk (DDP: all) "
        "of the params AdamW steps; sum: all at once. Each column's min / median / max is over "
        "the ranks on its own; 'busiest' is the rank with the largest sum. Not counted: the "
        "rest's params and grads, activations, staging buffers. docs/scaling.md, 'Memory per "
        "rank'."
    )
