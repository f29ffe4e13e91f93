"""One bucket's copies on this rank: the master copy (``flat``, the registered params' views)
and the compute copy (``lp``, what forward runs on and broadcasts carry).

Without mixed precision both are the same buffer. With ``param_dtype`` set, ``lp`` is a
``param_dtype`` buffer whose views are separate leaf params (``compute``) that the runtime
swaps into the module during its forward, like FSDP2's unsharded params; the registered
params keep the master dtype. Storage is freed and refilled with :mod:`dmuon.residency`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from . import residency
from .collectives import Pending


@dataclass(eq=False)
class Bucket:
    """The runtime side of one :class:`dmuon.buckets.BucketSpec` on this rank."""

    index: int
    module_name: str
    module: nn.Module
    owner: int  # global owner index g = r * N + s
    shard_owner: int  # s: group rank of the holder in each shard group
    replicate_owner: int  # r: group rank of the owner in the replicate group
    names: list[str]
    params: list[nn.Parameter]
    param_modules: list[nn.Module]  # the module each param is registered in (in its block)
    flat: torch.Tensor  # shape (numel,), params' data are views into it (master dtype)
    is_holder: bool
    is_owner: bool
    lp: torch.Tensor | None = None  # shape (numel,), param_dtype copy (mixed precision), else flat
    compute: list[nn.Parameter] = field(default_factory=list)  # views of lp used in forward
    valid: bool = False  # non-holders' compute copies (lp) are current and allocated
    master_valid: bool = False  # mixed precision: non-holders' master (flat) copies too
    reduced: bool = False  # reduced to the owner since the last step / zero_grad
    ready: set[int] = field(default_factory=set)
    used: list[bool] = field(default_factory=list)
    replicate_work: Pending | None = None  # in-flight replicate broadcast into flat (HSDP)
    broadcast_work: Pending | None = None  # in-flight forward / backward broadcast into lp
    reduce_work: Pending | None = None
    reduce_buf: torch.Tensor | None = None
    grad_flat: torch.Tensor | None = None  # (numel + len(params),), lp's dtype: grads + usage
    grad_views: list[torch.Tensor] = field(default_factory=list)  # views of grad_flat, per param

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def mixed(self) -> bool:
        """Whether the compute copy is a separate (``param_dtype``) buffer."""
        return self.lp is not self.flat

    def make_compute(self, param_dtype: torch.dtype | None) -> bool:
        """Build the compute copy from ``flat``; returns True when new compute params were
        made (the caller moves the grad hooks to them). Mixed-precision non-holders then
        drop their master copy (``sync_params`` brings it back)."""
        if param_dtype is None or param_dtype == self.flat.dtype:
            self.lp, self.compute = self.flat, self.params
            return False
        self.lp = torch.empty(self.numel, dtype=param_dtype, device=self.flat.device)
        with torch.no_grad():
            self.lp.copy_(self.flat)
        self.compute, offset = [], 0
        for p in self.params:
            n = p.numel()
            self.compute.append(nn.Parameter(self.lp[offset : offset + n].view(p.shape)))
            offset += n
        if not self.is_holder:
            self.free_master()
        return True

    def refresh_compute(self) -> None:
        """Cast the master copy into the compute copy (mixed precision; local)."""
        if self.mixed:
            residency.alloc_storage(self.lp)
            with torch.no_grad():
                self.lp.copy_(self.flat)

    def swap(self, compute: bool, module: nn.Module | None = None) -> None:
        """Put the compute params (or back the registered ones) into their modules (only
        into ``module`` when given)."""
        if self.mixed:
            for m, n, p, q in zip(self.param_modules, self.names, self.params, self.compute):
                if module is None or m is module:
                    m._parameters[n.rpartition(".")[2]] = q if compute else p

    def free_compute(self) -> None:
        """Drop the compute copy's storage (without mixed precision: the master's)."""
        if self.mixed:
            residency.free_storage(self.lp)
        else:
            self.free_master()

    def alloc_compute(self) -> None:
        if self.mixed:
            residency.alloc_storage(self.lp)
        else:
            self.alloc_master()

    def grad_buffer(self) -> torch.Tensor:
        """The bucket's flat grad buffer: shape (numel + len(params),), the compute copy's
        dtype and device: the params' grads (one view per param in ``grad_views``), then one
        usage element per param (the protocol's step 4). Created on first use (again after
        ``.to()`` moved the params), its storage re-grown after :meth:`free_grad_buffer`; the
        views stay the same objects, so a ``.grad`` set to one follows the storage."""
        g = self.grad_flat
        if g is None or g.dtype != self.lp.dtype or g.device != self.lp.device:
            g = self.grad_flat = torch.empty(
                self.numel + len(self.params), dtype=self.lp.dtype, device=self.lp.device
            )
            self.grad_views, offset = [], 0
            for p in self.params:
                self.grad_views.append(g[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
        else:
            residency.alloc_storage(g)
        return g

    def grad_into_buffer(self, i: int, q: torch.Tensor) -> None:
        """Make ``q.grad`` (the compute param ``i``) a view of the flat grad buffer: copy it in
        unless it already is one (then autograd accumulates into the buffer in place)."""
        self.grad_buffer()
        view, g = self.grad_views[i], q.grad
        if g is not None and not _is_view(g, view):
            with torch.no_grad():
                view.copy_(g)
            q.grad = view

    def fill_grad_buffer(self) -> torch.Tensor:
        """The flat grad buffer ready to reduce: every compute param's local grad, zeros for a
        param without one (no ``torch.cat``: grads already live there, see
        :meth:`grad_into_buffer`), then the usage elements: 1 for a param that got a grad
        since the last reduce (``used``), else 0."""
        buf = self.grad_buffer()
        usage = buf[self.numel :]
        with torch.no_grad():
            for q, view in zip(self.compute, self.grad_views):
                if q.grad is None:
                    view.zero_()
                elif not _is_view(q.grad, view):
                    view.copy_(q.grad)
            if all(self.used):
                usage.fill_(1)
            elif not any(self.used):
                usage.zero_()
            else:
                usage.copy_(torch.tensor(self.used, dtype=usage.dtype))
        return buf

    def free_grad_buffer(self) -> None:
        """Drop the flat grad buffer's storage (a non-holder after its reduce was waited)."""
        if self.grad_flat is not None and residency.is_allocated(self.grad_flat):
            residency.free_storage(self.grad_flat)

    def free_master(self) -> None:
        """Drop ``flat``'s storage; the registered params get the freed guard."""
        residency.free_storage(self.flat)
        for n, p in zip(self.names, self.params):
            residency.mark_freed(p, f"{n} (owner rank {self.owner}) on rank {dist.get_rank()}")
        self.master_valid = False

    def alloc_master(self) -> None:
        residency.alloc_storage(self.flat)
        for p in self.params:
            residency.mark_resident(p)


def _is_view(g: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``g`` is ``view`` (same memory, shape and dtype)."""
    return g.data_ptr() == view.data_ptr() and g.shape == view.shape and g.dtype == view.dtype
