"""Compute on the timeline: each block's forward and backward as spans, timed by the harness.

:class:`BlockCompute` installs hooks on the blocks of a model (the elements of its largest
``nn.ModuleList``, :func:`verify.workload.usermodel.block_names`; a model without one: the root's
children that hold parameters) while it is entered, and records one
:class:`tracer.context.Span` per block and pass:

- ``compute.forward``: from the block's forward pre-hook to its forward hook. Hooks registered
  by the runtime before ours (DMuon waits on a module's broadcasts in its pre-hook) run first,
  so a wait in the block's own pre-hook falls outside the span; waits in its submodules'
  pre-hooks fall inside it.
- ``compute.backward``: from the moment the gradient of the block's output is ready (a hook on
  the first output tensor that requires grad) to the moment the gradient of its input is
  (a hook on the first input tensor that requires grad): the autograd work of the block. A
  block whose input needs no grad (its input is data, not activations) has no backward span.

Times are :func:`tracer.context.now_ns`, the interposer's clock, so the spans line up with
the collectives. Hooks fire on autograd's threads too; the spans are collected under a lock.
The hooks issue nothing and change no tensor: traffic and results are the same with or
without them. The harness installs them itself (it shares no code with the runtime).
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tracer import context
from tracer.context import Span

from verify.workload.usermodel import block_names

#: Span names this module records.
FORWARD, BACKWARD = "compute.forward", "compute.backward"


def _first_grad_tensor(obj) -> torch.Tensor | None:
    return next((t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.requires_grad),
                None)


def compute_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the blocks whose compute :class:`BlockCompute` times, in order."""
    names = block_names(model)
    if names:
        return [(n, model.get_submodule(n)) for n in names]
    return [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]


class BlockCompute:
    """Record every block's forward and backward while entered (module docstring).

    Usage::

        with BlockCompute(model) as compute:
            train_step()
        compute.spans  # list[tracer.context.Span], in end order

    A model without blocks (no child holds parameters) records nothing.
    """

    def __init__(self, model: nn.Module) -> None:
        self.blocks = compute_blocks(model)
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._handles: list = []
        self._fwd_start: dict[str, int] = {}
        self._bwd_start: dict[str, int] = {}

    def __enter__(self) -> BlockCompute:
        for name, module in self.blocks:
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _add(self, name: str, module: str, t_start_ns: int) -> None:
        span = Span(name, module, None, context.current_phase(), t_start_ns, context.now_ns(),
                    threading.get_ident())
        with self._lock:
            self.spans.append(span)

    def _pre_hook(self, block: str):
        def hook(module, args):
            if torch.is_grad_enabled():
                x = _first_grad_tensor(args)
                if x is not None:  # its grad is ready when the block's backward is done
                    x.register_hook(lambda g: self._end_backward(block))
            self._fwd_start[block] = context.now_ns()

        return hook

    def _post_hook(self, block: str):
        def hook(module, args, output):
            t_start_ns = self._fwd_start.pop(block, None)
            if t_start_ns is not None:  # None: entered during this block's forward
                self._add(FORWARD, block, t_start_ns)
            y = _first_grad_tensor(output) if torch.is_grad_enabled() else None
            if y is not None:  # its grad is ready when the block's backward can start
                y.register_hook(lambda g: self._begin_backward(block))

        return hook

    def _begin_backward(self, block: str) -> None:
        self._bwd_start[block] = context.now_ns()

    def _end_backward(self, block: str) -> None:
        t_start_ns = self._bwd_start.pop(block, None)
        if t_start_ns is not None:
            self._add(BACKWARD, block, t_start_ns)
