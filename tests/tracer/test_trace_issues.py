"""``dmuon-trace``: dropped lines are a non-zero exit unless ``--lenient``; impossible calls are
issues, not events (tracer/cli.py, tracer.events.impossible_reason).

The NCCL lines are hand-written in NCCL's COLL format (as in the fixture logs of
../shared/fixtures/nccl); each impossible value is checked on both the vectorized and the
line-by-line path of the parser."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tracer.cli import EXIT_BAD_INPUT, EXIT_DROPPED, EXIT_OK, main
from tracer.events import impossible_reason
from tracer.nccl.log import iter_nccl_events

PREFIX = "node1:1234:1250 [0] NCCL INFO "
GOOD = (PREFIX + "AllReduce: opCount 2 sendbuff 0x7f0 recvbuff 0x7f0 count 1024 datatype 7 "
        "op 0 root 0 comm 0x55aa [nranks=2] stream 0x1\n")
IMPOSSIBLE = {
    "root 99 of 2": (PREFIX + "Broadcast: opCount 0 sendbuff 0x7f0 recvbuff 0x7f0 count 1024 "
                     "datatype 0 op 0 root 99 comm 0x55aa [nranks=2] stream 0x1\n",
                     "broadcast root 99 outside the group's ranks 0..1"),
    "nranks 0": (PREFIX + "AllReduce: opCount 1 sendbuff 0x7f0 recvbuff 0x7f0 count 1024 "
                 "datatype 7 op 0 root 0 comm 0x55aa [nranks=0] stream 0x1\n", "group size 0"),
    "peer 2 of 2": (PREFIX + "Send: opCount 0 sendbuff 0x7f0 recvbuff (nil) count 8 datatype 7 "
                    "op 0 root 2 comm 0x55aa [nranks=2] stream 0x1\n", "send peer 2 outside"),
    "root -1": (PREFIX + "Reduce: opCount 0 sendbuff 0x7f0 recvbuff 0x7f0 count 8 datatype 7 "
                "op 0 root -1 comm 0x55aa [nranks=4] stream 0x1\n", "reduce root -1 outside"),
}


@pytest.mark.parametrize("name", sorted(IMPOSSIBLE))
def test_impossible_coll_lines_are_issues_not_events(tmp_path, capsys, name):
    line, why = IMPOSSIBLE[name]
    log = tmp_path / "rank0.log"
    log.write_text(GOOD + line + GOOD)
    issues: list = []
    events = list(iter_nccl_events(str(log), issues=issues))  # line-by-line path
    assert [e.op for e in events] == ["all_reduce", "all_reduce"]
    assert len(issues) == 1 and why in str(issues[0]) and issues[0].line_no == 2
    out = tmp_path / "events.parquet"
    assert main(["nccl", str(log), "--out", str(out)]) == EXIT_DROPPED  # vectorized path
    io = capsys.readouterr()
    assert why in io.out and "impossible COLL line" in io.out
    assert "1 line(s), entries or rows dropped as issues" in io.err and "--lenient" in io.err
    assert pq.read_table(out).num_rows == 2  # the others are written either way
    assert main(["nccl", str(log), "--out", str(out), "--lenient"]) == EXIT_OK


def test_possible_edges_stay_events(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text(PREFIX + "Broadcast: opCount 0 sendbuff 0x7f0 recvbuff 0x7f0 count 8 "
                   "datatype 7 op 0 root 1 comm 0x55aa [nranks=2] stream 0x1\n" +
                   PREFIX + "AllReduce: opCount 1 sendbuff 0x7f0 recvbuff 0x7f0 count 8 "
                   "datatype 7 op 0 root 5 comm 0x55aa [nranks=1] stream 0x1\n")  # root unused
    assert main(["nccl", str(log), "--out", str(tmp_path / "e.parquet")]) == EXIT_OK


def test_impossible_reason_rule():
    assert impossible_reason("broadcast", 2, 1) is None
    assert impossible_reason("all_reduce", 2, 7) is None  # no root in an all_reduce
    assert impossible_reason("broadcast", None, 99) is None  # group size unknown: not judged
    assert "group size 0" in impossible_reason("all_reduce", 0, None)
    assert "recv peer 4" in impossible_reason("recv", 4, 4)
    assert "group rank 3" in impossible_reason("all_gather", 2, None, group_rank=3)


def test_strict_and_lenient_exclude_each_other(tmp_path, capsys):
    log = tmp_path / "rank0.log"
    log.write_text(GOOD)
    assert main(["nccl", str(log), "--out", str(tmp_path / "e.parquet"), "--strict",
                 "--lenient"]) == EXIT_BAD_INPUT
    assert "exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize("name", [
    "nccl_coll_broadcast_uint8_linewrapped__nccl_issue740.log",  # roots 0..7 of [nranks=8]
    "nccl_coll_sendrecv_oldformat__nccl_issue584.log",  # send / recv peers
    "nccl_coll_tp_allgather_reducescatter__torchtitan_issue1369.log",
])
def test_real_logs_exit_0_and_one_impossible_line_makes_1(shared_fixtures, tmp_path, capsys, name):
    """Real logs (../shared/fixtures/nccl, SOURCES.md) hold no impossible call: no false exit
    1; the same log with one impossible line appended exits 1 and names it."""
    log = shared_fixtures / "nccl" / name
    out = tmp_path / "e.parquet"
    assert main(["nccl", str(log), "--out", str(out)]) == EXIT_OK, capsys.readouterr().out[-1500:]
    rows = pq.read_table(out).num_rows
    damaged = tmp_path / name
    damaged.write_bytes(log.read_bytes() + IMPOSSIBLE["nranks 0"][0].encode())
    assert main(["nccl", str(damaged), "--out", str(out)]) == EXIT_DROPPED
    assert "group size 0" in capsys.readouterr().out
    assert pq.read_table(out).num_rows == rows
