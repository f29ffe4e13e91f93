"""The busiest-rank wire model (verify/traffic/wire.py) and step timing (verify/run/steptime.py)."""

from __future__ import annotations

import random

import pytest

from tracer.events import CollectiveEvent
from verify.run.steptime import StepTime, ThreadSample, sample, timing_report
from verify.traffic.formulas import avg_elems
from verify.traffic.wire import ALGORITHMS, avg_bytes_by_phase, member_wire_elems, wire_report


def test_broadcast_chain_root_sends_tail_receives():
    # n=4, root=1: chain 1 -> 2 -> 3 -> 0
    got = {r: member_wire_elems("broadcast", 100, 4, r, 1) for r in range(4)}
    assert got == {1: (100, 0), 2: (100, 100), 3: (100, 100), 0: (0, 100)}


def test_reduce_chain_ends_at_root():
    # n=4, root=1: chain 2 -> 3 -> 0 -> 1
    got = {r: member_wire_elems("reduce", 100, 4, r, 1) for r in range(4)}
    assert got == {2: (100, 0), 3: (100, 100), 0: (100, 100), 1: (0, 100)}


def test_ring_ops_are_uniform():
    assert member_wire_elems("all_reduce", 100, 4, 2, None) == (150.0, 150.0)
    assert member_wire_elems("all_gather", 25, 4, 0, None) == (75.0, 75.0)
    assert member_wire_elems("reduce_scatter", 25, 4, 3, None) == (75.0, 75.0)
    assert member_wire_elems("gather", 10, 4, 0, 0) == (0.0, 30.0)
    assert member_wire_elems("scatter", 10, 4, 2, 0) == (0.0, 10.0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="Invalid op='bogus'"):
        member_wire_elems("bogus", 1, 2, 0, None)
    with pytest.raises(ValueError, match="Invalid root=None for broadcast"):
        member_wire_elems("broadcast", 1, 2, 0, None)
    with pytest.raises(ValueError, match="Invalid group_rank=5"):
        member_wire_elems("all_reduce", 1, 2, 5, None)


def _random_events(rng: random.Random, world: int) -> list[CollectiveEvent]:
    """Every member's copy of random calls over random subgroups."""
    events = []
    for _ in range(60):
        op = rng.choice([op for op in ALGORITHMS if op not in ("send", "recv", "barrier")])
        ranks = sorted(rng.sample(range(world), rng.randint(1, world)))
        count, root = rng.randint(1, 5000), rng.randrange(len(ranks))
        for g, r in enumerate(ranks):
            events.append(CollectiveEvent(source="interposer", op=op, rank=r, group_size=len(ranks),
                                          group_rank=g, count=count, dtype="float32", root=root))
    return events


@pytest.mark.parametrize("seed", range(5))
def test_mean_of_per_rank_received_is_the_w_average(seed):
    """The theorem's figure is the mean of the wire model; the busiest rank is its maximum."""
    rng = random.Random(seed)
    world = rng.randint(2, 8)
    events = _random_events(rng, world)
    wire = wire_report(events, world_size=world, steps=2, share=lambda ev: 1.0)
    w_avg = sum(avg_elems(ev.op, ev.count, ev.group_size) for ev in events) / (world * 2)
    assert wire["mean_recv_elems"] == pytest.approx(w_avg, rel=1e-12)
    recv = [e["recv_elems"] for e in wire["per_rank"]]
    assert wire["max_recv_elems"] == max(recv) and recv[wire["busiest_rank"]] == max(recv)
    assert sum(e["sent_elems"] for e in wire["per_rank"]) == pytest.approx(sum(recv))  # conservation
    assert wire["max_recv_bytes"] == pytest.approx(4 * max(recv))


def test_busiest_rank_differs_from_average_for_broadcasts():
    # 4 ranks, one broadcast of 1,000 elements from each owner: every rank gets 3,000 - 1,000...
    # and one extra broadcast from rank 0: ranks 1..3 receive more than the average.
    events = [CollectiveEvent(source="interposer", op="broadcast", rank=r, group_size=4,
                              group_rank=r, count=1000, dtype="bfloat16", root=0) for r in range(4)]
    wire = wire_report(events, world_size=4, steps=1, share=lambda ev: 0.5)
    assert wire["mean_recv_elems"] == pytest.approx(375.0)  # (n-1)/n · S · share
    assert wire["max_recv_elems"] == 500.0 and wire["busiest_rank"] == 1
    assert wire["max_recv_bytes"] == 1000.0  # bf16


def test_avg_bytes_by_phase_per_dtype():
    calls = [("forward", "broadcast", 100, 4, "bfloat16", 1.0),
             ("backward", "reduce", 100, 4, "float32", 1.0),
             ("backward", "all_reduce", 100, 4, "float32", 0.5)]
    out = avg_bytes_by_phase(calls, world_size=4, steps=1)
    assert out["forward"] == {"bfloat16": 75 * 2 / 4}
    assert out["backward"] == {"float32": (75 + 150 * 0.5) * 4 / 4}
    assert out["total"] == {"bfloat16": 37.5, "float32": 150.0}
    with pytest.raises(ValueError, match="Invalid dtype='complex32'"):
        avg_bytes_by_phase([("forward", "broadcast", 1, 2, "complex32", 1.0)], world_size=2, steps=1)


def test_step_time_blocked_and_report():
    a, b = ThreadSample(0, 100, 10), ThreadSample(1000, 400, 110)
    assert StepTime.between(a, b) == StepTime(1000, 600)  # 1000 - 300 on CPU - 100 queued
    steps = [[StepTime(10_000_000, 5_000_000), StepTime(20_000_000, 5_000_000)],
             [StepTime(12_000_000, 0), StepTime(8_000_000, 0)]]
    rep = timing_report(steps, "cpu")
    assert rep["step_ms_per_step"] == [12.0, 20.0] and rep["step_ms"] == 16.0
    assert rep["exposed_comm_frac"] == pytest.approx((10 / 30 + 0) / 2)
    assert rep["exposed_comm_frac_max"] == pytest.approx(1 / 3)
    assert timing_report(steps, "cuda")["exposed_comm_frac"] is None
    assert "CUDA streams" in timing_report(steps, "cuda")["exposed_comm_reason"]
    assert timing_report([[StepTime(5, None)]], "cpu")["exposed_comm_frac"] is None
    with pytest.raises(ValueError, match="same non-zero number"):
        timing_report([[StepTime(1, 0)], []], "cpu")


def test_sample_reads_this_thread():
    s = sample()
    assert s.wall_ns > 0 and (s.cpu_ns is None or s.cpu_ns >= 0)
