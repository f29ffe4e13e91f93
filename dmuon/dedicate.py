"""Dedicated ownership at runtime: the hooks that move each Muon matrix to and from its owner.

Glossary (see ``topology.py`` for the mesh terms):

- **dedicated param**: a 2-D Muon target handled by DMuon instead of DDP / FSDP2.
- **owner** (global owner): the one rank ``(r, s)`` that keeps momentum and runs
  Newton–Schulz for the param. **Holders**: the R ranks ``(*, s)`` of the owner's shard
  index; they keep the full param between steps (for 1-D meshes the holder is the owner).
- **bucket**: the dedicated params of one module with the same owner and dtype. Their data
  are views into one flat buffer (``flat``, shape ``(numel,)``), so one broadcast moves
  them all and freeing the flat buffer's storage frees them all.
- **synced**: non-holders' copies equal the owner's current values. Every rank tracks the
  same flag for every bucket, so every rank takes the same collective decisions.

Per step (SPEC §1):

1. forward pre-hook: wait for a pending replicate broadcast (HSDP); if not synced,
   broadcast the bucket from its holder over the shard axis (phase ``forward``).
2. Z3 (``reshard_after_forward=True``): after forward non-holders free the flat storage
   (resize to 0; autograd's saved tensors keep the same storage), and a hook on the
   module's outputs broadcasts it again just before the module's backward.
3. when every grad of a bucket is accumulated: reduce (sum) to the holder over the shard
   axis, then (HSDP) to the owner over the replicate axis; the owner divides by W.
   Buckets reduce in a fixed order (reverse module order) on every rank; buckets whose
   grads never arrive (unused params) are reduced with zeros when backward ends, so the
   ranks' collective sequences always match.
4. ``optimizer.step()``: only owners update; then (HSDP) each owner broadcasts its buckets
   to the holders over the replicate axis asynchronously; the wait is in step 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from . import annotate, collectives
from .buckets import bucket_layout
from .plan import OwnershipPlan, specs_from_named_parameters
from .topology import Topology

@dataclass(eq=False)
class _Bucket:
    module_name: str
    module: nn.Module
    owner: int  # global owner index g = r * N + s
    shard_owner: int  # s: group rank of the holder in each shard group
    replicate_owner: int  # r: group rank of the owner in the replicate group
    names: list[str]
    params: list[nn.Parameter]
    flat: torch.Tensor  # shape (numel,), params' data are views into it
    is_holder: bool
    is_owner: bool
    synced: bool = False
    reduced: bool = False
    ready: set[int] = field(default_factory=set)
    pending: dist.Work | None = None

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def free(self) -> None:
        """Non-holders drop the storage (FSDP2's trick: resize the storage to 0)."""
        self.flat.untyped_storage().resize_(0)

    def alloc(self) -> None:
        storage = self.flat.untyped_storage()
        nbytes = self.numel * self.flat.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)


