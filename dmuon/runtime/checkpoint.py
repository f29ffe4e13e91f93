"""Checkpoints with the standard calls: what each rank saves and loads, and the hooks that make it so.

DMuon keeps a dedicated matrix current only on its holders between ``step()`` and the next
forward (non-holders keep a stale copy, or no storage at all under Z3), and its momentum only
on its owner. The standard calls (``model.state_dict()`` / ``load_state_dict``, DCP's
``get_state_dict`` / ``set_state_dict`` with default options, ``dcp.save`` / ``dcp.load``,
``opt.state_dict()`` / ``load_state_dict``) work unchanged because of two decisions:

**Model state dict: every rank holds the owner's current values of every dedicated param.**
A ``state_dict`` pre-hook on each module holding dedicated params calls
:meth:`DedicatedParams.sync_params`: a collective (phase ``checkpoint``: one broadcast per
stale bucket from its holder over the shard axis, after waiting for in-flight HSDP replicate
broadcasts) when some copy is stale, and no collective when every copy is current. So ``model.state_dict()``, ``get_state_dict``
and ``dcp.save`` must be called on **every rank**, as with FSDP, where a copy is stale; a rank
that calls it alone then raises instead of hanging (:func:`sync_if_every_rank` asks the
rendezvous store first). DCP writes a replicated
tensor from one rank of its choosing (``dedup_save_plans``: the rank with the smallest plan
so far); every rank holds the same values, so any choice is right. The returned tensors alias
the live params, as in plain torch: use (save or copy) them before the next forward, which
frees Z3 non-holders' storage again.

Loading (``model.load_state_dict``, hence ``set_state_dict``) is also called on every rank
with the same values: a ``load_state_dict`` pre-hook calls ``sync_params`` (which allocates
Z3 non-holders, so the copy never writes into freed storage; a no-op when every copy is
current, e.g. right after ``get_state_dict`` built DCP's load template), the module copies the
values in, and a post-hook calls :meth:`DedicatedParams.params_loaded` (local: every copy is
current, no broadcast before the next forward). ``load_state_dict(assign=True)`` and the
swap-tensors load path would replace the params that are views into DMuon's flat buffers:
both raise ``ValueError``. ``dcp.load`` writes in place into the template's tensors, which are
the live params: all ranks write the same values, so the copies stay current.

**Optimizer state dict: momentum on owners only; every rank lists every dedicated param.**
:class:`~dmuon.optim.optimizer.DMuon` keeps a *complete* state from construction on (the tensors
``torch.optim.Muon`` / ``AdamW`` would create lazily at the first step, with the same zero
values): on each rank, for every dedicated param that requires grad,

- its owner: ``{"momentum_buffer": <tensor, the param's shape and dtype>}``,
- every other rank: ``{}`` (an explicit empty entry),

and for every other param that requires grad: AdamW's ``{"step", "exp_avg", "exp_avg_sq"}``
(DTensor shards under FSDP2). Why, against DCP 2.13 (``torch/distributed/checkpoint/state_dict.py``):

- ``set_state_dict`` with ``strict=True`` requires a state entry for every param of every
  param group (``_split_optim_state_dict``: "Missing optimizer state for parameter ...");
  the empty entries satisfy it on non-owners. DCP flattens an empty dict to no key, so
  ``dcp.save`` writes each momentum once, from its owner, and ``dcp.load`` reads it into the
  owner only: at any world size, so a resume at another world size moves momentum to the new
  owners (their templates list the momentum of the params they now own).
- ``get_state_dict`` / ``set_state_dict`` call ``_init_optim_state``, which, on an optimizer
  whose ``state`` is empty, runs ``step()`` with zero grads and lr 0 to create the state. A
  complete state from construction on means that step never runs (it would run
  Newton–Schulz, mark every copy stale and, under HSDP, start replicate broadcasts: on the
  ranks whose state is empty only). The state DCP's template asks for exists before
  the first step, so ``dcp.load`` fills it.
- Loading checks the rule: an owned param whose entry has no ``momentum_buffer`` raises
  ``ValueError`` (a state dict from another rank or another ownership plan would otherwise
  reset its momentum silently); momentum given for a param this rank does not own is dropped
  (its owner loads its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.runtime.state import Copy


if TYPE_CHECKING:
    from dmuon.runtime.attach import HookSet
    from dmuon.runtime.dedicated_params import DedicatedParams

#: Optimizer state key of a dedicated param's momentum (``torch.optim.Muon``'s name).
MOMENTUM_KEY = "momentum_buffer"


# ---------------------------------------------------------------------------------- model side
def install(model: nn.Module, dm: DedicatedParams, hooks: HookSet) -> None:
    """Register the model-side checkpoint hooks of ``dm`` into ``hooks`` (module docstring).

    Called by ``DedicatedParams`` on the bare model. Each module that holds dedicated params
    gets a ``state_dict`` pre-hook and ``load_state_dict`` pre- and post-hooks, so the root's
    calls, a wrapper's (DDP: ``module.`` prefix) and a submodule's own ``state_dict()`` /
    ``load_state_dict()`` are all covered (after the first module of a call, the sync is a
    no-op). ``dm.close()`` removes them with the rest of ``hooks``.
    """
    modules = dict(model.named_modules())
    for name in dict.fromkeys(n.rpartition(".")[0] for n in dm.names):
        module = modules[name]
        hooks.add(
            module.register_state_dict_pre_hook(
                lambda module, prefix, keep_vars: sync_if_every_rank(dm, "model.state_dict()")),
            module.register_load_state_dict_pre_hook(
                lambda module, state_dict, prefix, local_metadata, *rest: _before_load(
                    dm, prefix, local_metadata
                )
            ),
            module.register_load_state_dict_post_hook(lambda module, keys: dm.params_loaded()),
        )


def _before_load(dm: DedicatedParams, prefix: str, local_metadata: dict) -> None:
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            f"Invalid load_state_dict(assign=True) reaching module {prefix.rstrip('.')!r}, which "
            "holds DMuon-dedicated params: assign replaces the params, which are views into "
            "DMuon's flat buffers. Must be assign=False (the default; values are copied in)."
        )
    if torch.__future__.get_swap_module_params_on_conversion():
        raise ValueError(
            "Invalid torch.__future__.set_swap_module_params_on_conversion(True) while loading "
            f"module {prefix.rstrip('.')!r}, which holds DMuon-dedicated params: swapping "
            "replaces the params, which are views into DMuon's flat buffers. Must be False "
            "while loading."
        )
    sync_if_every_rank(dm, "model.load_state_dict()")


#: Seconds a rank waits at a checkpoint sync for the other ranks to make the same call before it
#: raises (:func:`sync_if_every_rank`); ``DMUON_CHECKPOINT_WAIT_S`` in the environment overrides it.
CHECKPOINT_WAIT_S = 60.0

_arrivals: dict[str, int] = {}  # per DedicatedParams (its world group's name): checkpoint syncs so far


def needs_collective(dm: DedicatedParams) -> bool:
    """Whether :meth:`DedicatedParams.sync_params` would broadcast: some bucket's copy (its
    master copy under mixed precision) is not current on its non-holders (after ``step()``
    until the next forward; Z3 non-holders after every forward). The same answer on every
    rank (a bucket's copy state is global); local, no collective."""
    return any((b.master if b.mixed else b.copy) is not Copy.VALID for b in dm.buckets)


def sync_if_every_rank(dm: DedicatedParams, what: str) -> None:
    """The checkpoint hooks' sync: no collective where every copy is current; otherwise
    :meth:`DedicatedParams.sync_params` once every rank of DMuon's world group has made the
    same call, or ``RuntimeError`` on the rank that made it alone.

    Whether the others made the call is asked of ``torch.distributed``'s store (the rendezvous
    key-value store, not a collective: a rank calling alone, as in ``if rank == 0:
    torch.save(model.state_dict())``, would otherwise issue a broadcast its peers never join
    and hang, or pair it with their next forward's): each rank adds 1 to a counter keyed by
    DMuon's world group and the call's sequence number, the last to arrive sets a done key,
    and every rank waits for it for at most :data:`CHECKPOINT_WAIT_S` seconds
    (``DMUON_CHECKPOINT_WAIT_S``). Two store round trips per rank and call. A rank that gives
    up takes its arrival back, so a later call on every rank (the fix) meets on the same key.

    Raises:
        RuntimeError: the other ranks did not make the same call within the wait (names the
            call, this rank, the wait and the fixes).
    """
    if not needs_collective(dm):
        return
    world = dm.groups.world
    size = dist.get_world_size(world)
    if size > 1:
        store = dist.distributed_c10d._get_default_store()
        name = world.group_name
        seq = _arrivals.get(name, 0)
        _arrivals[name] = seq + 1
        key = f"dmuon/checkpoint/{name}/{seq}"
        wait_s = float(os.environ.get("DMUON_CHECKPOINT_WAIT_S", CHECKPOINT_WAIT_S))
        if store.add(key, 1) == size:
            store.set(key + "/done", "1")
        try:
            store.wait([key + "/done"], datetime.timedelta(seconds=wait_s))
        except (RuntimeError, dist.DistStoreError) as exc:
            # take this arrival back, so a later call on every rank meets on the same key
            store.add(key, -1)
            _arrivals[name] = seq
            stale = [b.names[0] for b in dm.buckets if (b.master if b.mixed else b.copy) is not Copy.VALID][:3]
            raise RuntimeError(
                f"DMuon: {what} on rank {dist.get_rank()} needs the owners' current values of "
                f"dedicated params (e.g. {stale}: after step() until the next forward, and under "
                "Z3 freed after every forward on the ranks that do not hold them), which takes a "
                f"broadcast from each owner, but the other {size - 1} ranks did not make the same "
                f"call within {wait_s:g} s (DMUON_CHECKPOINT_WAIT_S). Call it on every rank and "
                "save from one: `sd = model.state_dict()` on every rank, then `if rank == 0: "
                "torch.save(sd, path)`; or use DCP (get_state_dict + dcp.save on every rank)."
            ) from exc
    dm.sync_params()


# ------------------------------------------------------------------------------ optimizer side
def _momentum_owned(dm) -> set[int]:
    """ids of the dedicated params whose momentum this rank keeps: its owned params whose
    placement keeps it here (``Placement.keeps_momentum``: under TP, a TP-sharded param's
    only on the rank of its owner's TP group that runs its Newton–Schulz, full shape)."""
    return {id(p) for p in dm.owned() if dm.placement_of(p).keeps_momentum()}


def complete_state(opt) -> None:
    """Create every state entry a :class:`~dmuon.optim.optimizer.DMuon` reports (see the module docstring).

    Entries that exist are kept. New ones hold what the first ``step()`` would create: zero
    momentum on owners, ``{}`` on non-owners, AdamW's zero moments and step 0.
    """
    owned = _momentum_owned(opt.dedicated)
    for group in opt.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = opt.state[p]  # creates {} where missing
            if group["algorithm"] == "muon":
                if id(p) in owned and MOMENTUM_KEY not in state:
                    state[MOMENTUM_KEY] = opt.dedicated.placement_of(p).new_momentum(p)
            elif not state:
                state.update(opt.new_adamw_state(p))


def follow_moves(state: dict, keys: tuple[str, ...], like: torch.Tensor) -> None:
    """State :func:`complete_state` built before a move (``model.double()`` or ``.to(device)``
    between building the optimizer and a step) takes ``like``'s dtype and device, as
    ``Optimizer.load_state_dict`` casts loaded state; a no-op when they already agree."""
    for key in keys:
        t = state[key]
        if t.dtype != like.dtype or t.device != like.device:
            state[key] = t.to(device=like.device, dtype=like.dtype)


#: The key :meth:`DMuon.state_dict` adds next to ``state`` and ``param_groups``: which rank of how
#: many saved it and whose momentum it holds (``torch.optim.Optimizer.load_state_dict`` and DCP
#: ignore it; :func:`filter_loaded_state` names it in its error).
SAVED_BY_KEY = "dmuon_saved_by"


class PartialStateWarning(UserWarning):
    """``DMuon.state_dict()`` on one rank holds the momentum of that rank's owned params only
    (filter it with ``warnings.filterwarnings("ignore", category=PartialStateWarning)`` where
    every rank saves its own)."""


def saved_by(opt) -> dict[str, Any]:
    """``{"rank", "world_size", "momentum_of"}``: this rank, the world size and the names of
    the dedicated params whose momentum this rank's state dict holds. Local."""
    dm = opt.dedicated
    owned = _momentum_owned(dm)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"rank": rank, "world_size": world,
            "momentum_of": [n for n, p in zip(dm.names, dm.params) if id(p) in owned]}


