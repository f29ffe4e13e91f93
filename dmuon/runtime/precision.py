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
import torch.nn as nn
from torch.utils._pytree import tree_map

from dmuon.ownership.buckets import block_of


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


class ModuleSwaps:
    """Where the compute params go in, and the casts at each dedicated module (module
    docstring), arranged so that ``torch.compile`` of a block gives as many graphs as without
    a policy (1 per block on TinyGPT, 0 breaks; ``tests/distributed/parity/test_compile.py``).

    - **Swap, per block** (:meth:`pre_hook` / :meth:`post_hook` wrap the block's driver hooks,
      which run eagerly under ``torch.compiler.disable``): after the block's pre-forward the
      compute params of every module of that block holding dedicated params are registered
      in it; before its post-forward (hence before a Z3 free) the registered params are back.
    - **Casts, per module** (:meth:`leaf_pre_forward` / :meth:`leaf_post_forward`, plain
      hooks Dynamo traces into the block's graph): inputs to ``param_dtype``, outputs back in
      the dtype the inputs arrived in. Per call they keep one entry on a stack (LIFO, so
      nested modules pair up); a post-hook drops the entries above its own, which a forward
      that raised inside a module left behind (the exception caught by an enclosing one).
    - A module run outside its block's forward (its compute params not registered) swaps them
      in for its own forward (a compiled region breaks there; eager code is unaffected).

    ``buckets``: the runtime's (``bucket.Bucket``: ``names``, ``param_modules``, ``compute``,
    ``swap``); ``modules``: dotted name -> module; params of ``root`` are never swapped.
    """

    def __init__(self, policy, buckets, modules: dict[str, nn.Module], root: nn.Module) -> None:
        self.policy = policy
        self.buckets_of: dict[nn.Module, list] = {}  # module holding dedicated params -> buckets
        self.probe: dict[nn.Module, tuple] = {}  # such module -> (bucket, index, attribute name)
        self.block_leaves: dict[nn.Module, list[nn.Module]] = {}  # block -> its such modules
        self.calls: list[tuple] = []  # per module call in flight: (module, output dtype, swapped here)
        for b in buckets:
            for i, (m, name) in enumerate(zip(b.param_modules, b.names)):
                if m is root:
                    continue
                owner_name, _, attr = name.rpartition(".")
                if b not in self.buckets_of.setdefault(m, []):
                    self.buckets_of[m].append(b)
                self.probe.setdefault(m, (b, i, attr))
                leaves = self.block_leaves.setdefault(modules[block_of(owner_name)], [])
                if m not in leaves:
                    leaves.append(m)

    def swap_block(self, block: nn.Module, compute: bool) -> None:
        for m in self.block_leaves[block]:
            for b in self.buckets_of[m]:
                b.swap(compute, m)

    def pre_hook(self, hook):
        """``hook`` (a block's forward pre-hook returning None), then the block's compute
        params in (after it: a forward's start may re-bind the buckets or recover)."""
        def pre(module: nn.Module, args) -> None:
            hook(module, args)
            self.swap_block(module, True)
        return pre

    def post_hook(self, hook):
        """The block's registered params back, then ``hook`` (which may free the copies)."""
        def post(module: nn.Module, args, output):
            self.swap_block(module, False)
            return hook(module, args, output)
        return post

    @torch.compiler.disable
    def _swap_leaf(self, module: nn.Module, compute: bool) -> None:
        for b in self.buckets_of[module]:
            b.swap(compute, module)

    def leaf_pre_forward(self, module: nn.Module, args):
        b, i, attr = self.probe[module]
        here = module._parameters[attr] is not b.compute[i]  # outside its block's forward
        if here:
            self._swap_leaf(module, True)
        self.calls.append((module, output_dtype(self.policy, args), here))
        return cast_inputs(self.policy, args)

    def leaf_post_forward(self, module: nn.Module, args, output):
        m, dtype, here = self.calls.pop()
        while m is not module:  # left by a call that raised (list, docstring)
            m, dtype, here = self.calls.pop()
        if here:
            self._swap_leaf(module, False)
        return cast_output(dtype, output)
