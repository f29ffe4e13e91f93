"""What the optimizer computes, through the gate (``run_all``, what every rank of ``make
verify-traffic`` runs): the numerics, owner-grad, memory and checkpoint checks, each with the
regression it is there for planted in a real run (``gate_tasks.mutation``), failing with its
cause named. Each of these regressions leaves the traffic unchanged: bytes, calls, owners and
NS counts pass.

The fast test runs the hierarchical HSDP mode clean at W = 4 (2 x 2): its owners' grads, the
clip norm, every param's update and momentum against the single-process oracle, the memory
from both sides and a DCP round trip, so the default suite catches the hierarchical owner grad
off by R and AdamW's decay applied twice (the slow tests plant both and show the check that
fails).
"""

from __future__ import annotations

import tempfile

import pytest

from tests.distributed.phase_d import gate_tasks
from verify.report.checks import final_line

pytestmark = pytest.mark.distributed

HIER = "dmuon-hsdp-z3[hierarchical]"


def _report(pool, modes, mutated="none", **steps) -> dict:
    return pool.run(gate_tasks.gate, tempfile.mkdtemp(prefix="dmuon-gate-"), modes, mutated, **steps)[0]


def _failed(report: dict) -> dict[tuple[str, str], str]:
    return {(f["mode"], f["check"]): f["detail"] for f in report["failures"]}


def _traffic_passes(report: dict, mode: str) -> None:
    """The traffic checks hold: only what the optimizer computes or holds changed."""
    run = next(r for r in report["runs"] if r["mode"] == mode)
    for c in run["checks"]:
        if c["check"] in ("collectives", "closed_form", "ns_calls", "owners", "ns_balance"):
            assert c["pass"], c


def test_hierarchical_numerics_clean(pool4):
    report = _report(pool4, (HIER,), warmup=1, measured=1)
    assert report["pass"], final_line(report)
    run = report["runs"][0]
    names = {c["check"] for c in run["checks"]}
    assert {"numerics", "owner_grads", "checkpoint", "memory"} <= names
    num = run["numerics"]
    assert num["mesh"] == [2, 2] and len(num["grads"]) == 8  # every owner's grad, one per matrix
    assert {u["kind"] for u in num["updates"]} == {"muon", "adamw"}
    assert all(g["floor"] > 0 and 0.999 < g["ratio"] < 1.001 for g in num["grads"])
    assert num["losses"]["reference"] == "oracle" and not num["losses"]["off"]


@pytest.mark.slow
def test_hierarchical_owner_grad_r_times_the_mean(pool4):
    """Muon's update is invariant under the scaling: only the owner's grad and the clip norm
    show it."""
    report = _report(pool4, (HIER,), "hierarchical_grad_r", warmup=1, measured=1)
    detail = _failed(report)[(HIER, "owner_grads")]
    assert "2.000× the mean: divided by N=2, not W=4" in detail, detail
    assert "clip_grad_norm_" in detail
    _traffic_passes(report, HIER)


@pytest.mark.parametrize("mutated, check, words", [
    ("ns_one_fewer", "numerics", "update of blocks.0.attn.qkv.weight (muon) off the oracle's"),
    ("momentum_restart", "numerics", "momentum of blocks.0.attn.proj.weight off the oracle's"),
    ("adamw_decay_twice", "numerics", "(adamw) off the oracle's"),
    ("z2_frees", "memory", "between steps 0.20 MB < the plan's exact 0.39 MB (Z2: every copy "
                           "resident): freed what it should keep"),
    ("meter_zero", "memory", "meter reads 0 B forward"),
    ("momentum_zeroed_in_state_dict", "checkpoint", "blocks.0.attn.proj.weight:momentum"),
])
@pytest.mark.slow
def test_regression_fails_the_gate_naming_its_cause(pool2, mutated, check, words):
    """``z2_frees`` runs with ``coalesce="block"``: per-owner buckets (on gloo the aligned
    groups of ``auto`` hold every rank's part in one call)."""
    report = _report(pool2, ("dmuon-z2",), mutated, coalesce="block" if mutated == "z2_frees" else "auto")
    failed = _failed(report)
    assert ("dmuon-z2", check) in failed, final_line(report)
    assert words in failed[("dmuon-z2", check)], failed[("dmuon-z2", check)]
    _traffic_passes(report, "dmuon-z2")
