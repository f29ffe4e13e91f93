"""NCCL-log source: what torch's calls become in an NCCL log (tracer.nccl.expect).

The logs here are written in NCCL's own COLL / INIT formats (``src/enqueue.cc`` /
``src/init.cc``; the 2.21 INIT form of ``shared/fixtures/nccl/nccl_init_complete_
ncclCommInitRank_format__nccl_issue1412.log``), line by line for what NCCL logs for each call,
never rendered from the interposer events they are checked against; the point-to-point rule is
also checked on the real Send / Recv lines of ``nccl_coll_sendrecv_oldformat__nccl_issue584.log``
(NVIDIA/nccl#584). Without the rules the cross-check compared the interposer's calls
with the log as they are and failed every call below (each test asserts that too).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tracer.crosscheck import crosscheck
from tracer.events import CollectiveEvent
from tracer.nccl.expect import Lowering, expected_nccl_log
from tracer.nccl.log import parse_nccl_logs
from verify.sources.nccl_source import LogWindow, rank_window, relabel

WORLD = "0x5ae77eb5ea4ec1ee"                       # commId of the world communicator
PAIR = {(0, 1): "0x1111aaaa2222bbbb", (1, 2): "0x3333cccc4444dddd", (0, 2): "0x5555eeee6666ffff"}
PID = {0: 4101, 1: 4102, 2: 4103}


def _init(rank: int, nranks: int, ptr: str, comm_id: str, me: int) -> str:
    return (f"gpu-node:{PID[me]}:{PID[me] + 7} [{me}] NCCL INFO ncclCommInitRank comm {ptr} rank "
            f"{rank} nranks {nranks} cudaDev {me} nvmlDev {me} busId {me + 1}8000 commId "
            f"{comm_id} - Init COMPLETE")


def _coll(me: int, op: str, count: int, datatype: int, root: int, ptr: str, nranks: int) -> str:
    send, recv = ("(nil)", "0x7f3a00200000") if op in ("Send", "Recv") else ("0x7f3a00000000", "0x7f3a00200000")
    return (f"gpu-node:{PID[me]}:{PID[me]} [{me}] NCCL INFO {op}: opCount 0 sendbuff {send} recvbuff "
            f"{recv} count {count} datatype {datatype} op 0 root {root} comm {ptr} [nranks={nranks}] "
            f"stream 0x55d2c1a0f000")


def _log_events(tmp_path, logs: dict[int, list[str]], world: int) -> list[CollectiveEvent]:
    """Each rank's log: INIT of the world and of every pair comm it belongs to, then ``logs``."""
    per_rank = []
    for me, lines in logs.items():
        head = [_init(me, world, f"0x7e00{me}0", WORLD, me)]
        for (a, b), cid in PAIR.items():
            if me in (a, b) and b < world:
                head.append(_init((a, b).index(me), 2, f"0x7e01{a}{b}", cid, me))
        path = tmp_path / f"nccl.gpu-node.{PID[me]}.log"
        path.write_text("\n".join(head + lines) + "\n")
        per_rank.append(rank_window(LogWindow(me, PID[me], str(path), 0, 10_000)))
    events, problems = relabel(per_rank)
    assert problems == []
    return events


def _ev(rank, op, count=None, dtype="float32", root=None, n=3, **kw) -> CollectiveEvent:
    """An event as the interposer records it (group = the world of n ranks)."""
    return CollectiveEvent(source="interposer", op=op, rank=rank, group_id=",".join(map(str, range(n))),
                           group_size=n, group_rank=rank, count=count, dtype=dtype, root=root,
                           source_ref=f"interposer:rank{rank}:{op}", **kw)


def _check(reference, log_events, lowering=Lowering(alltoall_native=False)):
    expected = expected_nccl_log(reference, lowering)
    assert expected.problems == []
    return crosscheck(expected.events, log_events, source="nccl_log")


