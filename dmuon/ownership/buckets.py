"""Bucket layout: which dedicated params travel together in one collective (pure).

A **block** is the part of the model whose dedicated params share collectives: for a param
of module ``m``, the longest prefix of ``m``'s dotted name whose last component is an
integer (an element of a ``ModuleList`` / ``Sequential``: ``blocks.3`` for
``blocks.3.attn.qkv``, ``layers.0.experts.5`` for ``layers.0.experts.5.w1``); a module with
no such prefix (``head``, the root ``""``) is its own block (:func:`block_of`).

A **bucket** is the dedicated params of one block with the same global owner and dtype, in
model order, cut into consecutive runs of at most ``cap_bytes`` (bytes of the params' own
dtype; a param larger than the cap is a bucket of its own). :func:`bucket_layout` lists them
in model order (first appearance), so the buckets of any module's subtree are a contiguous
range; after the first step DMuon renumbers them block by block in the blocks' execution
order (``order.py``, ``dedicate.py`` step 7). DMuon's runtime (``dedicate.py``) uses
:func:`bucket_layout`; the traffic predictor (``verify/traffic/predict.py``) implements the same
documented rule on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmuon.ownership.plan import OwnershipPlan, ParamSpec

#: Default bucket cap, in MiB (DDP's ``bucket_cap_mb`` default).
DEFAULT_BUCKET_CAP_MB = 25


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: ``numel`` elements of ``dtype`` (torch name) owned by global index ``owner``;
    ``module`` is the block (see the module docstring)."""

    module: str
    owner: int
    dtype: str
    names: tuple[str, ...]
    numel: int


def block_of(module: str) -> str:
    """The block of a param of ``module`` (dotted name, ``""`` = root): module docstring."""
    parts = module.split(".") if module else []
    for k in range(len(parts), 0, -1):
        if parts[k - 1].isdigit():
            return ".".join(parts[:k])
    return module


def bucket_layout(specs: Sequence[ParamSpec], plan: OwnershipPlan, cap_bytes: int) -> list[BucketSpec]:
    """Buckets in model order (module docstring).

    Args:
        specs: the dedicated params in model order (``model.named_parameters()`` order).
        plan: the ownership plan computed from the same specs.
        cap_bytes: bucket cap in bytes of the params' dtype (> 0).

    Raises:
        KeyError: a spec is not in the plan.
    """
    assert cap_bytes > 0, cap_bytes
    members: dict[tuple[str, int, str], list[list[ParamSpec]]] = {}
    for spec in specs:
        runs = members.setdefault((block_of(spec.module), plan.owner[spec.name], spec.dtype), [[]])
        run = runs[-1]
        if run and (sum(s.nbytes for s in run) + spec.nbytes) > cap_bytes:
            runs.append(run := [])
        run.append(spec)
    return [
        BucketSpec(block, owner, dtype, tuple(s.name for s in run), sum(s.numel for s in run))
        for (block, owner, dtype), runs in members.items()
        for run in runs
    ]
