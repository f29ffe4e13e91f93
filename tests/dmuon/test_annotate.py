"""dmuon.annotate: NVTX ranges of phase() / span() (recorded through a stand-in NVTX domain),
the on/off switch (DMUON_NVTX at import, set_nvtx_enabled at run time), and that phase tags
and span listeners do not depend on the switch."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from dmuon import annotate
from tests.builders import RecordingDomain


@pytest.fixture
def domain(monkeypatch):
    """A recording domain in place of the real one, NVTX switched on; both restored after."""
    fake = RecordingDomain()
    monkeypatch.setattr(annotate, "_NVTX_DOMAIN", fake)
    previous = annotate.set_nvtx_enabled(True)
    yield fake
    annotate.set_nvtx_enabled(previous)


def test_ranges_carry_name_module_and_owner(domain):
    with annotate.phase("forward"):
        with annotate.span("dmuon.broadcast", module="blocks.0.mlp.fc1", owner=2):
            pass
        with annotate.span("dmuon.newton_schulz", owner=0):
            pass
    assert domain.calls == [
        ("push", "dmuon.phase forward"),
        ("push", "dmuon.broadcast blocks.0.mlp.fc1 owner=2"), ("pop", None),
        ("push", "dmuon.newton_schulz owner=0"), ("pop", None),
        ("pop", None),
    ]


def test_window_is_an_nvtx_range_only(domain):
    seen = []
    annotate.add_span_listener(seen.append)
    try:
        with annotate.window("dmuon-z3"):
            assert annotate.current_span() is None and annotate.current_phase() is None
    finally:
        annotate.remove_span_listener(seen.append)
    assert domain.calls == [("push", "dmuon.window dmuon-z3"), ("pop", None)] and seen == []
    annotate.set_nvtx_enabled(False)
    with annotate.window("x"):
        pass
    assert len(domain.calls) == 2


def test_switched_off_emits_nothing_but_keeps_phases_and_listeners(domain):
    spans = []
    annotate.add_span_listener(spans.append)
    try:
        assert annotate.set_nvtx_enabled(False) is True
        assert annotate.nvtx_enabled() is False
        with annotate.phase("backward"):
            assert annotate.current_phase() == "backward"
            with annotate.span("dmuon.reduce", module="fc1", owner=1):
                assert annotate.current_span() == ("dmuon.reduce", "fc1")
    finally:
        annotate.remove_span_listener(spans.append)
    assert domain.calls == []
    assert [(s.name, s.module, s.owner, s.phase) for s in spans] == [
        ("dmuon.reduce", "fc1", 1, "backward")]
    assert annotate.set_nvtx_enabled(True) is False and annotate.nvtx_enabled()


def test_switching_inside_an_open_range_keeps_push_and_pop_balanced(domain):
    with annotate.phase("optimizer"), annotate.span("dmuon.newton_schulz", module="fc", owner=0):
        annotate.set_nvtx_enabled(False)  # opened on: still closed
    annotate.set_nvtx_enabled(False)
    with annotate.phase("optimizer"), annotate.span("dmuon.newton_schulz"):
        annotate.set_nvtx_enabled(True)  # opened off: nothing to close
    assert [kind for kind, _ in domain.calls] == ["push", "push", "pop", "pop"]


def test_enabling_without_the_nvtx_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(annotate, "_nvtx_on", annotate._nvtx_on)  # restored after the test
    monkeypatch.setattr(annotate, "_NVTX_DOMAIN", None)
    with pytest.raises(ValueError, match=r"set_nvtx_enabled\(True\).*pip install 'nvtx'.*\.\[gpu\]"):
        annotate.set_nvtx_enabled(True)
    annotate.set_nvtx_enabled(False)  # switching off always works
    assert annotate.nvtx_enabled() is False


@pytest.mark.parametrize(("value", "expected"), [
    (None, True), ("", True), ("1", True), ("on", True), ("TRUE", True), ("yes", True),
    ("0", False), ("off", False), (" False ", False), ("no", False),
])
def test_env_values(value, expected):
    assert annotate._nvtx_from_env(value) is expected


def _fresh_annotate(monkeypatch, value):
    """Import annotate.py again as a new module with ``DMUON_NVTX=value``."""
    monkeypatch.setenv(annotate.NVTX_ENV, value)
    spec = importlib.util.spec_from_file_location("annotate_fresh", annotate.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_env_var_is_read_at_import(monkeypatch):
    off = _fresh_annotate(monkeypatch, "0")
    assert off.nvtx_enabled() is False
    on = _fresh_annotate(monkeypatch, "1")
    assert on.nvtx_enabled() is (on._NVTX_DOMAIN is not None)
    with pytest.raises(ValueError, match=r"Invalid DMUON_NVTX='maybe'\. Must be one of"):
        _fresh_annotate(monkeypatch, "maybe")
