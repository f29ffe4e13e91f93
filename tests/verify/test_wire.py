"""The busiest-rank wire model (verify/traffic/wire.py) and step timing (verify/measure/steptime.py)."""

from __future__ import annotations

import random

import pytest

from tracer.events import CollectiveEvent, all_to_all_count
from verify.measure.steptime import StepTime, ThreadSample, sample, timing_report
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


def test_uneven_all_to_all_member_sends_and_receives_all_but_its_own_chunk():
    # DMuon's gloo forward of owner shares 7, 7, 5, 5: member 0 sends 7 to each of 3 peers
    # and receives 7 + 5 + 5; member 2 sends 5 x 3, receives 7 + 7 + 5
    assert member_wire_elems("all_to_all", None, 4, 0, None, in_elems=28, out_elems=24,
                             self_elems=7) == (21.0, 17.0)
    assert member_wire_elems("all_to_all", None, 4, 2, None, in_elems=20, out_elems=24,
                             self_elems=5) == (15.0, 19.0)
    assert avg_elems("all_to_all", None, 4, in_elems=28, self_elems=7) == 21.0
    assert avg_elems("all_to_all", 6, 4, in_elems=24, self_elems=6) == avg_elems("all_to_all", 6, 4)
    # a (sent, received) share: the reduce's usage elements sit in other members' chunks
    ev = CollectiveEvent(source="interposer", op="all_to_all", rank=0, group_size=4, group_rank=0,
                         count=None, dtype="float32", in_elems=24, out_elems=28)
    wire = wire_report([ev], world_size=4, steps=1, share=lambda e: (0.5, 0.25), self_elems=lambda e: 7)
    assert (wire["per_rank"][0]["sent_elems"], wire["per_rank"][0]["recv_elems"]) == (8.5, 5.25)
    assert wire_report([ev], world_size=4, steps=1, share=lambda e: 1.0)["max_recv_elems"] == 0  # no own chunk: not charged


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="Invalid op='bogus'"):
        member_wire_elems("bogus", 1, 2, 0, None)
    with pytest.raises(ValueError, match="Invalid root=None for broadcast"):
        member_wire_elems("broadcast", 1, 2, 0, None)
    with pytest.raises(ValueError, match="Invalid group_rank=5"):
        member_wire_elems("all_reduce", 1, 2, 5, None)


def _random_events(rng: random.Random, world: int) -> tuple[list[CollectiveEvent], dict]:
    """Every member's copy of random calls over random subgroups, and the own chunk of every
    uneven all_to_all member (by source_ref: no source records it)."""
    events, own = [], {}
    for i in range(60):
        op = rng.choice([op for op in ALGORITHMS if op not in ("send", "recv", "barrier")]
                        + ["uneven all_to_all"])
        ranks = sorted(rng.sample(range(world), rng.randint(1, world)))
        count, root, n = rng.randint(1, 5000), rng.randrange(len(ranks)), len(ranks)
        if op == "uneven all_to_all":  # chunk[a][b]: what member a sends member b
            chunk = [[rng.randint(0, 500) for _ in range(n)] for _ in range(n)]
            for g, r in enumerate(ranks):
                ref = f"call {i} member {g}"
                in_elems, out_elems = sum(chunk[g]), sum(row[g] for row in chunk)
                own[ref] = chunk[g][g]
                events.append(CollectiveEvent(
                    source="interposer", op="all_to_all", rank=r, group_size=n, group_rank=g,
                    count=all_to_all_count(in_elems, out_elems, n), dtype="float32",
                    in_elems=in_elems, out_elems=out_elems, source_ref=ref))
            continue
        for g, r in enumerate(ranks):
            events.append(CollectiveEvent(source="interposer", op=op, rank=r, group_size=n,
                                          group_rank=g, count=count, dtype="float32", root=root))
    return events, own


@pytest.mark.parametrize("seed", range(5))
def test_mean_of_per_rank_received_is_the_w_average(seed):
    """The theorem's figure is the mean of the wire model; the busiest rank is its maximum.
    Uneven all_to_alls too: each member charged what it sends on the W-average, what it
    sends and receives on the wire, its own chunk from outside the event."""
    rng = random.Random(seed)
    world = rng.randint(2, 8)
    events, own = _random_events(rng, world)
    assert own  # every seed draws some uneven all_to_alls
    wire = wire_report(events, world_size=world, steps=2, share=lambda ev: 1.0,
                       self_elems=lambda ev: own.get(ev.source_ref))
    w_avg = sum(avg_elems(ev.op, ev.count, ev.group_size, in_elems=ev.in_elems,
                          self_elems=own.get(ev.source_ref)) for ev in events) / (world * 2)
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
