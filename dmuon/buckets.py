"""Bucket layout: which dedicated params travel together in one collective (pure).

A bucket is the dedicated params of one module with the same global owner and dtype, in
model order. DMuon's runtime (``dedicate.py``) and the traffic predictor (``verify/``) both
use :func:`bucket_layout`, so the predicted collective list and the issued one cannot drift.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plan import OwnershipPlan, ParamSpec


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: ``numel`` elements of ``dtype`` (torch name) owned by global index ``owner``."""

    module: str
    owner: int
    dtype: str
    names: tuple[str, ...]
    numel: int


def bucket_layout(specs: Sequence[ParamSpec], plan: OwnershipPlan) -> list[BucketSpec]:
    """Buckets in model order (order of first appearance of each (module, owner, dtype)).

    Args:
        specs: the dedicated params in model order (``model.named_parameters()`` order).
        plan: the ownership plan computed from the same specs.

    Raises:
        KeyError: a spec is not in the plan.
    """
    members: dict[tuple[str, int, str], list[ParamSpec]] = {}
    for spec in specs:
        key = (spec.module, plan.owner[spec.name], spec.dtype)
        members.setdefault(key, []).append(spec)
    out = []
    for (module, owner, dtype), group in members.items():
        numel = sum(spec.numel for spec in group)
        out.append(BucketSpec(module, owner, dtype, tuple(s.name for s in group), numel))
    return out
