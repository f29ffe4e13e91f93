"""Phase D with pipeline parallelism (``--pp 2``, verify/modes/pp.py): TinyGPT cut into 2
stage modules on a (2 × 2) mesh ("pp", "dp_shard"), ``Schedule1F1B`` with M = 4 micro-batches
inside ``dmuon.pipeline_step``, DMuon Z3 on each stage's slice (rest replicated by DMuon).
The measured collectives (interposer) equal the independent prediction of verify/traffic/pp.py
exactly: each stage's dedicated calls once per step (Z3 held for the step), the stage-to-stage
send / recv in their own phase ``pipeline`` on the pipeline groups; the dedicated W-average
equals Σ_s 2(N-1)/N·P_s / S, the P2P's received elements 2M·A/S; torch.profiler matches the
interposer one to one, send / recv included (gloo's Flight Recorder records no send / recv:
its check skips and counts them). The controls that make the comparison fail are in
tests/verify/test_predict_pp.py.
"""

import pytest

from tests.distributed.phase_d import traffic_tasks
from tracer.crosscheck import crosscheck
from tracer.profiler import profiler_source_events
from verify.compare import compare_run

pytestmark = pytest.mark.distributed

TIMEOUT_S = 240
#: TinyGPT (D = 64, 2 blocks of qkv 12,288 + proj 4,096 + fc1 16,384 + fc2 16,384): P_s =
#: 49,152 per stage, P_M = 98,304; N = 2, S = 2: 2(N-1)/N·P_M/S = 49,152.
EXPECTED_ELEMS = 49_152
#: One micro-batch's activation: 8 sequences / N = 2 ranks / M = 4 = 1 row of 64 × 64.
ACTIVATION = 64 * 64


@pytest.mark.slow  # about 20 s at W = 4 on gloo with the profiler
def test_pp_exact_collectives_closed_form_and_sources(pool4):
    results = pool4.run_with_timeout(TIMEOUT_S, traffic_tasks.measure_mode, "dmuon-z3", pp=2,
                                     microbatches=4, profiler=True)
    events = [ev for r in results for ev in r["events"]]
    layout = results[0]["layout"]
    run = compare_run(layout, events, steps=2, ns_calls=sum(r["ns_calls"] for r in results))
    assert run["missing"] == [] and run["unexpected"] == [], (run["missing"][:5], run["unexpected"][:5])
    assert (run["pp_size"], run["microbatches"], run["shard_size"]) == (2, 4, 2)
    assert run["stage_p_m"] == [EXPECTED_ELEMS, EXPECTED_ELEMS]
    assert run["measured_avg_elems"] == pytest.approx(EXPECTED_ELEMS, rel=1e-12)
    assert run["closed_form_matches"] and run["pass"]
    assert run["ns_calls_per_step"] == run["ns_calls_expected"] == 8  # once per matrix
    # the P2P: 1 boundary x 2 pipeline groups x 4 micro-batches x (activation + grad) x
    # (send + recv) per step, all in phase pipeline, none dedicated
    p2p = [ev for ev in events if ev.op in ("send", "recv")]
    assert len(p2p) == 2 * 4 * 2 * 2 * 2 and {ev.phase for ev in p2p} == {"pipeline"}
    assert {ev.group_id for ev in p2p} == {"0,2", "1,3"} and {ev.count for ev in p2p} == {ACTIVATION}
    assert not [ev for ev in events if ev.phase == "pipeline" and ev.op not in ("send", "recv")]
    ph = run["phases"]["pipeline"]
    assert ph["measured_avg_elems"] == 0
    assert ph["all_measured_avg_elems"] == ph["all_closed_form_avg_elems"] == 2 * 4 * ACTIVATION / 2
    # DMuon's calls stay in their stage: groups "0,1" and "2,3" only
    assert {ev.group_id for ev in events if ev.phase != "pipeline"} == {"0,1", "2,3"}
    ref, prof, _ = profiler_source_events(events, [ev for r in results for ev in r["profiler_events"]])
    check = crosscheck(ref, prof, source="profiler", backend="gloo")
    assert check.passed and check.matched == len(events) > 0, check.lines()[:10]
    if all(r["fr_events"] is not None for r in results):  # the Flight Recorder, where on
        fr = [ev for r in results for ev in r["fr_events"]]
        check = crosscheck(events, fr, source="flight_recorder", backend="gloo")
        assert check.passed and check.matched == len(events) - len(p2p), check.lines()[:10]
