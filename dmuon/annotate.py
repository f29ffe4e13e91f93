"""Phase tags and timeline spans: how DMuon (and a training loop) says what it is doing.

Two things, both cheap when nobody listens:

- :func:`phase` sets the *training phase* (``"forward"``, ``"backward"``, ``"optimizer"``,
  ``"replicate"``, ...) that tracers attach to every collective issued inside it. The phase is
  process-wide, not thread-local, because autograd may run backward hooks on its own threads.
- :func:`span` marks a named range (``"dmuon.broadcast"``, ``"dmuon.newton_schulz"``, ...)
  with the module and owner it concerns. Each span is an NVTX push/pop range in the
  ``"DMuon"`` domain (package ``nvtx``; a no-op without a profiler attached) and is passed to
  every registered listener (the tracer's timeline uses this).

Nothing here issues a collective or imports the tracer: listeners are registered from outside.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

try:  # nvtx is a dependency; keep DMuon importable where its native part is missing.
    import nvtx as _nvtx

    _NVTX_DOMAIN = _nvtx.get_domain("DMuon")
except Exception:  # pragma: no cover - depends on the platform
    _nvtx = None
    _NVTX_DOMAIN = None

#: Phase names DMuon itself uses; a training loop may add its own.
PHASES = ("setup", "forward", "backward", "optimizer", "replicate")

_phase_stack: list[str] = []
_lock = threading.Lock()
_active = threading.local()  # per thread: stack of (span name, module) currently open


def current_span() -> tuple[str, str | None] | None:
    """``(name, module)`` of the innermost open :func:`span` on this thread, or ``None``."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def current_phase() -> str | None:
    """The innermost active phase, or ``None`` outside any :func:`phase` block."""
    return _phase_stack[-1] if _phase_stack else None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Tag everything issued inside the block with phase ``name`` (nestable).

    Also an NVTX range ``dmuon.phase <name>`` in the ``DMuon`` domain, so Nsight Systems
    (and ``tracer.nsys``) can attribute NCCL ranges to phases.
    """
    with _lock:
        _phase_stack.append(name)
    if _NVTX_DOMAIN is not None:
        _NVTX_DOMAIN.push_range(_NVTX_DOMAIN.get_event_attributes(message=f"dmuon.phase {name}"))
    try:
        yield
    finally:
        if _NVTX_DOMAIN is not None:
            _NVTX_DOMAIN.pop_range()
        with _lock:
            # Remove the innermost occurrence: blocks may exit out of order across threads.
            for i in range(len(_phase_stack) - 1, -1, -1):
                if _phase_stack[i] == name:
                    del _phase_stack[i]
                    break


@dataclass(frozen=True, slots=True)
class Span:
    """A finished timeline range: ``t_start_ns``/``t_end_ns`` from ``time.perf_counter_ns``."""

    name: str
    module: str | None
    owner: int | None
    phase: str | None
    t_start_ns: int
    t_end_ns: int
    thread_id: int


SpanListener = Callable[[Span], None]
_listeners: list[SpanListener] = []


def add_span_listener(fn: SpanListener) -> None:
    """Call ``fn(span)`` for every span that ends from now on."""
    _listeners.append(fn)


def remove_span_listener(fn: SpanListener) -> None:
    """Stop calling ``fn``; a listener that is not registered is ignored."""
    if fn in _listeners:
        _listeners.remove(fn)


def now_ns() -> int:
    """The clock every DMuon / tracer timestamp uses (``time.perf_counter_ns``)."""
    return time.perf_counter_ns()


@contextmanager
def span(name: str, *, module: str | None = None, owner: int | None = None) -> Iterator[None]:
    """Mark a timeline range; shows in Nsight Systems (NVTX domain ``DMuon``) and listeners.

    The NVTX message is ``name`` followed by ``module`` and ``owner`` when given, e.g.
    ``dmuon.broadcast blocks.0.mlp.fc1 owner=2``.
    """
    message = name
    if module is not None:
        message += f" {module}"
    if owner is not None:
        message += f" owner={owner}"
    nvtx_range = None
    if _NVTX_DOMAIN is not None:
        nvtx_range = _NVTX_DOMAIN.get_event_attributes(message=message)
        _NVTX_DOMAIN.push_range(nvtx_range)
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    stack.append((name, module))
    t0 = now_ns()
    try:
        yield
    finally:
        t1 = now_ns()
        stack.pop()
        if _NVTX_DOMAIN is not None:
            _NVTX_DOMAIN.pop_range()
        if _listeners:
            s = Span(name, module, owner, current_phase(), t0, t1, threading.get_ident())
            for fn in list(_listeners):
                fn(s)
