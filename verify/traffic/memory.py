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
  adjacent units' buffers (the one accumulating and the one whose reduce flies). Under mixed
  precision an owner also holds its params' averaged grads in their own dtype from the end of
  backward to the step (cast out of the buffer): counted for every held bucket, an upper
  bound where a holder is not the owner (hierarchical HSDP).

The gate (``verify.report.checks``, check ``memory``) compares each rank's measured peak
dedicated bytes in forward and in backward with ``held + window`` and its peak grad bytes
with ``held grads + two units``, and from below: where the plan makes a figure exact (Z2:
every copy resident in forward, backward and between steps; Z3 between steps: the held
buckets) the measured one must equal it, and elsewhere reach the least the protocol needs
(Z3: the held buckets plus the largest unit, whole while it runs; grads: the held buffers or
the largest bucket's; under mixed precision the owner's cast grads). So a rank that frees what it should keep fails, and so does a meter
that reads 0 where bytes are held.
"""

from __future__ import annotations

import dataclasses
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
            units with the most non-held grad-buffer bytes (plus, under mixed precision, the
            held buckets' grads in the params' dtype).
        floor_peak_bytes: what forward and backward hold at least: ``peak_bytes`` under Z2
            (every copy resident: exact), under Z3 ``held_bytes`` plus the unit with the most
            non-held bytes (a unit is whole while it runs).
        floor_grads_bytes: what the grad buffers hold at least: ``grads_held_bytes``, or the
            largest bucket's buffer (every rank accumulates it, one allocation) where that is
            more; under mixed precision, where a buffer is reachable through no ``.grad``
            once its reduce is issued, the owner's cast grads (0 on a holder that is not the
            owner: hierarchical HSDP).
        between_exact: ``between_bytes`` is exact (what a rank holds after a step: Z2 every
            copy, Z3 its held buckets), not a bound; ``False`` under mixed precision (the
            compute copies' lifetime is the wrapper's).
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
    floor_peak_bytes: int = 0
    floor_grads_bytes: int = 0
    between_exact: bool = False

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


def _windows(buckets: Sequence[DMuonBucket], depth: int) -> list[tuple[int, int]]:
    """``[(a, b)]``: every Z3 window as a bucket index range, per unit ``[lo, hi]`` its
    forward reach ``[lo, last(hi + d)]`` then its backward reach ``[first(lo - d), hi]``
    (module docstring); the same for every rank."""
    n = len(buckets)
    first, last = _group_ends(buckets)
    return [w for lo, hi in _units(buckets)
            for w in ((lo, last[min(hi + depth, n - 1)]), (first[max(lo - depth, 0)], hi))]


def _widest(sums: Sequence[int], windows: Sequence[tuple[int, int]],
            unit_of: Sequence[int]) -> tuple[int, int]:
    """``(bytes, units)`` of the first window with the most bytes (``sums``, one per window)."""
    best, span = 0, 0
    for held, (a, b) in zip(sums, windows):
        if held > best:
            best, span = held, unit_of[b] - unit_of[a] + 1
    return best, span


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def z3_window(sizes: Sequence[int], buckets: Sequence[DMuonBucket], depth: int) -> tuple[int, int]:
    """``(bytes, units)``: the Z3 window (module docstring) over ``sizes`` (non-held bytes
    per bucket, 0 where held), and how many units the widest window spans.

    Raises:
        ValueError: ``depth`` < 0, or ``sizes`` and ``buckets`` differ in length.
    """
    if depth < 0 or len(sizes) != len(buckets):
        raise ValueError(f"Invalid z3_window(depth={depth}, {len(sizes)} sizes, {len(buckets)} "
                         "buckets). Must be depth >= 0 (prefetch_depth) and one size per bucket.")
    windows = _windows(buckets, depth)
    total = _prefix(sizes)
    unit_of = [k for k, (lo, hi) in enumerate(_units(buckets)) for _ in range(lo, hi + 1)]
    return _widest([total[b + 1] - total[a] for a, b in windows], windows, unit_of)


def predict_memory(layout: RunLayout, prefetch_depth: int = 1) -> list[MemoryBound] | None:
    """Every rank's :class:`MemoryBound` of a DMuon ``layout`` (``None`` for a mode without
    DMuon). ``prefetch_depth``: ``dedicate_params``' (DMuon's default 1).

    A rank's bound depends only on the buckets it holds (``rank % shard_size``), so each
    holder class is computed once, from the all-non-held sums less its held buckets (only
    the windows covering a held bucket are summed again).

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
    sums = _Buckets(layout, buckets, prefetch_depth, holders_own=moved.replicate_size == 1)
    held_by: dict[int, list[int]] = {}  # holder class (rank % shard_size) -> its bucket indices
    for i, b in enumerate(buckets):
        held_by.setdefault(b.owner % moved.shard_size, []).append(i)
    by_class: dict[int | None, tuple] = {}  # holder class -> its figures after ``rank``
    out = []
    for rank in range(layout.world_size):
        key = rank % moved.shard_size if rank % moved.shard_size in held_by else None
        if key not in by_class:
            by_class[key] = dataclasses.astuple(sums.bound(rank, held_by.get(key, [])))[1:]
        out.append(MemoryBound(rank, *by_class[key]))
    return out


