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

Nothing here issues a collective. The phase stack, span stack, :class:`Span` and the listener
registry live in :mod:`tracer.context` (torch-free, so the tracers read them without importing
``dmuon``); this module adds the NVTX ranges and re-exports that API.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from tracer import context as _context
from tracer._compat import install_hint
from tracer.context import (  # noqa: F401 - re-exported: DMuon's public phase/span API
    PHASES,
    Span,
    SpanListener,
    _listeners,
    add_span_listener,
    now_ns,
    remove_span_listener,
)

try:  # nvtx is a dependency; keep DMuon importable where its native part is missing.
    import nvtx as _nvtx

    _NVTX_DOMAIN = _nvtx.get_domain("DMuon")
except Exception:  # pragma: no cover - depends on the platform
    _nvtx = None
    _NVTX_DOMAIN = None

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
                         f"here. Must install it to emit NVTX ranges: {install_hint('nvtx')}.")
    previous, _nvtx_on = _nvtx_on, bool(enabled)
    return previous

def current_span() -> tuple[str, str | None] | None:
    """``(name, module)`` of the innermost open :func:`span` on this thread, or ``None``."""
    return _context.current_span()


def current_phase() -> str | None:
    """The innermost active phase, or ``None`` outside any :func:`phase` block."""
    return _context.current_phase()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Tag everything issued inside the block with phase ``name`` (nestable).

    Also an NVTX range ``dmuon.phase <name>`` in the ``DMuon`` domain (unless switched off,
    :func:`set_nvtx_enabled`), so Nsight Systems (and ``tracer.nsys``) can attribute NCCL
    ranges to phases.
    """
    with _context.phase_tag(name), _nvtx_range("dmuon.phase", name):
        yield


@contextmanager
def window(name: str) -> Iterator[None]:
    """An NVTX range ``dmuon.window <name>`` in the ``DMuon`` domain and nothing else (no phase
    tag, no span listener): marks a measured window in an Nsight Systems profile so that a
    checker keeps only the NCCL ranges inside it (``verify/sources/nsys_verify.py``). Off when NVTX
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


@contextmanager
def span(name: str, *, module: str | None = None, owner: int | None = None) -> Iterator[None]:
    """Mark a timeline range; shows in Nsight Systems (NVTX domain ``DMuon``) and listeners.

    The NVTX message (unless switched off, :func:`set_nvtx_enabled`) is ``name`` followed by
    ``module`` and ``owner`` when given, e.g. ``dmuon.broadcast blocks.0.mlp.fc1 owner=2``.
    The span itself (stack, timing, listeners) is :func:`tracer.context.span_scope`.
    """
    emit = _nvtx_on
    if emit:
        message = name
        if module is not None:
            message += f" {module}"
        if owner is not None:
            message += f" owner={owner}"
        _NVTX_DOMAIN.push_range(_NVTX_DOMAIN.get_event_attributes(message=message))
    try:
        with _context.span_scope(name, module=module, owner=owner):
            yield
    finally:
        if emit:
            _NVTX_DOMAIN.pop_range()
