"""Phase tags and span tracking: the context every tracer reads, with no dependency at all.

This is the torch-free, NVTX-free core behind :func:`dmuon.annotate.phase` and
:func:`dmuon.annotate.span` (which add the NVTX ranges). It lives in ``tracer`` so that the
tracers (interposer, timeline) read it without importing ``dmuon``; DMuon writes it.

- The *phase* (``"forward"``, ``"backward"``, ``"optimizer"``, ``"replicate"``, ...) is
  process-wide, not thread-local, because autograd may run backward hooks on its own threads:
  :func:`phase_tag` pushes it, :func:`current_phase` reads the innermost one.
- A *span* is a named range (``"dmuon.broadcast"``, ...) with the module and owner it concerns.
  The stack of open spans is per thread (:func:`current_span`); every span that ends is passed
  as a :class:`Span` to each listener registered with :func:`add_span_listener`.

Times come from :func:`now_ns` (``time.perf_counter_ns``, ns).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Phase names DMuon itself uses, in report order; a training loop may add its own.
#: ``checkpoint``: ``sync_params()`` broadcasts; ``qk_clip``: MuonClip's per-step max all_reduce.
PHASES = ("setup", "forward", "backward", "optimizer", "replicate", "qk_clip", "checkpoint")

_phase_stack: list[str] = []
_lock = threading.Lock()
_active = threading.local()  # per thread: stack of (span name, module) currently open


@dataclass(frozen=True, slots=True)
class Span:
    """A finished timeline range: ``t_start_ns``/``t_end_ns`` from :func:`now_ns` (ns)."""

    name: str
    module: str | None
    owner: int | None
    phase: str | None
    t_start_ns: int
    t_end_ns: int
    thread_id: int


SpanListener = Callable[[Span], None]
_listeners: list[SpanListener] = []


def now_ns() -> int:
    """The clock every DMuon / tracer timestamp uses (``time.perf_counter_ns``, ns)."""
    return time.perf_counter_ns()


def current_phase() -> str | None:
    """The innermost active phase (any thread), or ``None`` outside any phase."""
    return _phase_stack[-1] if _phase_stack else None


def current_span() -> tuple[str, str | None] | None:
    """``(name, module)`` of the innermost open span on this thread, or ``None``."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def add_span_listener(fn: SpanListener) -> None:
    """Call ``fn(span)`` for every span that ends from now on."""
    _listeners.append(fn)


def remove_span_listener(fn: SpanListener) -> None:
    """Stop calling ``fn``; a listener that is not registered is ignored."""
    if fn in _listeners:
        _listeners.remove(fn)


@contextmanager
def phase_tag(name: str) -> Iterator[None]:
    """Make ``name`` the current phase inside the block (nestable, process-wide)."""
    with _lock:
        _phase_stack.append(name)
    try:
        yield
    finally:
        with _lock:
            # Remove the innermost occurrence: blocks may exit out of order across threads.
            for i in range(len(_phase_stack) - 1, -1, -1):
                if _phase_stack[i] == name:
                    del _phase_stack[i]
                    break


@contextmanager
def span_scope(name: str, *, module: str | None = None, owner: int | None = None) -> Iterator[None]:
    """Open span ``name`` on this thread; on exit pass its :class:`Span` to every listener."""
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
        if _listeners:
            s = Span(name, module, owner, current_phase(), t0, t1, threading.get_ident())
            for fn in list(_listeners):
                fn(s)
