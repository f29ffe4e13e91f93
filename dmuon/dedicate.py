"""Dedicated ownership at runtime: the hooks that move each Muon matrix to and from its owner.

This docstring is the authoritative description of DMuon's protocol (the traffic predictor
in ``verify/`` is derived from it independently).

Glossary (see ``topology.py`` for the mesh terms):

- **dedicated param**: a Muon target (a matrix, a stack of matrices or a conv weight) handled by
  DMuon instead of DDP / FSDP2; the runtime moves it as flat elements, whatever its shape.
- **owner** (global owner): the one rank ``(r, s)`` that keeps momentum and runs
  Newton–Schulz for the param. **Holders**: the R ranks ``(*, s)`` of the owner's shard
  index; they keep the full param between steps (for 1-D meshes the holder is the owner).
- **block**: the longest prefix of a param's module name ending in an integer component (a
  ``ModuleList`` element such as ``blocks.3``), else the module itself (``buckets.block_of``).
- **bucket**: the dedicated params of one block with the same owner and dtype, cut into runs
  of at most ``bucket_cap_mb`` (``buckets.bucket_layout``), numbered ``0 .. B-1`` block by
  block in the **block order**: model order until the end of the first ``step()``, then the
  order in which the blocks' forwards first ran, agreed across ranks (step 7, rule in
  ``order.py``); within a block, model order. Their data are views into one flat buffer
  (``residency.py``), so one collective moves them all. A bucket's ``module`` is its block.
- **valid**: the non-holders' copies equal the owner's current values and are allocated.
  Every rank tracks the same flag for every bucket (it changes only at points every rank
  passes: the end of a driver's forward, of the root's forward, of backward, ``step()``,
  ``sync_params()``), so every rank takes the same collective decisions.
- **driver**: a module whose subtree holds buckets (the blocks and their ancestors, not the
  root). Its hooks cover the buckets of its whole subtree, a contiguous index range. With
  ``mp_policy``, the modules that hold dedicated params also get hooks that swap their
  compute params in for their forward and cast its inputs and output (in any state,
  activation-checkpoint recompute included).
- **state**: :class:`dmuon.state.TrainingState`, one per DedicatedParams.

Every asynchronous call goes through ``collectives.Launcher`` (work handles on gloo, side
streams and events on CUDA; ``collectives`` docstring, "Asynchrony").

Channels (``collectives.DMuonGroups``, DMuon's own process groups): ``broadcast`` and
``reduce`` over the shard axis (N ranks), ``replicate`` over the replicate axis (R ranks,
HSDP), ``world`` (W ranks). On each channel the call sequence per step is fixed, the same on
every rank whichever modules run (MoE experts that receive no tokens, a branch taken on some
ranks only), so calls always pair up with the same bucket on every rank.

Per step (SPEC §1):

1. **forward** (channel ``broadcast``, phase ``forward``): a forward cursor walks the buckets
   in index order (from the second step on, the blocks' execution order: step 7). The
   root's pre-hook issues the first ``prefetch_depth`` buckets (no wait: they fly during
   the root's prologue, an embedding, FSDP2's root all_gather). A driver's pre-hook
   advances it to the driver's last bucket ``hi``; the root's post-hook advances it to the
   end (so buckets of modules that did not run on this rank are still sent). Advancing to
   ``hi`` first *issues* every bucket up to
   ``hi + prefetch_depth`` not issued yet (each waits for its pending replicate broadcast
   (HSDP), then, if not valid, is broadcast from its holder, shard group rank ``s``,
   asynchronously), then *waits* for every bucket up to ``hi``, which become valid. So while
   a module computes, the broadcasts of the next ``prefetch_depth`` buckets are in flight.
   Exactly one broadcast per invalid bucket per forward, issued in index order on every
   rank (``prefetch_depth`` moves when a call is issued, never which or in what order).
2. **after forward**, Z3 (``reshard_after_forward=True``): a driver's post-hook frees the
   non-holders' storage of the buckets in its subtree that the cursor passed; the root's
   post-hook frees the rest. Every bucket is then invalid on every rank. **Reuse**: a block
   whose forward runs again in the same forward (weight sharing) finds its buckets freed;
   its pre-hook broadcasts each of them again from its holder (phase ``forward``, issued
   and waited there), as FSDP2 re-gathers a reused module, and its post-hook frees them
   again. Every rank must run the block the same number of times (as under FSDP2). Under
   Z2 the buckets stay valid: no call. A module *inside* a block that runs outside its
   block's forward after the block's buckets were freed reads the freed guard and raises.
3. **backward**, Z3 (channel ``broadcast``, phase ``backward``): a re-broadcast cursor walks
   the buckets in reverse index order. A driver's pre-backward hook (its outputs' first
   grad) advances it to the driver's first bucket; activation-checkpoint recompute (a
   driver's forward while backward runs) does the same and neither frees nor broadcasts in
   forward; the end of backward flushes the rest. Each bucket is re-broadcast exactly once,
   issued ``prefetch_depth`` buckets ahead in that reverse order (asynchronous, waited when
   the cursor reaches it). A bucket's storage is never freed while a broadcast into it is
   in flight (the free waits for it first).
4. **backward reduces** (channel ``reduce``, phase ``backward``): buckets reduce (sum) to the
   holder over the shard axis in reverse index order, asynchronously, each as soon as it and
   every bucket before it in that order have all their grads; at the end of backward every
   remaining bucket is reduced, a param without a local grad contributing zeros. A bucket's
   reduce carries ``numel + len(params)`` elements of the reduce dtype: the grads (params
   in bucket order), then one **usage** element per param, 1 if this rank produced a grad
   for it since the last reduce, else 0. Then all reduces are waited on, and (HSDP) each
   holder reduces its buckets over the replicate axis to the owner (channel ``replicate``,
   same order, phase ``backward``, the same ``numel + len(params)`` elements; each issued
   asynchronously once its shard reduce is waited, all waited before the results are read).
   A bucket's grads live in one flat grad buffer (``Bucket.grad_buffer``, the compute
   dtype): a param's grad hook copies a fresh ``.grad`` into its view and makes ``.grad``
   that view, so later accumulations (``no_sync`` micro-batches) land there in place and the
   reduce sends the buffer itself (no ``torch.cat``). Holders keep it between steps (the
   owner's ``.grad`` are its views); non-holders free its storage after the reduce wait.
5. **after the reduces** (local): the owner divides the reduced grads by W and sets
   ``.grad``, or ``None`` for a param whose reduced usage is 0 (unused on every rank: no
   update, as ``torch.optim.Muon``; any positive sum of 0/1 values stays positive in every
   reduce dtype, so this holds in bf16 too). An owner that kept a grad tensor from
   ``zero_grad(set_to_none=False)`` gets the reduced zeros instead, and steps on its
   momentum as torch would. Non-owners' grads are ``None``. Z3 non-holders
   free every bucket (all invalid). (The usage elements replaced a separate all_reduce over
   the world, a latency-bound call and a world-wide sync point every step.)
6. **step** (``optimizer.step()``): only owners update; every bucket becomes invalid; then
   (HSDP) each owner broadcasts its buckets to the holders over the replicate axis
   (channel ``replicate``, phase ``replicate``) asynchronously, in index order; the wait is
   in step 1.
7. **block order** (first ``step()`` only; channel ``world``, phase ``setup``, span
   ``dmuon.order_agreement``). During the first forward after ``dedicate_params`` (state
   FORWARD; activation-checkpoint recompute and later forwards are not recorded, a forward
   that raised is recorded again) each block records its name when its forward pre-hook
   first runs (the root block: the root's pre-hook). In the first ``step()``, after the
   update and before step 6's replicate broadcasts (every call of the step has then been
   waited on, so no call in flight can pair with a renumbered bucket; every rank reaches
   this point at the same place of its call sequence; the next forward is the first to use
   the order), every rank derives a block order from its record (``order.py``: model order
   if the record already follows it, else the blocks that ran in that order then the others
   in model order, and model order when some driver's buckets would not be contiguous)
   and all_gathers its sha256 (32 bytes per rank, all W ranks). If every digest is the same,
   the buckets are renumbered in that order (block by block, model order within a block);
   every later call sequence (steps 1-6, ``sync_params``) follows the new indices. If they
   differ (e.g. a module ran on some ranks only, out of model order), every rank warns once
   with the same text (the ranks holding each digest) and keeps model order. No other call:
   one per ``DedicatedParams``, none in later steps. A first ``step()`` with no forward
   before it agrees on model order.

Dtypes. Without ``mp_policy`` every call moves the params' dtype. With
``mp_policy=MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)`` (``rd`` None: ``pd``):
forward broadcasts and Z3 re-broadcasts send ``pd`` (the compute copy), shard and replicate
reduces run in ``rd``, the replicate broadcast (step 6) and ``sync_params`` send the master
dtype (fp32); the usage elements travel in ``rd``. Counts are unchanged. Holders keep the
master and cast it to ``pd`` locally (owners after the step, other holders after the
replicate wait); non-holders keep only the ``pd`` copy (master freed, until sync_params).

Outside the step:

- ``no_sync()``: backward passes inside skip steps 4-5 (grads accumulate locally); Z3 still
  re-broadcasts and frees. A ``step()`` with such grads never reduced (no backward outside
  ``no_sync`` since) raises instead of stepping owners on their local micro-batches.
- ``sync_params()`` (phase ``checkpoint``, channel ``broadcast``): every invalid bucket is
  broadcast from its holder in index order (after its pending replicate broadcast) and
  becomes valid; no call when all are valid. ``params_loaded()``: local, marks all valid.
- An exception in forward or backward leaves the state FORWARD or BACKWARD; the next root
  forward, ``zero_grad()`` or ``step()`` recovers: it waits for the reduces already issued,
  drops the dedicated grads of an aborted backward, frees Z3 non-holders (invalid) and
  starts over. Ranks must have raised at the same point (collectives issued identically).

Limit (blocking backends such as gloo): a module that runs on some ranks only is flushed by
the next driver every rank runs (e.g. the MoE block around its experts) or by the root's
end. If another library's blocking collective (an FSDP2 all_gather of a later block) comes
before that point on the ranks that skipped the module, the ranks wait on each other: keep
conditional modules inside a module that every rank runs. NCCL's asynchronous launches do
not block the CPU there.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from . import annotate, collectives, order, precision, residency
from .buckets import DEFAULT_BUCKET_CAP_MB, bucket_layout
from .copies import Bucket
from .schedule import Schedule
from .plan import OwnershipPlan, specs_from_named_parameters
from .state import StateMachine, TrainingState
from .topology import Topology

S = TrainingState


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class DedicatedParams(Schedule):
    """The dedicated params of one model and the hooks that manage them.

    Built by :func:`dedicate_params`; pass it to :class:`dmuon.DMuon`. Iterating yields the
    dedicated ``nn.Parameter`` objects (pass them as ``ignored_params`` to ``fully_shard``).
    The module docstring describes the protocol; call the model given to ``dedicate_params``
    (its root hooks end the forward's fixed schedule).

    Attributes:
        names: fully qualified names of the dedicated params, in model order.
        plan: the :class:`~dmuon.plan.OwnershipPlan` every rank agreed on.
        topology: this rank's :class:`~dmuon.topology.Topology`.
        reshard_after_forward: ``True`` for Z3 (non-holders free after forward), ``False`` for Z2.
        groups: DMuon's own process groups (:class:`~dmuon.collectives.DMuonGroups`).
    """

    def __init__(
        self,
        model: nn.Module,
        named: list[tuple[str, nn.Parameter, str]],
        topology: Topology,
        plan: OwnershipPlan,
        reshard_after_forward: bool,
        *,
        mesh=None,
        mp_policy=None,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_MB * 1024 * 1024,
        prefetch_depth: int = 1,
        assignments: list | None = None,
    ) -> None:
        self._assignments = list(assignments or ())
        self.bucket_cap_bytes = bucket_cap_bytes
        self.prefetch_depth = prefetch_depth
        self.names = [n for n, _, _ in named]
        self.mp_policy = mp_policy
        self._param_dtype, self._reduce_dtype = precision.dtypes(mp_policy)
        self.plan = plan
        self.topology = topology
        self.reshard_after_forward = reshard_after_forward
        self._params = [p for _, p, _ in named]
        self._param_ids = {id(p) for p in self._params}
        self._state = StateMachine()
        for p in self._params:
            collectives.check_param_device(p.device, topology.shard_group, "the dedicated params")
        rows = _mesh_rows(mesh, topology)
        self.groups = collectives.make_groups(rows)
        self._build_buckets(model, named)
        self._model_blocks = self.block_order  # model order (module docstring, step 7)
        self._order = order.OrderRecorder()
        self._order_agreed = False
        self._root = model
        self._fwd_cursor = 0  # next bucket index the forward cursor waits for
        self._fwd_issued = 0  # next bucket index the forward cursor issues (prefetch)
        self._rb_cursor = -1  # next bucket index the re-broadcast cursor waits for (downwards)
        self._rb_issued = -1  # next bucket index the re-broadcast cursor issues (downwards)
        self._reduce_cursor = 0  # position in reverse index order
        self._no_sync = False
        self._stepped = False  # a step() consumed the reduced grads; no zero_grad() since
        self._launchers: dict[torch.device, collectives.Launcher] = {}
        self._handles: list = []
        self._install_hooks(model)
        for b in self.buckets:
            self._make_compute(b)
            if reshard_after_forward and not b.is_holder:
                b.free_compute()

    def assignments(self) -> list:
        """Every param of the model, in model order, with where it goes and why: a list of
        :class:`dmuon.select.Assignment` (``name, shape, numel, optimizer, reason, matrix,
        role``; ``optimizer`` is ``"muon"`` for the dedicated params, ``"adamw"`` for the
        rest; ``as_row()`` gives the first five). Computed by :func:`dmuon.dedicate_params`."""
        return list(self._assignments)

    # ------------------------------------------------------------------ construction
    def _build_buckets(self, model: nn.Module, named) -> None:
        topology = self.topology
        modules = dict(model.named_modules())
        by_name = {n: p for n, p, _ in named}
        specs = specs_from_named_parameters((n, p) for n, p, _ in named)
        me = topology.global_index
        self.buckets: list[Bucket] = []
        for i, spec in enumerate(bucket_layout(specs, self.plan, self.bucket_cap_bytes)):
            r, s = topology.coords(spec.owner)
            params = [by_name[n] for n in spec.names]
            self.buckets.append(
                Bucket(
                    index=i,
                    module_name=spec.module,
                    module=modules[spec.module],
                    owner=spec.owner,
                    shard_owner=s,
                    replicate_owner=r,
                    names=list(spec.names),
                    params=params,
                    param_modules=[modules[n.rpartition(".")[0]] for n in spec.names],
                    flat=residency.flatten_into_views(params),
                    is_holder=s == topology.shard_index,
                    is_owner=spec.owner == me,
                    used=[False] * len(params),
                )
            )
        self._owner_by_id = {id(p): b.owner for b in self.buckets for p in b.params}
        self._name_by_id = {id(p): n for b in self.buckets for n, p in zip(b.names, b.params)}
        self._modules = modules
        self._index_buckets(model)

    def _index_buckets(self, model: nn.Module) -> None:
        """Everything that depends on bucket indices, from the order of ``self.buckets``."""
        modules = self._modules
        for i, b in enumerate(self.buckets):
            b.index = i
        # driver module -> (first, last) bucket index of its subtree, and its own buckets
        self._span: dict[nn.Module, tuple[int, int]] = {}
        self._own: dict[nn.Module, list[Bucket]] = {}
        # module holding dedicated params (not the root) -> buckets with params in it
        self._leaf: dict[nn.Module, list[Bucket]] = {}
        count: dict[nn.Module, int] = {}
        for b in self.buckets:
            self._own.setdefault(b.module, []).append(b)
            for m in dict.fromkeys(b.param_modules):
                if m is not model:
                    self._leaf.setdefault(m, []).append(b)
            for driver in order.drivers_of(b.module_name):
                m = modules[driver]
                lo, hi = self._span.get(m, (b.index, b.index))
                self._span[m] = (min(lo, b.index), max(hi, b.index))
                count[m] = count.get(m, 0) + 1
        # a driver's hooks cover one index range: order.py keeps every driver contiguous
        assert all(hi - lo + 1 == count[m] for m, (lo, hi) in self._span.items())

    def _install_hooks(self, model: nn.Module) -> None:
        h = self._handles
        h.append(model.register_forward_pre_hook(self._root_pre_forward))
        h.append(model.register_forward_hook(self._root_post_forward))
        # torch.compile: the hooks run eagerly (Dynamo must not trace into the schedule or
        # inspect freed Z3 copies); the module's own forward is still compiled.
        if self.mp_policy is not None:  # first: post-hooks swap back before a block frees
            leaf_pre = torch.compiler.disable(self._leaf_pre_forward)
            leaf_post = torch.compiler.disable(self._leaf_post_forward)
            for m in self._leaf:
                h.append(m.register_forward_pre_hook(leaf_pre))
                h.append(m.register_forward_hook(leaf_post))
        pre_forward = torch.compiler.disable(self._pre_forward)
        post_forward = torch.compiler.disable(self._post_forward)
        for m in self._span:
            h.append(m.register_forward_pre_hook(pre_forward))
            h.append(m.register_forward_hook(post_forward))
        self._grad_handles: dict[tuple[int, int], object] = {}
        for b in self.buckets:
            for i in range(len(b.params)):
                self._hook_grad(b, i)
        h.append(model.register_state_dict_pre_hook(self._before_state_dict))

    def _hook_grad(self, b: Bucket, i: int) -> None:
        old = self._grad_handles.pop((b.index, i), None)
        if old is not None:
            old.remove()
        target = b.compute[i] if b.compute else b.params[i]
        self._grad_handles[(b.index, i)] = target.register_post_accumulate_grad_hook(
            self._grad_hook(b, i)
        )

    # ------------------------------------------------------------------ public helpers
    def __iter__(self) -> Iterator[nn.Parameter]:
        self._rebind_if_moved()
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def __contains__(self, p: object) -> bool:
        return id(p) in self._param_ids

    @property
    def params(self) -> list[nn.Parameter]:
        """The dedicated params (plain tensors, never DTensors), in model order."""
        self._rebind_if_moved()
        return list(self._params)

    @property
    def state(self) -> TrainingState:
        """The current :class:`~dmuon.state.TrainingState`."""
        return self._state.state

    @property
    def block_order(self) -> tuple[str, ...]:
        """The blocks (dotted module names, ``""`` = root) in bucket-index order: model order
        until the first ``step()``, then the agreed execution order (module docstring, step 7)."""
        return tuple(dict.fromkeys(b.module_name for b in self.buckets))

    def owned(self) -> list[nn.Parameter]:
        """Params whose global owner is this rank (the only ones this rank steps)."""
        self._rebind_if_moved()
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

    def sync_params(self) -> None:
        """Make every rank's dedicated params hold the owner's current values (a collective).

        Call it on every rank, between steps (like FSDP's full state dict). Afterwards every
        copy is current and allocated, Z3 non-holders included; they stay so until the next
        forward frees them as usual, and that forward does not broadcast them again. Issues
        one broadcast per invalid bucket (phase ``checkpoint``, index order) and none when
        every copy is already current. Waits for in-flight replicate broadcasts (HSDP).

        Raises:
            RuntimeError: called while a forward or backward is running.
        """
        if self.state in (S.FORWARD, S.BACKWARD) and not self._aborted_ok():
            raise RuntimeError(
                f"DMuon: sync_params() called in state {self.state.name}. Call it between "
                "steps (after step() or before the forward), on every rank."
            )
        self._rebind_if_moved()
        for b in self.buckets:
            self._wait_replicate(b)
            if not (b.master_valid if b.mixed else b.valid):
                self._broadcast(b, "checkpoint")
            elif not b.valid:  # mixed precision: master current, compute copy stale or freed
                b.refresh_compute()
                b.valid = True

    def params_loaded(self) -> None:
        """Mark every copy current after identical values were written into every rank's
        dedicated params (a checkpoint load). Local: no collective.

        Raises:
            RuntimeError: a copy is freed on this rank (call :meth:`sync_params` before
                loading, so that every copy is allocated and can be written).
        """
        self.wait_pending()
        self._rebind_if_moved()
        for b in self.buckets:
            if not residency.is_allocated(b.flat) and b.flat.device.type != "meta":
                raise RuntimeError(
                    f"DMuon: params_loaded() but {b.names[0]} is freed on rank "
                    f"{dist.get_rank()}, so the load could not write it. Call "
                    "dm.sync_params() on every rank before loading."
                )
            b.refresh_compute()
            b.valid = b.master_valid = True

    def remove(self) -> None:
        """Remove every hook DMuon registered (the params stay where they are)."""
        self.wait_pending()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def unreduced_bucket(self):
        """A bucket with local grads not yet reduced to its owner (``no_sync`` backward
        passes since the last reduce), or ``None``. Local: each rank's own usage flags."""
        return next((b for b in self.buckets if any(b.used)), None)

    # ------------------------------------------------------------------ optimizer protocol
    def before_step(self) -> None:
        """Called by the optimizer before updating: in-flight sends must not be modified.

        Raises:
            RuntimeError: a backward pass has not finished (it raised, or step() was called
                from inside it), or grads accumulated under ``no_sync()`` were never reduced
                (owners would step on their own micro-batches only). Checked on each rank
                from its own grads, before any collective.
        """
        if self.state == S.BACKWARD:
            if _in_backward():
                raise RuntimeError(
                    "DMuon: optimizer.step() was called inside a backward pass. Call step() "
                    "after loss.backward() returns."
                )
            self._recover()
        local = self.unreduced_bucket()
        if local is not None:
            raise RuntimeError(
                f"DMuon: optimizer.step() after backward passes inside dm.no_sync() only: the "
                f"grads of {local.names[0]} (and others) were accumulated locally on rank "
                f"{dist.get_rank()} and never reduced to their owners. Run the last "
                "micro-batch's backward outside `with dm.no_sync():`, or call "
                "optimizer.zero_grad() to drop them."
            )
        self.wait_pending()
        self._rebind_if_moved()

    def after_step(self) -> None:
        """Mark every bucket invalid; HSDP owners start the async replicate broadcasts."""
        if self.state == S.FORWARD:
            self._recover()
        self._end_iteration()
        self._stepped = any(b.reduced for b in self.buckets)
        if not self._order_agreed:
            self._agree_order()
        for b in self.buckets:
            b.valid = b.master_valid = False
            if b.is_owner:
                b.refresh_compute()
        if self.groups.replicate is None:
            return
        with annotate.phase("replicate"):
            for b in self.buckets:
                if b.is_holder:
                    with annotate.span("dmuon.replicate_broadcast", module=b.module_name, owner=b.owner):
                        b.replicate_work = self._launcher(b.flat).broadcast(
                            b.flat, b.replicate_owner, self.groups.replicate, channel="replicate"
                        )

    def after_zero_grad(self) -> None:
        """Grads were cleared: a new accumulation may start (recovers an aborted step)."""
        if self.state in (S.FORWARD, S.BACKWARD):
            self._recover()
        self._stepped = False
        for b in self.buckets:
            b.reduced = False
            b.used = [False] * len(b.params)

    # ------------------------------------------------------------------ block order
    def _agree_order(self) -> None:
        """Agree on the first forward's block order and renumber (module docstring, step 7)."""
        assert all(b.broadcast_work is None and b.reduce_work is None and b.replicate_work is None
                   for b in self.buckets), "a call is in flight while renumbering"
        self._order_agreed = True
        proposal = order.execution_block_order(self._model_blocks, self._order.recorded)
        world = self.groups.world
        digests = collectives.all_gather_order_digests(order.order_digest(proposal), world)
        if len(set(digests)) != 1:
            ranks = [dist.get_global_rank(world, i) for i in range(len(digests))]
            warnings.warn(
                "DMuon: the blocks ran in different orders on different ranks in the first "
                f"forward (digests of the derived block order: {collectives.ranks_by_digest(digests, ranks)}"
                "), so the buckets keep model order and prefetch follows model order. Run the "
                "same blocks in the same order on every rank in the first step to get buckets "
                "in execution order (README, 'Overlap').",
                stacklevel=3,
            )
            return
        if proposal != self._model_blocks:
            self._renumber(proposal)

    def _renumber(self, blocks: tuple[str, ...]) -> None:
        """Buckets block by block in ``blocks`` order (stable: model order within a block)."""
        position = {name: i for i, name in enumerate(blocks)}
        old_index = {id(b): b.index for b in self.buckets}
        self.buckets.sort(key=lambda b: position[b.module_name])
        self._index_buckets(self._root)
        new_index = {old_index[id(b)]: b.index for b in self.buckets}
        self._grad_handles = {(new_index[k], i): h for (k, i), h in self._grad_handles.items()}

    # ------------------------------------------------------------------ state changes
    def _aborted_ok(self) -> bool:
        """Outside autograd, a FORWARD/BACKWARD state is a leftover of an exception."""
        if _in_backward():
            return False
        self._recover()
        return True

    def _recover(self) -> None:
        """Leave the state an exception left behind (module docstring, 'Outside the step')."""
        old = self._state.recover()
        for b in self.buckets:
            self._wait_broadcast(b)
            if b.reduce_work is not None:
                b.reduce_work.wait()
            b.reduce_work = b.reduce_buf = None
            if not b.is_holder:
                b.free_grad_buffer()
            b.swap(False)
            if old == S.BACKWARD:
                for p in b.params + b.compute:
                    p.grad = None
                b.reduced = False
                b.used = [False] * len(b.params)
        self._end_iteration()

    def _end_iteration(self) -> None:
        """Cursors back to the start; Z3 non-holders free everything (all invalid)."""
        for b in self.buckets:
            b.ready.clear()
            self._free_non_holder(b)
        self._fwd_cursor = self._fwd_issued = 0
        self._rb_cursor = self._rb_issued = -1
        self._reduce_cursor = 0
        if self._state.state != S.IDLE:
            self._state.to(S.IDLE)

    def _begin_forward(self) -> None:
        if self.state in (S.FORWARD, S.BACKWARD):
            self._recover()  # the last forward or backward raised
        self._rebind_if_moved()
        self._state.to(S.FORWARD)
        self._order.begin()
        self._fwd_cursor = self._fwd_issued = 0
        for b in self.buckets:  # mixed precision: master copies of non-holders (sync) go
            if b.mixed and not b.is_holder and residency.is_allocated(b.flat):
                b.free_master()

    def _end_forward(self) -> None:
        self._order.end()
        self._advance_forward(len(self.buckets) - 1)
        if self.reshard_after_forward:
            for b in self.buckets:
                self._free_non_holder(b)
        self._state.to(S.FORWARD_DONE)

    def _begin_backward(self) -> None:
        if self.state == S.BACKWARD:
            return
        if self.state == S.FORWARD:
            self._end_forward()
        if self.state not in (S.FORWARD_DONE, S.BACKWARD_DONE):
            raise RuntimeError(
                f"DMuon: a backward started in state {self.state.name}, with no forward "
                "through the model given to dedicate_params since the last step."
            )
        if not self._no_sync and any(b.reduced for b in self.buckets):
            done = next(b for b in self.buckets if b.reduced)
            if self._stepped:
                raise RuntimeError(
                    f"DMuon: a backward started after optimizer.step() without "
                    f"optimizer.zero_grad(); grads (e.g. of {done.names[0]}) are still those "
                    "of the last step. Call optimizer.zero_grad() (the DMuon optimizer's: "
                    "model.zero_grad(), ddp.zero_grad() or setting p.grad = None do not tell "
                    "DMuon that the grads were cleared)."
                )
            raise RuntimeError(
                f"DMuon: a second backward started before optimizer.step() or zero_grad(); "
                f"grads (e.g. of {done.names[0]}) were already reduced to their owners. For "
                "gradient accumulation wrap all but the last micro-batch in "
                "`with dm.no_sync():`."
            )
        self._state.to(S.BACKWARD)
        self._rb_cursor = self._rb_issued = len(self.buckets) - 1
        self._reduce_cursor = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    # ------------------------------------------------------------------ hooks
    def _before_state_dict(self, *args, **kwargs) -> None:
        self.wait_pending()

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        if self.state == S.BACKWARD and _in_backward():
            return  # recompute of a checkpointed root
        self._begin_forward()
        if module in self._own:  # buckets of the root module itself
            self._order.note("")
            self._advance_forward(max(b.index for b in self._own[module]))
        else:  # nothing needed yet: the first buckets fly during the root's own prologue
            self._issue_forward(self.prefetch_depth - 1)

    def _root_post_forward(self, module: nn.Module, args, output) -> None:
        if self.state != S.FORWARD:
            return  # recompute
        self._end_forward()
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and torch.is_grad_enabled():
            register_multi_grad_hook(outputs, lambda grads: self._root_pre_backward(), mode="any")

    def _root_pre_backward(self) -> None:
        self._begin_backward()
        if self.reshard_after_forward and self._root in self._own:
            self._advance_rebroadcast(min(b.index for b in self._own[self._root]))

    def _pre_forward(self, module: nn.Module, args) -> None:
        lo, hi = self._span[module]
        own = self._own.get(module, ())
        if self.state == S.BACKWARD and _in_backward():  # activation-checkpoint recompute
            if self.reshard_after_forward:
                self._advance_rebroadcast(lo)
            return None
        if self.state != S.FORWARD:
            self._begin_forward()  # a forward that did not enter through the root
        if own:
            self._order.note(own[0].module_name)
        self._advance_forward(hi)
        for b in own:
            if not b.valid:  # Z3, the block runs again in this forward: same on every rank
                self._wait_replicate(b)
                self._broadcast(b, "forward")
                self._wait_broadcast(b)
        return None

    def _leaf_pre_forward(self, module: nn.Module, args):
        """Mixed precision: the module's compute params in, its inputs cast (any state)."""
        for b in self._leaf[module]:
            b.swap(True, module)
        return precision.cast_inputs(self.mp_policy, args)

    def _leaf_post_forward(self, module: nn.Module, args, output):
        for b in self._leaf[module]:
            b.swap(False, module)
        return precision.cast_output(self.mp_policy, output)

    def _post_forward(self, module: nn.Module, args, output):
        if self.state != S.FORWARD or not self.reshard_after_forward:
            return None  # recompute, or Z2
        lo, hi = self._span[module]
        for b in self.buckets[lo : min(hi, self._fwd_cursor - 1) + 1]:
            self._free_non_holder(b)
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and torch.is_grad_enabled():
            register_multi_grad_hook(outputs, lambda grads: self._pre_backward(lo), mode="any")
        return None

    def _pre_backward(self, lo: int) -> None:
        self._begin_backward()
        self._advance_rebroadcast(lo)

    def _grad_hook(self, b: Bucket, i: int):
        def hook(p: nn.Parameter) -> None:
            self._begin_backward()
            b.used[i] = True
            b.grad_into_buffer(i, p)
            if self._no_sync:
                return
            b.ready.add(i)
            self._advance_reduce(final=False)

        return hook

    def _end_backward(self) -> None:
        if self.reshard_after_forward:
            self._advance_rebroadcast(0)
        if not self._no_sync:
            self._advance_reduce(final=True)
            self._finish_reduces()
        for b in self.buckets:
            b.ready.clear()
            b.swap(False)
            self._free_non_holder(b)
        self._state.to(S.BACKWARD_DONE)

    def _make_compute(self, b: Bucket) -> None:
        if b.make_compute(self._param_dtype):
            for i in range(len(b.params)):
                self._hook_grad(b, i)

    def _rebind_if_moved(self) -> None:
        """Follow ``.to()`` / ``to_empty()`` / ``p.data = ...`` after ``dedicate_params``.

        A module param replaced by a new object (``to_empty`` from meta does that) is
        adopted (grad hook moved); a param whose storage no longer is its view of the flat
        buffer gets a new flat buffer built from its current data (device and dtype follow).
        Such buckets become invalid (re-sent from their holders at the next forward), and Z3
        non-holders free them. Local: every rank must have applied the same call.
        """
        for b in self.buckets:
            current = [m._parameters[n.rpartition(".")[2]] for m, n in zip(b.param_modules, b.names)]
            replaced = [
                i for i, (p, q) in enumerate(zip(b.params, current))
                if p is not q and not any(q is c for c in b.compute)  # not swapped in by us
            ]
            for i in replaced:
                old = b.params[i]
                self._params[next(k for k, q in enumerate(self._params) if q is old)] = current[i]
                b.params[i] = current[i]
                self._hook_grad(b, i)
            if replaced:
                self._param_ids = {id(p) for p in self._params}
                self._owner_by_id = {id(p): c.owner for c in self.buckets for p in c.params}
                self._name_by_id = {id(p): n for c in self.buckets for n, p in zip(c.names, c.params)}
            if not replaced and residency.is_bound(b.params, b.flat):
                continue
            if b.replicate_work is not None:  # HSDP: moved while the step's values were in flight
                self._refill_moved(b, replaced)
            b.flat = residency.flatten_into_views(b.params)
            collectives.check_param_device(b.flat.device, self.groups.broadcast, b.names[0])
            self._make_compute(b)
            b.valid = b.master_valid = False
            if self.reshard_after_forward and not b.is_holder:
                b.free_compute()
            elif residency.is_allocated(b.flat):
                for p in b.params:
                    residency.mark_resident(p)


    def _refill_moved(self, b: Bucket, replaced: list[int]) -> None:
        """Wait for ``b``'s replicate broadcast, which writes the owner's new values into the
        old flat buffer, and copy them into the moved params (``.to()`` copied the old buffer
        before they arrived: the replicate peers would keep the previous step's values).
        Params replaced by new objects (``to_empty``) are left to their new initialisation."""
        old = b.flat
        self._wait_replicate(b)
        offset = 0
        with torch.no_grad():
            for i, p in enumerate(b.params):
                n = p.numel()
                if i not in replaced:
                    p.copy_(old[offset : offset + n].view(p.shape))
                offset += n


def _mesh_rows(mesh, topology: Topology) -> list[list[int]]:
    """World ranks of every shard group (one row per replicate index)."""
    if mesh is None:
        assert topology.replicate_size == 1, "HSDP needs the mesh to build DMuon's groups"
        return [list(topology.shard_group_ranks)]
    ranks = mesh.mesh.tolist()
    return [ranks] if mesh.ndim == 1 else ranks
