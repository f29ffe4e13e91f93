"""What a rank holds for DMuon at every hook of the measured steps, read by the harness's own
hooks (docs/verify.md, "Memory").

The hooks: a forward pre- and post-hook on every module, a hook on every output tensor that
requires grad (it fires when that output's grad is computed: the module's backward starts)
and a post-accumulate-grad hook on every dedicated param (its backward ends). Each is
registered after DMuon's, so it sees what DMuon's hook of the same event left. At each one
the meter sums, in bytes (``untyped_storage().nbytes()``: 0 once a storage is freed, each
storage counted once):

- ``dedicated``: the storages of the dedicated params (``dm``'s registered params and the
  tensor each dedicated name's module currently registers: under mixed precision, the
  compute copy during forward);
- ``grads``: the storages of those tensors' ``.grad`` (DMuon's flat grad buffers: a ``.grad``
  is a view, its ``_base`` the buffer), each remembered by a weak reference from the first
  hook that saw it, so a buffer no longer reachable through a ``.grad`` (a non-owner's,
  dropped when its reduce was issued) still counts until it is freed or dropped, and the
  meter keeps nothing alive. Given the optimizer, the meter also reads the grads in its
  step pre-hook: under mixed precision an owner's averaged grad (the master dtype) is set
  at the end of backward, after every module hook, and lives until the step.

On CUDA it also reads ``torch.cuda.memory_allocated()`` minus its value at the step's start
and ``max_memory_allocated()`` over the window (``None`` on other devices): every tensor, not
DMuon's only, reported and not gated. Reads public objects only (``dm``'s params and names);
it does not import the runtime's bound.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

#: Phases of a sample: ``between`` (a step's start, after the previous optimizer step),
#: ``forward``, ``backward``.
PHASES = ("between", "forward", "backward")


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a TP DTensor: its local shard


def _remember(seen: dict, t: torch.Tensor) -> None:
    """Add ``t``'s buffer (its view base, else itself) to ``seen`` (storage id -> weak ref)."""
    t = _local(t)
    base = t._base if t._base is not None else t
    seen.setdefault(t.untyped_storage()._cdata, weakref.ref(base))


def _bytes(seen: dict) -> int:
    """Bytes of the live storages in ``seen``, each once."""
    live = {}
    for ref in seen.values():
        t = ref()
        if t is not None:
            s = t.untyped_storage()
            live[s._cdata] = s.nbytes()
    return sum(live.values())


class MemoryMeter:
    """Peak bytes of DMuon's dedicated params and grad buffers on this rank (module docstring).

    Args:
        model: the bare model (its modules carry the hooks).
        dedicated: ``dmuon.dedicate_params``' result (its params and ``names``).
        device: ``"cuda"`` reads the CUDA allocator too; anything else does not.

    Use: :meth:`attach` once, :meth:`start` at the window's start, :meth:`step` at the start
    of every measured step, :meth:`close` at the end; :meth:`result` is what rank 0 gets.
    """

    def __init__(self, model: nn.Module, dedicated, device: str = "cpu") -> None:
        self.model, self.params = model, list(dedicated)
        modules = dict(model.named_modules())
        self._slots = []
        for name in dedicated.names:
            owner, _, leaf = name.rpartition(".")
            self._slots.append((modules[owner], leaf))
        self._cuda = device == "cuda" and torch.cuda.is_available()
        self._copies: dict[int, weakref.ref] = {}
        self._grads: dict[int, weakref.ref] = {}
        self._handles: list = []
        self.on = False
        self.peak = {p: 0 for p in PHASES}
        self.peak_grads = 0
        self.trace: list[tuple[str, int, int, int | None]] = []  # the last step's samples
        self._cuda_base = 0

    def _tensors(self) -> list[torch.Tensor]:
        live = [m._parameters.get(leaf) for m, leaf in self._slots]
        return [t for t in self.params + live if t is not None]

    def sample(self, phase: str | None = None, copies_peak: bool = True) -> None:
        """Read the storages now (module docstring); ``phase`` defaults to the autograd state.
        ``copies_peak=False`` (the optimizer's step pre-hook: backward has ended, the copies'
        peaks are not this moment's to set) reads the grads' peak only."""
        if not self.on:
            return
        if phase is None:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        for t in self._tensors():
            if copies_peak:
                _remember(self._copies, t)
            if t.grad is not None:
                _remember(self._grads, t.grad)
        copies, grads = _bytes(self._copies), _bytes(self._grads)
        cuda = torch.cuda.memory_allocated() - self._cuda_base if self._cuda else None
        if copies_peak:
            self.peak[phase] = max(self.peak[phase], copies)
        self.peak_grads = max(self.peak_grads, grads)
        self.trace.append((phase, copies, grads, cuda))

    def attach(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryMeter:
        """Register the hooks (after DMuon's: call after ``dedicate_params``); with
        ``optimizer``, a step pre-hook that reads the grads (:meth:`sample`, ``copies_peak=False``)."""
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(
                lambda *a: self.sample("backward", copies_peak=False)))
        def on_output(module, args, output):
            self.sample()
            if self.on and torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda grad: self.sample())

        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(lambda *a: self.sample()))
            self._handles.append(m.register_forward_hook(on_output))
        for p in self.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda p: self.sample()))
        return self

    def start(self) -> None:
        """Start measuring (the window's first step starts next)."""
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.on = True

    def step(self) -> None:
        """A measured step starts: the between-steps sample; the trace keeps this step only."""
        if self._cuda:
            self._cuda_base = torch.cuda.memory_allocated()
        self.trace = []
        self.sample("between")

    def close(self) -> None:
        """Stop, remove the hooks and drop the remembered storages."""
        self.on = False
        for h in self._handles:
            h.remove()
        self._handles = []
        self._copies, self._grads = {}, {}

    def result(self) -> dict:
        """This rank's figures: ``{"peak_bytes": {phase: bytes}, "peak_grads_bytes",
        "trace": [[phase, dedicated_bytes, grads_bytes, cuda_delta_bytes]], "cuda_max_allocated_bytes"}``
        (CUDA figures ``None`` off CUDA)."""
        return {"peak_bytes": dict(self.peak), "peak_grads_bytes": self.peak_grads,
                "trace": [list(s) for s in self.trace],
                "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if self._cuda else None}
