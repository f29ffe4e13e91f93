"""``verify-traffic --qk-clip`` in a real 2-rank run (``run_all``, what every rank of ``make
verify-traffic ARGS="--qk-clip"`` runs): the DMuon modes run MuonClip's
QK-clip, their prediction has its all_reduce, the report shows the phase ``qk_clip`` with
measured = predicted bytes, a baseline mode says n/a, and one extra all_reduce planted in the
clip's phase fails the run naming that phase.

Fails without the feature: ``verify.modes.build.build`` had no ``qk_clip_tau`` and ``RunConfig``
no ``qk_clip_tau`` (TypeError), nothing attached a QKClip, so no run had a ``qk_clip`` phase.
"""

from __future__ import annotations

import tempfile

import pytest

from tests.distributed.phase_d import qk_clip_run_tasks as T
from verify.report.checks import final_line
from verify.report.render import format_markdown
from verify.report.terminal import format_table
from verify.measure.qk_clip import DEFAULT_TAU, NOT_DMUON

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120
#: TinyGPT's heads: 2 blocks x 4 heads (RunConfig's default size).
HEADS = 8


@pytest.mark.parametrize("mode,tau,want", [("dmuon-z2", DEFAULT_TAU, HEADS),
                                           ("dmuon-ddp", 0.3, HEADS),
                                           ("dmuon-z2", None, 0),
                                           ("naive-fsdp2-z2", DEFAULT_TAU, 0)])
def test_build_wires_the_clip_into_dmuon_modes_and_the_layout(pool2, mode, tau, want):
    """The builder attaches a QKClip on the DMuon modes only (one layer per block, τ as given)
    and records the head count the predictor needs; a baseline gets neither."""
    for r in pool2.run_with_timeout(TIMEOUT_S, T.built_layout, mode, tau):
        assert r["heads"] == want
        assert r["clip"] == bool(want)
        if want:
            assert r["layers"] == ["blocks.0.attn", "blocks.1.attn"] and r["tau"] == tau


def _run(pool, modes, planted=False) -> dict:
    out = tempfile.mkdtemp(prefix="dmuon-qkclip-")
    return pool.run_with_timeout(TIMEOUT_S, T.qk_clip_run, out, modes, DEFAULT_TAU, planted)[0]


def test_qk_clip_phase_measured_equals_predicted(pool2):
    report = _run(pool2, ("dmuon-z3", "ddp-muon"))
    assert report["pass"], final_line(report)
    z3, ddp = report["runs"]
    ph = z3["phases"]["qk_clip"]
    assert (ph["collectives_measured"], ph["collectives_predicted"], ph["pass"]) == (2, 2, True)
    q = z3["qk_clip"]
    # 8 fp32 maxima per call; all_reduce over W = 2: f(n)·S = 2(2-1)/2 · 8 elements · 4 B
    assert q["applies"] and q["heads"] == HEADS and q["msg_bytes"] == 4 * HEADS
    assert q["calls_measured_per_step"] == q["calls_predicted_per_step"] == 2
    assert q["measured_avg_bytes"] == q["predicted_avg_bytes"] == 32.0 and q["pass"]
    assert len(q["clipped_per_step"]) == 4 and q["clipped_per_step"][0] > 0  # the clip bites
    assert "qk_clip" not in ddp["phases"]
    assert ddp["qk_clip"] == {"applies": False, "tau": DEFAULT_TAU, "reason": NOT_DMUON}
    report = {**report, "run_id": "t", "created_utc": "now"}
    section = format_markdown(report).split("## QK-clip (MuonClip): phase qk_clip")[1].split("\n## ")[0]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in section.splitlines() if line.startswith("| dmuon-z3") or
             line.startswith("| ddp-muon")}
    assert cells["dmuon-z3"][:6] == ["0.05", "8", "32", "2/2", "32", "32"], cells
    assert cells["dmuon-z3"][-1] == "PASS" and cells["ddp-muon"][-1] == "n/a"
    assert f"n/a: {NOT_DMUON}: ddp-muon" in section
    text = format_table(report)
    assert "qk_clip phase" in text and "qk_clip n/a: not a DMuon mode" in " ".join(text.split())
    assert " ".join(f"{NOT_DMUON}: ddp-muon".split()) in " ".join(text.split())


def test_an_extra_all_reduce_in_the_qk_clip_phase_fails(pool2):
    report = _run(pool2, ("dmuon-z2",), planted=True)
    assert not report["pass"]
    (run,) = report["runs"]
    assert not run["phases"]["qk_clip"]["pass"]
    assert run["phases"]["qk_clip"]["collectives_measured"] == 4  # 2 per step, one extra
    assert not run["qk_clip"]["pass"] and run["qk_clip"]["measured_avg_bytes"] == 64.0
    failed = {(f["mode"], f["check"]): f["detail"] for f in report["failures"]}
    detail = failed[("dmuon-z2", "collectives")]
    assert "(phases: qk_clip)" in detail, detail