class DedicatedParams:
    """The dedicated params of one model and the hooks that manage them.

    Built by :func:`dedicate_params`; pass it to :class:`dmuon.DMuon`. Iterating yields the
    dedicated ``nn.Parameter`` objects (pass them as ``ignored_params`` to ``fully_shard``).

    Attributes:
        names: fully qualified names of the dedicated params, in model order.
        plan: the :class:`~dmuon.plan.OwnershipPlan` every rank agreed on.
        topology: this rank's :class:`~dmuon.topology.Topology`.
        reshard_after_forward: ``True`` for Z3 (non-holders free after forward), ``False`` for Z2.
    """

    def __init__(
        self,
        model: nn.Module,
        named: list[tuple[str, nn.Parameter, str]],
        topology: Topology,
        plan: OwnershipPlan,
        reshard_after_forward: bool,
    ) -> None:
        self.names = [n for n, _, _ in named]
        self.plan = plan
        self.topology = topology
        self.reshard_after_forward = reshard_after_forward
        self._params = [p for _, p, _ in named]
        self._param_ids = {id(p) for p in self._params}
        modules = dict(model.named_modules())
        by_name = {n: p for n, p, _ in named}
        specs = specs_from_named_parameters((n, p) for n, p, _ in named)
        me = topology.global_index
        self.buckets: list[_Bucket] = []
        for spec in bucket_layout(specs, plan):
            r, s = topology.coords(spec.owner)
            params = [by_name[n] for n in spec.names]
            self.buckets.append(
                _Bucket(
                    module_name=spec.module,
                    module=modules[spec.module],
                    owner=spec.owner,
                    shard_owner=s,
                    replicate_owner=r,
                    names=list(spec.names),
                    params=params,
                    flat=_flatten_into_views(params),
                    is_holder=s == topology.shard_index,
                    is_owner=spec.owner == me,
                )
            )
        self._by_module: dict[nn.Module, list[_Bucket]] = {}
        for b in self.buckets:
            self._by_module.setdefault(b.module, []).append(b)
        self._owner_by_id = {id(p): b.owner for b in self.buckets for p in b.params}
        self._reduce_order = list(reversed(self.buckets))
        self._next_reduce = 0
        self._callback_queued = False
        self._no_sync = False
        self._handles: list = []
        for module in self._by_module:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward))
            self._handles.append(module.register_forward_hook(self._post_forward))
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._handles.append(
                    p.register_post_accumulate_grad_hook(self._grad_hook(b, i))
                )
            if reshard_after_forward and not b.is_holder:
                b.free()
        self._handles.append(model.register_state_dict_pre_hook(self._before_state_dict))

    # ------------------------------------------------------------------ public helpers
    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def __contains__(self, p: object) -> bool:
        return id(p) in self._param_ids

    @property
    def params(self) -> list[nn.Parameter]:
        """The dedicated params (plain tensors, never DTensors), in model order."""
        return list(self._params)

    def owned(self) -> list[nn.Parameter]:
        """Params whose global owner is this rank (the only ones this rank steps)."""
        return [p for b in self.buckets if b.is_owner for p in b.params]

    def owner_of(self, p: nn.Parameter) -> int:
        """Global owner index ``g`` of a dedicated param.

        Raises:
            ValueError: ``p`` is not a dedicated param.
        """
        if id(p) in self._owner_by_id:
            return self._owner_by_id[id(p)]
        raise ValueError(
            f"Invalid param of shape {tuple(p.shape)}: not dedicated by this DedicatedParams."
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally (no reduce) in backward passes inside the block.

        Use it for all micro-batches but the last of a gradient-accumulation step, like
        ``DistributedDataParallel.no_sync``.
        """
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def wait_pending(self) -> None:
        """Wait for every in-flight replicate broadcast (HSDP); a no-op elsewhere."""
        for b in self.buckets:
            self._wait_replicate(b)

    def remove(self) -> None:
        """Remove every hook DMuon registered (the params stay where they are)."""
        self.wait_pending()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ optimizer protocol
    def before_step(self) -> None:
        """Called by the optimizer before updating: in-flight sends must not be modified.

        Raises:
            RuntimeError: a backward pass has not finished reducing its grads.
        """
        self.wait_pending()
        if self._next_reduce != 0:
            raise RuntimeError(
                "DMuon: optimizer.step() was called while a backward pass had reduced only "
                f"{self._next_reduce} of {len(self._reduce_order)} buckets. Call step() after "
                "loss.backward() returns."
            )

    def after_step(self) -> None:
        """Mark non-holders stale; HSDP owners start the async replicate broadcasts."""
        topo = self.topology
        for b in self.buckets:
            b.synced = False
            b.reduced = False
        if topo.replicate_group is None:
            return
        with annotate.phase("replicate"):
            for b in self.buckets:
                if b.is_holder:
                    with annotate.span("dmuon.replicate_broadcast", module=b.module_name, owner=b.owner):
                        b.pending = collectives.broadcast_(
                            b.flat, b.replicate_owner, topo.replicate_group, async_op=True
                        )

    def after_zero_grad(self) -> None:
        """Grads were cleared: a new accumulation may start."""
        for b in self.buckets:
            b.reduced = False

    # ------------------------------------------------------------------ hooks
    def _before_state_dict(self, *args, **kwargs) -> None:
        self.wait_pending()

    def _wait_replicate(self, b: _Bucket) -> None:
        if b.pending is not None:
            with annotate.span("dmuon.replicate_wait", module=b.module_name, owner=b.owner):
                b.pending.wait()
            b.pending = None

    def _broadcast(self, b: _Bucket, phase: str) -> None:
        if not b.is_holder:
            b.alloc()
        with annotate.phase(phase), annotate.span(
            "dmuon.broadcast" if phase == "forward" else "dmuon.rebroadcast",
            module=b.module_name,
            owner=b.owner,
        ):
            collectives.broadcast_(b.flat, b.shard_owner, self.topology.shard_group)
        b.synced = True

    def _pre_forward(self, module: nn.Module, args) -> None:
        for b in self._by_module[module]:
            self._wait_replicate(b)
            if not b.synced:
                self._broadcast(b, "forward")

    def _post_forward(self, module: nn.Module, args, output) -> None:
        if not self.reshard_after_forward:
            return
        buckets = self._by_module[module]
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            register_multi_grad_hook(outputs, lambda grads: self._pre_backward(buckets), mode="any")
        for b in buckets:
            if not b.is_holder:
                b.free()
            b.synced = False

    def _pre_backward(self, buckets: list[_Bucket]) -> None:
        for b in buckets:
            if not b.synced:
                self._broadcast(b, "backward")

    def _grad_hook(self, b: _Bucket, i: int):
        def hook(p: nn.Parameter) -> None:
            if self._no_sync:
                return
            if b.reduced:
                raise RuntimeError(
                    f"DMuon: a second backward reached {b.names[i]} before optimizer.step() "
                    "or zero_grad(); its grad was already reduced to the owner. For gradient "
                    "accumulation wrap all but the last micro-batch in `with dm.no_sync():`."
                )
            b.ready.add(i)
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                self._callback_queued = True
            self._reduce_ready()

        return hook

    def _reduce_ready(self) -> None:
        order = self._reduce_order
        while self._next_reduce < len(order):
            b = order[self._next_reduce]
            if len(b.ready) < len(b.params):
                return
            self._reduce(b)
            self._next_reduce += 1

    def _end_backward(self) -> None:
        order = self._reduce_order
        while self._next_reduce < len(order):
            self._reduce(order[self._next_reduce])  # missing grads count as zeros
            self._next_reduce += 1
        self._next_reduce = 0
        self._callback_queued = False

    def _reduce(self, b: _Bucket) -> None:
        topo = self.topology
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        buf = grads[0].reshape(-1) if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
        with annotate.phase("backward"), annotate.span("dmuon.reduce", module=b.module_name, owner=b.owner):
            collectives.reduce_sum_(buf, b.shard_owner, topo.shard_group)
            if topo.replicate_group is not None and b.is_holder:
                collectives.reduce_sum_(buf, b.replicate_owner, topo.replicate_group)
        if b.is_owner:
            buf.div_(topo.world_size)
            offset = 0
            for p, g in zip(b.params, grads):
                n = p.numel()
                p.grad = buf[offset : offset + n].view_as(p) if len(grads) > 1 else g
                offset += n
        else:
            for p in b.params:
                p.grad = None
        b.ready.clear()
        b.reduced = True
        if self.reshard_after_forward and not b.is_holder:
            b.free()
            b.synced = False


def _flatten_into_views(params: list[nn.Parameter]) -> torch.Tensor:
    """Copy ``params`` into one flat buffer and make their ``.data`` views into it."""
    first = params[0]
    flat = torch.empty(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.data.reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            offset += n
    return flat
