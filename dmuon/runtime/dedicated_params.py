"""Dedicated ownership at runtime: the public handle, and the protocol its hooks follow.

This docstring is the authoritative description of DMuon's protocol (the traffic predictor
in ``verify/`` is derived from it independently). Who does what (``docs/architecture.md``):
:class:`DedicatedParams` here is the handle and its lifecycle; ``runtime.py`` (``Runtime``) the
pass state and the hooks' logic; ``schedule.py`` the cursors and every call; ``bucket.py``
each bucket's copies, grads and states (the only code that changes a dedicated param);
``attach.py`` what is attached to the model and undone by ``close()``; ``state.py`` every
state and transition.

Glossary (see ``topology.py`` for the mesh terms):

- **dedicated param**: a Muon target (a matrix, a stack of matrices or a conv weight) handled by
  DMuon instead of DDP / FSDP2; the runtime moves it as flat elements, whatever its shape.
- **owner** (global owner): the one rank ``(r, s)`` that keeps momentum and runs
  Newton–Schulz for the param. **Holders**: the R ranks ``(*, s)`` of the owner's shard
  index; they keep the full param between steps (for 1-D meshes the holder is the owner).
- **block**: the longest prefix of a param's module name ending in an integer component (a
  ``ModuleList`` element such as ``blocks.3``), else the module itself (``buckets.block_of``).
- **unit**: a run of consecutive blocks (model order) whose params share collectives, as
  many as fit ``dedicate_params``' ``coalesce`` target (``buckets.unit_layout``; by default
  the backend's α/β bytes, where a call's fixed cost equals its transfer time). Without
  coalescing (``coalesce="block"``) every block is its own unit. Named by its first block.
- **bucket**: the dedicated params of one unit with the same owner and dtype, cut into runs
  of at most ``bucket_cap_mb`` (``buckets.bucket_layout``), numbered ``0 .. B-1`` unit by
  unit in the **block order**: model order until the end of the first ``step()``, then the
  order in which the units' blocks first ran, agreed across ranks (step 7, rule in
  ``order.py``); within a unit, the layout's order. Their data are views into one flat
  buffer (``residency.py``), so one collective moves them all. A bucket's ``module`` is its
  unit (its first block's module); the unit's blocks are ``blocks``.
- **aligned group**: the buckets of one unit and dtype when they are exactly one per global
  owner, of equal ``numel`` and param count (on gloo, ``reduce_by_gather``, their sizes may
  differ: an **uneven** group, below), of any size, and ``coalesce`` is not ``"block"``; ordered by ``(s, r)``. Every call below that would move each of its buckets separately moves the whole
  group in one call instead: a forward broadcast or Z3 re-broadcast becomes one
  **all_gather** over the shard axis (each rank's input: the R buckets of its shard index, in
  ``r`` order; count ``R * numel``), a shard reduce one **reduce_scatter** (sum) over the
  shard axis (input: the group's reduce buffers in group order; each rank keeps its R
  buckets' sums; count ``R * (numel + params)``), an HSDP replicate reduce one
  **reduce_scatter** over the replicate axis (input: the holder's R buckets; the owner keeps
  its own; count ``numel + params``) and step 6's replicate broadcast one **all_gather** over
  the replicate axis (input: the owner's bucket; count ``numel``). The call is issued where
  the group's first bucket in the walk's direction would be (forward and step 6: its lowest
  index; backward: its highest) and replaces the group's calls there; each bytes-per-rank
  figure equals that of the calls it replaces. ``sync_params`` still broadcasts per bucket.
  Where the members' parts of a call differ (an uneven group: each rank's part is the sum
  of its buckets' sizes in that call), the all_gather is an **all_to_all** of the rank's
  input repeated n times (input splits ``[part] * n``, output splits every rank's part, in
  group-rank order) and the reduce_scatter (an all_to_all on gloo already, step 4) takes
  input splits of every rank's part and output splits ``[own part] * n``; the same elements
  arrive where the equal-size call would put them.
- **copy state** (``state.Copy``, one per bucket): where the non-holders' compute copy
  stands: ``FREED`` (no storage), ``STALE``, ``IN_FLIGHT`` (a broadcast is writing it) or
  ``VALID`` (equal to the owner's current values, allocated). Every rank tracks the same
  value for every bucket, holders included (it changes only at points every rank passes:
  the end of a driver's forward, of the root's forward, of backward, ``step()``,
  ``sync_params()``), so every rank takes the same collective decisions. "A bucket is
  current" below means ``VALID``.
- **driver**: a module whose subtree holds buckets (the blocks and their ancestors, not the
  root). Its hooks cover the buckets of its whole subtree, a contiguous index range. With
  ``mp_policy``, a block's hooks also register the compute params of its modules for the
  block's forward, and the modules that hold dedicated params get hooks that cast their
  inputs to ``param_dtype`` and hand their outputs back in the dtype the inputs arrived in
  (``precision.ModuleSwaps``; in any state; such a module run outside its block's forward,
  as in an activation-checkpoint recompute of the block's body, swaps them in itself).
- **state**: :class:`dmuon.runtime.state.TrainingState`, one per DedicatedParams (``dm.state``); the
  per-bucket states (copy, master copy, HSDP replica, grads) and every allowed transition
  are in ``state.py``. Entering FORWARD or BACKWARD resets the pass's cursors
  (``schedule.Cursors``), nowhere else.

Every asynchronous call goes through ``collectives.Launcher`` (work handles on gloo, side
streams and events on CUDA; ``collectives`` docstring, "Asynchrony").

Channels (``collectives.DMuonGroups``, DMuon's own process groups): ``broadcast`` and
``reduce`` over the shard axis (N ranks), ``replicate`` over the replicate axis (R ranks,
HSDP), ``world`` (W ranks). An HSDP mesh moved **flat** (``dedicate_params(hierarchy=...)``,
``buckets.resolve_hierarchy``; docs/traffic-model.md "HSDP: flat or hierarchical") follows
everything below as a 1-D mesh of all W ranks: R = 1, N = W, owner index g = world rank g,
no ``replicate`` channel and no replicate steps. On each channel the call sequence per step is fixed, the same on
every rank whichever modules run (MoE experts that receive no tokens, a branch taken on some
ranks only), so calls always pair up with the same bucket on every rank.

Per step (docs/spec.md §1):

1. **forward** (channel ``broadcast``, phase ``forward``): a forward cursor walks the buckets
   in index order (from the second step on, the blocks' execution order: step 7). The
   root's pre-hook issues the first ``prefetch_depth`` buckets (no wait: they fly during
   the root's prologue, an embedding, FSDP2's root all_gather). A driver's pre-hook
   advances it to the driver's own last bucket ``hi`` (a driver without buckets of its own,
   one that only encloses blocks, issues its first ``prefetch_depth`` buckets and waits for
   nothing: its blocks' hooks advance the cursor); a driver's post-hook advances it to its
   subtree's last bucket; the root's post-hook advances it to the
   end (so buckets of modules that did not run on this rank are still sent). Advancing to
   ``hi`` first *issues* every bucket up to
   ``hi + prefetch_depth`` not issued yet (each waits for its pending replicate broadcast
   (HSDP), then, if FREED or STALE, is broadcast from its holder, shard group rank ``s``,
   asynchronously: IN_FLIGHT), then *waits* for every bucket up to ``hi``, which become
   VALID. So while
   a module computes, the broadcasts of the next ``prefetch_depth`` buckets are in flight.
   Exactly one broadcast per bucket not VALID per forward, issued in index order on every
   rank (``prefetch_depth`` moves when a call is issued, never which or in what order).
2. **after forward**, Z3 (``reshard_after_forward=True``): a driver's post-hook frees the
   non-holders' storage of the buckets in its subtree that the cursor passed and whose
   unit's blocks have all finished their forward in this pass (a unit of several blocks
   stays until its last block ran); the root's post-hook frees the rest. **Except the last
   unit** (the unit of bucket ``B-1``, the last to run once the block order holds): its
   drivers never free it; the root's post-hook frees it only when the root's forward ran
   under ``no_grad`` (no backward follows), else its buckets stay VALID into the backward,
   which needs them first (as FSDP2 keeps its root's params after forward). Every other
   bucket is then FREED on every rank. **Reuse**: a block whose forward runs again in the
   same forward (weight sharing) finds its buckets FREED (the last unit's: VALID, no call);
   its pre-hook broadcasts each of them again from its holder (phase ``forward``, issued
   and waited there: ``Schedule.refill``), as FSDP2 re-gathers a reused module, and its
   post-hook frees them again (the last unit's stay). Every rank must run the block the
   same number of times (as under FSDP2). Under Z2 the buckets stay VALID: no call. A
   module *inside* a block that runs outside its block's forward after the block's buckets
   were freed reads the freed guard and raises.
3. **backward**, Z3 (channel ``broadcast``, phase ``backward``): a re-broadcast cursor walks
   the buckets in reverse index order. A driver's pre-backward hook (its outputs' first
   grad) advances it to the driver's own first bucket (one without buckets of its own asks
   for the next ``prefetch_depth`` re-broadcasts only); activation-checkpoint recompute (a
   driver's forward while backward runs) does the same and neither frees nor broadcasts in
   forward; the end of backward flushes the rest. Each bucket that is not VALID (all but
   the last unit's, step 2) is re-broadcast exactly once,
   issued ``prefetch_depth`` buckets ahead in that reverse order (asynchronous, waited when
   the cursor reaches it). A bucket's storage is never freed while a broadcast into it is
   in flight (the free waits for it first).
4. **backward reduces** (channel ``reduce``, phase ``backward``): buckets reduce (sum) to the
   holder over the shard axis in reverse index order, asynchronously, each as soon as it and
   every bucket before it in that order have all their grads, or none of its grads can
   arrive in this backward on this rank (a block that did not run here: it sends zeros).
   Z3's re-broadcasts and the reduces follow one order on every rank (``Schedule._pump``:
   units descending, each unit's re-broadcasts, counted at the unit ``prefetch_depth``
   buckets above, before its reduces; docs/performance.md "One issue order across
   channels"); Z3 frees a bucket once its grads arrived or its reduce was issued. A unit's
   reduces are waited when the next unit's are issued (``Schedule._settle``) and
   non-holders free their grad buffers then. At the end of backward every remaining call
   is issued in that order, a param without a local grad contributing zeros. A bucket's
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
   owner's ``.grad`` are its views); non-holders free its storage at the reduce wait (the
   next unit's issue, else the end of backward).
   Grad states (``state.Grads``): a grad hook makes the bucket LOCAL, the issue REDUCING,
   the wait below REDUCED. **On gloo** (``buckets.LINK_COSTS``: ``reduce_by_gather``) every
   reduce of this step, shard and replicate, is a **gather** to the same root of the same
   ``numel + len(params)`` elements, and every aligned group's reduce_scatter an
   **all_to_all** of the same input (count: the chunk each member keeps; an uneven group's
   chunks differ, see "aligned group"); the receiver sums
   the members' rows at the wait, adjacent pairs level by level (``collectives.sum_rows_``).
   Each rank sends and receives the same elements on the W-average (docs/traffic-model.md),
   in one message round where gloo's reduce and reduce_scatter take several.
5. **after the reduces** (local): the owner divides the reduced grads by W and sets
   ``.grad``, or ``None`` for a param whose reduced usage is 0 (unused on every rank: no
   update, as ``torch.optim.Muon``; any positive sum of 0/1 values stays positive in every
   reduce dtype, so this holds in bf16 too). An owner that kept a grad tensor from
   ``zero_grad(set_to_none=False)`` gets the reduced zeros instead, and steps on its
   momentum as torch would. Non-owners' grads are ``None``. Z3 non-holders
   free every bucket (all FREED). (The usage elements replaced a separate all_reduce over
   the world, a latency-bound call and a world-wide sync point every step.)
6. **step** (``optimizer.step()``): only owners update; every VALID bucket becomes STALE
   (FREED ones stay FREED) and REDUCED grads STEPPED (a backward before ``zero_grad()``
   raises); then
   (HSDP) each owner broadcasts its buckets to the holders over the replicate axis
   (channel ``replicate``, phase ``replicate``) asynchronously, in index order; the wait is
   in step 1.
7. **block order** (first ``step()`` only; channel ``world``, phase ``setup``, span
   ``dmuon.order_agreement``). During the first forward after ``dedicate_params`` (state
   FORWARD; activation-checkpoint recompute and later forwards are not recorded, a forward
   that raised is recorded again) each block records its unit's name when its forward
   pre-hook first runs (the root block: the root's pre-hook); ``order.py``'s rule then runs
   on units, a unit's drivers being those of all its blocks. In the first ``step()``, after the
   update and before step 6's replicate broadcasts (every call of the step has then been
   waited on, so no call in flight can pair with a renumbered bucket; every rank reaches
   this point at the same place of its call sequence; the next forward is the first to use
   the order), every rank derives a block order from its record (``order.py``: model order
   if the record already follows it, else the blocks that ran in that order then the others
   in model order, and model order when some driver's buckets would not be contiguous)
   and all_gathers its sha256 (32 bytes per rank, all W ranks). If every digest is the same,
   the buckets are renumbered in that order (unit by unit, layout order within a unit);
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
- ``sync_params()`` (phase ``checkpoint``, channel ``broadcast``): every bucket whose
  copies are not all current (the master copy's state under mixed precision, else the
  copy state) is broadcast from its holder in index order (after its pending replicate
  broadcast) and becomes VALID; no call when all are VALID. ``params_loaded()``: local,
  marks all VALID (raises, on every rank, if some copy is FREED: the load could not write it).
- An exception in forward or backward leaves the state FORWARD or BACKWARD; the next root
  forward, ``zero_grad()``, ``step()`` or ``sync_params()`` recovers: it waits for the calls
  already issued, drops the dedicated grads of an aborted backward (grads NONE), frees Z3
  non-holders (FREED) and starts over. Ranks must have raised at the same point
  (collectives issued identically).
- **Moves** (local; every rank must make the same call). ``.to()`` / ``.cuda()`` /
  ``.double()`` / ``to_empty()`` on the model or any part of it run ``_apply`` on the
  modules that hold dedicated params and on the blocks, whose classes DMuon swapped for a
  subclass (``attach.py``): before the conversion, their buckets' in-flight calls are
  waited (HSDP: the owner's replicate broadcast lands first, so ``.to()`` right after
  ``step()`` copies current values) and the registered params are put back; when the
  outermost such ``_apply`` returns, each touched bucket adopts params its modules now
  register (``to_empty`` from meta replaces them) and, if its params left their flat buffer
  and agree on device and dtype, gets a new one (``bucket_module.Bucket.rebind``): copies that had
  values, or come from meta (the user initialises them next), stay allocated, STALE until
  the next forward sends them; freed ones stay FREED; holders re-cast their mixed-precision
  compute copy at the next forward. Changes made without ``_apply`` (``p.data = x``,
  ``m.weight = nn.Parameter(...)``) are found at one point, the start of every forward
  (``Runtime.check_bindings``), and adopted the same way; a bucket whose params are split
  across devices or dtypes (one submodule moved alone) raises there, naming them, as does an
  aligned group whose buckets are (some of a unit's blocks moved alone; also checked before
  every ``step()``).
- **Lifecycle**: ``dm.close()`` (or leaving ``with dmuon.dedicate_params(...) as dm:``), on
  every rank, between steps: ``sync_params()`` (skipped when the ``with`` block raised),
  waits for in-flight calls, removes every hook, restores the modules' classes (kept as a
  pass-through under a wrapper that subclassed them, e.g. ``fully_shard``), removes the
  names DMuon added to DDP's ignore list and destroys DMuon's process groups (in a fixed
  order). The state becomes CLOSED; every later use of the handle raises.

Tensor parallelism (``dmuon/placement/matrix.py``, ``layout.py``). The mesh is ``("shard", "tp")``
(N × T) or ``("replicate", "shard", "tp")`` (R × N × T), W = R·N·T; rank ``(r, s, t)``. The
model's blocks were parallelized on ``mesh["tp"]`` first (``parallelize_module``); a
dedicated TP param is a 2-D DTensor ``Shard(d)``, d in {0, 1}, whose dim d T divides, and rank
``(r, s, t)`` holds shard t of it (n/T elements of a matrix of n). A dedicated param that is not
a DTensor is replicated over TP.

- **Per TP column, the protocol above, unchanged, on the local shards.** The ranks with TP
  index t form a data-parallel mesh R × N (``mesh["shard"]`` / ``mesh["replicate"]`` give
  its groups); on it DMuon runs steps 1-6 exactly as written, with W read as the
  data-parallel size R·N (the divisor of step 5: the T ranks of a TP group see the same
  batch) and every bucket holding the params' local shards (a TP param's ``_local_tensor`` is
  its view into the flat buffer; it stays a DTensor, which the TP forwards need; the bucket
  cap counts the local shards' bytes). Owner
  ``g = r·N + s``, holders and bucket contents are the same in every column, so the
  per-column call sequences are those of a plain DMuon with every TP matrix n/T elements.
  Channels ``broadcast`` / ``reduce`` / ``replicate`` are this column's groups; ``world`` spans
  all W ranks (step 7); a new channel ``tp`` is this rank's TP group ``(r, s, *)``.
- **Plan.** The planner balances the full matrices' Newton–Schulz cost over W slots, as a
  ``(R, N·T)`` mesh: slot ``s' = s·T + t_o`` makes ``(r, s)`` the owner and ``t_o`` the TP
  index of the rank that runs Newton–Schulz (the **NS rank**); the ranks agree on this plan.
- **Step 6 for a TP param** (``optimizer.step()``, channel ``tp``, phase ``optimizer``).
  After step 5 every rank ``(r, s, t)`` of the owner's TP group holds the averaged gradient
  of its shard. Per NS rank ``t_o`` of that group (ascending) and per (dtype, device), one
  ``gather`` to ``t_o`` of the concatenated local grads of the TP params it runs NS for
  (model order; count = the sum of their n/T), all issued before any is waited; the NS rank
  concatenates the T shards along d, runs ``torch.optim.Muon``'s momentum (full-shape
  buffer, kept on the NS rank only) and Newton–Schulz on the full matrix; then one
  ``scatter`` from ``t_o`` of the update shards (the same count, the param's dtype); every
  rank applies its shard, ``p.mul_(1 - lr·wd); p.add_(u, alpha=-adjust_lr(lr, full shape))``.
  Params without a grad (usage 0) take no part. A dedicated param replicated over TP is
  stepped by its owner in every column (T identical Newton–Schulz runs). Then the copies
  become stale and HSDP owners broadcast as in step 6, per column.
- **Traffic** (docs/traffic-model.md, "Tensor parallelism"): the data-parallel terms are those
  of a plain DMuon at P_M/T (TP matrices) per column; the step adds a gather and a scatter of
  (T-1)/T·n per TP matrix, (T-1)/(T·W)·P_M each on the W-average. Newton–Schulz: once per TP
  matrix per step across the whole mesh.
- **Why a gather to one rank, not an all_gather with NS on every TP rank**: an all_gather
  moves (T-1)·n per matrix instead of (T-1)/T·n plus the scatter's (T-1)/T·n, and runs NS T
  times; the gather/scatter pair moves 2(T-1)/T·n and runs NS once, and the plan spreads the NS
  ranks over all W ranks.
- **Unsupported** (``ValueError`` on every rank before any collective, ``tp.check_model``): a
  DTensor param not on ``mesh["tp"]`` (an FSDP2-wrapped model), a dedicated TP param that is not
  2-D or whose placement is not ``Shard(0)`` / ``Shard(1)`` (e.g. ``Replicate()``), or whose
  sharded dim T does not divide; a mesh whose names are not the two above.

Expert parallelism (``dmuon/placement/stack.py``, ``layout.py``). The mesh is ``("shard", "ep")`` (N × E) or
``("replicate", "shard", "ep")`` (R × N × E), W = R·N·E; rank ``(r, s, e)`` = world rank
``(r·N + s)·E + e``. The model's expert stacks were sharded on ``mesh["ep"]`` first
(``examples/ep_moe.py``: ``shard_experts``): a dedicated **expert stack** is a 3-D DTensor
``Shard(0)`` of global shape ``(X, rows, cols)``, X a multiple of E, and rank ``(r, s, e)`` holds
the local stack ``(X/E, rows, cols)``, experts ``[e·X/E, (e+1)·X/E)``. Every other dedicated param is
a plain tensor, data parallel over all W ranks (each rank has its own batch; the model moves
tokens to their experts by all_to_all over the EP group ``(r, s, *)``, which DMuon neither issues
nor sees).

- **Two data-parallel meshes, steps 1-6 unchanged on each.** The dense params move as on an
  ``(R, N·E)`` mesh: shard axis the N·E ranks ``(r, *, *)``, replicate axis ``(*, s, e)``. The
  expert stacks move per **column** e (the R·N ranks ``(*, *, e)``, ``mesh["shard"]`` /
  ``mesh["replicate"]``), as on an ``(R, N)`` mesh of their local stacks; owner ``g = r·N + s``
  is the same in every column. Each bucket holds params of one kind and runs on its kind's groups
  (channels ``broadcast`` / ``reduce`` / ``replicate`` of its mesh); ``world`` is shared. Both kinds
  divide the summed grads (step 5) by **W**: an expert's local grad already sums its EP group's
  tokens (the all_to_all's backward), the column sum adds the other EP groups'.
- **Units**: one per block (``coalesce`` does not join blocks on an EP mesh), so a block's dense
  and expert buckets share its unit (its forward window, Z3 free and reduce trigger). Bucket
  order: each kind's ``bucket_layout``, merged unit by unit in model order (a block's two kinds
  ordered by their first param). No aligned groups (one call per bucket).
- **Plan.** The expert stacks are planned first over ``(R, N)`` (the cost of a column's local
  stack, X/E matrices); their load lands on every rank ``(r, s, *)``; the dense params are then
  planned over the ``(R, N·E)`` slots starting from that load (``plan_ownership(initial_load=)``).
  The ranks agree on both (one digest; an expert's owner recorded as column 0's rank).
- **Step 6 for an expert stack**: the column owner runs ``torch.optim.Muon``'s momentum and
  Newton–Schulz on each of its X/E local experts (one batch; no collective); its momentum is a
  DTensor like the param, so DCP saves each column's experts at their offsets and loads them at
  another EP degree or data-parallel size. Newton–Schulz: once per expert per step across the
  mesh.
- **Norm** (``opt.clip_grad_norm_``): each owner adds its owned grads (an expert stack's local
  experts); torch's ``clip_grad_norm_`` is not supported here (the grads are not shown on FSDP2's
  mesh), and ``rest="replicate"`` is the tested way to handle the rest.
- **Unsupported** (``ValueError`` on every rank before any collective): ``hierarchy="flat"``, a
  DTensor param not ``Shard(0)`` on ``mesh["ep"]``, a dedicated DTensor that is not 3-D or whose
  expert count E does not divide, a mesh whose names are not the two above.

Limit (blocking backends such as gloo): a module that runs on some ranks only is flushed by
the next driver every rank runs (e.g. the MoE block around its experts) or by the root's
end. If another library's blocking collective (an FSDP2 all_gather of a later block) comes
before that point on the ranks that skipped the module, the ranks wait on each other: keep
conditional modules inside a module that every rank runs. NCCL's asynchronous launches do
not block the CPU there.
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
    The module docstring describes the protocol; call the model given to ``dedicate_params``
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
        """The :class:`~dmuon.runtime.bucket_module.Bucket` objects in index order (read-only use)."""
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
        until the first ``step()``, then the agreed execution order (module docstring, step 7)."""
        return self._live("block_order").block_order()

    def coalescing(self) -> dict:
        """How the blocks share collectives on this rank (docs/traffic-model.md, "Coalescing").

        Returns a dict: ``target_bytes`` (the unit target ``coalesce`` resolved to);
        ``reduce_by_gather`` (reduces run as gathers and reduce_scatters as all_to_alls, each
        summed by the receiver: gloo; module docstring, step 4); ``hierarchy``: how an HSDP
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
        # Z3 re-broadcasts every unit but the last (module docstring, step 2)
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
