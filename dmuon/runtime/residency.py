"""Where a dedicated param's values live on this rank: one flat buffer per bucket, freed and
refilled without breaking autograd, and a guard that turns a read of a freed copy into an error.

- **flat buffer** (shape ``(numel,)``): the params of one bucket are views into it, so one
  collective moves them all. Freeing resizes its storage to 0 bytes (FSDP2's trick): the
  params and autograd's saved references keep their tensor objects, and refilling the storage
  (resize back, then a broadcast writes it) makes them valid again.
- **freed guard**: a read of a param whose storage has 0 bytes would read unmapped memory
  (SIGSEGV). While freed, each param's class is switched to a subclass of its own class whose
  ``__torch_function__`` raises a clear error for everything except metadata and hook
  bookkeeping (``shape``, ``grad``, ``register_*_hook`` ...). Refilling switches it back, so
  forward and backward run on the plain class (no overhead).
- **binding**: ``.to()`` / ``to_empty()`` / ``p.data = ...`` replace a param's storage and so
  disconnect it from the flat buffer. :func:`is_bound` detects that; the bucket then rebuilds
  the flat buffer from the params' new data (:func:`flatten_into_views`).

Primitives only: ``bucket.py`` is their one caller (it decides when, and keeps the states).
"""

from __future__ import annotations

import traceback

import torch


#: Tensor attributes a freed param may still answer (metadata and autograd bookkeeping).
_SAFE_ATTRS = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim",
    "layout", "is_cuda", "is_meta", "is_cpu", "is_sparse", "is_quantized", "is_nested",
    "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad", "names", "output_nr",
    "_version", "__dict__", "is_mkldnn", "is_xpu", "is_mps", "_base", "itemsize", "nbytes",
})
#: Tensor methods a freed param may still run.
_SAFE_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "__hash__",
    "_has_compatible_shallow_copy_type", "get_device", "is_contiguous", "stride",
    "untyped_storage", "__format__",
})

#: Conversions ``.to()`` / ``to_empty()`` / ``.double()`` ... apply to a freed param: they give
#: a freed result of the new dtype / device (its values are re-sent by the holder anyway).
_CONVERSIONS = frozenset({
    "to", "double", "float", "half", "bfloat16", "cuda", "cpu", "type", "empty_like", "_to_copy",
})

#: Why a param is freed and how to get its values, filled by the runtime: name -> message.
_WHY: dict[int, str] = {}
_FREED_CLASSES: dict[type, type] = {}


def _func_name(func) -> tuple[str, str]:
    """``("attr", name)`` for a property access, else ``("call", name)``."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":
        return "attr", owner.__name__
    return "call", getattr(func, "__name__", repr(func))


def _freed_class(cls: type) -> type:
    """The guard subclass of ``cls`` (cached; one per original param class)."""
    if cls not in _FREED_CLASSES:

        @classmethod
        def __torch_function__(sub, func, types, args=(), kwargs=None):
            kind, name = _func_name(func)
            safe = (name in _SAFE_ATTRS) if kind == "attr" else (name in _SAFE_METHODS)
            if kind == "attr" and name == "data":
                safe = getattr(func, "__name__", "") == "__set__"  # .to() re-points .data
            if kind == "call" and name in _CONVERSIONS:
                return _convert_freed(sub, func, args, kwargs or {})
            if not safe:
                freed = [a for a in (*args, *(kwargs or {}).values()) if type(a) is sub]  # nn.init: tensor=
                what = _WHY.get(id(freed[0]), "a DMuon param freed on this rank") if freed else ""
                if _in_fully_shard():
                    raise ValueError(
                        f"DMuon: fully_shard reached {what}, a matrix dedicated by "
                        "dmuon.dedicate_params: FSDP2 must not manage DMuon's params. Pass "
                        "ignored_params=set(dm) to every fully_shard call over a module that "
                        "holds them: fully_shard(module, mesh=mesh, ignored_params=set(dm)).")
                raise RuntimeError(
                    f"DMuon: cannot run {name} on {what}. Its storage on this rank is freed "
                    "(a non-holder between steps: Z3 frees its copy after forward, and with "
                    "mixed precision it keeps only the param_dtype copy), so it holds no "
                    "values here. Read it on "
                    "its owner (dm.owner_of(p)), or call dm.sync_params() on every rank "
                    "first: every copy is then current and allocated until the next forward "
                    "(state_dict, torch.save, .to() and dcp.save all work after it)."
                )
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

        _FREED_CLASSES[cls] = type(f"Freed{cls.__name__}", (cls,), {
            "__torch_function__": __torch_function__,
            "__module__": __name__,
        })
    return _FREED_CLASSES[cls]


def _in_fully_shard() -> bool:
    """Whether FSDP2's ``fully_shard`` is on the stack (its init reads every param it manages:
    a dedicated one reaches it only when ``ignored_params`` left it out). Error path only."""
    return any(f.name == "fully_shard" and "fsdp" in f.filename for f in traceback.extract_stack())


def _convert_freed(sub: type, func, args, kwargs) -> torch.Tensor:
    """Run a conversion on a stand-in that reads nothing (one element, expanded), then drop the
    result's storage: the result is freed, with the dtype and device the conversion asked for."""
    proxies = [
        torch.zeros(1, dtype=a.dtype, device=a.device).expand(a.shape) if type(a) is sub else a
        for a in args
    ]
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*proxies, **kwargs)
        if isinstance(out, torch.Tensor):
            out = out.contiguous() if not out.is_contiguous() else out
            out.untyped_storage().resize_(0)
    return out


