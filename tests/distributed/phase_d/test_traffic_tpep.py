"""Phase D with TP × EP (``--tp 2 --ep 2``, verify/modes/tpep.py): DMuon on a (1 × 2 × 2) mesh
("dp_shard", "ep", "tp") with the reference EP layer's tiny Qwen3-MoE, its attention tensor
parallel on "tp" and its experts on "ep", the rest under FSDP2 on each TP column. The measured
collectives (interposer) equal the independent prediction of verify/traffic/tpep.py exactly
(DTensor's all_reduces in phase ``tp``, the token all_to_alls in ``activations`` over the EP
groups (0, 2) and (1, 3)), the dedicated W-average equals the closed form of
docs/traffic-model.md ("TP × EP"); a planted bug (the dense column's owners rotated) fails the
gate by name. Both ``slow`` (``make test-all``; ``make verify-traffic-full`` runs the same).
"""

import pytest

from tests.distributed.phase_d import tpep_traffic_tasks, traffic_tasks
from verify.compare import compare_run
from verify.report.checks import run_checks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 300
#: docs/traffic-model.md, "TP × EP", at W = 4 (N = 1, E = T = 2): P_D,loc = 6,144/2 + 512 =
#: 3,584; Z2 = P_D,loc + P_TP/4 = 3,584 + 1,536; Z3 = 1.5·P_D,loc − 0.5·1,792 + 1,536.
EXPECTED_ELEMS = {"dmuon-z2": 5_120, "dmuon-z3": 6_016}


def _run(pool, task, mode):
    results = pool.run_with_timeout(TIMEOUT_S, task, mode, tp=2, ep=2, rest="wrapper")
    events = [ev for r in results for ev in r["events"]]
    run = compare_run(results[0]["layout"], events, steps=2, ns_calls=sum(r["ns_calls"] for r in results))
    return run, events


def test_tpep_exact_collectives_and_closed_form(pool4):
    run, events = _run(pool4, traffic_tasks.measure_mode, "dmuon-z3")
    assert run["missing"] == [] and run["unexpected"] == [], (run["missing"][:5], run["unexpected"][:5])
    assert (run["tp_size"], run["ep_size"], run["shard_size"]) == (2, 2, 1)
    assert run["measured_avg_elems"] == pytest.approx(EXPECTED_ELEMS["dmuon-z3"], rel=1e-12)
    assert run["ns_calls_per_step"] == run["ns_calls_expected"] == 8 + 2 * (2 + 32)
    assert run["closed_form_matches"] and run["pass"]
    a2a = [ev for ev in events if ev.phase == "activations"]
    assert len(a2a) == 2 * 5 * 4 * 2 and {ev.group_id for ev in a2a} == {"0,2", "1,3"}
    tp = [ev for ev in events if ev.phase == "tp"]
    assert len(tp) == 2 * 4 * 4 * 2 and {ev.group_id for ev in tp} == {"0,1", "2,3"}


def test_tpep_gate_fails_rotated_dense_owners(pool4):
    """Control: the runtime's dense owners rotated by one column rank (same buckets, other
    holders and step-6 groups) fail the ``collectives`` check with calls missing and unexpected."""
    run, _ = _run(pool4, tpep_traffic_tasks.measure_with_dense_owners_rotated, "dmuon-z2")
    assert not run["pass"]
    assert run["missing"] and run["unexpected"]
    failed = {c["check"]: c["detail"] for c in run_checks({**run, "sources": {}}) if not c["pass"]}
    assert "collectives" in failed and "missing" in failed["collectives"], failed
