"""tracer.timeline: Chrome-trace / Perfetto JSON of collectives and DMuon spans."""

from __future__ import annotations

import json

import pytest

from dmuon.annotate import Span
from tracer.events import CollectiveEvent
from tracer.timeline import TID_COLLECTIVES, TID_IN_FLIGHT, TID_SPANS, write_chrome_trace


def _ev(rank, seq, t0, t1, **kw):
    base = dict(source="interposer", op="all_gather", rank=rank, group_id="0,1", group_size=2,
                group_rank=rank, seq=seq, count=10 + seq, dtype="bfloat16", phase="forward",
                module="blocks.0.attn", t_start_ns=t0, t_end_ns=t1,
                source_ref=f"interposer:rank{rank}:#{seq}")
    base.update(kw)
    return CollectiveEvent(**base)


def _per_rank():
    return {
        0: ([_ev(0, 0, 1_000_000, 1_002_500), _ev(0, 1, 1_003_000, 1_003_000, op="broadcast",
                                                      root=1, phase="backward",
                                                      t_wait_start_ns=1_005_000,
                                                      t_waited_ns=1_006_000)],
            [Span("dmuon.broadcast", "blocks.0.attn", 1, "forward", 999_000, 1_004_000, 7)]),
        1: ([_ev(1, 0, 1_000_100, 1_002_000), _ev(1, 1, 1_003_100, 1_004_100, op="broadcast",
                                                      root=1, phase="backward")],
            []),
    }


def test_structure_and_every_collective_present(tmp_path):
    per_rank = _per_rank()
    path = write_chrome_trace(tmp_path / "t" / "trace.json", per_rank, name="run-1")
    doc = json.loads(path.read_text())
    assert doc["otherData"] == {"name": "run-1", "origin_ns": 999_000}
    events = doc["traceEvents"]
    meta = {(e["pid"], e.get("tid"), e["name"]): e["args"] for e in events if e["ph"] == "M"}
    for rank in (0, 1):
        assert meta[(rank, None, "process_name")] == {"name": f"rank {rank}"}
        assert meta[(rank, TID_COLLECTIVES, "thread_name")] == {"name": "collectives"}
        assert meta[(rank, TID_SPANS, "thread_name")] == {"name": "DMuon spans"}
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["ph"] for e in events} == {"M", "X"}
    for e in complete:
        assert {"name", "cat", "pid", "tid", "ts", "dur", "args"} <= e.keys()
        assert e["ts"] >= 0 and e["dur"] >= 0
    collectives = [e for e in complete if e["cat"] == "collective"]
    given = [(r, ev) for r, (evs, _) in per_rank.items() for ev in evs]
    assert len(collectives) == len(given)
    by_ref = {e["args"]["source_ref"]: e for e in collectives}
    for rank, ev in given:
        out = by_ref[ev.source_ref]
        assert out["pid"] == rank and out["tid"] == TID_COLLECTIVES and out["name"] == ev.op
        assert out["ts"] == pytest.approx((ev.t_start_ns - 999_000) / 1e3)  # microseconds
        assert out["dur"] == pytest.approx((ev.t_end_ns - ev.t_start_ns) / 1e3)
        for key in ("op", "count", "msg_bytes", "dtype", "group_id", "seq", "phase", "module",
                    "root"):
            assert out["args"][key] == getattr(ev, key)
    assert by_ref["interposer:rank0:#0"]["dur"] == 2.5
    assert by_ref["interposer:rank0:#0"]["args"]["msg_bytes"] == 20
    [span] = [e for e in complete if e["cat"] == "dmuon"]
    assert (span["pid"], span["tid"], span["name"], span["ts"], span["dur"]) == (
        0, TID_SPANS, "dmuon.broadcast", 0.0, 5.0)
    assert span["args"] == {"module": "blocks.0.attn", "owner": 1, "phase": "forward",
                            "thread_id": 7}
    [flight] = [e for e in complete if e["cat"] == "in_flight"]  # the one waited async call
    assert (flight["pid"], flight["tid"], flight["name"], flight["ts"], flight["dur"]) == (
        0, TID_IN_FLIGHT, "broadcast in flight", 4.0, 3.0)
    assert flight["args"]["blocked_ns"] == 1_000


def test_event_without_times_is_rejected(tmp_path):
    per_rank = {0: ([_ev(0, 0, None, None, source="nccl_log", source_ref="a.log:12")], [])}
    with pytest.raises(ValueError, match=r"'a.log:12' of rank 0: t_start_ns=None"):
        write_chrome_trace(tmp_path / "x.json", per_rank)


def test_bad_rank_and_reversed_times_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="rank='0'"):
        write_chrome_trace(tmp_path / "x.json", {"0": ([], [])})
    with pytest.raises(ValueError, match="t_end_ns=5 < t_start_ns=9"):
        write_chrome_trace(tmp_path / "x.json", {0: ([_ev(0, 0, 9, 5)], [])})


def test_empty_run_is_a_valid_trace(tmp_path):
    doc = json.loads(write_chrome_trace(tmp_path / "e.json", {}).read_text())
    assert doc["traceEvents"] == [] and doc["otherData"]["origin_ns"] == 0