def _called_by_dcp() -> bool:
    """Whether DCP's ``get_state_dict`` / ``get_optimizer_state_dict`` is on the stack (it
    calls ``state_dict()`` on every rank and routes each momentum from its owner)."""
    import sys

    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            return True
        frame = frame.f_back
    return False


def warn_partial_save(opt, record: dict[str, Any]) -> bool:
    """Warn (:class:`PartialStateWarning`, once per optimizer: returns whether it warned) where
    this rank's state dict lacks some dedicated param's momentum (it lives on its owner) and DCP
    is not the caller: a file saved from one rank (``if rank == 0: torch.save(opt.state_dict())``)
    cannot resume the others. Local, no collective."""
    dm = opt.dedicated
    if record["world_size"] < 2 or len(record["momentum_of"]) == len(
            [p for p in dm.params if p.requires_grad]) or _called_by_dcp():
        return False
    import warnings

    warnings.warn(
        f"DMuon.state_dict() on rank {record['rank']} of {record['world_size']} holds the Muon "
        f"momentum of the {len(record['momentum_of'])} dedicated params this rank owns only (of "
        f"{len(dm.names)}; the others' momentum is on their owners and is not gathered). A file "
        "saved from one rank (`if rank == 0: torch.save(opt.state_dict(), path)`) cannot resume "
        "the other ranks. Save on every rank, each to its own file and loaded by the same rank "
        "(`torch.save(opt.state_dict(), f'opt{rank}.pt')`), or use DCP (get_state_dict + "
        "dcp.save on every rank: each momentum once, from its owner, any world size on resume).",
        PartialStateWarning, stacklevel=3)
    return True


