"""Phase D with context parallelism (``--cp 2``, verify/modes/cp.py): the CP decoder of
examples/cp_attention.py on a (2 × 2) mesh ("dp_shard", "cp"), DMuon Z3 with both dims declared
shard dims (N_eff = N·C = 4), one unit per block (``coalesce="block"``, so Z3's backward
re-broadcast shows). The measured collectives (interposer) equal the independent prediction of
verify/traffic/cp.py exactly: DMuon's calls on the one shard group of all 4 ranks, the
attention's K/V all_gathers and their grads' all_reduces in their own phase ``context`` on the
CP groups; the dedicated W-average equals the 1-D form at N_eff, the K/V phase's received
elements 6(C-1)·Σ_l a_l; torch.profiler and gloo's Flight Recorder match the interposer one to
one. The controls that make the comparison fail are in tests/verify/test_predict_cp.py.
"""

import pytest

from tests.distributed.phase_d import traffic_tasks
from tracer.crosscheck import crosscheck
from tracer.profiler import profiler_source_events
from verify.compare import compare_run

pytestmark = pytest.mark.distributed

TIMEOUT_S = 240
#: The CP decoder at D = 64, 2 blocks of qkv 12,288 + proj 4,096 + fc1 8,192 + fc2 8,192:
#: P_M = 65,536, each block's unit 32,768; N_eff = 4: Z3 (3/4)·P_M forward, (3/4)·P_M +
#: (3/4)·(P_M - P_M^L) backward with P_M^L = 32,768 (the last block's unit, kept).
P_M, P_KEPT = 65_536, 32_768
EXPECTED_ELEMS = 0.75 * P_M * 2 + 0.75 * (P_M - P_KEPT)
#: One rank's part of K (or V) per layer: 8 sequences / N = 2 -> 4 rows x 64 / C = 32 positions x 64.
KV = 4 * 32 * 64


@pytest.mark.slow  # about 20 s at W = 4 on gloo with the profiler
def test_cp_exact_collectives_closed_form_and_sources(pool4):
    results = pool4.run_with_timeout(TIMEOUT_S, traffic_tasks.measure_mode, "dmuon-z3", cp=2,
                                     coalesce="block", profiler=True)
    events = [ev for r in results for ev in r["events"]]
    layout = results[0]["layout"]
    run = compare_run(layout, events, steps=2, ns_calls=sum(r["ns_calls"] for r in results))
    assert run["missing"] == [] and run["unexpected"] == [], (run["missing"][:5], run["unexpected"][:5])
    assert (run["cp_size"], run["n_eff"], run["shard_size"]) == (2, 4, 2)
    assert layout.p_m() == P_M
    assert run["measured_avg_elems"] == pytest.approx(EXPECTED_ELEMS, rel=1e-12)
    assert run["closed_form_matches"] and run["pass"]
    assert run["ns_calls_per_step"] == run["ns_calls_expected"] == 8  # once per matrix over N_eff
    # the K/V exchange: per rank, layer and step two all_gathers (KV each) and two all_reduces
    # (2·KV each), on the CP groups, all in phase context, none dedicated
    kv = [ev for ev in events if ev.phase == "context"]
    assert len(kv) == 4 * 2 * 4 * 2  # ranks x layers x calls x steps
    assert {(ev.op, ev.count) for ev in kv} == {("all_gather", KV), ("all_reduce", 2 * KV)}
    assert {ev.group_id for ev in kv} == {"0,1", "2,3"}
    ph = run["phases"]["context"]
    assert ph["measured_avg_elems"] == 0
    assert ph["all_measured_avg_elems"] == ph["all_closed_form_avg_elems"] == 6 * 1 * 2 * KV
    # DMuon's calls (and its replicated rest) on the one shard group of all N·C ranks
    assert {ev.group_id for ev in events if ev.phase != "context"} == {"0,1,2,3"}
    ref, prof, _ = profiler_source_events(events, [ev for r in results for ev in r["profiler_events"]])
    check = crosscheck(ref, prof, source="profiler", backend="gloo")
    assert check.passed and check.matched == len(events) > 0, check.lines()[:10]
    if all(r["fr_events"] is not None for r in results):  # the Flight Recorder, where on
        fr = [ev for r in results for ev in r["fr_events"]]
        check = crosscheck(events, fr, source="flight_recorder", backend="gloo")
        assert check.passed and check.matched == len(events), check.lines()[:10]
