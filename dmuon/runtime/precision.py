"""Module-level mixed precision for dedicated modules: FSDP2's ``MixedPrecisionPolicy``
fields applied at a dedicated module's boundary (``cast_forward_inputs``, ``output_dtype``)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


def dtypes(policy) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of ``policy`` (``None``: no mixed precision);
    ``reduce_dtype`` defaults to ``param_dtype``, as in FSDP2."""
    pd = getattr(policy, "param_dtype", None)
    return pd, getattr(policy, "reduce_dtype", None) or pd


def cast_inputs(policy, args: tuple):
    """Floating tensors of ``args`` in ``param_dtype`` (``None``: leave them)."""
    pd = getattr(policy, "param_dtype", None)
    if pd is None or not getattr(policy, "cast_forward_inputs", True):
        return None
    return tuple(a.to(pd) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def cast_output(policy, output):
    """Floating tensors of ``output`` in ``output_dtype`` (``None``: leave them)."""
    od = getattr(policy, "output_dtype", None)
    if od is None:
        return None
    return tree_map(lambda t: t.to(od) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
