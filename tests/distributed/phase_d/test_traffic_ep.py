"""Phase D with expert parallelism (``--ep 2``, verify/modes/ep.py): DMuon on a (2 × 2)
mesh ("shard", "ep") with the reference EP layer's tiny Qwen3-MoE (rest="replicate"). The
measured collectives (interposer) equal the independent prediction of verify/traffic/ep.py
exactly, the token all_to_all (counts, dispatch, combine; the two transposes in backward) in
its own phase ``activations`` as predicted from the recorded routing, the dedicated W-average
equals the EP closed form of docs/traffic-model.md ("Expert parallelism"), Flight Recorder and
torch.profiler match the interposer one to one; a planted bug (expert buckets on the dense
groups) fails the gate by name.
"""

import pytest

from tests.distributed.phase_d import ep_traffic_tasks, traffic_tasks
from tracer.crosscheck import crosscheck
from tracer.profiler import profiler_source_events
from verify.compare import compare_run
from verify.report.checks import run_checks
from verify.run import runner

pytestmark = pytest.mark.distributed

TIMEOUT_S = 240
#: The tiny Qwen3-MoE (2 layers, D = 32, 8 experts of width 16): P_D = 2 x (q 1,024 + k 512 +
#: v 512 + o 1,024 + router 256) = 6,656; P_X = 2 x (gate_up 8,192 + down 4,096) = 24,576,
#: P_X/E = 12,288 at E = 2; P_M = 31,232. N = E = 2: Z2 = 2(NE-1)/(NE)·P_D + 2(N-1)/N·P_X/E
#: = 9,984 + 12,288 = 22,272; Z3 adds (NE-1)/(NE)·(P_D - P_D^L) + (N-1)/N·(P_X/E - P_X^L),
#: the last layer kept (P_D^L = 3,328, P_X^L = 6,144): + 2,496 + 3,072 = 27,840. HSDP-Z3 on
#: (2, 1, 2): (2(W-1)/W + (NE-1)/(NE))·P_D - (NE-1)/(NE)·P_D^L + 2(RN-1)/(RN)·P_X/E (N = 1: no
#: shard-axis term for the stacks) = 13,312 - 1,664 + 12,288 = 23,936.
EXPECTED_ELEMS = {"dmuon-z2": 22_272, "dmuon-z3": 27_840, "dmuon-hsdp-z3": 23_936}


def _run(pool, task, mode, profiler=False):
    results = pool.run_with_timeout(TIMEOUT_S, task, mode, ep=2, rest="replicate", profiler=profiler)
    events = [ev for r in results for ev in r["events"]]
    run = compare_run(results[0]["layout"], events, steps=2, ns_calls=sum(r["ns_calls"] for r in results))
    return run, results, events


# Z3 (every Z2 call and the re-broadcasts) in make test; Z2 and HSDP-Z3 in make test-all, with
# torch.profiler's source (about 10 s of EP's many calls: the other modes' profiler source runs
# in make test through test_traffic.py and test_traffic_tp.py)
@pytest.mark.parametrize("mode", [pytest.param("dmuon-z2", marks=pytest.mark.slow), "dmuon-z3",
                                  pytest.param("dmuon-hsdp-z3", marks=pytest.mark.slow)])
def test_ep_exact_collectives_closed_form_and_sources(pool4, mode):
    profiled = mode != "dmuon-z3"
    run, results, events = _run(pool4, traffic_tasks.measure_mode, mode, profiler=profiled)
    assert run["missing"] == [] and run["unexpected"] == [], (run["missing"][:5], run["unexpected"][:5])
    assert (run["ep_size"], run["replicate_size"], run["shard_size"]) == ((2, 2, 1) if "hsdp" in mode else (2, 1, 2))
    assert run["measured_avg_elems"] == pytest.approx(EXPECTED_ELEMS[mode], rel=1e-12)
    assert run["ns_calls_per_step"] == run["ns_calls_expected"] == 2 * (4 + 1 + 8 + 8)  # once per expert
    assert run["closed_form_matches"] and run["pass"]
    # the token all_to_all: 2 layers x 5 calls x 4 ranks per step, on the EP groups, all of
    # them in phase activations (the two backward transposes included), none dedicated
    a2a = [ev for ev in events if ev.phase == "activations"]
    assert len(a2a) == 2 * 5 * 4 * 2 and {ev.op for ev in a2a} == {"all_to_all"}
    assert {ev.group_id for ev in a2a} == {"0,1", "2,3"}
    assert not [ev for ev in events if ev.op == "all_to_all" and ev.phase != "activations"]
    assert run["phases"]["activations"]["measured_avg_elems"] == 0
    assert run["phases"]["activations"]["collectives_measured"] == 40
    assert run["total_measured_avg_elems"] == pytest.approx(run["total_predicted_avg_elems"], rel=1e-12)
    if profiled:
        ref, prof, _ = profiler_source_events(events, [ev for r in results for ev in r["profiler_events"]])
        check = crosscheck(ref, prof, source="profiler", backend="gloo")
        assert check.passed and check.matched == len(events) > 0, check.lines()[:10]
    if all(r["fr_events"] is not None for r in results):  # the Flight Recorder, where on
        fr = [ev for r in results for ev in r["fr_events"]]
        check = crosscheck(events, fr, source="flight_recorder", backend="gloo")
        assert check.passed and check.matched == len(events), check.lines()[:10]
        # every warm-up step FR holds: the whole prediction, the token all_to_alls by count
        src = {"pass": True, "mismatches": []}
        runner._fr_step_check(src, results, 2, "gloo")
        assert src["pass"] and src["steps"]["checked"] == [0, 1], src


@pytest.mark.slow  # a planted change; the exact EP comparison beside it fails on any other call
def test_ep_gate_fails_expert_buckets_on_the_dense_groups(pool4):
    """The planted bug keeps every byte count (same buckets, same elements) and moves the
    expert stacks' broadcasts and reduces to the dense groups: the gate names the calls missing
    on the EP columns ("0,2", "1,3") and the same calls unexpected on "0,1,2,3"."""
    run, _, _ = _run(pool4, ep_traffic_tasks.measure_with_experts_on_dense_groups, "dmuon-z2")
    assert not run["pass"]
    missing = {(c["group_id"], c["module"]) for c in run["missing"]}
    unexpected = {c["group_id"] for c in run["unexpected"]}
    assert {g for g, _ in missing} == {"0,2", "1,3"}, missing
    assert {m for _, m in missing} == {"model.layers.0", "model.layers.1"}
    assert unexpected == {"0,1,2,3"}
    failed = {c["check"]: c["detail"] for c in run_checks({**run, "sources": {}}) if not c["pass"]}
    assert "collectives" in failed and "missing" in failed["collectives"], failed
