"""Six regressions, each planted in a real 2-rank run (``run_all``, what every rank of
``make verify-traffic`` runs; ``gate_tasks.mutation``), must FAIL the gate with a message that
names its cause. W = 2 is the cheapest world that shows each; the modes are the default run's
(``dmuon-z3[block]`` is the variant that makes the per-owner broadcast / reduce path run on gloo).

Without the gates added for the issue: the extra broadcast passed (the default modes moved
nothing by broadcast), the owner rotation failed without naming an owner and read "measured 0",
every-matrix-on-rank-0 passed (nothing gated per-rank NS load), and the coalescing change passed
(no baseline). Each test below asserts the new message, so it fails without its fix.
"""

from __future__ import annotations

import tempfile

import pytest

from tests.distributed.phase_d import gate_tasks
from verify.report.baseline import apply_baseline, make_baseline
from verify.report.checks import final_line
from verify.run.main import parse_args

pytestmark = pytest.mark.distributed

MODES = ("dmuon-z2", "dmuon-z3[block]")


def _report(pool, mutated: str, modes=MODES) -> dict:
    """The traffic plants leave the numbers alone: the checks after the window (numerics,
    owners' grads, checkpoint: ``test_gate_numerics.py``) run on the clean run only."""
    return pool.run(gate_tasks.gate, tempfile.mkdtemp(prefix="dmuon-gate-"), modes, mutated,
                    numerics=mutated == "none")[0]


def _failed(report: dict) -> dict[tuple[str, str], str]:
    return {(f["mode"], f["check"]): f["detail"] for f in report["failures"]}


def _no_measured_zero(report: dict) -> None:
    """Bytes that moved are never read as 0 (the closed-form line, the table, traffic.png)."""
    for run in report["runs"]:
        for name, ph in run["phases"].items():
            if ph["collectives_measured"]:
                assert ph["measured_avg_elems"] > 0, (run["mode"], name)
        for c in run["checks"]:
            assert "measured 0 " not in c["detail"], c


def test_default_run_has_every_protocol_path():
    """The default --modes carries the variants that run the per-owner broadcast / reduce path
    with Z3's re-broadcast and HSDP's hierarchical replicate axis."""
    modes = parse_args(["--out-dir", "x"]).modes.split(",")
    assert "dmuon-z3[block]" in modes and "dmuon-hsdp-z3[hierarchical]" in modes


def test_clean_run_passes_every_gate(pool2):
    report = _report(pool2, "none")
    assert report["pass"], final_line(report)
    for run in report["runs"]:
        names = [c["check"] for c in run["checks"]]
        assert "owners" in names and "ns_balance" in names


def test_all_to_all_issued_twice(pool2):
    failed = _failed(_report(pool2, "all_to_all_twice", ("dmuon-z2",)))
    assert "bytes" in failed[("dmuon-z2", "collectives")]
    assert "unexpected" in failed[("dmuon-z2", "collectives")]


@pytest.mark.slow  # one of six plants; make test runs three and the clean control
def test_extra_broadcast_caught_by_block_variant(pool2):
    report = _report(pool2, "broadcast_twice")
    failed = _failed(report)
    assert ("dmuon-z3[block]", "collectives") in failed, final_line(report)
    assert "1.5× calls" in failed[("dmuon-z3[block]", "collectives")]


@pytest.mark.slow  # one of six plants; make test runs three and the clean control
def test_small_buckets_same_bytes_more_calls(pool2):
    report = _report(pool2, "small_buckets", ("dmuon-z2",))
    detail = _failed(report)[("dmuon-z2", "collectives")]
    assert detail.startswith("same bytes, 4.5× calls (36 vs 8 per step)"), detail
    _no_measured_zero(report)


def test_owners_rotated_named(pool2):
    report = _report(pool2, "owners_rotated", ("dmuon-z3[block]",))
    detail = _failed(report)[("dmuon-z3[block]", "owners")]
    assert "owner of blocks.0.mlp.fc2.weight: expected rank 1, traffic shows rank 0" in detail
    _no_measured_zero(report)


@pytest.mark.slow  # one of six plants; make test runs three and the clean control
def test_every_matrix_on_rank0_breaks_the_shape_bound(pool2):
    """The planner the predictor shares is mutated: collectives and closed form agree, the
    harness's own bound from the shapes does not."""
    report = _report(pool2, "all_on_rank0", ("dmuon-z2",))
    failed = _failed(report)
    assert set(failed) == {("dmuon-z2", "ns_balance")}, failed
    assert failed[("dmuon-z2", "ns_balance")].startswith("rank 0 runs 8 NS calls per step > bound 5")


def test_coalescing_target_mirrored_fails_the_baseline(pool2):
    """Runtime and predictor changed alike: every other gate passes, the baseline names it."""
    clean = _report(pool2, "none", ("dmuon-z2",))
    changed = _report(pool2, "coalesce_target", ("dmuon-z2",))
    assert changed["pass"], final_line(changed)  # what the gate said before the baseline
    apply_baseline(changed, make_baseline(clean), "clean.json", explicit=True)
    detail = _failed(changed)[("dmuon-z2", "baseline")]
    assert "units: 2 vs baseline 1" in detail and "calls_per_step: 12 vs baseline 8" in detail
    assert "DMuon's units changed (1 -> 2): the coalescing target" in detail
    assert final_line(changed) == "FAIL: figures differ from the baseline (dmuon-z2)"