def mark_freed(tensors: tuple[torch.Tensor, ...], why: str) -> None:
    """Switch ``tensors`` (a param's, ``Placement.guarded``: the param, and a DTensor's local
    tensor, which ``to_local()`` hands out without a torch function call) to their guard
    class (``why`` names the param and rank in the error)."""
    if tensors[0].device.type == "meta":
        return  # meta tensors have no memory to misread: nothing to guard
    for t in tensors:
        cls = type(t)
        if cls not in _FREED_CLASSES.values():
            _WHY[id(t)] = why
            t.__class__ = _freed_class(cls)


def mark_resident(tensors: tuple[torch.Tensor, ...]) -> None:
    """Undo :func:`mark_freed` (a no-op for resident tensors)."""
    for t in tensors:
        cls = type(t)
        if cls in _FREED_CLASSES.values():
            t.__class__ = cls.__mro__[1]
            _WHY.pop(id(t), None)


def is_freed(p: torch.Tensor) -> bool:
    """Whether ``p`` currently carries the freed guard."""
    return type(p) in _FREED_CLASSES.values()


def free_storage(flat: torch.Tensor) -> None:
    """Drop ``flat``'s storage (resize to 0 bytes); views of it keep their shapes."""
    flat.untyped_storage().resize_(0)


def alloc_storage(flat: torch.Tensor) -> None:
    """Give ``flat``'s storage its full size again (values undefined until written)."""
    storage = flat.untyped_storage()
    nbytes = flat.numel() * flat.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def is_allocated(flat: torch.Tensor) -> bool:
    """Whether ``flat``'s storage holds its full size."""
    return flat.untyped_storage().nbytes() == flat.numel() * flat.element_size()


def flatten_into_views(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` (the params' local tensors, ``Placement.local``: a plain param itself, a
    DTensor's local shard) into one new flat buffer (their device and dtype) and make their
    ``.data`` views into it (a freed tensor's values are not copied: it has none). Returns the
    buffer, shape ``(sum of numel,)``.

    Raises:
        ValueError: the tensors differ in device or dtype.
    """
    first = tensors[0]
    kinds = {(t.device, t.dtype) for t in tensors}
    if len(kinds) != 1:
        raise ValueError(
            f"Invalid bucket: params on {sorted(map(str, kinds))}. Must share one device and "
            "dtype: apply .to() to the whole model."
        )
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            view = flat[offset : offset + n].view(t.shape)
            if not is_freed(t):  # a freed tensor has no values to keep
                view.copy_(t.data)
            t.data = view
            offset += n
    return flat


def is_bound(tensors: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether every tensor (as for :func:`flatten_into_views`) is still the view of ``flat``
    that :func:`flatten_into_views` made (``.to()``, ``to_empty()`` or ``p.data = ...`` break
    this)."""
    if any(t.device != flat.device or t.dtype != flat.dtype for t in tensors):
        return False
    if not is_allocated(flat):
        return all(is_freed(t) or t.device.type == "meta" for t in tensors) and all(
            t.untyped_storage().nbytes() == 0 for t in tensors
        )
    if flat.device.type == "meta":
        return True
    base = flat.data_ptr()
    offset = 0
    for t in tensors:
        if t.data_ptr() != base + offset * flat.element_size() or not t.is_contiguous():
            return False
        offset += t.numel()
    return True
