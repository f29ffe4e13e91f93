"""The public handle of dedicated ownership: :class:`DedicatedParams`, what
:func:`dmuon.dedicate_params` returns.

It holds the dedicated params of one model (iterating yields them: ``fully_shard``'s
``ignored_params``), the plan, the mesh layout and the resolved options, and exposes the calls
a training script makes: :meth:`DedicatedParams.sync_params`,
:meth:`DedicatedParams.params_loaded`, :meth:`DedicatedParams.wait_pending`,
:meth:`DedicatedParams.no_sync`, the optimizer's protocol (what :class:`dmuon.DMuon` calls
around ``step()`` and ``zero_grad()``), :meth:`DedicatedParams.close` and the context manager.
It builds the :class:`~dmuon.runtime.runtime.Runtime` and its process groups, attaches the hooks
(``attach.py``) and the checkpoint hooks (``checkpoint.py``), and undoes both at ``close()``.

The protocol those hooks follow (every collective, its channel, phase and issuer, steps 1-7,
mixed precision, what happens outside the step, TP and EP) is ``docs/protocol.md``, the one
authoritative description; which module implements which part is ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
import torch.nn as nn

from dmuon.options import ResolvedOptions
from dmuon.runtime import attach, checkpoint, collectives
from dmuon.ownership import buckets
from dmuon.placement.layout import MeshLayout
from dmuon.runtime.runtime import Runtime, in_backward
from dmuon.runtime.rest import ReplicatedRest, rest_of
from dmuon.runtime.state import DdpCheck, Grads, TrainingState
from dmuon.ownership.topology import Topology

S = TrainingState


class DedicatedParams:
    """The dedicated params of one model and the hooks that manage them.

    Built by :func:`dedicate_params`; pass it to :class:`dmuon.DMuon`. Iterating yields the
    dedicated ``nn.Parameter`` objects (pass them as ``ignored_params`` to ``fully_shard``).
    ``docs/protocol.md`` describes the protocol; call the model given to ``dedicate_params``
    (its root hooks end the forward's fixed schedule). Release it with :meth:`close` (or use
    it as a context manager) on every rank.

    Attributes:
        names: fully qualified names of the dedicated params, in model order.
        plan: the :class:`~dmuon.ownership.plan.OwnershipPlan` the runtime moves by (the
            data-parallel plan; every rank agreed on ``layout.agreed_plan``).
        layout: the :class:`~dmuon.placement.layout.MeshLayout` of the mesh (its data-parallel
            and model-parallel dims, the columns); ``placements``: name -> the
            :class:`~dmuon.placement.base.Placement` of each dedicated param.
        topology: this rank's :class:`~dmuon.ownership.topology.Topology`.
        options: the :class:`~dmuon.options.ResolvedOptions` every part of the runtime reads:
            ``options.given`` the knobs given to ``dedicate_params`` (validated), the rest what
            they resolved to here. Read-only views of it: ``reshard_after_forward`` (``True``
            for Z3), ``bucket_cap_bytes``, ``prefetch_depth``, ``coalesce_bytes`` (the unit
            target in bytes), ``reduce_by_gather``, ``hierarchy`` and ``link`` (as given),
            ``flat`` (an HSDP mesh moved flat, as a 1-D mesh of all W ranks; ``topology`` and
            ``plan`` stay the mesh's), ``rest`` (``"wrapper"``: DDP / FSDP2 handle the params
            DMuon does not dedicate; ``"replicate"``: DMuon, ``rest.py``) and ``rest_names``
            (those params in model order under ``"replicate"``, else empty).
        mesh_ranks: the world ranks of the mesh given to ``dedicate_params``
            (``mesh.mesh.tolist()``: nested lists, row r = replicate index r), ``None``
            without one.
    """

    def __init__(
        self,
        model: nn.Module,
        named: list[tuple[str, nn.Parameter, str]],
        topology: Topology,
        layout: MeshLayout,
        options: ResolvedOptions,
        *,
        mesh=None,
        assignments: list | None = None,
    ) -> None:
        self._assignments = list(assignments or ())
        self.options = options
        self.mesh_ranks = None if mesh is None else mesh.mesh.tolist()
        #: the mesh given to dedicate_params when it is a pipeline stage's slice
        #: (``topology.stage_ranks``), else ``None``: the optimizer's agreement stays inside it
        self.stage_mesh = mesh if getattr(layout, "stage", None) is not None else None
        # what the runtime moves by: an HSDP mesh moved flat is a 1-D layout of all W ranks
        plan = layout.plan
        moved, moved_plan = topology, plan
        if options.flat:
            moved = topology.flattened()
            moved_plan = dataclasses.replace(plan, mesh_shape=moved.mesh_shape)
        self.names = [n for n, _, _ in named]
        self.plan = plan
        self.topology = topology
        for _, p, _ in named:
            collectives.check_param_device(p.device, topology.shard_group, "the dedicated params")
        self._model = model
        self.layout = layout
        self.placements = layout.placements
        self._groups = layout.make_groups(mesh, moved)
        replicated = (None if options.rest != "replicate"
                      else ReplicatedRest(model, list(options.rest_names), self._groups.world))
        for p in replicated.params() if replicated is not None else ():
            collectives.check_param_device(p.device, self._groups.world, "the rest's params")
        self._runtime: Runtime | None = Runtime(model, named, moved, moved_plan, self._groups, self.placements,
                                                options, extra_meshes=layout.extra_meshes(self._groups),
                                                replicated=replicated)
        self._hooks = attach.HookSet()
        self._runtime.install(self._hooks)
        checkpoint.install(model, self, self._hooks)
        # rest="replicate": DDP must not handle the rest either (wrap nothing)
        self._ddp_ignored_before = attach.ignore_in_ddp(model, self.names + self.rest_names)
        attach.mark_dedicated((p for _, p, _ in named), self._runtime)

    # ------------------------------------------------------------------ options (read-only)
    @property
    def reshard_after_forward(self) -> bool:
        return self.options.reshard_after_forward

    @property
    def bucket_cap_bytes(self) -> int:
        return self.options.bucket_cap_bytes

    @property
    def prefetch_depth(self) -> int:
        return self.options.prefetch_depth

    @property
    def coalesce_bytes(self) -> int:
        return self.options.coalescing.target_bytes

    @property
    def reduce_by_gather(self) -> bool:
        return self.options.reduce_by_gather

    @property
    def hierarchy(self) -> str:
        return self.options.given.hierarchy

    @property
    def link(self) -> str:
        return self.options.given.link

    @property
    def flat(self) -> bool:
        return self.options.flat

    @property
    def rest(self) -> str:
        return self.options.rest

    @property
    def rest_names(self) -> list[str]:
        return list(self.options.rest_names)

    # ------------------------------------------------------------------ lifecycle
    def assignments(self) -> list:
        """Every param of the model, in model order, with where it goes and why: a list of
        :class:`dmuon.ownership.select.Assignment` (``name, shape, numel, optimizer, reason,
        matrix, role``; ``optimizer`` is ``"muon"`` for the dedicated params, ``"adamw"`` for
        the rest; ``as_row()`` gives the first five). Computed by :func:`dmuon.dedicate_params`."""
        return list(self._assignments)

    def close(self, *, sync: bool = True) -> None:
        """Detach DMuon from the model and release its process groups. Call it on every
        rank, in the same order relative to other ``DedicatedParams.close()`` and process
        group calls (it destroys DMuon's groups, a collective-order operation), between
        steps. A second call does nothing.

        In order: ``sync_params()`` (a collective; ``sync=False`` skips it, as leaving a
        ``with`` block by an exception does), so every rank holds the owner's current
        values, allocated; waits for in-flight calls (and, with ``sync``, blocks until the
        accelerator finished them); removes every hook; puts the modules'
        original classes back (``.to()`` is no longer followed); removes the names DMuon
        added to DDP's ignore list; destroys DMuon's process groups. The params stay where
        they are, plain params that nothing synchronizes any more. Afterwards every method
        of this handle (and ``DMuon.step()``) raises; the model can be dedicated again.

        Raises:
            RuntimeError: called inside a backward pass; or (``sync=True``) with grads
                accumulated under ``no_sync()`` and never reduced (each rank would keep its own micro-batches' grads). Checked on every
                rank from state every rank shares, before any collective.
        """
        rt = self._runtime
        if rt is None:
            return
        if in_backward():
            raise RuntimeError("DMuon: close() was called inside a backward pass. Call it "
                               "between steps, on every rank.")
        local = self.unreduced_param() if sync else None
        if local is not None:
            raise RuntimeError(
                f"DMuon: close() with grads accumulated under dm.no_sync() and never reduced "
                f"(e.g. {local}): each rank would keep its own micro-batches' grads. Run the "
                "last micro-batch's backward outside no_sync() and step(), or call "
                "optimizer.zero_grad() before close().")
        if sync:
            self.sync_params()
        elif rt.state in (S.FORWARD, S.BACKWARD):
            rt.recover()  # local: waits for the calls already issued
        rt.wait_pending()
        if sync:  # block until the calls finished; after an exception, shutdown aborts them
            rt.schedule.drain()
        self._hooks.remove_all()
        attach.unignore_in_ddp(self._model, self.names + self.rest_names, self._ddp_ignored_before)
        attach.release_dedicated(self.params)
        rt.close()
        groups, self._groups, self._runtime = self._groups, None, None
        collectives.destroy_groups(groups)  # their threads and sockets go with the last reference

    @property
    def model(self) -> nn.Module:
        """The module given to ``dedicate_params`` (a pipeline stage's module under PP)."""
        return self._model

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._runtime is None

    @property
    def groups(self) -> collectives.DMuonGroups:
        """DMuon's own process groups (:class:`~dmuon.runtime.collectives.DMuonGroups`)."""
        self._live("groups")
        return self._groups

    def __enter__(self) -> DedicatedParams:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(sync=exc_type is None)

    def _live(self, what: str) -> Runtime:
        if self._runtime is None:
            raise RuntimeError(
                f"DMuon: {what} on a DedicatedParams after close(): its hooks and process "
                "groups are gone. Build a new one with dmuon.dedicate_params (and a new "
                "dmuon.DMuon optimizer) to train with DMuon again."
            )
        return self._runtime

    # ------------------------------------------------------------------ params
    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, p: object) -> bool:
        return id(p) in self._live("`p in dm`").by_id

    @property
    def params(self) -> list[nn.Parameter]:
        """The dedicated params, in model order: plain tensors, or (TP meshes) the model's own
        TP DTensors, whose local shards DMuon manages."""
        rt = self._live("params")
        rt.adopt_replaced()  # replaced by hand since: the new objects (set(dm), the optimizer)
        by_name = {n: p for b in rt.buckets for n, p in zip(b.names, b.params)}
        return [by_name[n] for n in self.names]

    @property
    def buckets(self) -> list:
        """The :class:`~dmuon.runtime.bucket.Bucket` objects in index order (read-only use)."""
        return self._live("buckets").buckets

    @property
    def mp_policy(self):
        """The mixed-precision policy the hooks apply (``None``: none; fixed by
        ``dedicate_params``, whose setup agreement covers it)."""
        self._live("mp_policy")
        return self.options.mp_policy

    @property
    def state(self) -> TrainingState:
        """The current :class:`~dmuon.runtime.state.TrainingState` (CLOSED after :meth:`close`)."""
        return S.CLOSED if self._runtime is None else self._runtime.state

    @property
    def block_order(self) -> tuple[str, ...]:
        """The blocks (dotted module names, ``""`` = root) in bucket-index order: model order
        until the first ``step()``, then the agreed execution order (``docs/protocol.md``, step 7)."""
        return self._live("block_order").block_order()

    def coalescing(self) -> dict:
        """How the blocks share collectives on this rank (docs/traffic-model.md, "Coalescing").

        Returns a dict: ``target_bytes`` (the unit target ``coalesce`` resolved to);
        ``reduce_by_gather`` (reduces run as gathers and reduce_scatters as all_to_alls, each
        summed by the receiver: gloo; ``docs/protocol.md``, step 4); ``hierarchy``: how an HSDP
        mesh moves the dedicated params, ``"flat"`` or ``"hierarchical"`` (``dedicate_params``'
        ``hierarchy`` resolved; ``None`` on a 1-D mesh);
        ``units``: one row per unit in bucket order, ``{"name", "blocks", "bytes", "aligned"}``
        (``bytes``: its dedicated params in their own dtype; ``aligned``: every one of its
        buckets is in an aligned group); ``calls_per_step``: DMuon's
        collectives this rank takes part in per step outside the first, by protocol step
        (``forward``, ``backward`` (Z3 re-broadcasts of every unit but the last, and
        reduces), ``replicate``; an aligned group counts one call per channel);
        ``z3_peak_bytes``: under Z3 the most compute-copy bytes this rank holds at once for
        buckets it does not hold (docs/traffic-model.md, "Z3 memory bound"): over every unit,
        its buckets and the ``prefetch_depth`` buckets after them (forward) or before them
        (backward), each widened to its whole aligned group, when every block runs once per
        forward (a block that does not run keeps its unit until the root's post-forward, a
        rerun refills its unit); 0 under Z2; ``rest``: ``{"mode",
        "params", "bytes"}``, the rest DMuon replicates (``rest="replicate"``: its all_reduces,
        one per dtype, count in ``backward``; 0 params under ``"wrapper"``).
        """
        rt = self._live("coalescing()")
        units: dict[str, dict] = {}
        for b in rt.buckets:
            row = units.setdefault(b.module_name, {"name": b.module_name, "blocks": b.blocks,
                                                   "bytes": 0, "aligned": True})
            row["aligned"] = row["aligned"] and b.aligned
            row["bytes"] += b.numel * b.flat.element_size()
        def calls_of(buckets) -> int:  # an aligned group counts once
            return len({id(rt.schedule.groups_of.get(id(b), b)) for b in buckets})

        calls = calls_of(rt.buckets)
        # Z3 re-broadcasts every unit but the last (docs/protocol.md, step 2)
        rebroadcasts = calls - calls_of(b for b in rt.buckets
                                        if b.module_name == rt.buckets[-1].module_name)
        replicate = 0
        if self.topology.replicate_size > 1 and not self.flat:
            held = [b for b in rt.buckets if b.is_holder]
            replicate = 2 * calls_of(held)
        z3 = self.reshard_after_forward
        peak = _z3_window_bytes(rt.buckets, rt.schedule.groups_of, self.prefetch_depth) if z3 else 0
        rest = rt.replicated.params() if rt.replicated is not None else []
        rest_calls = len({p.dtype for p in rest if p.requires_grad})  # one all_reduce per dtype
        hsdp = self.topology.replicate_size > 1
        return {"target_bytes": self.coalesce_bytes, "reduce_by_gather": self.reduce_by_gather,
                "hierarchy": ("flat" if self.flat else "hierarchical") if hsdp else None,
                "units": list(units.values()),
                "calls_per_step": {"forward": calls,
                                   "backward": calls + (rebroadcasts if z3 else 0) + replicate // 2
                                   + rest_calls,
                                   "replicate": replicate // 2},
                "z3_peak_bytes": peak,
                "rest": {"mode": self.rest, "params": len(rest),
                         "bytes": sum(p.numel() * p.element_size() for p in rest)}}

    def owned(self) -> list[nn.Parameter]:
        """Params whose global owner is this rank (the only ones this rank steps). On a TP
        mesh: every rank of the owner's TP group (each holds and steps its shard)."""
        return [p for b in self._live("owned()").buckets if b.is_owner for p in b.params]

    def _bucket_of(self, p: nn.Parameter, what: str):
        return self._entry(p, what)[0]

    def _entry(self, p: nn.Parameter, what: str):
        """``(bucket, position)`` of a dedicated param (``Runtime.by_id``)."""
        entry = self._live(what).by_id.get(id(p))
        if entry is None:
            raise ValueError(
                f"Invalid param of shape {tuple(p.shape)}: not dedicated by this DedicatedParams."
            )
        return entry

    def owner_of(self, p: nn.Parameter) -> int:
        """Global owner index ``g`` of a dedicated param.

        Raises:
            ValueError: ``p`` is not a dedicated param.
        """
        return self._bucket_of(p, "owner_of()").owner

    def block_of(self, p: nn.Parameter) -> str:
        """The block (``buckets.py``) of a dedicated param.

        Raises:
            ValueError: ``p`` is not a dedicated param.
        """
        b = self._bucket_of(p, "block_of()")
        name = b.names[next(i for i, q in enumerate(b.params) if q is p)]
        return buckets.block_of(name.rpartition(".")[0])

    def unit_of(self, p: nn.Parameter) -> str:
        """The unit (``buckets.py``: the blocks that share its collectives, named by the
        first) of a dedicated param: the module its spans name.

        Raises:
            ValueError: ``p`` is not a dedicated param.
        """
        return self._bucket_of(p, "unit_of()").module_name

    def placement_of(self, p: nn.Parameter):
        """The :class:`~dmuon.placement.base.Placement` of a dedicated param.

        Raises:
            ValueError: ``p`` is not a dedicated param.
        """
        b, i = self._entry(p, "placement_of()")
        return b.placements[i]

    # ------------------------------------------------------------------ between steps
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide each owner's reduced grad by ``factor`` instead of the number of ranks whose
        batches differ (the default, the mean), as FSDP2's
        ``FSDPModule.set_gradient_divide_factor`` does for its shards; ``1`` gives the sum, for
        a script that scales its loss by the global token count itself (torchtitan). Call it
        with the same factor on every rank, before a backward or between steps.

        Raises:
            ValueError: ``factor`` is not a finite number > 0 (names the value and the fix).
        """
        rt = self._live("set_gradient_divide_factor()")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                0 < factor < float("inf")):
            raise ValueError(f"Invalid gradient divide factor {factor!r}. Must be a finite "
                             "number > 0 (1: the owners' grads are the sum over the ranks).")
        for b in rt.buckets:
            b.divisor = factor

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally (no reduce) in backward passes inside the block.

        Use it for all micro-batches but the last of a gradient-accumulation step, like
        ``DistributedDataParallel.no_sync``. Not needed under a wrapper: DDP's ``no_sync()``
        and ``require_backward_grad_sync = False`` and FSDP2's
        ``set_requires_gradient_sync(False)`` have the same effect on DMuon
        (``rest.wrapper_defers_sync``, read at each forward's start).
        """
        rt = self._live("no_sync()")
        rt.no_sync = True
        try:
            yield
        finally:
            rt.no_sync = False

    @contextmanager
    def pipeline_step(self, microbatches: int) -> Iterator[None]:
        """One step of a pipeline schedule over this handle's model (a stage module) with
        ``microbatches`` micro-batches: every backward inside but the ``microbatches``-th
        accumulates locally (as under :meth:`no_sync`), the last one reduces each dedicated
        grad to its owner once, whatever order the schedule ran them in; under Z3 the
        non-holders keep their copies from the step's first forward to that last backward
        (no re-broadcast per micro-batch: docs/traffic-model.md, "Pipeline parallelism").
        On a clean exit the optimizer's grad notes are taken again (torch's schedules divide
        every grad by ``microbatches`` after the last backward: ``scale_grads``). Use it
        through :func:`dmuon.pipeline_step`, which reads the count and checks the schedule.
        Local, no collective.

        Raises:
            ValueError: ``microbatches`` is not an int >= 1, or a pipeline step is already
                open on this handle.
            RuntimeError: at exit, some but not ``microbatches`` backward passes ran (the
                schedule ran another count than it declared: its last backward never reduced).
        """
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"Invalid microbatches={microbatches!r}. Must be an int >= 1 (the "
                             "schedule's n_microbatches).")
        rt = self._live("pipeline_step()")
        if rt.pipeline is not None:
            raise ValueError("Invalid pipeline_step(): one is already open on this handle. Open "
                             "one per schedule.step(...) call.")
        from dmuon.runtime.runtime import PipelineStep

        rt.pipeline = step = PipelineStep(microbatches)
        try:
            yield
        finally:
            rt.pipeline = None
            rt.schedule.hold = False
        if step.backwards == 0:  # forward only (evaluation): Z3 frees what it held
            for b in rt.buckets:
                rt.schedule.free(b)
            return
        if step.backwards != microbatches:
            raise RuntimeError(
                f"DMuon: a pipeline step of {microbatches} micro-batches ran {step.backwards} "
                f"backward passes through {type(self._model).__name__} on rank {dist.get_rank()}: "
                "the grads of the dedicated params were reduced only if the last of "
                f"{microbatches} ran. Pass dmuon.pipeline_step the schedule that runs the step, "
                "with the n_microbatches it was built with, and run one schedule.step(...) inside.")
        for fn in list(rt.grads_final):
            fn()

    def wait_pending(self) -> None:
        """Wait for every in-flight replicate broadcast (HSDP); a no-op elsewhere."""
        self._live("wait_pending()").wait_pending()

    def sync_params(self) -> None:
        """Make every rank's dedicated params hold the owner's current values (a collective).

        Call it on every rank, between steps (like FSDP's full state dict). Afterwards every
        copy is current and allocated, Z3 non-holders included; they stay so until the next
        forward frees them as usual, and that forward does not broadcast them again. Issues
        one broadcast per bucket whose copies are not all current (phase ``checkpoint``,
        index order) and none when every copy is already current. Waits for in-flight
        replicate broadcasts (HSDP).

        Raises:
            RuntimeError: called while a forward or backward is running; or a broadcast
                failed (on gloo, one that timed out because some rank did not call it: the
                message says which calls run it).
        """
        rt = self._live("sync_params()")
        if rt.state in (S.FORWARD, S.BACKWARD) and not rt.recover_if_aborted():
            raise RuntimeError(
                f"DMuon: sync_params() called in state {rt.state.name}. Call it between "
                "steps (after step() or before the forward), on every rank."
            )
        try:
            rt.schedule.sync()
        except RuntimeError as exc:  # gloo raises a timeout; NCCL's watchdog aborts instead
            raise RuntimeError(
                f"DMuon: sync_params() failed in its broadcasts ({type(exc).__name__}: {exc}). It "
                "is a collective, also run by model.state_dict(), load_state_dict(), DCP's "
                "get_state_dict / set_state_dict and dcp.save / dcp.load: call those on every "
                "rank (as with FSDP), not on rank 0 only (e.g. `if rank == 0: "
                "torch.save(model.state_dict())`)."
            ) from exc

    def params_loaded(self) -> None:
        """Mark every copy current after identical values were written into every rank's
        dedicated params (a checkpoint load). Local: no collective.

        Raises:
            RuntimeError: a copy is freed on its non-holders (call :meth:`sync_params`
                before loading, so that every copy is allocated and can be written).
        """
        rt = self._live("params_loaded()")
        rt.wait_pending()
        problem = next((m for m in (b.load_problem() for b in rt.buckets) if m), None)
        if problem is not None:
            raise RuntimeError(f"DMuon: params_loaded() but {problem}. Call dm.sync_params() "
                               "on every rank before loading.")
        for b in rt.buckets:
            b.loaded()

    def unreduced_param(self) -> str | None:
        """The name of a param with local grads not yet reduced to its owner (``no_sync``
        backward passes since the last reduce), or ``None``. Local: this rank's own grads."""
        b = next((b for b in self._live("unreduced_param()").buckets if b.grads is Grads.LOCAL), None)
        return None if b is None else b.names[b.used.index(True)]

    # ------------------------------------------------------------------ optimizer protocol
    def before_step(self) -> None:
        """Called by the optimizer before updating: in-flight sends must not be modified.

        Raises:
            RuntimeError: a backward pass has not finished (it raised, or step() was called
                from inside it), or grads accumulated under ``no_sync()`` were never reduced
                (owners would step on their own micro-batches only). Checked on each rank
                from its own grads, before any collective.
            ValueError: a move (``.to()``) of some of a unit's blocks left an aligned group's
                buckets in different dtypes or devices (``Runtime.check_groups``).

        Warns (``UserWarning``, once): ``rest="wrapper"`` and nothing averages the rest's
        grads (no DDP forward, no FSDP2 shards: ``rest.warn_if_not_averaged``).
        """
        rt = self._live("optimizer.step()")
        if rt.state == S.BACKWARD:
            if in_backward():
                raise RuntimeError(
                    "DMuon: optimizer.step() was called inside a backward pass. Call step() "
                    "after loss.backward() returns."
                )
            rt.recover()
        rt.check_groups()
        if rt.ddp_check in (DdpCheck.LOOKING, DdpCheck.SEEN):  # rest="wrapper", until it could tell
            rt.check_rest_averaged(rest_of(self._model, set(self.names)), self.topology.world_size,
                                   self.layout.is_data_sharded)
        local = self.unreduced_param()
        if local is not None:
            raise RuntimeError(
                f"DMuon: optimizer.step() after backward passes inside dm.no_sync() only: the "
                f"grads of {local} (and others) were accumulated locally on rank "
                f"{dist.get_rank()} and never reduced to their owners. Run the last "
                "micro-batch's backward outside `with dm.no_sync():`, or call "
                "optimizer.zero_grad() to drop them."
            )
        rt.wait_pending()

    def after_step(self) -> None:
        """Every copy is out of date; HSDP owners start the async replicate broadcasts (and,
        at the first step, the block order is agreed)."""
        self._live("optimizer.step()").after_step()

    def on_grads_final(self, fn) -> None:
        """Call ``fn()`` at the end of every backward outside ``no_sync()``, once every grad
        is final (queued after every other end-of-backward callback, DDP's and FSDP2's
        included). Local, no collective; ``close()`` drops it."""
        self._live("on_grads_final()").grads_final.append(fn)

    def after_zero_grad(self) -> None:
        """Grads were cleared: a new accumulation may start (recovers an aborted step)."""
        self._live("optimizer.zero_grad()").after_zero_grad()

    def show_grads(self, mesh) -> None:
        """Every rank, local: each dedicated param's ``.grad`` becomes a DTensor on ``mesh``
        (FSDP2's), ``Shard(0)`` on each mesh dim, the owner's local tensor its averaged grad,
        the others' a row of zeros, so torch's ``clip_grad_norm_`` / ``get_total_norm`` reduce it with
        FSDP2's grads (``dmuon/runtime/grad_view.py``). The optimizer calls it at the end of
        each backward outside ``no_sync()`` where FSDP2 handles the rest."""
        self._live("show_grads()").show_grads(mesh)

    def take_back_grads(self) -> None:
        """Every rank, local: the plain grads back after :meth:`show_grads` (owners: their
        grad, as edited since; others: ``None``); nothing where none are shown."""
        if self._runtime is not None:
            self._runtime.take_back_grads()


def _z3_window_bytes(buckets: list, groups_of: dict, depth: int) -> int:
    """The Z3 memory bound of ``coalescing()`` (docs/traffic-model.md, "Z3 memory bound"):
    the most non-held compute-copy bytes over each unit's forward window (its buckets and the
    next ``depth``) and backward window (its buckets and the ``depth`` before them), a bucket
    counting with its whole aligned group (one call fills them all)."""
    n = len(buckets)
    size = [0 if b.is_holder else b.numel * b.lp.element_size() for b in buckets]
    first = {id(b): min(m.index for m in groups_of.get(id(b), [b])) for b in buckets}
    last = {id(b): max(m.index for m in groups_of.get(id(b), [b])) for b in buckets}
    peak, lo = 0, 0
    for hi in range(n):
        if hi + 1 < n and buckets[hi + 1].module_name == buckets[hi].module_name:
            continue  # [lo, hi] is one unit
        fwd_end = last[id(buckets[min(hi + depth, n - 1)])]
        bwd_start = first[id(buckets[max(lo - depth, 0)])]
        peak = max(peak, sum(size[lo : fwd_end + 1]), sum(size[bwd_start : hi + 1]))
        lo = hi + 1
    return peak
