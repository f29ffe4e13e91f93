"""The runtime of one :class:`~dmuon.DedicatedParams`: its pass state machine and what its hooks
do (the role of FSDP2's ``FSDPParamGroup``). The protocol the hooks follow, and the states
with their transitions, are described in ``docs/protocol.md``; the transition table is
``state.py``'s.

:class:`Runtime` builds the buckets (:class:`~dmuon.runtime.bucket.Bucket`) and the :class:`~dmuon.runtime.schedule.Schedule`
that issues their calls, registers the hooks (``attach.HookSet``), and follows the model's
moves: ``.to()`` / ``to_empty()`` reach :meth:`Runtime.before_apply` / :meth:`Runtime.after_apply`
(``attach.follow_moves``); anything that changed a param without ``_apply`` (``p.data = x`` or
``m.weight = nn.Parameter(...)`` by hand) is found at one point, the start of every forward
(:meth:`Runtime.check_bindings`), and adopted, or named in an error.
"""

from __future__ import annotations

import dataclasses

import inspect
from itertools import groupby
from typing import TYPE_CHECKING
import warnings

import weakref

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from dmuon.errors import invariant
from dmuon.runtime import attach, collectives, order, precision
from dmuon.ownership.buckets import block_of, bucket_layout
from dmuon.runtime.bucket import Bucket
from dmuon.runtime.rest import ReplicatedRest, ddp_group_size, warn_if_not_averaged, wrapper_defers_sync
from dmuon.ownership.plan import OwnershipPlan, specs_from_named_parameters
from dmuon.runtime.schedule import Schedule
from dmuon.runtime.state import (BlockOrder, Copy, DdpCheck, Grads, GroupCheck, StateMachine,
                                  TrainingState, check)
from dmuon.ownership.topology import Topology

if TYPE_CHECKING:
    from dmuon.options import ResolvedOptions

S = TrainingState