class _RangeMax:
    """The largest sum of ``weights`` over fixed index ``ranges``, less the weights of a few
    removed indices (a rank's held buckets): only the ranges covering a removed index are
    summed again, the rest come from one sort by full sum."""

    def __init__(self, ranges: Sequence[tuple[int, int]], weights: Sequence[int]) -> None:
        total = _prefix(weights)
        self.weights = weights
        self.full = [total[b + 1] - total[a] for a, b in ranges]
        self.order = sorted(range(len(ranges)), key=lambda k: (-self.full[k], k))
        self.cover: list[list[int]] = [[] for _ in weights]  # index -> the ranges holding it
        for k, (a, b) in enumerate(ranges):
            for i in range(a, b + 1):
                self.cover[i].append(k)

    def best(self, removed: Sequence[int]) -> tuple[int, int]:
        """``(sum, k)``: the first range ``k`` with the largest sum; ``(0, -1)`` when every
        sum is 0 or there is no range."""
        cut: dict[int, int] = {}
        for i in removed:
            for k in self.cover[i]:
                cut[k] = cut.get(k, 0) + self.weights[i]
        found = [(self.full[k] - c, -k) for k, c in cut.items()]
        found += [(self.full[k], -k) for k in self.order[: len(cut) + 1] if k not in cut][:1]
        value, k = max(found, default=(0, 1))
        return (value, -k) if value > 0 else (0, -1)


class _Buckets:
    """Per-bucket bytes of a layout's buckets and what every rank's bound is taken from (all
    non-held less its held ones): the compute copies over each Z3 window, the grad buffers
    over each two adjacent units."""

    def __init__(self, layout: RunLayout, buckets: Sequence[DMuonBucket], depth: int,
                 holders_own: bool = True) -> None:
        self.z3 = layout.reshard_after_forward
        mp = layout.mp_param_dtype
        self.mixed = mp is not None and any(mp != b.dtype for b in buckets)
        self.holders_own = holders_own  # every holder is its buckets' owner (R = 1 as moved)
        lp = [DTYPE_BYTES[mp or b.dtype] for b in buckets]
        self.copy = [b.numel * e for b, e in zip(buckets, lp)]  # a non-holder's compute copy
        self.grad = [(b.numel + len(b.names)) * e for b, e in zip(buckets, lp)]  # flat buffer
        # mixed precision: the owner's averaged grads, cast to the params' dtype, until the step
        self.master_grad = [b.numel * DTYPE_BYTES[b.dtype] if mp not in (None, b.dtype) else 0
                            for b in buckets]
        # a holder's: its master copy, plus the compute copy where mixed precision casts
        self.master = [b.numel * DTYPE_BYTES[b.dtype] + (c if mp not in (None, b.dtype) else 0)
                       for b, c in zip(buckets, self.copy)]
        units = _units(buckets)
        self.n_units, self.copy_total = len(units), sum(self.copy)
        self.units = units
        self.exact = mp is None
        unit_of = [k for k, (lo, hi) in enumerate(units) for _ in range(lo, hi + 1)]
        self.windows = _windows(buckets, depth) if self.z3 else []
        self.spans = [unit_of[b] - unit_of[a] + 1 for a, b in self.windows]
        self.window_max = _RangeMax(self.windows, self.copy)
        pairs = [(a[0], b[1]) for a, b in zip(units, units[1:])] or units[:1]
        self.grads_max = _RangeMax(pairs, self.grad)

    def bound(self, rank: int, held: list[int]) -> MemoryBound:
        """:class:`MemoryBound` of ``rank``, which holds the buckets ``held``."""
        non_held = self.copy_total - sum(self.copy[i] for i in held)
        held_bytes = sum(self.master[i] for i in held)
        if self.z3:
            window, k = self.window_max.best(held)
            units = self.spans[k] if k >= 0 else 0
        else:
            window, units = non_held, self.n_units
        grads_held = sum(self.grad[i] for i in held)
        two = self.grads_max.best(held)[0]
        cast = sum(self.master_grad[i] for i in held)
        mine = set(held)
        unit_copy = max((sum(self.copy[i] for i in range(lo, hi + 1) if i not in mine)
                         for lo, hi in self.units), default=0)
        one_buffer = max(self.grad, default=0)  # a bucket's flat buffer is one allocation
        # mixed precision: a buffer is reachable through no .grad once its reduce is issued,
        # so the least the meter must see is an owner's cast grads (none for a holder that
        # does not own: hierarchical HSDP)
        floor_grads = (cast if self.holders_own else 0) if self.mixed else max(grads_held, one_buffer)
        return MemoryBound(rank=rank, held_bytes=held_bytes, non_held_bytes=non_held,
                           window_bytes=window, window_units=units, peak_bytes=held_bytes + window,
                           between_bytes=held_bytes if self.z3 else held_bytes + non_held,
                           grads_held_bytes=grads_held, grads_bytes=grads_held + two + cast,
                           floor_peak_bytes=held_bytes + (unit_copy if self.z3 else non_held),
                           floor_grads_bytes=floor_grads, between_exact=self.exact)


def memory_report(layout: RunLayout, measured: Sequence[dict]) -> dict:
    """report.json ``runs[].memory`` of a DMuon run: per rank the measured peaks
    (``verify.measure.memory_meter.MemoryMeter.result``, one dict per rank) beside the predicted
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
