"""A Flight Recorder that lost one call fails ``source:flight_recorder`` in a real 2-rank run,
whether the call was in a warm-up step or in the window (``gate_tasks.mutation``:
``fr_lost_warmup`` / ``fr_lost_window``), naming the source, the step, the op and the count;
the unmodified run checks every warm-up step and passes (``test_gate_mutations.py``'s clean
run). Before the per-step check, the warm-up loss passed: the window's one-to-one check never
sees the warm-up (``tests/verify/test_source_steps.py`` has the same without processes).
"""

from __future__ import annotations

import tempfile

import pytest

from tests.distributed.phase_d import gate_tasks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODE = "dmuon-z2"


def _fr_source(pool, mutated: str) -> tuple[dict, dict]:
    report = pool.run(gate_tasks.gate, tempfile.mkdtemp(prefix="dmuon-fr-lost-"), (MODE,), mutated,
                      numerics=False)[0]
    (run,) = report["runs"]
    return report, run["sources"]["flight_recorder"]


def test_clean_run_checks_every_warmup_step(pool2):
    report, src = _fr_source(pool2, "none")
    assert report["pass"] and src["pass"]
    assert src["steps"] == {"checked": [0, 1], "not_recorded": {}, "incomplete": 0}


@pytest.mark.parametrize("mutated, where", [("fr_lost_warmup", "step 1 rank 1: 1 of "),
                                            ("fr_lost_window", "rank 1 group ")])
def test_lost_fr_call_fails_the_source(pool2, mutated, where):
    report, src = _fr_source(pool2, mutated)
    assert not report["pass"] and not src["pass"]
    failed = {(f["mode"], f["check"]): f["detail"] for f in report["failures"]}
    assert set(failed) == {(MODE, "source:flight_recorder")}, failed
    detail = failed[(MODE, "source:flight_recorder")]
    assert where in detail and "missing in flight_recorder" in detail, detail
