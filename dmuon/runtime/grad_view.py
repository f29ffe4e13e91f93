"""Dedicated grads as DTensors between backward and ``step()``, where FSDP2 handles the rest:
``torch.nn.utils.clip_grad_norm_`` then gives the global norm.

After DMuon's backward a dedicated matrix's averaged grad exists on its owner only. Under FSDP2
the other params' grads are DTensor shards on the FSDP2 mesh, whose norms torch reduces over
the mesh (its ``Partial`` norm placement) when ``clip_grad_norm_`` / ``get_total_norm`` need the
total. So at the end of every backward outside ``no_sync()`` each dedicated param's ``.grad``
becomes, on every rank, a DTensor on that mesh with ``Shard(0)`` on each mesh dim: the owner's
local tensor is the whole averaged grad (the same tensor ``step()`` reads, in place), every
other rank's one row of zeros (``(1, …, 1, shape[-1])``: an empty tensor would make torch's
infinity norm raise, as it has no identity). torch's norm then sums (or maxes) every rank's
part: the rest's shards and each dedicated grad once. The local shapes do not follow
DTensor's even split, so only local ops are right on them (norms, scaling, clamping, in-place
edits, ``clip_grad_value_``: they act on the owner's grad); ``full_tensor()`` raises (on every
rank: checked on gloo, a 6×2 grad). ``step()``, ``zero_grad()`` and DMuon's own clipping take
the plain grads back (owners: the local tensor; others: ``None``). The optimizer decides when
(``dmuon/optim/optimizer.py``); ``bucket.Bucket`` assigns the ``.grad`` (the layering rule: one
module changes dedicated params); this module builds and reads the DTensors.

An owner whose param had a grad on no rank (``.grad`` ``None``) shows a zero row too, so
every rank shows the same list of DTensors: torch's total is one reduction (two over an HSDP
mesh, one per dim) whatever each rank owns. Param with a TP-sharded layout, DDP, and
``rest="replicate"`` (plain grads, no FSDP2 mesh): nothing is shown; there torch's function
issues no collective, so the step refuses after it (``dmuon/optim/grad_guard.py``).

The DTensors are built from a spec made once per param (``DTensorSpec``, as FSDP2's own
``FSDPParam`` does). Measured on this
project's 2-core CI machine (torch 2.13, tiny HF Llama, 14 dedicated params, W=2): show 19-52
µs and take-back 5-15 µs per param per backward, on a loaded machine; ``DTensor.from_local``
alone took 90-200 µs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def fsdp2_mesh(params) -> object | None:
    """The device mesh of the first DTensor among ``params`` (FSDP2's shards of the rest), or
    ``None`` where none is one (DDP, ``rest="replicate"``, a model with nothing but matrices)."""
    return next((p.device_mesh for p in params if isinstance(p, DTensor)), None)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def shown(p: torch.Tensor, grad: torch.Tensor | None, mesh, specs: dict) -> DTensor:
    """The DTensor that stands for ``p``'s plain ``grad`` on ``mesh`` (module docstring).

    Args:
        p: a dedicated param (plain tensor; on a non-holder its storage may be freed: only its
            shape, dtype and device are read).
        grad: this rank's plain grad of ``p`` (the owner's averaged grad), or ``None`` (no
            grad here): a local of zeros, shape ``(1, …, 1, p.shape[-1])``.
        mesh: the FSDP2 mesh (:func:`fsdp2_mesh`).
        specs: a per-caller cache of ``DTensorSpec`` by ``id(p)``.

    Returns:
        A DTensor of ``p``'s shape and dtype, ``Shard(0)`` on every mesh dim, whose local
        tensor is ``grad`` itself; ``.dmuon_plain_grad`` holds ``grad`` (for :func:`plain`).
    """
    spec = specs.get(id(p))
    if (spec is None or spec.mesh is not mesh or spec.shape != p.shape
            or spec.tensor_meta.dtype != p.dtype):  # first use, or a cast since
        meta = TensorMeta(p.shape, _contiguous_stride(p.shape), p.dtype)
        spec = specs[id(p)] = DTensorSpec(mesh, (Shard(0),) * mesh.ndim, tensor_meta=meta)
    # No grad here: one zero row of the last dim's length (not an empty tensor: torch's
    # infinity norm has no identity for one). Fresh each time: an in-place edit by the user
    # (noise, a clamp) must not carry into the next step's norm.
    local = grad if grad is not None else torch.zeros(
        (1,) * (p.dim() - 1) + (p.shape[-1],), dtype=p.dtype, device=p.device)
    with torch.no_grad():
        out = DTensor(local, spec, requires_grad=False)
    out.dmuon_plain_grad = grad
    return out


def plain(g: DTensor, is_owner: bool) -> torch.Tensor | None:
    """The plain grad a ``.grad`` DTensor gives back: a shown one, what it stood for (the
    owner's grad, edited in place since, or ``None``); one the user set in its place
    (``p.grad = p.grad * c``), its local tensor on the owner and ``None`` elsewhere."""
    if hasattr(g, "dmuon_plain_grad"):
        return g.dmuon_plain_grad
    return g.to_local() if is_owner else None
