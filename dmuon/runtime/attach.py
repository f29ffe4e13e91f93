"""How DMuon attaches to the user's model, and how ``DedicatedParams.close()`` detaches it.

Everything here is undone by :func:`detach_all` / :meth:`HookSet.remove_all`:

- **hooks** (:class:`HookSet`): every module hook and ``state_dict`` / ``load_state_dict``
  hook DMuon registers (grad hooks on the params belong to their bucket, ``bucket.py``);
- **moves** (:func:`follow_moves`): the modules that hold dedicated params, and each
  bucket's block, get a subclass of their own class whose ``_apply`` (what ``.to()``,
  ``.cuda()``, ``.double()``, ``to_empty()`` ... call, recursively, on every submodule)
  tells DMuon before and after the conversion, as FSDP2's ``FSDPModule._apply`` does. The
  subclass keeps the class's ``__name__`` and ``__qualname__`` (``repr(model)`` and
  ``type(m).__name__`` are unchanged), pickles and deep-copies as the original class (the
  copy is not DMuon's), and composes with wrappers that subclass it again (``fully_shard``:
  ``FSDP<ours<Linear>>``). Detaching restores the original class when ours is still the
  module's exact class; under a later wrapper it stays in the MRO as a pass-through;
- **DDP's ignore list** (:func:`ignore_in_ddp`): the dedicated names added to the model's
  ``_ddp_params_and_buffers_to_ignore`` (the user's own entries kept);
- **dedicated marks** (:func:`mark_dedicated`): which params a live ``DedicatedParams``
  took, so ``dedicate_params`` refuses a second one on the same params until ``close()``.
"""

from __future__ import annotations

import copyreg
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch.nn as nn


class HookSet:
    """The removable handles of DMuon's module hooks, removed together."""

    def __init__(self) -> None:
        self._handles: list = []

    def add(self, *handles) -> None:
        self._handles.extend(handles)

    def __len__(self) -> int:
        return len(self._handles)

    def remove_all(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ---------------------------------------------------------------------------------- moves
class MoveListener(Protocol):
    """What :func:`follow_moves` calls around a followed module's ``_apply``."""

    def before_apply(self, module: nn.Module) -> None: ...

    def after_apply(self, module: nn.Module, completed: bool) -> None: ...


#: module -> weak references to its listeners (a module may serve several DedicatedParams).
_LISTENERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SUBCLASS: dict[type, type] = {}  # original class -> DMuon's subclass
_ORIGINAL: dict[type, type] = {}  # DMuon's subclass -> original class


def _listeners(module: nn.Module) -> list[MoveListener]:
    return [l for l in (ref() for ref in _LISTENERS.get(module, ())) if l is not None]


class _FollowsMoves:
    """Put in front of a module's class by :func:`follow_moves` (module docstring)."""

    def _apply(self, fn, *args, **kwargs):
        entered, completed = [], False
        try:
            for listener in _listeners(self):
                listener.before_apply(self)
                entered.append(listener)  # after_apply pairs with a before_apply that returned
            out = super()._apply(fn, *args, **kwargs)
            completed = True
        finally:
            for listener in entered:
                listener.after_apply(self, completed)
        return out

    def __reduce_ex__(self, protocol):
        reduced = super().__reduce_ex__(protocol)
        original = _ORIGINAL.get(type(self))
        if original is None or not isinstance(reduced, tuple) or len(reduced) < 2:
            return reduced  # a wrapper's subclass on top of ours: its own business
        fn, args, *rest = reduced
        if fn is copyreg.__newobj__ and args[:1] == (type(self),):
            # pickle requires __newobj__'s class to be the object's: build it the protocol-1 way
            fn, args = copyreg._reconstructor, (original, object, None)
        else:
            args = tuple(original if a is type(self) else a for a in args)
        return (fn, args, *rest)


def follow_moves(module: nn.Module, listener: MoveListener) -> None:
    """Call ``listener`` around every ``_apply`` of ``module`` (swaps its class once)."""
    if not isinstance(module, _FollowsMoves):
        cls = type(module)
        sub = _SUBCLASS.get(cls)
        if sub is None:
            sub = type(cls.__name__, (_FollowsMoves, cls), {
                "__module__": __name__, "__qualname__": cls.__qualname__})
            _SUBCLASS[cls], _ORIGINAL[sub] = sub, cls
        module.__class__ = sub
    refs = _LISTENERS.setdefault(module, [])
    refs.append(weakref.ref(listener))


def unfollow_moves(module: nn.Module, listener: MoveListener) -> None:
    """Undo :func:`follow_moves` for ``listener``; the class is restored when no listener is
    left and DMuon's subclass is still the module's exact class."""
    refs = [r for r in _LISTENERS.get(module, ()) if r() is not None and r() is not listener]
    if refs:
        _LISTENERS[module] = refs
        return
    _LISTENERS.pop(module, None)
    original = _ORIGINAL.get(type(module))
    if original is not None:
        module.__class__ = original


# ---------------------------------------------------------------------------- DDP ignore list
def ignore_in_ddp(model: nn.Module, names: list[str]) -> list[str] | None:
    """Add ``names`` to the model's DDP ignore list; returns the previous list (for
    :func:`unignore_in_ddp`)."""
    from torch.nn.parallel import DistributedDataParallel

    previous = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    merged = list(dict.fromkeys([*(previous or ()), *names]))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, merged)
    return None if previous is None else list(previous)


def unignore_in_ddp(model: nn.Module, names: list[str], previous: list[str] | None) -> None:
    """Restore the ignore list :func:`ignore_in_ddp` changed."""
    if previous is None:
        model.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
    else:
        model._ddp_params_and_buffers_to_ignore = previous
    keep = set(previous or ())
    for name, p in model.named_parameters():
        if name in names and name not in keep:
            p.__dict__.pop("_ddp_ignored", None)


# ------------------------------------------------------------------------- dedicated marks
#: id(param) -> weak reference to the runtime that took it, whose ``holds(p)`` confirms the
#: object (a param it dropped may have died and its id been reused). Not a weak reference to
#: the param: ``torch.utils.swap_tensors`` refuses a tensor that has one ("Cannot swap t1
#: because it has weakref"), the path ``_apply`` takes for DTensor params (``to_empty`` of a
#: TP model built on meta). The forward hooks hold the runtime, so a handle dropped without
#: ``close()`` still counts.
_DEDICATED: dict[int, weakref.ref] = {}


def mark_dedicated(params: Iterable[nn.Parameter], owner) -> None:
    """Mark ``params`` as taken by ``owner`` (an object with ``holds(param) -> bool``)."""
    for key in [k for k, ref in _DEDICATED.items() if ref() is None]:  # runtimes gone
        del _DEDICATED[key]
    for p in params:
        _DEDICATED[id(p)] = weakref.ref(owner)


def release_dedicated(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        _DEDICATED.pop(id(p), None)


def dedicated_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s params that a live DedicatedParams took (local)."""
    out = []
    for name, p in model.named_parameters():
        owner = ref() if (ref := _DEDICATED.get(id(p))) is not None else None
        if owner is not None and owner.holds(p):
            out.append(name)
    return out
