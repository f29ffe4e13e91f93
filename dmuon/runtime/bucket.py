"""One bucket on this rank: its copies, its grads, and their states. The only module that
changes a dedicated param: its storage (freed / refilled / re-bound), its class (the freed
guard), its ``.grad``, and which tensor its module registers (``m._parameters[...]``). Every
other module calls a :class:`Bucket` method; the storage primitives live in
:mod:`dmuon.runtime.residency`, which only this module imports.

Copies: the master copy ``flat`` (the registered params' views) and the compute copy ``lp``
(what forward runs on and broadcasts carry). Without mixed precision both are the same
buffer. With ``param_dtype`` set, ``lp`` is a ``param_dtype`` buffer whose views are separate
leaf params (``compute``) that :meth:`Bucket.swap` puts into the modules during their
forward, like FSDP2's unsharded params; the registered params keep the master dtype.

States (:mod:`dmuon.runtime.state`; what they mean and their diagrams: ``docs/protocol.md``,
"States"): ``copy`` and ``master`` (the non-holders' copies, the same value on every rank),
``replica`` (a holder's master under HSDP), ``grads``. Which protocol step calls which method:
``docs/architecture.md``, "One step, and who owns each arrow".
Each in-flight call's handle belongs to the state that says it is in flight (``copy``
``IN_FLIGHT``, ``replica`` ``RECEIVING``, ``grads`` ``REDUCING``) and is dropped when it is
waited; storage is never read back as state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.runtime import grad_view, residency, usage
from dmuon.runtime.collectives import Pending
from dmuon.runtime.state import Copy, Grads, Replica, check

if TYPE_CHECKING:
    from dmuon.options import ResolvedOptions


class Bucket:
    """The runtime side of one :class:`dmuon.ownership.buckets.BucketSpec` on this rank.

    Args:
        index: position in the bucket order (changed by renumbering).
        module_name, module: the unit (``buckets.py``; its first block) and its module.
        blocks: the unit's blocks (dotted names, model order).
        aligned: member of an aligned group (one ``all_gather`` / ``reduce_scatter`` for
            the group's buckets: ``schedule.py``).
        owner: global owner index ``g = r * N + s``; ``shard_owner`` = ``s`` (group rank of
            the holder in each shard group), ``replicate_owner`` = ``r``.
        names, params, param_modules, placements: the params (model order), with the module
            each is registered in and its :class:`~dmuon.placement.base.Placement` (which
            tensor of it the bucket holds and how a tensor is shown as it).
        groups, divisor: the process groups its collectives run on (its placements'
            data-parallel mesh: ``broadcast``, ``reduce``, ``replicate``) and the divisor of its
            reduced grads (W of the data the grads came from).
        is_holder, is_owner: this rank's roles.
        options: the :class:`~dmuon.options.ResolvedOptions` of its ``DedicatedParams``
            (read: ``reshard_after_forward``, Z3: non-holders free the compute copy between
            uses; ``param_dtype``, the compute copy's dtype; ``reduce_dtype``).
        on_grad: ``on_grad(bucket, i)`` -> the post-accumulate-grad hook of param ``i``'s
            compute param (registered here, moved when the compute params change).
    """

    def __init__(self, *, index: int, module_name: str, module: nn.Module, blocks: tuple[str, ...],
                 aligned: bool, owner: int, shard_owner: int, replicate_owner: int, names: list[str],
                 params: list[nn.Parameter], param_modules: list[nn.Module], placements: list,
                 groups, divisor: int, is_holder: bool,
                 is_owner: bool, options: ResolvedOptions,
                 on_grad: Callable[[Bucket, int], Callable]) -> None:
        self.index, self.module_name, self.module = index, module_name, module
        self.blocks, self.aligned = tuple(blocks) or (module_name,), aligned
        self.owner, self.shard_owner, self.replicate_owner = owner, shard_owner, replicate_owner
        self.names, self.params, self.param_modules = names, params, param_modules
        self.placements = placements
        self.groups, self.divisor = groups, divisor
        self.is_holder, self.is_owner, self.options = is_holder, is_owner, options
        self._on_grad = on_grad
        self.flat = residency.flatten_into_views(self._locals())  # (numel,), the master dtype
        self.lp: torch.Tensor = self.flat  # (numel,), param_dtype copy (mixed precision)
        self.compute: list[nn.Parameter] = params  # views of lp that forward runs on
        self.copy = Copy.STALE  # made FREED by the first make_compute under Z3
        self.master: Copy | None = None  # mixed precision only
        self.replica = Replica.CURRENT
        self.grads = Grads.NONE
        self.used = [False] * len(params)  # this rank produced a grad since the last reduce
        self.sent_usage: list[bool] = []  # the usage flags of the reduce in flight (step 4)
        self.arrived: set[int] = set()  # grads arrived in this backward (the reduce trigger)
        self.grad_flat: torch.Tensor | None = None  # (numel + len(params),), lp's dtype
        self.grad_views: list[torch.Tensor] = []  # views of grad_flat, per param
        self._grad_hooks: list = []
        self._broadcast: Pending | None = None
        self._replicate: Pending | None = None
        self._reduce: Pending | None = None
        self._reduce_buf: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (f"Bucket({self.index}, {self.module_name!r}, owner={self.owner}, copy="
                f"{self.copy.name}, replica={self.replica.name}, grads={self.grads.name})")

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def mixed(self) -> bool:
        """Whether the compute copy is a separate (``param_dtype``) buffer."""
        return self.lp is not self.flat

    def _to(self, field: str, new) -> None:
        setattr(self, field, check(f"bucket {self.index} ({self.module_name!r}) {field}",
                                   getattr(self, field), new))

    def _locals(self) -> list[torch.Tensor]:
        """The params' local tensors (``Placement.local``): what ``flat`` views."""
        return [pl.local(p) for p, pl in zip(self.params, self.placements)]

    # ------------------------------------------------------------------ compute copy
    def make_compute(self, *, keep_master: bool = False, keep_copy: bool = False) -> None:
        """Build the compute copy (``options.param_dtype``) from ``flat`` and hook its grads. Mixed-precision
        non-holders then drop their master copy unless ``keep_master`` (``sync_params``
        brings it back); Z3 non-holders drop the compute copy (FREED) unless ``keep_copy``
        (then STALE: freed after the next forward)."""
        param_dtype = self.options.param_dtype
        if param_dtype is None or param_dtype == self.flat.dtype:
            self.lp, self.compute = self.flat, self.params
            self._to("master", None)  # no separate master copy (state.CREATED: a drop)
        else:
            self.lp = torch.empty(self.numel, dtype=param_dtype, device=self.flat.device)
            with torch.no_grad():
                self.lp.copy_(self.flat)
            self.compute, offset = [], 0
            for p, pl in zip(self.params, self.placements):
                shape = pl.local(p).shape  # the compute param is shown like p (a DTensor under TP)
                n = shape.numel()
                self.compute.append(nn.Parameter(pl.like(p, self.lp[offset : offset + n].view(shape))))
                offset += n
            # a new master copy (None -> its state), or the old one kept (STALE) or dropped
            self._to("master", Copy.STALE if keep_master else Copy.FREED)
            if not keep_master and not self.is_holder:
                self._free_master_storage()
        self._hook_grads()
        if self.options.reshard_after_forward and not keep_copy:
            self._to("copy", Copy.FREED)
            if not self.is_holder:
                self._free_compute_storage()
        else:
            self._to("copy", Copy.STALE)

    def _hook_grads(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = [q.register_post_accumulate_grad_hook(self._on_grad(self, i))
                            for i, q in enumerate(self.compute)]

    def refresh_compute(self) -> None:
        """Cast the master copy into the compute copy (mixed precision; local)."""
        if self.mixed:
            residency.alloc_storage(self.lp)
            with torch.no_grad():
                self.lp.copy_(self.flat)

    def swap(self, compute: bool, module: nn.Module | None = None) -> None:
        """Register the compute params (or back the registered ones) in their modules (only
        in ``module`` when given). A no-op without mixed precision."""
        if self.mixed:
            for m, n, p, q in zip(self.param_modules, self.names, self.params, self.compute):
                if module is None or m is module:
                    m._parameters[n.rpartition(".")[2]] = q if compute else p

    def receive_buffer(self, master: bool) -> torch.Tensor:
        """The buffer a broadcast from the holder writes (compute copy, or the master copy for
        ``sync_params``), its storage allocated on non-holders."""
        if not self.is_holder:
            self._alloc_master_storage() if master or not self.mixed else residency.alloc_storage(self.lp)
        return self.flat if master else self.lp

    def broadcast_issued(self, work: Pending) -> None:
        self._to("copy", Copy.IN_FLIGHT)
        self._broadcast = work

    def wait_broadcast(self) -> None:
        """Wait for the in-flight broadcast, if any: the copy is then VALID."""
        if self.copy is Copy.IN_FLIGHT:
            self._broadcast.wait()
            self._broadcast = None
            self._to("copy", Copy.VALID)

    def master_synced(self) -> None:
        """``sync_params`` broadcast the master copy (synchronously): every copy is current."""
        if self.mixed:
            self._to("master", Copy.VALID)
            self.refresh_compute()
        self._to("copy", Copy.VALID)

    def compute_from_master(self) -> None:
        """Mixed precision, master current everywhere: cast it into the compute copy (local)."""
        self.refresh_compute()
        self._to("copy", Copy.VALID)

    def load_problem(self) -> str | None:
        """Why a checkpoint load could not have written this bucket on its non-holders (its
        copy there is freed), else None. The same answer on every rank (agreed states)."""
        if self.flat.device.type == "meta" or (self.master if self.mixed else self.copy) is not Copy.FREED:
            return None
        return (f"{self.names[0]} is freed on the ranks that do not hold it (shard group rank "
                f"{self.shard_owner} holds it), so the load could not write it there")

    def loaded(self) -> None:
        """Identical values were written into every rank's params: every copy is current
        (call only when :meth:`load_problem` is None)."""
        self.refresh_compute()
        if self.mixed:
            self._to("master", Copy.VALID)
        self._to("copy", Copy.VALID)

    def free(self) -> None:
        """Z3: non-holders free the compute copy (FREED; waits an in-flight broadcast first)."""
        self.wait_broadcast()
        if self.copy is not Copy.FREED:
            self._to("copy", Copy.FREED)
            if not self.is_holder:
                self._free_compute_storage()

    def drop_master(self) -> None:
        """Mixed precision: non-holders' master copies (from ``sync_params``) are freed."""
        if self.mixed and self.master is not Copy.FREED:
            self._to("master", Copy.FREED)
            if not self.is_holder:
                self._free_master_storage()

    def stepped(self) -> None:
        """``step()`` changed the owner's values: every copy elsewhere is out of date."""
        if self.copy is Copy.VALID:
            self._to("copy", Copy.STALE)
        if self.master is Copy.VALID:
            self._to("master", Copy.STALE)
        if self.is_owner:
            self.refresh_compute()

    # ------------------------------------------------------------------ replica (HSDP)
    def replicate_issued(self, work: Pending) -> None:
        self._to("replica", Replica.RECEIVING)
        self._replicate = work

    def wait_replicate(self) -> None:
        """Wait for the owner's replicate broadcast, if any; holders cast it (mixed)."""
        if self.replica is Replica.RECEIVING:
            self._replicate.wait()
            self._replicate = None
            self._to("replica", Replica.CURRENT)
            self.refresh_compute()

    # ------------------------------------------------------------------ storage
    def _free_compute_storage(self) -> None:
        if self.mixed:
            residency.free_storage(self.lp)
        else:
            self._free_master_storage()

    def _free_master_storage(self) -> None:
        residency.free_storage(self.flat)
        for n, p, pl in zip(self.names, self.params, self.placements):
            residency.mark_freed(pl.guarded(p), f"{n} (owner rank {self.owner}) on rank {dist.get_rank()}")

    def _alloc_master_storage(self) -> None:
        residency.alloc_storage(self.flat)
        for p, pl in zip(self.params, self.placements):
            residency.mark_resident(pl.guarded(p))

    # ------------------------------------------------------------------ binding
    def adopt_replaced(self, same_kind: bool = False) -> list[int]:
        """Adopt params their modules now register instead of ours (``to_empty`` from meta,
        ``m.weight = nn.Parameter(...)``); returns their positions. ``same_kind``: only a
        replacement that is a DTensor exactly where ours is (not FSDP2's shard of a param
        ``fully_shard`` took because it was not in ``ignored_params``: the optimizer names
        that)."""
        replaced = []
        for i, (m, n) in enumerate(zip(self.param_modules, self.names)):
            q = m._parameters.get(n.rpartition(".")[2])
            if same_kind and q is not None and (
                    type(q).__name__ == "DTensor") != (type(self.params[i]).__name__ == "DTensor"):
                continue
            if q is not None and q is not self.params[i] and not any(q is c for c in self.compute):
                if q.shape != self.params[i].shape:
                    raise ValueError(
                        f"Invalid replacement of dedicated param {n!r}: the module now holds a "
                        f"param of shape {tuple(q.shape)} in place of the dedicated one of shape "
                        f"{tuple(self.params[i].shape)} (replaced by hand after "
                        "dmuon.dedicate_params, whose ownership plan is for the old shape). "
                        "Replace params before dedicate_params, or write new values into the "
                        "dedicated one: `with torch.no_grad(): module.weight.copy_(new)`.")
                self.params[i] = q
                replaced.append(i)
        if replaced and not self.mixed:
            self.compute = self.params
            self._hook_grads()
        return replaced

    def is_bound(self) -> bool:
        """Whether every param is still its view of ``flat``."""
        return residency.is_bound(self._locals(), self.flat)

    def consistent(self) -> bool:
        """Whether the params share one device and dtype (a rebind can join them)."""
        return len({(p.device, p.dtype) for p in self.params}) == 1

    def rebind(self) -> None:
        """A new ``flat`` from the params' current data (their device and dtype; waits first
        for in-flight calls), and a new compute copy. Copies that had values (or come from
        the meta device: the user initialises them next) stay allocated, STALE until the next
        forward; copies that were freed stay freed (their conversion carried no values).
        Holders' compute copies are cast from the master again at the next forward
        (:meth:`recast`), after the user's initialisation."""
        self.wait_broadcast()
        self.wait_replicate()
        from_meta = self.flat.device.type == "meta"
        keep_copy = from_meta or self.copy is not Copy.FREED
        keep_master = from_meta or (self.master if self.mixed else self.copy) is not Copy.FREED
        self.flat = residency.flatten_into_views(self._locals())
        self.make_compute(keep_master=keep_master, keep_copy=keep_copy)
        if self.is_holder or (keep_master if self.mixed else keep_copy):
            for p, pl in zip(self.params, self.placements):  # flat is allocated here: no freed guard
                residency.mark_resident(pl.guarded(p))

    def recast(self) -> None:
        """Holders: cast the master into the compute copy (after a rebind; mixed precision)."""
        if self.is_holder:
            self.refresh_compute()

    # ------------------------------------------------------------------ grads
    def grad_buffer(self) -> torch.Tensor:
        """The flat grad buffer: shape (numel + len(params),), the compute copy's dtype and
        device: the params' grads (``grad_views``), then one usage element per param
        (protocol step 4). Created on first use (again after ``.to()``); the views stay the
        same objects, so a ``.grad`` set to one follows the storage."""
        g = self.grad_flat
        if g is None or g.dtype != self.lp.dtype or g.device != self.lp.device:
            g = self.grad_flat = torch.empty(self.numel + len(self.params), dtype=self.lp.dtype,
                                             device=self.lp.device)
            self.grad_views, offset = [], 0
            for p in self._locals():  # views of the local tensors (a TP param's shard)
                self.grad_views.append(g[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
        else:
            residency.alloc_storage(g)
        return g

    def grad_arrived(self, i: int, q: torch.Tensor, counts: bool) -> None:
        """Compute param ``i`` got a grad: it becomes a view of the grad buffer (copied in
        unless it already is one; autograd then accumulates there in place). ``counts``:
        it counts towards this backward's reduce (not under ``no_sync``)."""
        self._to("grads", Grads.LOCAL)
        self.used[i] = True
        if counts:
            self.arrived.add(i)
        self.grad_buffer()
        view, g, pl = self.grad_views[i], q.grad, self.placements[i]
        if g is not None and not _is_view(pl.local(g), view):
            with torch.no_grad():
                view.copy_(pl.local(pl.placed_like(q, g)))
            q.grad = pl.like(q, view)

    def reduce_buffer(self) -> torch.Tensor:
        """The buffer to reduce: every local grad (zeros where none), then the usage
        elements (1 where ``used``), in ``options.reduce_dtype``."""
        reduce_dtype = self.options.reduce_dtype
        buf = self.grad_buffer()
        with torch.no_grad():
            for q, view, pl in zip(self.compute, self.grad_views, self.placements):
                if q.grad is None:
                    view.zero_()
                elif not _is_view(pl.local(q.grad), view):
                    view.copy_(pl.local(pl.placed_like(q, q.grad)))
        usage.fill_flags_(buf[self.numel :], self.used)  # no host-to-device copy (usage.py)
        return buf if reduce_dtype is None or buf.dtype == reduce_dtype else buf.to(reduce_dtype)

    def reduce_issued(self, work: Pending, buf: torch.Tensor) -> None:
        """The reduce of ``buf`` is in flight: local grads are consumed (non-owners and
        mixed-precision compute params drop theirs)."""
        self._to("grads", Grads.REDUCING)
        self._reduce, self._reduce_buf = work, buf
        self.sent_usage, self.used = self.used, [False] * len(self.params)
        if not self.is_owner or self.mixed:
            for q in self.compute:
                q.grad = None

    def wait_reduce(self) -> torch.Tensor | None:
        """Wait for the shard reduce (once); returns its buffer (the sums, on the holder;
        ``None`` on a non-holder once :meth:`reduce_settled`)."""
        if self._reduce is not None:
            self._reduce.wait()
            self._reduce = None
        return self._reduce_buf

    def reduce_settled(self) -> None:
        """Wait for the shard reduce; a non-holder, which reads nothing back, then frees its
        grad buffer (and a reduce-dtype copy of it) at once, not at the end of backward.
        On CUDA the wait orders the compute stream after the call, so the allocator hands
        the memory out again only after the call read it (``collectives.Pending``)."""
        self.wait_reduce()
        if not self.is_holder:
            self._reduce_buf = None
            self.free_grad_buffer()

    def grads_pending(self) -> bool:
        """Whether a grad of this bucket can still arrive in the running backward: a compute
        param that requires grad, has not had its grad yet, and whose grad accumulator the
        autograd engine will run in this backward (``torch._C._will_engine_execute_node``;
        outside a backward: True). False for a block that did not run on this rank, or whose
        output the loss does not use here."""
        if torch._C._current_graph_task_id() == -1:
            return True
        for i, q in enumerate(self.compute):
            if i not in self.arrived and q.requires_grad:
                with torch._C.DisableTorchFunctionSubclass(), torch.enable_grad():
                    node = q.view_as(q).grad_fn.next_functions[0][0]  # q's grad accumulator
                if torch._C._will_engine_execute_node(node):
                    return True
        return False

    def reduced(self, used: list[bool], world_size: int) -> None:
        """Every reduce into the holder's buffer is waited: owners set each param's averaged
        grad (``None`` where ``used`` is False, no rank had a grad, and no grad tensor was
        kept, as torch would; ``usage.used_anywhere``); non-holders free the buffer."""
        buf, self._reduce_buf = self._reduce_buf, None
        self._to("grads", Grads.REDUCED)
        if not self.is_holder:
            self.free_grad_buffer()
        if not self.is_owner:
            return
        same = buf.dtype == self.flat.dtype
        if same:
            buf.div_(world_size)
        offset = 0
        for p, pl, anywhere in zip(self.params, self.placements, used):
            n = pl.local(p).numel()
            g = buf[offset : offset + n].view_as(pl.local(p))
            if not same:  # mixed precision: the master grad, averaged in its dtype
                g = g.to(p.dtype).div_(world_size)
            p.grad = pl.like(p, g) if anywhere or p.grad is not None else None
            offset += n

    def show_grads(self, mesh, specs: dict) -> None:
        """Each param's ``.grad`` as a DTensor on ``mesh`` (``grad_view.py``), on every rank;
        a ``.grad`` that already is a DTensor stays."""
        with torch._C.DisableTorchFunctionSubclass():  # freed Z3 params: plain attribute reads
            for p in self.params:
                if p.requires_grad and not isinstance(p.grad, grad_view.DTensor):
                    p.grad = grad_view.shown(p, p.grad if self.is_owner else None, mesh, specs)

    def take_back_grads(self) -> None:
        """The plain grads back from :meth:`show_grads` (``grad_view.plain``)."""
        with torch._C.DisableTorchFunctionSubclass():
            for p in self.params:
                if isinstance(p.grad, grad_view.DTensor):
                    p.grad = grad_view.plain(p.grad, self.is_owner)

    def pass_ended(self) -> None:
        """A backward (or the iteration) ended: registered params in, arrivals forgotten."""
        self.arrived.clear()
        self.swap(False)

    def step_consumed(self) -> None:
        if self.grads is Grads.REDUCED:
            self._to("grads", Grads.STEPPED)

    def clear_grads(self) -> None:
        """``zero_grad()``: a new accumulation starts (the optimizer cleared the tensors)."""
        self._to("grads", Grads.NONE)
        self.used = [False] * len(self.params)

    def abort(self, drop_grads: bool) -> None:
        """Leave what an exception left: wait in-flight calls, registered params back, and
        (an aborted backward) drop every dedicated grad of this bucket."""
        self.wait_broadcast()
        self.wait_reduce()
        self._reduce_buf = None
        self.arrived.clear()
        self.swap(False)
        if drop_grads:
            for p in self.params + self.compute:
                p.grad = None
            self.clear_grads()
            if not self.is_holder:
                self.free_grad_buffer()

    def free_grad_buffer(self) -> None:
        """Drop the flat grad buffer's storage (non-holders, after their reduce)."""
        if self.grad_flat is not None:
            residency.free_storage(self.grad_flat)

    def close(self) -> None:
        """Registered params back and grad hooks removed (``DedicatedParams.close``)."""
        self.swap(False)
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []


def _is_view(g: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``g`` is ``view`` (same memory, shape and dtype)."""
    return g.data_ptr() == view.data_ptr() and g.shape == view.shape and g.dtype == view.dtype