def filter_loaded_state(opt, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The part of an optimizer ``state_dict`` this rank keeps; raise if momentum is missing.

    Keys of ``state_dict["state"]`` are matched to params the way
    ``torch.optim.Optimizer.load_state_dict`` does: by position in the saved param groups
    (integer ids from ``opt.state_dict()``, FQNs from DCP's ``set_state_dict``).

    Returns:
        A shallow copy of ``state_dict`` without momentum for params this rank does not own.

    Raises:
        ValueError: the param groups do not match in number, size or algorithm, or an owned dedicated
            param that requires grad has no ``momentum_buffer`` of its shape.
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, opt.param_groups)
    ):
        raise ValueError(
            f"Invalid state_dict: param groups of sizes {[len(s['params']) for s in saved_groups]}. "
            f"Must match this DMuon's {[len(g['params']) for g in opt.param_groups]} "
            "(a Muon and an AdamW part per param group given to DMuon)."
        )
    kinds = [s.get("algorithm") for s in saved_groups]
    if kinds != [g["algorithm"] for g in opt.param_groups]:
        raise ValueError(
            f"Invalid state_dict: param groups of algorithms {kinds}. Must match this DMuon's "
            f"{[g['algorithm'] for g in opt.param_groups]}: build it with the same param groups "
            "as the DMuon that saved it."
        )
    dm = opt.dedicated
    owned = _momentum_owned(dm)
    name_of = dict(zip(map(id, dm.params), dm.names))
    state = dict(state_dict["state"])
    muon = [(k, p) for s, g in zip(saved_groups, opt.param_groups) if g["algorithm"] == "muon"
            for k, p in zip(s["params"], g["params"])]
    for key, p in muon:
        entry = state.get(key, {})
        if id(p) not in owned:
            if MOMENTUM_KEY in entry:
                state[key] = {k: v for k, v in entry.items() if k != MOMENTUM_KEY}
            continue
        buf = entry.get(MOMENTUM_KEY)
        if p.requires_grad and (not isinstance(buf, torch.Tensor) or buf.shape != p.shape):
            got = "none" if buf is None else f"shape {tuple(getattr(buf, 'shape', ()))}"
            raise ValueError(
                f"Invalid state_dict: momentum_buffer of dedicated param {name_of[id(p)]!r} "
                f"(owned by this rank, global owner index {dm.owner_of(p)}) is {got}. Must be a "
                f"tensor of shape {tuple(p.shape)}. {_saved_by_text(state_dict)}"
                "DMuon keeps momentum on owners only: load on "
                "each rank the optimizer state dict that rank saved under the same ownership "
                "plan, or use DCP (get_state_dict, dcp.save / dcp.load, set_state_dict), which "
                "routes momentum to the new owners at any world size."
            )
    return {**state_dict, "state": state}


def _saved_by_text(state_dict: dict[str, Any]) -> str:
    """How the loaded state dict was saved, for the load error ('' where it does not say)."""
    record = state_dict.get(SAVED_BY_KEY)
    if not isinstance(record, dict):
        return ""
    here = dist.get_rank() if dist.is_initialized() else 0
    return (f"This state dict was saved by DMuon.state_dict() on rank {record.get('rank')} of "
            f"{record.get('world_size')} (it holds the momentum of that rank's "
            f"{len(record.get('momentum_of', ()))} owned params only) and is loaded on rank "
            f"{here}. ")
