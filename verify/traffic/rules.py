"""The collectives FSDP2 and DDP issue for the params DMuon does not own: one set of rules
that both the exact predictor (:mod:`verify.traffic.predict`, per rank) and the aggregate
predictor (:mod:`verify.traffic.scale`, per rank class) turn into their own records.

Rules (torch 2.13; the per-call accounting is :mod:`verify.traffic.formulas`):

- **FSDP2** (``fully_shard``): a *group* is the params of one wrapped module that are neither
  in a nested wrapped module nor ignored (:func:`fsdp_groups`). Per group and step: one
  all_gather over the shard axis in forward, again in backward when ``reshard_after_forward``
  unless it is the root wrapped without an explicit ``reshard_after_forward`` (``FSDPState.
  _lazy_init`` keeps that root unsharded: ``RunLayout.root_auto_reshard``), one
  reduce_scatter over the shard axis; on an HSDP mesh one all_reduce over the replicate axis.
  A module whose forward runs u > 1 times per forward (weight sharing,
  ``RunLayout.module_calls``) is gathered again: with ``reshard_after_forward`` u all_gathers
  in forward and u in backward (it reshards after each run, and after each run's backward);
  without, 1 in forward and u - 1 in backward (each run's backward but the first finds it
  resharded by the previous one's post-backward). Still one reduce_scatter (and all_reduce):
  the grads are reduced once, when the last run's backward is done. Measured on gloo
  (``examples/structures.py:shared_block``).
  Per-rank count: the sum of dim-0-padded shard sizes ceil(d0/N)·(d1·…)
  (:func:`padded_shard_numel`). FSDP2 skips the all_gather and reduce_scatter of a one-rank
  shard group (``_fsdp_param_group.py`` unshard: world_size == 1; ``_fsdp_collectives.py``
  foreach_reduce: world_size > 1) but still all-reduces over the replicate axis. Dtypes: the
  all_gathers in ``param_dtype``, the reduce_scatter and all_reduce in ``reduce_dtype``.
- **DDP**: one all_reduce over the world per gradient bucket, buckets from DDP's own
  ``dist._compute_bucket_assignment_by_size`` (:func:`ddp_buckets`), in the params' dtype;
  and, when the module has buffers (``RunLayout.ddp_buffers``: rotary ``inv_freq``, BatchNorm
  statistics), one broadcast from rank 0 over the world before every forward per dtype and
  250 MiB of buffers (``broadcast_buffers=True``, DDP's ``_sync_buffers`` through
  ``dist._broadcast_coalesced``, whose ``take_tensors`` groups by dtype and closes a group
  once it reaches the bucket size; :func:`ddp_buffer_broadcasts`).
- **DMuon's replicated rest** (``dedicate_params(rest="replicate")``, ``RunLayout.dmuon_rest``;
  documented in ``dmuon/runtime/rest.py``'s docstring and written here from that text): nothing
  wraps the model, so neither of the rules above applies. Per step one all_reduce (sum) over
  the world per dtype of the *trainable* non-dedicated params (dtype groups in model order of
  first appearance), phase ``backward``, in the params' own dtype (mixed precision does not
  apply to the rest), carrying ``sum(numel) + len(params)`` elements: the grads, then one
  usage element per param (:func:`rest_calls`). No Muon payload. Its first-forward
  broadcast of the whole rest (phase ``setup``) is a one-time call, like DMuon's block-order
  agreement, outside any steady step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dmuon.ownership.plan import ParamSpec

if TYPE_CHECKING:
    from verify.traffic.predict import RunLayout


@dataclass(frozen=True)
class AxisCall:
    """One collective every rank of an axis issues with the same size.

    Attributes:
        phase: ``forward`` or ``backward``.
        op: ``all_gather``, ``reduce_scatter`` or ``all_reduce``.
        axis: ``shard`` (a row of the (R, N) mesh), ``replicate`` (a column) or ``world``.
        group_size: ranks in the group.
        count: per-rank count in elements (nccl-tests' convention, ``tracer.events``).
        dtype: torch dtype name of the call.
        dedicated_count: elements of ``count`` that belong to Muon-target params.
        module: the wrapped module (FSDP2), ``None`` for DDP buckets.
        root: the group rank a broadcast starts from (DDP's buffers: rank 0), else ``None``.
    """

    phase: str
    op: str
    axis: str
    group_size: int
    count: int
    dtype: str
    dedicated_count: int
    module: str | None
    root: int | None = None


#: DDP's ``broadcast_bucket_size`` for its buffer broadcasts (torch 2.13: 250 MiB).
DDP_BUFFER_BUCKET_BYTES = 250 * 1024 * 1024


def ddp_buffer_broadcasts(buffers: Sequence[tuple[str, int]],
                          bucket_bytes: int = DDP_BUFFER_BUCKET_BYTES) -> list[tuple[str, int]]:
    """``(dtype, count)`` of each broadcast DDP issues to sync ``buffers`` (``(dtype, numel)``
    in ``named_buffers()`` order): per dtype, buffers join a group until its bytes reach
    ``bucket_bytes`` (c10d's ``take_tensors``); closed groups first, then the open ones in
    the order their dtype first appeared."""
    closed: list[tuple[str, int]] = []
    open_groups: dict[str, list[int]] = {}
    for dtype, numel in buffers:
        group = open_groups.setdefault(dtype, [0, 0])  # [elements, bytes]
        group[0] += numel
        group[1] += numel * getattr(torch, dtype).itemsize
        if group[1] >= bucket_bytes:
            closed.append((dtype, group[0]))
            del open_groups[dtype]
    return closed + [(dtype, g[0]) for dtype, g in open_groups.items() if g[0]]


def padded_shard_numel(shape: Sequence[int], n: int) -> int:
    """FSDP2's per-rank shard size: dim 0 padded up to a multiple of n, divided by n."""
    rest = math.prod(shape[1:])
    return -(-shape[0] // n) * rest if shape else 1


def fsdp_groups(layout: RunLayout, ignored: set[str]) -> list[tuple[str, list[ParamSpec]]]:
    """(wrapped module, managed params) in wrap order, empty groups dropped.

    A param belongs to the first module in ``layout.fsdp_modules`` (wrap order) whose name is
    a prefix of it (``""`` = the root), unless it is in ``ignored``. O(params × depth).
    """
    order = {m: i for i, m in enumerate(layout.fsdp_modules)}
    members: dict[int, list[ParamSpec]] = defaultdict(list)
    for p in layout.params:
        if p.name in ignored:
            continue
        parts = p.name.split(".")
        ancestors = [""] + [".".join(parts[:k]) for k in range(1, len(parts))]
        hits = [order[a] for a in ancestors if a in order]
        if hits:
            members[min(hits)].append(p)
    return [(layout.fsdp_modules[i], members[i]) for i in sorted(members)]


def fsdp_calls(layout: RunLayout, ignored: set[str]) -> list[AxisCall]:
    """FSDP2's calls of one step on every rank, group by group in wrap order (module docstring).

    Raises:
        ValueError: a group mixes dtypes (FSDP2 gathers one dtype per group; set
            ``mp_param_dtype`` to gather them in one).
    """
    n, r = layout.shard_size, layout.replicate_size
    muon, frozen = set(layout.muon_names), set(layout.frozen_names)
    out: list[AxisCall] = []
    for module, managed in fsdp_groups(layout, ignored):
        dtypes = {layout.cast_dtype(p.dtype) for p in managed}
        if len(dtypes) != 1:
            raise ValueError(
                f"Invalid FSDP group {module or '<root>'}: mixed dtypes {sorted(dtypes)}. Must "
                "be one dtype per fully_shard group (set mp_param_dtype to gather them in one)."
            )
        dtype = dtypes.pop()
        red = layout.reduce_dtype(managed[0].dtype)  # own dtypes agree when no mp is set
        count = sum(padded_shard_numel(p.shape, n) for p in managed)
        ded = sum(padded_shard_numel(p.shape, n) for p in managed if p.name in muon)
        # gradient reductions cover the params with a grad (FSDP2's fsdp_params_with_grad)
        trained = [p for p in managed if p.name not in frozen]
        grad_count = sum(padded_shard_numel(p.shape, n) for p in trained)
        keeps_unsharded = module == "" and layout.root_auto_reshard
        runs = layout.calls_of(module)
        reshards = layout.reshard_after_forward and not keeps_unsharded

        def add(phase: str, op: str, axis: str, size: int, dt: str, times: int = 1,
                elems: int = count) -> None:
            out.extend([AxisCall(phase, op, axis, size, elems, dt, ded, module)] * times)

        if n > 1:
            add("forward", "all_gather", "shard", n, dtype, runs if reshards else 1)
            add("backward", "all_gather", "shard", n, dtype, runs if reshards else runs - 1)
            if trained:
                add("backward", "reduce_scatter", "shard", n, red, elems=grad_count)
        if r > 1 and trained:
            add("backward", "all_reduce", "replicate", r, red, elems=grad_count)
    return out


def ddp_buckets(params: Sequence[ParamSpec], cap_bytes: int,
                first_cap_bytes: int | None = None) -> list[list[ParamSpec]]:
    """DDP's gradient buckets, from DDP's own assignment function (torch 2.13).

    ``first_cap_bytes``: the first bucket's cap. torch 2.13 (``BucketCapacityConfig`` in
    torch/nn/parallel/distributed.py) uses ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) only when
    ``bucket_cap_mb`` is left at its default; an explicit ``bucket_cap_mb`` makes the first
    bucket as large as the others. ``None``: the explicit case (first = ``cap_bytes``).

    Raises:
        RuntimeError: torch's private ``_compute_bucket_assignment_by_size`` is missing.
    """
    if not params:
        return []
    tensors = [torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta") for p in params]
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    # DDP assigns over params in model order with [first bucket cap, bucket_cap].
    indices, _ = dist._compute_bucket_assignment_by_size(
        tensors,
        [first, cap_bytes] if first < cap_bytes else [cap_bytes],
        [False] * len(tensors),
    )
    return [[params[i] for i in bucket] for bucket in indices]


def ddp_calls(layout: RunLayout, ignored: set[str]) -> list[AxisCall]:
    """DDP's all_reduces of one step on every rank, bucket by bucket (module docstring)."""
    muon = set(layout.muon_names)
    skip = ignored | set(layout.frozen_names)  # DDP buckets only params that require grad
    buckets = ddp_buckets([p for p in layout.params if p.name not in skip],
                          layout.ddp_bucket_cap_bytes, layout.ddp_first_bucket_cap_bytes)
    return [
        AxisCall("forward", "broadcast", "world", layout.world_size, count, dtype, 0, None, root=0)
        for dtype, count in ddp_buffer_broadcasts(layout.ddp_buffers)
    ] + [
        AxisCall("backward", "all_reduce", "world", layout.world_size,
                 sum(p.numel for p in bucket), bucket[0].dtype,
                 sum(p.numel for p in bucket if p.name in muon), None)
        for bucket in buckets
    ]


def rest_calls(layout: RunLayout) -> list[AxisCall]:
    """DMuon's all_reduces of its replicated rest in one step on every rank (module docstring);
    ``[]`` unless a DMuon mode runs with ``dmuon_rest == "replicate"``."""
    if not (layout.is_dmuon and layout.dmuon_rest == "replicate"):
        return []
    skip = set(layout.muon_names) | set(layout.frozen_names)  # dedicated, or without a grad
    groups: dict[str, list[ParamSpec]] = {}
    for p in layout.params:
        if p.name not in skip:
            groups.setdefault(p.dtype, []).append(p)
    return [
        AxisCall("backward", "all_reduce", "world", layout.world_size,
                 sum(p.numel for p in members) + len(members), dtype, 0, None)
        for dtype, members in groups.items()
    ]
