"""Phase D gates memory: ``run_all`` measures DMuon's bytes per rank
at the harness's own hooks, predicts the bound from the plan (``verify.traffic.memory``) and
fails the ``memory`` check where a rank's peak exceeds it, naming the rank, the phase, both
figures and the cause.

The model is nested (``body.layers.{i}``, ``body`` called from the root) with one unit per
block. With the runtime's pre-forward mutated back to before commit 1f3ca19 (a driver that
only encloses blocks waited for its whole subtree), a Z3 non-holder holds every unit at the
body's pre-forward: the gate FAILs; on today's runtime it passes. Without the gate (before
this feature) the mutated run passed: nothing measured memory.
"""

from __future__ import annotations

import re
import tempfile

import pytest

from tests.distributed.phase_d import memory_run_tasks as T
from verify.report.checks import final_line
from verify.report.memory_view import memory_rows

pytestmark = pytest.mark.distributed

TIMEOUT_S = 180


def _run(pool, modes, mutated=False) -> dict:
    out = tempfile.mkdtemp(prefix="dmuon-memory-")
    return pool.run_with_timeout(TIMEOUT_S, T.memory_run, out, modes, mutated)[0]


def _memory_check(run) -> dict:
    return next(c for c in run["checks"] if c["check"] == "memory")


@pytest.mark.slow  # two gate runs; the bound is the runtime's below and the check's logic unit-tested
def test_memory_gate_passes_today_and_fails_the_old_nested_pre_forward(pool4):
    report = _run(pool4, ("dmuon-z3", "dmuon-z2"))
    assert report["pass"], final_line(report)
    z3, z2 = report["runs"]
    for rank in z3["memory"]["ranks"]:
        m, b = rank["measured"], rank["bound"]
        assert 0 < m["forward"] <= b["peak_bytes"] and 0 < m["backward"] <= b["peak_bytes"]
        assert m["between"] == b["between_bytes"] == b["held_bytes"]  # Z3: only what it holds
        assert b["window_units"] <= 3 and b["window_bytes"] < b["non_held_bytes"]
        assert 0 < m["grads"] <= b["grads_bytes"]
    for rank in z2["memory"]["ranks"]:  # Z2 resident by design: every copy, all the time
        m, b = rank["measured"], rank["bound"]
        assert m["forward"] == m["backward"] == m["between"] == b["peak_bytes"]
        assert b["peak_bytes"] == b["held_bytes"] + b["non_held_bytes"]
    assert len(memory_rows(report)[1]) == 8

    bad = _run(pool4, ("dmuon-z3",), mutated=True)
    assert not bad["pass"]
    check = _memory_check(bad["runs"][0])
    assert not check["pass"]
    assert re.search(r"rank \d peak forward [\d.]+ MB > bound [\d.]+ MB \(Z3 window of \d units?\)",
                     check["detail"]), check["detail"]
    assert "DMuon's memory outside the plan's bounds (dmuon-z3)" in final_line(bad)
    # the other checks still hold: the mutation moves no byte, it only waits early
    assert [c["check"] for c in bad["runs"][0]["checks"] if not c["pass"]] == ["memory"]


@pytest.mark.parametrize("coalesce,depth", [("block", 1), ("block", 2), ("block", 0), ("auto", 1)])
def test_runtime_z3_peak_bytes_is_the_gates_bound(pool4, coalesce, depth):
    """``dm.coalescing()["z3_peak_bytes"]`` (the runtime's own figure) equals the window the
    gate predicts from the plan with its own code, on every rank; a narrower window than the
    whole non-held share where there is more than one unit."""
    for r in pool4.run_with_timeout(TIMEOUT_S, T.window_agreement, coalesce, depth):
        assert r["runtime"] == r["harness"] > 0, r
        if coalesce == "block" and depth < 2:
            assert r["harness"] < r["non_held"], r
