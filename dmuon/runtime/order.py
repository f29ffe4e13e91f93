"""Buckets in execution order: the rule that turns the blocks' recorded forward order into the
bucket order every rank uses (:func:`execution_block_order`, pure), the recorder, and the one
agreement call (:func:`agree`; step 7 of ``docs/protocol.md``).

Inputs: ``model_blocks``, the blocks that hold buckets in model order (the order of their
first bucket in ``buckets.bucket_layout``), and ``recorded``, the blocks in the order their
forward pre-hook first ran in the first forward after ``dedicate_params`` (the root block
``""``, if any, when the root's pre-hook ran). The rule (:func:`execution_block_order`):

1. ``ran``: the recorded names that are blocks, first occurrence only.
2. If ``ran`` is already in model order (a subsequence of ``model_blocks``), the result is
   ``model_blocks``: a model whose forward follows its registration keeps model order, even
   when some blocks did not run (MoE experts without tokens), so the ranks agree.
3. Else the candidate is ``ran`` followed by the blocks that never ran, in model order.
4. Every *driver* (a dotted prefix of a block's name, the block itself included, not the
   root) must cover a contiguous run of the candidate (its hooks cover one index range);
   if one does not, the result is ``model_blocks``.

With coalescing the names are units (``buckets.py``): a unit is recorded when any of its
blocks first runs, and its drivers are those of all its blocks. Buckets are then ordered by
their unit's position in the result, and within a unit keep their order. The traffic predictor (``verify/traffic/predict.py``) implements the same rule on
its own.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from dmuon.runtime import collectives


def drivers_of(block: str) -> list[str]:
    """The dotted prefixes of ``block`` (``"a.b.1"`` -> ``["a", "a.b", "a.b.1"]``; root: none)."""
    parts = block.split(".") if block else []
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def contiguous_drivers(blocks: Sequence[str], drivers: Mapping[str, Sequence[str]] | None = None) -> bool:
    """Whether every driver's blocks form one contiguous run of ``blocks`` (``drivers``: name
    -> its drivers, for units of several blocks; default :func:`drivers_of`)."""
    positions: dict[str, list[int]] = {}
    for i, block in enumerate(blocks):
        for driver in dict.fromkeys(drivers[block] if drivers is not None else drivers_of(block)):
            positions.setdefault(driver, []).append(i)
    return all(p[-1] - p[0] + 1 == len(p) for p in positions.values())


def execution_block_order(model_blocks: Sequence[str], recorded: Sequence[str],
                          drivers: Mapping[str, Sequence[str]] | None = None) -> tuple[str, ...]:
    """The block order buckets follow (module docstring, steps 1-4).

    Args:
        model_blocks: every block (or unit) holding buckets, in model order (distinct names).
        recorded: block names in the order their forward first ran (repeats and unknown
            names are ignored).
        drivers: name -> its drivers: for a unit, those of every block in it (default:
            :func:`drivers_of` of the name).

    Returns:
        A permutation of ``model_blocks``.
    """
    model = tuple(model_blocks)
    known = set(model)
    ran = tuple(b for b in dict.fromkeys(recorded) if b in known)
    where = {b: i for i, b in enumerate(model)}
    if all(where[a] < where[b] for a, b in zip(ran, ran[1:])):
        return model
    candidate = ran + tuple(b for b in model if b not in set(ran))
    return candidate if contiguous_drivers(candidate, drivers) else model


def order_digest(blocks: Sequence[str]) -> str:
    """sha256 (64 hex chars) of a block order (its names as a JSON list)."""
    return hashlib.sha256(json.dumps(list(blocks)).encode("utf-8")).hexdigest()


class OrderRecorder:
    """The blocks' first-run order during the first forward after ``dedicate_params``.

    ``begin()`` at every forward's start (a forward that raised before it ended is recorded
    again from scratch), ``note(block)`` from the forward pre-hooks, ``end()`` when the
    forward ends; after the first ``end()`` nothing changes.
    """

    def __init__(self) -> None:
        self.recorded: list[str] = []
        self.done = False
        self._active = False

    def begin(self) -> None:
        if not self.done:
            self.recorded.clear()
            self._active = True

    def note(self, block: str) -> None:
        if self._active and block not in self.recorded:
            self.recorded.append(block)

    def end(self) -> None:
        if self._active:
            self._active, self.done = False, True


def agree(model_blocks: Sequence[str], recorded: Sequence[str], world: dist.ProcessGroup,
          drivers: Mapping[str, Sequence[str]] | None = None) -> tuple[str, ...]:
    """The block order every rank derives from its record, if all ranks derived the same one
    (one all_gather of the 32-byte digests on DMuon's ``world`` group); else ``model_blocks``,
    after every rank warned with the same text (which ranks hold which digest)."""
    proposal = execution_block_order(model_blocks, recorded, drivers)
    digests = collectives.all_gather_order_digests(order_digest(proposal), world)
    if len(set(digests)) == 1:
        return proposal
    ranks = [dist.get_global_rank(world, i) for i in range(len(digests))]
    warnings.warn(
        "DMuon: the blocks ran in different orders on different ranks in the first "
        f"forward (digests of the derived block order: {collectives.ranks_by_digest(digests, ranks)}"
        "), so the buckets keep model order and prefetch follows model order. Run the "
        "same blocks in the same order on every rank in the first step to get buckets "
        "in execution order (docs/performance.md, 'Buckets in execution order').",
        stacklevel=5,  # the caller of the optimizer's step()
    )
    return tuple(model_blocks)
