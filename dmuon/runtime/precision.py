"""Module-level mixed precision for dedicated modules: FSDP2's ``MixedPrecisionPolicy``
applied at a dedicated module's boundary. Its floating inputs are cast to ``param_dtype``
(``cast_forward_inputs``) and its floating outputs handed back in the dtype its inputs arrived
in, so a dedicated module fits between the modules around it whatever computes them (the rest
in its own dtype under DDP or ``rest="replicate"``, in ``param_dtype`` inside an FSDP2 unit).
``output_dtype`` stays ``fully_shard``'s, applied at its units' outputs: FSDP2 applies it at
a unit's root, and a dedicated module inside a unit is not one (a module with no floating
input hands back ``output_dtype`` when set)."""

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


def output_dtype(policy, args: tuple) -> torch.dtype | None:
    """The dtype a dedicated module hands its floating outputs back in (module docstring):
    that of its first floating input in ``args``, else ``policy.output_dtype`` (``None``:
    leave them)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return getattr(policy, "output_dtype", None)


def cast_output(dtype: torch.dtype | None, output):
    """Floating tensors of ``output`` in ``dtype`` (``None``: leave them; also when ``output``
    is one tensor already in ``dtype``, the common case, which needs no tree walk)."""
    if dtype is None or (isinstance(output, torch.Tensor) and output.dtype == dtype):
        return None
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
