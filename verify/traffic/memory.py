"""The memory bound of a DMuon run, predicted from the plan (docs/verify.md, "Memory";
docs/traffic-model.md, "Z3 memory bound" and "Grad buffers").

Written from the documented model, independently of the runtime (``dmuon/runtime``'s own
figure, ``dm.coalescing()["z3_peak_bytes"]``, is what this one is checked against in
``tests/verify/test_memory_model.py``, not where it comes from). The buckets are the
harness's (:func:`verify.traffic.predict.layout_buckets`, in DMuon's index order), so every
byte below is a sum over them. Per rank, in bytes:

- **held**: the buckets this rank holds (1-D and flat HSDP: it owns them; hierarchical HSDP:
  its shard index is the owner's, ``rank % N == g % N``), in the params' own dtype, plus their
  ``param_dtype`` compute copy where mixed precision casts.
- **window** (non-held compute copies, in ``param_dtype`` where set): Z2 keeps every one
  (resident); Z3 holds at most, over every unit ``[lo, hi]`` (bucket indices), its buckets
  with the next ``d = prefetch_depth`` (forward) or the ``d`` before them (backward), each end
  widened to its whole aligned group (one call fills every member)::

      Z3 window = max over units [lo, hi] of max(B[lo, last(hi + d)], B[first(lo - d), hi])

  where ``B[i, j]`` sums the non-held bytes of buckets ``i..j``. The kept last unit is inside
  its own windows.
- **grads**: every rank accumulates a bucket's grads in one flat buffer of
  ``numel + len(params)`` elements (the grads, then one usage element per param) in the
  compute dtype; a holder keeps its buckets'; a non-holder frees a unit's once its reduce is
  waited, which happens when the next unit's reduces are issued, so it holds at most two
  adjacent units' buffers (the one accumulating and the one whose reduce flies).

The gate (``verify.report.checks``, check ``memory``) compares each rank's measured peak
dedicated bytes in forward and in backward with ``held + window`` and its peak grad bytes
with ``held grads + two units``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tracer.events import DTYPE_BYTES
from verify.traffic.predict import DMuonBucket, RunLayout, dmuon_layout, layout_buckets


@dataclass(frozen=True)
class MemoryBound:
    """One rank's predicted bytes (module docstring).

    Attributes:
        rank: world rank.
        held_bytes: the buckets it holds (master copy, plus the compute copy under mixed
            precision).
        non_held_bytes: the compute copies of every bucket it does not hold (Z2's resident
            figure).
        window_bytes: non-held compute copies held at once: Z3's window, Z2's
            ``non_held_bytes``.
        window_units: the units of the widest window (for the failure's cause).
        peak_bytes: ``held_bytes + window_bytes``: the bound on forward and backward.
        between_bytes: after a step (optimizer step done): ``held_bytes`` under Z3, the peak
            under Z2.
        grads_held_bytes: grad buffers of held buckets.
        grads_bytes: bound on the grad buffers: ``grads_held_bytes`` plus the two adjacent
            units with the most non-held grad-buffer bytes.
    """

    rank: int
    held_bytes: int
    non_held_bytes: int
    window_bytes: int
    window_units: int
    peak_bytes: int
    between_bytes: int
    grads_held_bytes: int
    grads_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def is_holder(bucket: DMuonBucket, rank: int, shard_size: int) -> bool:
    """Whether world ``rank`` holds ``bucket`` on a mesh of shard size ``shard_size`` (the
    layout DMuon's calls are predicted on: :func:`verify.traffic.predict.dmuon_layout`)."""
    return rank % shard_size == bucket.owner % shard_size


def _units(buckets: Sequence[DMuonBucket]) -> list[tuple[int, int]]:
    """``[(lo, hi)]``: each unit's bucket index range (a unit's buckets are consecutive)."""
    out: list[tuple[int, int]] = []
    for i, b in enumerate(buckets):
        if out and buckets[out[-1][0]].module == b.module:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _group_ends(buckets: Sequence[DMuonBucket]) -> tuple[list[int], list[int]]:
    """``(first, last)``: per bucket, the lowest and highest index of its aligned group
    (itself where it is not aligned)."""
    members: dict[tuple[str, str], list[int]] = {}
    for i, b in enumerate(buckets):
        if b.aligned:
            members.setdefault((b.module, b.dtype), []).append(i)
    first, last = list(range(len(buckets))), list(range(len(buckets)))
    for idx in members.values():
        for i in idx:
            first[i], last[i] = min(idx), max(idx)
    return first, last


def z3_window(sizes: Sequence[int], buckets: Sequence[DMuonBucket], depth: int) -> tuple[int, int]:
    """``(bytes, units)``: the Z3 window (module docstring) over ``sizes`` (non-held bytes
    per bucket, 0 where held), and how many units the widest window spans.

    Raises:
        ValueError: ``depth`` < 0, or ``sizes`` and ``buckets`` differ in length.
    """
    if depth < 0 or len(sizes) != len(buckets):
        raise ValueError(f"Invalid z3_window(depth={depth}, {len(sizes)} sizes, {len(buckets)} "
                         "buckets). Must be depth >= 0 (prefetch_depth) and one size per bucket.")
    n = len(buckets)
    first, last = _group_ends(buckets)
    unit_of = [k for k, (lo, hi) in enumerate(_units(buckets)) for _ in range(lo, hi + 1)]
    best, span = 0, 0
    for lo, hi in _units(buckets):
        for a, b in ((lo, last[min(hi + depth, n - 1)]), (first[max(lo - depth, 0)], hi)):
            held = sum(sizes[a : b + 1])
            if held > best:
                best, span = held, unit_of[b] - unit_of[a] + 1
    return best, span


def predict_memory(layout: RunLayout, prefetch_depth: int = 1) -> list[MemoryBound] | None:
    """Every rank's :class:`MemoryBound` of a DMuon ``layout`` (``None`` for a mode without
    DMuon). ``prefetch_depth``: ``dedicate_params``' (DMuon's default 1).

    Raises:
        ValueError: ``prefetch_depth`` is not an int >= 0.
    """
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise ValueError(f"Invalid prefetch_depth={prefetch_depth!r}. Must be an int >= 0 "
                         "(dedicate_params' prefetch_depth).")
    if not layout.is_dmuon:
        return None
    moved = dmuon_layout(layout)
    buckets = layout_buckets(moved)
    z3 = layout.reshard_after_forward
    out = []
    for rank in range(layout.world_size):
        held_bytes = grads_held = 0
        sizes, grad_sizes = [], []
        for b in buckets:
            lp = DTYPE_BYTES[layout.mp_param_dtype or b.dtype]
            grad = (b.numel + len(b.names)) * lp
            if is_holder(b, rank, moved.shard_size):
                held_bytes += b.numel * DTYPE_BYTES[b.dtype]
                held_bytes += b.numel * lp if layout.mp_param_dtype not in (None, b.dtype) else 0
                grads_held += grad
                sizes.append(0)
                grad_sizes.append(0)
            else:
                sizes.append(b.numel * lp)
                grad_sizes.append(grad)
        non_held = sum(sizes)
        if z3:
            window, units = z3_window(sizes, buckets, prefetch_depth)
        else:
            window, units = non_held, len(_units(buckets))
        per_unit = [sum(grad_sizes[lo : hi + 1]) for lo, hi in _units(buckets)]
        two = max((a + b for a, b in zip(per_unit, per_unit[1:])), default=sum(per_unit))
        out.append(MemoryBound(rank=rank, held_bytes=held_bytes, non_held_bytes=non_held,
                               window_bytes=window, window_units=units,
                               peak_bytes=held_bytes + window,
                               between_bytes=held_bytes if z3 else held_bytes + non_held,
                               grads_held_bytes=grads_held, grads_bytes=grads_held + two))
    return out


def memory_report(layout: RunLayout, measured: Sequence[dict]) -> dict:
    """report.json ``runs[].memory`` of a DMuon run: per rank the measured peaks
    (``verify.run.memory_meter.MemoryMeter.result``, one dict per rank) beside the predicted
    bound (:func:`predict_memory` at the measured run's ``prefetch_depth``), and each rank's
    last-step trace (``[phase, dedicated_bytes, grads_bytes]`` per hook).

    Returns ``{"z3", "prefetch_depth", "ranks": [{"rank", "measured": {"between", "forward",
    "backward", "grads"}, "bound": MemoryBound.to_dict(), "cuda_max_allocated_bytes"}],
    "trace": [[...] per rank]}``; every figure in bytes.

    Raises:
        ValueError: ``measured`` does not have one entry per rank of ``layout``, or the ranks
            ran different ``prefetch_depth``.
    """
    depths = {m["prefetch_depth"] for m in measured}
    if len(measured) != layout.world_size or len(depths) != 1:
        raise ValueError(f"Invalid memory figures: {len(measured)} ranks with prefetch_depth "
                         f"{sorted(depths)}. Must be one entry per rank of W={layout.world_size}, "
                         "all with the same prefetch_depth.")
    depth = depths.pop()
    bounds = predict_memory(layout, depth)
    ranks = []
    for bound, m in zip(bounds, measured):
        ranks.append({"rank": bound.rank,
                      "measured": {**m["peak_bytes"], "grads": m["peak_grads_bytes"]},
                      "bound": bound.to_dict(),
                      "cuda_max_allocated_bytes": m["cuda_max_allocated_bytes"]})
    return {"z3": layout.reshard_after_forward, "prefetch_depth": depth, "ranks": ranks,
            "trace": [[s[:3] for s in m["trace"]] for m in measured]}
