"""Refuse a step after ``torch.nn.utils.clip_grad_norm_`` where every grad is a plain tensor
(DDP, ``rest="replicate"``). Local, no collective.

Why not make torch's function right there: it computes the norm of the grads it is given, and
after DMuon's backward a dedicated matrix's grad exists on its owner only (the others have
``None``). The true norm needs every owner's part, i.e. a collective, and torch's function
issues one only for DTensor grads: under FSDP2 DMuon shows its grads as DTensors and torch's
norm is global (``dmuon/runtime/grad_view.py``); with plain grads each rank would clip by its
own norm, the replicated params drift apart and nothing says so. ``opt.clip_grad_norm_`` is the
collective version. So the step refuses: on every rank, before any param changes.

How a rank tells (from its own grads; no message between ranks): when a backward outside
``no_sync()`` has made every grad final (``DedicatedParams.on_grads_final``), the guard notes,
for each plain-tensor grad the optimizer will read on this rank, the grad itself (weakly), its
version counter and the norm of an evenly strided sample of at most ``SAMPLE`` elements. At
``step()``, the grads still in place whose version moved are compared with their notes. torch's
``clip_grad_norm_`` / ``clip_grads_with_norm_`` multiply every grad they get by one clamped
coefficient (also 1.0 when the norm is below ``max_norm``: ``torch._foreach_mul_``, torch 2.13
``torch/nn/utils/clip_grad.py``): each such grad's version moved by exactly 1 (k for k moved
views of one buffer, which share a counter) and every sample norm by the same factor. That pattern raises. Every rank that holds a grad sees it (each rank
calls torch's function on its own grads), whether or not clipping bit, from the first step on.

What passes: no in-place change; ``clip_grad_value_`` (elementwise, so right on the grads where
DMuon reads them: two foreach ops on plain tensors, the samples clamped, not scaled);
``opt.clip_grad_norm_`` (it notes the grads again); a grad replaced by another tensor;
``GradScaler``'s unscale (its kernel leaves the version counters unchanged, and an elementwise
unscale is right on the grads DMuon reads: ``dmuon/optim/amp.py``). What also raises: any
other single in-place scaling of every changed grad by one factor (``p.grad.mul_(c)``): scale
the loss instead. DTensor grads (FSDP2's, and DMuon's shown ones) are not noted.
"""

from __future__ import annotations

import math
import weakref

import torch

#: Elements per grad in the noted sample (evenly strided).
SAMPLE = 64
#: Relative spread of the sample-norm ratios still counted as one factor, in units of the
#: grads' dtype epsilon (each element of g·c is rounded once: fp32 4.8e-7, bf16 3.1e-2).
SAME_FACTOR_EPS = 4


def _sample_norm(g: torch.Tensor) -> torch.Tensor:
    flat = g.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLE)].float().norm()


class GradGuard:
    """The notes of one optimizer (module docstring)."""

    def __init__(self) -> None:
        self._notes: list[tuple[weakref.ref, int, torch.Tensor]] = []

    def note(self, params) -> None:
        """Note the plain-tensor grads of ``params`` (those not ``None``)."""
        grads = [p.grad for p in params if p.grad is not None and type(p.grad) is torch.Tensor]
        self._notes = [(weakref.ref(g), g._version, _sample_norm(g)) for g in grads]

    def check(self) -> None:
        """Raise if the noted grads were scaled in place by one factor since :meth:`note`.

        Raises:
            RuntimeError: the pattern of ``torch.nn.utils.clip_grad_norm_`` (module docstring).
        """
        moved, views = [], {}
        for ref, version, before in self._notes:
            g = ref()
            if g is not None and g._version != version:
                moved.append((g._version - version, before, g))
                storage = g.untyped_storage().data_ptr()
                views[storage] = views.get(storage, 0) + 1
        # Views of one buffer (DMuon's owned grads, DDP's bucket views) share one version
        # counter: one in-place op on each of k of them moves it by k.
        if not moved or any(delta != views[g.untyped_storage().data_ptr()] for delta, _, g in moved):
            self._notes = []
            return
        ratios = [(_sample_norm(g) / before).item() for _, before, g in moved if before.item() > 0]
        rtol = SAME_FACTOR_EPS * max(torch.finfo(g.dtype).eps for _, _, g in moved)
        lo, hi = min(ratios, default=math.nan), max(ratios, default=math.nan)
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo > rtol * abs(hi):
            self._notes = []
            return
        raise RuntimeError(  # the notes stay: a retried step() raises again
            f"DMuon: after backward, {len(moved)} grads on this rank were multiplied in place by "
            f"one factor ({hi:.6g}), as torch.nn.utils.clip_grad_norm_ does. With DMuon, torch's "
            "function sees each dedicated matrix's grad on its owner only, so every rank clips by "
            "its own norm and the replicated params drift apart. Call opt.clip_grad_norm_(max_norm"
            ", norm_type) on every rank instead (the global norm, the same on every rank; same "
            "arguments and return value). Nothing was stepped. To scale every grad by a factor "
            "that is the same on every rank, scale the loss instead.")
