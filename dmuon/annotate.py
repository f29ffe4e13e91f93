"""Phase tags and timeline spans: how DMuon (and a training loop) says what it is doing.

Two things, both cheap when nobody listens:

- :func:`phase` sets the *training phase* (``"forward"``, ``"backward"``, ``"optimizer"``,
  ``"replicate"``, ...) that tracers attach to every collective issued inside it. The phase is
  process-wide, not thread-local, because autograd may run backward hooks on its own threads.
- :func:`span` marks a named range (``"dmuon.broadcast"``, ``"dmuon.newton_schulz"``, ...)
  with the module and owner it concerns. Each span is an NVTX push/pop range in the
  ``"DMuon"`` domain (package ``nvtx``; a no-op without a profiler attached) and is passed to
  every registered listener (the tracer's timeline uses this).

NVTX emission can be switched off, e.g. to measure its cost (``benchmarks/bench_nvtx.py``) or
to keep DMuon's ranges out of a profile: set the environment variable ``DMUON_NVTX=0`` before
``dmuon`` is imported, or call :func:`set_nvtx_enabled` at any time. Off, :func:`phase` and
:func:`span` skip the NVTX calls and the message formatting (one boolean check each); the phase
tags and the span listeners work either way. On is the default.

Nothing here issues a collective or imports the tracer: listeners are registered from outside.
"""

from __future__ import annotations

import os
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

#: Environment variable read once at import: ``0``/``false``/``off``/``no`` turn NVTX off.
NVTX_ENV = "DMUON_NVTX"
_ENV_OFF = ("0", "false", "off", "no")
_ENV_ON = ("", "1", "true", "on", "yes")


def _nvtx_from_env(value: str | None) -> bool:
    """Whether ``DMUON_NVTX=value`` asks for NVTX emission (unset: yes).

    Raises:
        ValueError: ``value`` is not one of the accepted spellings.
    """
    if value is None or value.strip().lower() in _ENV_ON:
        return True
    if value.strip().lower() in _ENV_OFF:
        return False
    raise ValueError(f"Invalid {NVTX_ENV}={value!r}. Must be one of {_ENV_OFF} (NVTX off) or "
                     f"{_ENV_ON[1:]} (on); unset it for the default (on).")


# True while phase()/span() emit NVTX ranges: nvtx importable and not switched off.
_nvtx_on = _NVTX_DOMAIN is not None and _nvtx_from_env(os.environ.get(NVTX_ENV))


def nvtx_enabled() -> bool:
    """Whether :func:`phase` and :func:`span` currently emit NVTX ranges."""
    return _nvtx_on


def set_nvtx_enabled(enabled: bool) -> bool:
    """Switch NVTX emission of :func:`phase` / :func:`span` on or off; returns the previous
    setting. Ranges already open are closed as they were opened (no unbalanced pop).

    Raises:
        ValueError: ``enabled`` is true but the ``nvtx`` package could not be imported.
    """
    global _nvtx_on
    if enabled and _NVTX_DOMAIN is None:
        raise ValueError("Invalid set_nvtx_enabled(True): the nvtx package is not importable "
                         "here. Must install it (pip install nvtx) to emit NVTX ranges.")
    previous, _nvtx_on = _nvtx_on, bool(enabled)
    return previous

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

    Also an NVTX range ``dmuon.phase <name>`` in the ``DMuon`` domain (unless switched off,
    :func:`set_nvtx_enabled`), so Nsight Systems (and ``tracer.nsys``) can attribute NCCL
    ranges to phases.
    """
    with _lock:
        _phase_stack.append(name)
    try:
        with _nvtx_range("dmuon.phase", name):
            yield
    finally:
        with _lock:
            # Remove the innermost occurrence: blocks may exit out of order across threads.
            for i in range(len(_phase_stack) - 1, -1, -1):
                if _phase_stack[i] == name:
                    del _phase_stack[i]
                    break


@contextmanager
def window(name: str) -> Iterator[None]:
    """An NVTX range ``dmuon.window <name>`` in the ``DMuon`` domain and nothing else (no phase
    tag, no span listener): marks a measured window in an Nsight Systems profile so that a
    checker keeps only the NCCL ranges inside it (``verify/nsys_verify.py``). Off when NVTX
    emission is switched off (:func:`set_nvtx_enabled`).
    """
    with _nvtx_range("dmuon.window", name):
        yield


@contextmanager
def _nvtx_range(kind: str, name: str) -> Iterator[None]:
    """NVTX push/pop range ``<kind> <name>`` in the DMuon domain, if emission is on at entry
    (the message is only formatted then)."""
    emit = _nvtx_on
    if emit:
        _NVTX_DOMAIN.push_range(_NVTX_DOMAIN.get_event_attributes(message=f"{kind} {name}"))
    try:
        yield
    finally:
        if emit:
            _NVTX_DOMAIN.pop_range()


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

    The NVTX message (unless switched off, :func:`set_nvtx_enabled`) is ``name`` followed by
    ``module`` and ``owner`` when given, e.g. ``dmuon.broadcast blocks.0.mlp.fc1 owner=2``.
    """
    emit = _nvtx_on
    if emit:
        message = name
        if module is not None:
            message += f" {module}"
        if owner is not None:
            message += f" owner={owner}"
        _NVTX_DOMAIN.push_range(_NVTX_DOMAIN.get_event_attributes(message=message))
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
        if emit:
            _NVTX_DOMAIN.pop_range()
        if _listeners:
            s = Span(name, module, owner, current_phase(), t0, t1, threading.get_ident())
            for fn in list(_listeners):
                fn(s)