def test_gather_scatter_are_send_recv_and_a_one_rank_root_logs_nothing(tmp_path):
    w = "0x7e00{}0"
    logs = {  # gather to root 0 then scatter from root 2, 4 floats each (NCCL < 2.28.3 lowering)
        0: [_coll(0, "Recv", 4, 7, 1, w.format(0), 3), _coll(0, "Recv", 4, 7, 2, w.format(0), 3),
            _coll(0, "Recv", 4, 7, 2, w.format(0), 3)],
        1: [_coll(1, "Send", 4, 7, 0, w.format(1), 3), _coll(1, "Recv", 4, 7, 2, w.format(1), 3)],
        2: [_coll(2, "Send", 4, 7, 0, w.format(2), 3), _coll(2, "Send", 4, 7, 0, w.format(2), 3),
            _coll(2, "Send", 4, 7, 1, w.format(2), 3)],
    }
    events = _log_events(tmp_path, logs, 3)
    reference = [e for r in range(3) for e in (_ev(r, "gather", 4, root=0), _ev(r, "scatter", 4, root=2))]
    check = _check(reference, events)
    assert check.passed, check.lines()
    assert check.matched == 8
    assert not crosscheck(reference, events, source="nccl_log").passed  # as recorded: FAIL
    # W = 1: the root copies locally, NCCL logs nothing; the barrier beside it does log
    solo = [_ev(0, "gather", 4, root=0, n=1), _ev(0, "barrier", dtype=None, n=1)]
    assert [e.op for e in expected_nccl_log(solo, Lowering(False)).events] == ["all_reduce"]


def test_all_to_all_is_send_recv_pairs_before_nccl_2_28_and_one_line_after(tmp_path):
    w = "0x7e00{}0"
    logs = {me: [_coll(me, op, 3, 9, p, w.format(me), 2) for p in range(2) for op in ("Send", "Recv")]
            for me in range(2)}
    events = _log_events(tmp_path, logs, 2)
    reference = [_ev(r, "all_to_all", 3, "bfloat16", n=2, in_elems=6, out_elems=6) for r in range(2)]
    check = _check(reference, events, Lowering.for_version((2, 27, 7)))
    assert check.passed and check.matched == 8, check.lines()
    assert not crosscheck(reference, events, source="nccl_log").passed
    native = tmp_path / "native"
    native.mkdir()
    logs = {me: [_coll(me, "AlltoAll", 3, 9, 0, w.format(me), 2)] for me in range(2)}
    check = _check(reference, _log_events(native, logs, 2), Lowering.for_version((2, 28, 3)))
    assert check.passed and check.matched == 2, check.lines()


def test_uneven_all_to_all_sends_each_peer_its_split(tmp_path):
    w = "0x7e00{}0"
    # rank 0 sends rows [2, 1] of 4 elements and receives [2, 3]; rank 1 the mirror
    logs = {0: [_coll(0, "Send", 8, 7, 0, w.format(0), 2), _coll(0, "Recv", 8, 7, 0, w.format(0), 2),
                _coll(0, "Send", 4, 7, 1, w.format(0), 2), _coll(0, "Recv", 12, 7, 1, w.format(0), 2)],
            1: [_coll(1, "Send", 12, 7, 0, w.format(1), 2), _coll(1, "Recv", 4, 7, 0, w.format(1), 2),
                _coll(1, "Send", 8, 7, 1, w.format(1), 2), _coll(1, "Recv", 8, 7, 1, w.format(1), 2)]}
    reference = [
        _ev(0, "all_to_all", None, n=2, in_elems=12, out_elems=20).replace(
            source_ref="interposer:rank0:#0 uneven all_to_all in_splits=[2, 1] out_splits=[2, 3] row_elems=4"),
        _ev(1, "all_to_all", None, n=2, in_elems=20, out_elems=12).replace(
            source_ref="interposer:rank1:#0 uneven all_to_all in_splits=[3, 2] out_splits=[1, 2] row_elems=4"),
    ]
    check = _check(reference, _log_events(tmp_path, logs, 2), Lowering.for_version((2, 28, 3)))
    assert check.passed and check.matched == 8, check.lines()
    bad = expected_nccl_log([_ev(0, "all_to_all", None, n=2, in_elems=12, out_elems=20)], Lowering(True))
    assert bad.problems and "without its per-peer splits" in bad.problems[0]