@dataclasses.dataclass
class PipelineStep:
    """One pipeline step of a handle (``DedicatedParams.pipeline_step``): ``microbatches``
    backward passes are expected, ``backwards`` counts those begun."""

    microbatches: int
    backwards: int = 0


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _in_reentrant_checkpoint() -> bool:
    """Whether reentrant activation checkpointing's forward (``CheckpointFunction.forward`` of
    ``torch.utils.checkpoint``, torch 2.13) is on the stack. Walks a few frames."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "forward" and frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        frame = frame.f_back
    return False


def _used_again(block: str, unit: str) -> ValueError:
    """The error for a block whose second use backpropagates in a backward that already took
    its first use's grads for reduction (grads REDUCING or REDUCED: :meth:`Runtime._grad_hook`)
    or, under Z3, already freed its copy (its recompute: :meth:`Runtime._pre_forward`): it was
    used more than once and its uses backpropagate separately, each in its own nested backward.
    Every rank runs the same model, so every rank raises at the same point."""
    return ValueError(
        f"DMuon: block {block!r} (unit {unit!r}) backpropagates a second use in one backward "
        "after DMuon had taken its grads for reduction to their owner rank (and, under "
        "reshard_after_forward=True, freed its copy): it was used more than once before this "
        "backward (run twice in a forward, or in two forwards before one backward) and its uses "
        "backpropagate separately, as under reentrant activation checkpointing "
        "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True), or checkpoint_wrapper with "
        "CheckpointImpl.REENTRANT). Checkpoint it with use_reentrant=False "
        "(CheckpointImpl.NO_REENTRANT), or call backward after each forward (with dm.no_sync() "
        "for all but the last micro-batch).")


class Runtime:
    """Buckets, pass state and hook logic of one DedicatedParams (module docstring)."""

    def __init__(self, model: nn.Module, named: list[tuple[str, nn.Parameter, str]],
                 topology: Topology, plan: OwnershipPlan, groups: collectives.DMuonGroups,
                 placements: dict, options: ResolvedOptions, *, extra_meshes: dict | None = None,
                 replicated: ReplicatedRest | None = None) -> None:
        self.root = model
        self.topology = topology
        self.options = options  # every knob, resolved (dmuon/options.py)
        self.pass_state = StateMachine()
        self.user_no_sync = False  # inside dm.no_sync()
        self.wrapper_no_sync = False  # this pass's wrapper skips its reduction (rest.wrapper_defers_sync)
        # inside a pipeline step (DedicatedParams.pipeline_step): its micro-batch count and the
        # backward passes seen; only the last backward reduces, Z3 holds copies until then
        self.pipeline: PipelineStep | None = None
        self.grad_mesh, self.grad_specs = None, {}  # dedicated grads shown as DTensors (grad_view.py)
        self.replicated = replicated  # rest="replicate": the rest DMuon replicates (rest.py)
        # rest="wrapper": whether a forward ran inside DDP (of ddp_size ranks), until the first
        # step() that can tell whether the rest's grads are averaged (state.DdpCheck)
        self.ddp_check = DdpCheck.LOOKING if replicated is None else DdpCheck.OFF
        self.ddp_size = 0
        self.order = order.OrderRecorder()
        self.order_state = BlockOrder.RECORDING
        # called once every grad of a reducing backward is final (after every end-of-backward
        # callback: DDP's and FSDP2's too); the optimizer's grad guard (dmuon/optim/grad_guard.py)
        self.grads_final: list = []
        self._modules = dict(model.named_modules())
        meshes = {"dp": (topology, plan, groups, topology.world_size), **(extra_meshes or {})}
        buckets = self._build_buckets(named, meshes, placements)
        self.schedule = Schedule(buckets, groups, options)
        self.model_blocks = self.unit_order()  # model order (protocol step 7)
        self._ran: set[str] = set()  # blocks whose forward finished in this forward (Z3)
        # hooked module -> whether a run of it in this forward was reentrant-checkpointed
        self._runs: dict[nn.Module, bool] = {}
        self._forward_grad = True  # grad mode when this forward began
        self._applying = 0  # depth of followed _apply calls in progress
        self._moved: dict[int, Bucket] = {}  # buckets an _apply touched, not re-bound yet
        self._rebound: dict[int, Bucket] = {}  # re-bound since the last forward (recast there)
        self.group_check = GroupCheck.CHECKED  # PENDING: a bucket re-bound since check_groups
        # unit -> the drivers of all its blocks (order.py's contiguity rule, the spans)
        self._drivers = {b.module_name: list(dict.fromkeys(
            d for block in b.blocks for d in order.drivers_of(block))) for b in buckets}
        self._index()
        for b in buckets:
            b.make_compute()
        self._index_params()
        # mixed precision: the compute params' swaps and the casts (installed by install())
        policy = options.mp_policy
        self.mp = None if policy is None else precision.ModuleSwaps(policy, buckets, self._modules, model)

    @property
    def no_sync(self) -> bool:
        """Whether this pass accumulates dedicated grads locally: inside ``dm.no_sync()``, or
        its wrapper (DDP, FSDP2) skips its own reduction (``rest.wrapper_defers_sync``). Inside
        a pipeline step the wrapper is not asked (torch's schedules tell it per backward, after
        DMuon read it): every backward but the step's last accumulates."""
        if self.pipeline is not None:
            return self.user_no_sync or self.pipeline.backwards < self.pipeline.microbatches
        return self.user_no_sync or self.wrapper_no_sync

    @no_sync.setter
    def no_sync(self, value: bool) -> None:
        self.user_no_sync = value

    @property
    def buckets(self) -> list[Bucket]:
        return self.schedule.buckets

    @property
    def state(self) -> TrainingState:
        return self.pass_state.state

    def unit_order(self) -> tuple[str, ...]:
        """The units (``buckets.py``; one per block without coalescing) in bucket order."""
        return tuple(dict.fromkeys(b.module_name for b in self.buckets))

    def block_order(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(block for b in self.buckets for block in b.blocks))

    # ------------------------------------------------------------------ construction
    def _build_buckets(self, named, meshes: dict, placements: dict) -> list[Bucket]:
        """The buckets of every data-parallel mesh the params move on (``meshes``: a
        placement's ``mesh_key`` -> (topology, plan, groups, divisor); ``"dp"`` for the dense
        and TP kinds), each laid out by ``bucket_layout``, merged unit by unit in model order
        (a unit of two meshes: the mesh of its first param first)."""
        modules, by_name = self._modules, {n: p for n, p, _ in named}
        position = {n: i for i, (n, _, _) in enumerate(named)}
        runs = []
        by_key: dict[str, list] = {}
        for n, p, _ in named:
            by_key.setdefault(placements[n].mesh_key, []).append((n, p))
        for key, sub in by_key.items():
            topology, plan, groups, divisor = meshes[key]
            # buckets hold the local tensors (a TP shard), so the cap counts their bytes
            specs = specs_from_named_parameters((n, placements[n].local(p)) for n, p in sub)
            coalescing = self.options.coalescing
            layout = bucket_layout(specs, plan, self.options.bucket_cap_bytes,
                                   coalescing.target_bytes, coalescing.reduce_by_gather)
            for _, unit in groupby(layout, lambda spec: spec.module):
                unit = list(unit)
                runs.append((min(position[n] for spec in unit for n in spec.names), unit,
                             (topology, groups, divisor)))
        buckets = []
        for _, unit, (topology, groups, divisor) in sorted(runs, key=lambda run: run[0]):
            for spec in unit:
                r, s = topology.coords(spec.owner)
                buckets.append(Bucket(
                    index=len(buckets), module_name=spec.module, module=modules[spec.module],
                    owner=spec.owner, blocks=spec.blocks, aligned=spec.aligned,
                    shard_owner=s, replicate_owner=r, names=list(spec.names),
                    params=[by_name[n] for n in spec.names],
                    param_modules=[modules[n.rpartition(".")[0]] for n in spec.names],
                    placements=[placements[n] for n in spec.names], groups=groups,
                    divisor=divisor, is_holder=s == topology.shard_index,
                    is_owner=spec.owner == topology.global_index,
                    options=self.options, on_grad=self._grad_hook))
        return buckets

    def _index(self) -> None:
        """Everything that depends on bucket indices, from the bucket order."""
        # driver module -> (first, last) bucket index of its subtree, and its own buckets
        self._span: dict[nn.Module, tuple[int, int]] = {}
        self._own: dict[nn.Module, list[Bucket]] = {}
        # followed module (holds params, or a block) -> its buckets
        self._followed: dict[nn.Module, list[Bucket]] = {}
        # driver -> the blocks in its subtree (its post-forward means they all finished)
        self._blocks_under: dict[nn.Module, set[str]] = {}
        count: dict[nn.Module, int] = {}
        for b in self.buckets:
            block_modules = [self._modules[block] for block in b.blocks]
            for m in block_modules:  # a unit's buckets are every one of its blocks' own (index order)
                self._own.setdefault(m, []).append(b)
            for m in dict.fromkeys([*b.param_modules, *block_modules]):
                self._followed.setdefault(m, []).append(b)
            for driver in self._drivers[b.module_name]:
                m = self._modules[driver]
                lo, hi = self._span.get(m, (b.index, b.index))
                self._span[m] = (min(lo, b.index), max(hi, b.index))
                count[m] = count.get(m, 0) + 1
            for block in b.blocks:
                for driver in order.drivers_of(block):
                    self._blocks_under.setdefault(self._modules[driver], set()).add(block)
        # a driver's hooks cover one index range: order.py keeps every driver contiguous
        invariant(all(hi - lo + 1 == count[m] for m, (lo, hi) in self._span.items()), lambda: (
            "Runtime: a driver's buckets are not one contiguous index range: "
            f"{[(lo, hi, count[m]) for m, (lo, hi) in self._span.items() if hi - lo + 1 != count[m]]}"))

    def _index_params(self) -> None:
        """``by_id``: id(param) -> (bucket, position), for every registered dedicated param."""
        self.by_id = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` itself (not another object at its id) is one of its dedicated params."""
        entry = self.by_id.get(id(p))
        return entry is not None and entry[0].params[entry[1]] is p

    def install(self, hooks: attach.HookSet) -> None:
        """Register the forward hooks (into ``hooks``) and follow the modules' moves.
        torch.compile: the root's and the drivers' hooks run eagerly (Dynamo must not trace
        into the schedule or inspect freed copies: Z3's, mixed precision's fp32 masters); the
        modules' own forwards are still compiled, with mixed precision's per-module casts
        traced into them (``precision.ModuleSwaps``: a block is one graph, as without it)."""
        model, off = self.root, torch.compiler.disable
        hooks.add(model.register_forward_pre_hook(off(self._root_pre_forward)),
                  model.register_forward_hook(off(self._root_post_forward)),
                  model.register_state_dict_pre_hook(lambda *a, **k: self.wait_pending()))
        mp = self.mp
        for m in self._span:  # mixed precision: a block swaps its compute params in and out
            pre, post = self._pre_forward, self._post_forward
            if mp is not None and m in mp.block_leaves:
                pre, post = mp.pre_hook(pre), mp.post_hook(post)
            hooks.add(m.register_forward_pre_hook(off(pre)), m.register_forward_hook(off(post)))
        if mp is not None:  # casts only: traced into a compiled block (precision.ModuleSwaps)
            for m in mp.buckets_of:
                hooks.add(m.register_forward_pre_hook(mp.leaf_pre_forward),
                          m.register_forward_hook(mp.leaf_post_forward))
        for m in self._followed:
            attach.follow_moves(m, self)

    def close(self) -> None:
        """Grad hooks off, registered params back, moves no longer followed; CLOSED (local;
        call between passes, in-flight calls waited)."""
        for b in self.buckets:
            b.close()
        for m in self._followed:
            attach.unfollow_moves(m, self)
        # drop the process groups: gloo's threads go with the last reference, and a closed
        # DedicatedParams may live on in a reference cycle until the garbage collector runs
        self.schedule.groups = None
        if self.replicated is not None:
            self.replicated.close()
        self._enter(S.CLOSED)

    # ------------------------------------------------------------------ pass state
    def _set(self, field: str, new) -> None:
        """Change one of the runtime's states (``state.py``: BlockOrder, DdpCheck, GroupCheck),
        checked against its table."""
        setattr(self, field, check(f"runtime {field}", getattr(self, field), new))

    def check_rest_averaged(self, rest: list, dp_size: int, is_shard) -> None:
        """``rest="wrapper"``, at ``step()``: until it could tell once, whether something
        averages the rest's grads (``rest.warn_if_not_averaged``; warns, or raises its
        RuntimeError for a DDP over other ranks); ``is_shard(p)``: whether a rest param is an
        FSDP2 shard (``MeshLayout.is_data_sharded``)."""
        if self.ddp_check in (DdpCheck.LOOKING, DdpCheck.SEEN):
            if warn_if_not_averaged(rest, self.ddp_size or False, dp_size, is_shard):
                self._set("ddp_check", DdpCheck.DONE)

    def _enter(self, new: TrainingState) -> None:
        self.pass_state.to(new)
        if new in (S.FORWARD, S.BACKWARD):
            self.schedule.reset()  # the one place cursors are reset

    def recover_if_aborted(self) -> bool:
        """Outside autograd, a FORWARD / BACKWARD state is a leftover of an exception:
        recover and return True; inside a backward return False."""
        if in_backward():
            return False
        self.recover()
        return True

    def recover(self) -> None:
        """Leave the state an exception left behind (protocol, 'Outside the step')."""
        self.schedule.hold = False
        old = self.pass_state.recover()
        for b in self.buckets:
            b.abort(drop_grads=old == S.BACKWARD)
        if self.replicated is not None:
            self.replicated.abort(drop_grads=old == S.BACKWARD)
        elif old == S.BACKWARD:  # the wrapper's grads are not DMuon's to drop: say so
            warnings.warn(
                "DMuon recovered from an exception inside backward and dropped that backward's "
                "grads of the dedicated params, but under rest='wrapper' the DDP / FSDP2 wrapper "
                "of the other params does not recover from it: it may keep that backward's "
                "partial grads of the rest (FSDP2 adds them to the next step's, and "
                "optimizer.zero_grad() does not clear them). Reload the model and optimizer from "
                "a checkpoint, or use dedicate_params(rest='replicate'), which drops them too.",
                stacklevel=3,
            )
        self._end_iteration()

    def _end_iteration(self) -> None:
        """Z3 non-holders free everything; back to IDLE."""
        for b in self.buckets:
            b.pass_ended()
            self.schedule.free(b)
        if self.state != S.IDLE:
            self._enter(S.IDLE)

    def begin_forward(self) -> None:
        if self.state in (S.FORWARD, S.BACKWARD):
            self.recover()  # the last forward or backward raised
        self.check_bindings()
        for b in self._rebound.values():
            b.recast()
        self._rebound.clear()
        if self.replicated is not None:
            self.replicated.begin_forward()  # checks the rest is unwrapped; broadcasts it once
        elif self.ddp_check is DdpCheck.LOOKING:
            self.ddp_size = ddp_group_size(self.root) or 0
            if self.ddp_size:
                self._set("ddp_check", DdpCheck.SEEN)
        self.wrapper_no_sync = self.replicated is None and wrapper_defers_sync(self.root)
        self._enter(S.FORWARD)
        self.schedule.hold = self.pipeline is not None
        self._ran.clear()
        self._runs.clear()
        self._forward_grad = torch.is_grad_enabled()
        self.order.begin()
        for b in self.buckets:  # mixed precision: non-holders' master copies (sync) go
            b.drop_master()

    def _end_forward(self, backward_follows: bool) -> None:
        self.order.end()
        self.schedule.advance_forward(len(self.buckets) - 1)
        for b in self.buckets:
            if not (backward_follows and self._last_unit(b)):
                self.schedule.free(b)
        self._enter(S.FORWARD_DONE)

    def _last_unit(self, b) -> bool:
        """Whether ``b`` is in the unit of the last bucket index: under Z3 it stays allocated
        from its forward into the backward that needs it first (protocol, step 2)."""
        return b.module_name == self.buckets[-1].module_name

    def begin_backward(self) -> None:
        if self.state == S.BACKWARD:
            return
        if self.state == S.FORWARD:
            self._end_forward(backward_follows=True)
        if self.state == S.CLOSED:
            raise RuntimeError(
                "DMuon: a backward started after DedicatedParams.close(): the forward ran "
                "while DMuon was attached, but its grads can no longer be reduced to their "
                "owners. Call close() after loss.backward() and optimizer.step().")
        if self.state not in (S.FORWARD_DONE, S.BACKWARD_DONE):
            raise RuntimeError(
                f"DMuon: a backward started in state {self.state.name}, with no forward "
                "through the model given to dedicate_params since the last step."
            )
        done = next((b for b in self.buckets if b.grads in (Grads.REDUCED, Grads.STEPPED)), None)
        if done is not None and done.grads is Grads.STEPPED:
            raise RuntimeError(
                f"DMuon: a backward started after optimizer.step() without "
                f"optimizer.zero_grad(); grads (e.g. of {done.names[0]}) are still those "
                "of the last step. Call optimizer.zero_grad() (the DMuon optimizer's: "
                "model.zero_grad(), ddp.zero_grad() or setting p.grad = None do not tell "
                "DMuon that the grads were cleared)."
            )
        if done is not None:
            raise RuntimeError(
                f"DMuon: a second backward started before optimizer.step() or zero_grad(); "
                f"grads (e.g. of {done.names[0]}) were already reduced to their owners. For "
                "gradient accumulation wrap all but the last micro-batch in "
                "`with dm.no_sync():`; under a pipeline schedule run schedule.step(...) inside "
                "`with dmuon.pipeline_step(schedule, dm):` (it reduces after the last "
                "micro-batch's backward)."
            )
        self._enter(S.BACKWARD)
        if self.pipeline is not None:
            self.pipeline.backwards += 1
            self.schedule.hold = self.no_sync  # the step's last backward frees (Z3)
        self.schedule.reduces = not self.no_sync
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        if not self.no_sync:  # every call left, re-broadcasts included, in the one order
            self.schedule.advance_reduce(final=True)
        elif self.options.reshard_after_forward:
            self.schedule.advance_rebroadcast(0)
        if not self.no_sync:
            if self.replicated is not None:  # after the last shard reduce, waited with them
                self.replicated.issue(self.schedule.launcher)
            self.schedule.finish_reduces()
            if self.replicated is not None:
                self.replicated.finish(self.topology.world_size)
        for b in self.buckets:
            b.pass_ended()
            self.schedule.free(b)
        self._enter(S.BACKWARD_DONE)
        if self.grads_final and not self.no_sync:  # queued last: after the wrappers' callbacks
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: [fn() for fn in list(self.grads_final)])

    # ------------------------------------------------------------------ hooks
    def _root_pre_forward(self, module: nn.Module, args) -> None:
        if self.state == S.BACKWARD and in_backward():
            return  # recompute of a checkpointed root
        self.begin_forward()
        if module in self._own:  # buckets of the root module itself
            self.order.note(self._own[module][0].module_name)
            self.schedule.advance_forward(self._own[module][-1].index)
        else:  # nothing needed yet: the first buckets fly during the root's own prologue
            self.schedule.issue_forward(self.options.prefetch_depth - 1)

    def _root_post_forward(self, module: nn.Module, args, output) -> None:
        if self.state != S.FORWARD:
            return  # recompute
        self._end_forward(backward_follows=torch.is_grad_enabled())
        self._on_first_grad(output, self._root_pre_backward)

    def _root_pre_backward(self) -> None:
        self.begin_backward()
        if self.options.reshard_after_forward and self.root in self._own:
            self.schedule.advance_rebroadcast(self._own[self.root][0].index)

    def _pre_forward(self, module: nn.Module, args) -> None:
        lo, hi = self._span[module]
        own = self._own.get(module, ())
        if self.state == S.BACKWARD and in_backward():  # activation-checkpoint recompute
            if self.options.reshard_after_forward:
                # a recompute of buckets this backward already waited, then freed: a second use
                if own and own[0].index > self.schedule.cursors.bwd_waited and any(
                        b.copy is not Copy.VALID for b in own):
                    raise _used_again(next(n for n, m in self._modules.items() if m is module),
                                      own[0].module_name)
                self._rebroadcast_for(module)
            return
        if self.state != S.FORWARD:
            self.begin_forward()  # a forward that did not enter through the root
        # a driver waits only for its own buckets; one that only encloses blocks (HF's
        # model.model, an encoder) lets its blocks' hooks move the cursor, and prefetches
        if own:
            self._check_reentrant_reuse(module)
            self.order.note(own[0].module_name)
            self.schedule.advance_forward(own[-1].index)
        else:
            self.schedule.issue_forward(lo + self.options.prefetch_depth - 1)
        for b in own:
            if b.copy is not Copy.VALID:  # Z3, the block runs again in this forward (every rank)
                self.schedule.refill(b)

    def _check_reentrant_reuse(self, module: nn.Module) -> None:
        """A module holding dedicated params that runs twice in one forward (weight sharing)
        with a run under reentrant activation checkpointing would get one grad per use, each
        from its own nested backward, the second after DMuon reduced the first: refuse it here,
        before its next collective (every rank runs the same forward, so every rank raises)."""
        reentrant = (self._forward_grad and not torch.is_grad_enabled()
                     and _in_reentrant_checkpoint())
        seen = self._runs.get(module)
        self._runs[module] = bool(seen) or reentrant
        if seen is None or not self._runs[module]:
            return
        name = next(n for n, m in self._modules.items() if m is module)
        raise ValueError(
            f"DMuon: module {name!r} (it holds dedicated params) runs more than once in this "
            "forward and a run is under reentrant activation checkpointing "
            "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True), or checkpoint_wrapper "
            "with CheckpointImpl.REENTRANT), which backpropagates each use on its own: the "
            "second use's grad would reach DMuon after the first was reduced to its owner. "
            "Checkpoint it with use_reentrant=False (CheckpointImpl.NO_REENTRANT).")

    def _post_forward(self, module: nn.Module, args, output) -> None:
        if self.state != S.FORWARD or not self.options.reshard_after_forward:
            return  # recompute, or Z2
        lo, hi = self._span[module]
        self._ran |= self._blocks_under[module]
        self.schedule.advance_forward(hi)  # units of sub-blocks that did not run: freed below
        for b in self.buckets[lo : hi + 1]:
            # a unit stays until all its blocks ran; the last one until the root's end decides
            # (a reentrant-checkpointed block runs under no_grad inside a forward with grad)
            if self._ran.issuperset(b.blocks) and not self._last_unit(b):
                self.schedule.free(b)
        self._on_first_grad(output, lambda: self._pre_backward(module))

    def _pre_backward(self, module: nn.Module) -> None:
        self.begin_backward()
        self._rebroadcast_for(module)

    def _rebroadcast_for(self, module: nn.Module) -> None:
        """Z3, ``module``'s backward (or recompute) starts: wait for its own buckets (and,
        the cursor descending, every bucket above them); a driver that only encloses blocks
        asks for the next ``prefetch_depth`` re-broadcasts and lets its blocks wait."""
        own = self._own.get(module)
        if own:
            self.schedule.advance_rebroadcast(own[0].index)
        else:
            self.schedule.prefetch_rebroadcast(self._span[module][1] - self.options.prefetch_depth + 1)

    @staticmethod
    def _on_first_grad(output, fn) -> None:
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and torch.is_grad_enabled():
            register_multi_grad_hook(outputs, lambda grads: fn(), mode="any")

    def _grad_hook(self, b: Bucket, i: int):
        # Weak references: a tensor's grad hooks are invisible to Python's garbage collector,
        # so a strong one here would keep this runtime, its buckets and the model alive after
        # the user dropped both (a model's GPU memory included).
        runtime, bucket = weakref.ref(self), weakref.ref(b)

        def hook(q: nn.Parameter) -> None:
            rt, b = runtime(), bucket()
            if rt is None or b is None:
                return
            rt.begin_backward()
            if b.grads in (Grads.REDUCING, Grads.REDUCED):
                raise _used_again(block_of(b.names[i].rpartition(".")[0]), b.module_name)
            b.grad_arrived(i, q, counts=not rt.no_sync)
            if not rt.no_sync:
                rt.schedule.advance_reduce(final=False)

        return hook

    # ------------------------------------------------------------------ between passes
    def wait_pending(self) -> None:
        for b in self.buckets:
            self.schedule.wait_replicate(b)

    def after_step(self) -> None:
        """Protocol step 6 (and step 7 at the first step)."""
        if self.state == S.FORWARD:
            self.recover()
        self._end_iteration()
        for b in self.buckets:
            b.step_consumed()
        if self.order_state is BlockOrder.RECORDING:
            # no call is in flight: every call of the step was waited
            self._set("order_state", BlockOrder.AGREED)
            blocks = order.agree(self.model_blocks, self.order.recorded, self.schedule.groups.world,
                                 self._drivers)
            if blocks != self.model_blocks:
                position = {name: i for i, name in enumerate(blocks)}
                self.schedule.reorder(sorted(self.buckets, key=lambda b: position[b.module_name]))
                self._index()
        for b in self.buckets:
            b.stepped()
        self.schedule.replicate()

    def show_grads(self, mesh) -> None:
        self.grad_mesh = mesh
        for b in self.buckets:
            b.show_grads(mesh, self.grad_specs)

    def take_back_grads(self) -> None:
        if self.grad_mesh is not None:
            self.grad_mesh = None
            for b in self.buckets:
                b.take_back_grads()

    def after_zero_grad(self) -> None:
        if self.state in (S.FORWARD, S.BACKWARD):
            self.recover()
        for b in self.buckets:
            b.clear_grads()

    # ------------------------------------------------------------------ moves
    def before_apply(self, module: nn.Module) -> None:
        """A followed module's ``_apply`` starts: the values it will read are the owners'
        (HSDP replicate waited), nothing is in flight, the registered params are in."""
        for b in self._followed.get(module, ()):
            self.schedule.wait_replicate(b)
            b.wait_broadcast()
            b.swap(False)
            self._moved[id(b)] = b
        self._applying += 1  # last: after_apply runs only if this returned

    def after_apply(self, module: nn.Module, completed: bool) -> None:
        """When the outermost followed ``_apply`` returns, re-bind every touched bucket whose
        params agree on device and dtype (the others wait for the rest of their params)."""
        self._applying -= 1
        if self._applying or not completed:
            return
        for key, b in list(self._moved.items()):
            if b.adopt_replaced():
                self._index_params()
            if b.is_bound() or b.consistent():
                if not b.is_bound():
                    self._rebind(b)
                del self._moved[key]

    def adopt_replaced(self) -> None:
        """Adopt params replaced by hand (``m.weight = nn.Parameter(...)``) now, not only at
        the next forward: ``set(dm)`` (``fully_shard``'s ``ignored_params``) and the optimizer
        then see the new objects. Their buffers are rebound at that forward (:meth:`check_bindings`).

        Raises:
            ValueError: a replacement has another shape (``Bucket.adopt_replaced``).
        """
        if any([b.adopt_replaced(same_kind=True) for b in self.buckets]):
            self._index_params()

    def check_bindings(self) -> None:
        """The one detection point (every forward's start): adopt params replaced or
        re-pointed without ``_apply``, or raise if a bucket's params were split across
        devices or dtypes.

        Raises:
            ValueError: a bucket's params differ in device or dtype (local: every rank
                made the same calls, so every rank raises).
        """
        for b in self.buckets:
            replaced = b.adopt_replaced()
            if replaced:
                self._index_params()
            if not replaced and b.is_bound():
                continue
            if not b.consistent():
                where = ", ".join(f"{n} {p.dtype} on {p.device}" for n, p in zip(b.names, b.params))
                raise ValueError(
                    f"Invalid dedicated params of unit {b.module_name!r} (blocks "
                    f"{', '.join(b.blocks)}): {where}. They share one DMuon bucket and must "
                    "share one device and dtype: apply .to() / to_empty() to the whole model "
                    "or to all of the unit's blocks, on every rank."
                )
            self._rebind(b)
        self._moved.clear()
        self.check_groups()

    def check_groups(self) -> None:
        """An aligned group moves in one call, so its buckets must share dtype and device; a
        move of some of a unit's blocks splits them (every bucket stays consistent). Checked
        with the bindings at every forward's start, and before every ``step()`` (whose HSDP
        replicate broadcast moves the groups too).

        Raises:
            ValueError: the members of an aligned group differ in dtype or device (local:
                every rank made the same moves, so every rank raises, before any call).
        """
        if self.group_check is GroupCheck.CHECKED:
            return
        for members in {id(g): g for g in self.schedule.groups_of.values()}.values():
            if len({(m.flat.dtype, m.flat.device) for m in members}) > 1:
                where = ", ".join(f"{n} {m.flat.dtype} on {m.flat.device}" for m in members
                                  for n in m.names)
                raise ValueError(
                    f"Invalid dedicated params of unit {members[0].module_name!r} (blocks "
                    f"{', '.join(members[0].blocks)}): {where}. They move in one collective "
                    "and must share one device and dtype: apply .to() / to_empty() to all of "
                    "the unit's blocks or to the whole model, on every rank, or build with "
                    "dedicate_params(coalesce='block') (one unit per block)."
                )
        self._set("group_check", GroupCheck.CHECKED)

    def _rebind(self, b: Bucket) -> None:
        b.rebind()
        self._set("group_check", GroupCheck.PENDING)
        self._rebound[id(b)] = b