def test_bool_complex_and_barrier_as_nccl_logs_them(tmp_path):
    w = "0x7e00{}0"
    logs = {me: [_coll(me, "AllReduce", 5, 1, 0, w.format(me), 2),     # bool: uint8
                 _coll(me, "Broadcast", 12, 7, 1, w.format(me), 2),    # complex64: 2 x float32
                 _coll(me, "AllReduce", 1, 7, 0, w.format(me), 2)]     # barrier: one float
            for me in range(2)}
    events = _log_events(tmp_path, logs, 2)
    reference = [e for r in range(2) for e in (
        _ev(r, "all_reduce", 5, "bool", n=2), _ev(r, "broadcast", 6, "complex64", root=1, n=2),
        _ev(r, "barrier", dtype=None, n=2))]
    check = _check(reference, events)
    assert check.passed and check.matched == 6, check.lines()
    raw = crosscheck(reference, events, source="nccl_log")
    assert not raw.passed and {"dtype differs", "count differs", "op differs"} <= {
        d for m in raw.mismatches for d in m.reason.split(", ")}


def test_single_send_recv_use_the_pairs_communicator(tmp_path):
    logs = {1: [_coll(1, "Send", 7, 7, 1, "0x7e0112", 2), _coll(1, "Send", 7, 7, 0, "0x7e0101", 2)],
            2: [_coll(2, "Recv", 7, 7, 0, "0x7e0112", 2)],
            0: [_coll(0, "Recv", 7, 7, 1, "0x7e0101", 2)]}
    events = _log_events(tmp_path, logs, 3)
    assert {e.group_id for e in events} == {"1,2", "0,1"}
    reference = [_ev(1, "send", 7, root=2), _ev(1, "send", 7, root=0), _ev(2, "recv", 7, root=1),
                 _ev(0, "recv", 7, root=1)]
    check = _check(reference, events)
    assert check.passed and check.matched == 4, check.lines()
    assert not crosscheck(reference, events, source="nccl_log").passed


def test_pair_rule_on_real_send_recv_lines(shared_fixtures):
    """NVIDIA/nccl#584: one process's Send / Recv on two 2-rank communicators; it is the
    lower rank on one (peer 1) and the higher on the other (peer 0), as torch's pair
    communicators make it. The lines carry no INIT, so each comm is compared on its own."""
    read = parse_nccl_logs([shared_fixtures / "nccl/nccl_coll_sendrecv_oldformat__nccl_issue584.log"])
    by_comm = defaultdict(list)
    for e in read.events:
        by_comm[e.comm].append((e.op, e.count, e.dtype, e.root, e.group_size))
    # world rank 1 of 3 sends to 2 four times, to 0 twice, receives from 2 once
    reference = [*[_ev(1, "send", 2420736, root=2)] * 4, *[_ev(1, "send", 2420736, root=0)] * 2,
                 _ev(1, "recv", 2420736, root=2)]
    expected = defaultdict(list)
    for e in expected_nccl_log(reference, Lowering(False)).events:
        expected[e.group_id].append((e.op, e.count, e.dtype, e.root, e.group_size))
    assert by_comm["0x7f5128002e10"] == expected["1,2"]
    assert by_comm["0x7f516c002e10"] == expected["0,1"]


@pytest.mark.parametrize("version, native", [(None, False), ((2, 27, 7), False), ((2, 28, 0), True),
                                             ((2, 30, 1), True)])
def test_lowering_by_version(version, native):
    assert Lowering.for_version(version).alltoall_native is native
    with pytest.raises(ValueError, match="Invalid nccl_version"):
        Lowering.for_version((2, 28))
