"""gather / scatter (NCCL 2.28+ ``ncclGather`` / ``ncclScatter``) as canonical ops: the event
record, the NCCL log parser, the traffic model and the tables keyed by op.

Count convention (NCCL ``docs/api/colls.rst``): ``count`` is per rank, the send count of each
rank of gather (the root receives ``nranks * count``) and the receive count of each rank of
scatter (the root sends ``nranks * count``).
"""

from __future__ import annotations

import pytest

from tests.tools import nccl_render as R
from tracer.crosscheck import Equivalence
from tracer.events import OPS, CollectiveEvent
from tracer.nccl.log import parse_nccl_logs
from verify.traffic.formulas import array_elems, avg_elems, avg_recv_factor


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_event_record_and_parser(op, tmp_path):
    assert op in OPS
    ev = CollectiveEvent(source="nccl_log", op=op, count=1000, dtype="bfloat16", root=2,
                         comm="0xc0", group_size=4, host="n0", pid=7, cuda_dev=1)
    assert ev.msg_bytes == 2000  # per rank, as NCCL logs it
    line = R.event_line(ev, opcount=5)
    assert line.split("NCCL INFO ")[1].startswith(R.NCCL_NAME[op] + ": opCount 5 ")
    path = tmp_path / "nccl.log"
    path.write_text(line + "\n" + "[1] " + line + "\n")  # bulk path, then the general one
    res = parse_nccl_logs(path)
    assert res.issues == []
    assert [(e.op, e.count, e.msg_bytes, e.root, e.group_size, e.seq) for e in res.events] == [
        (op, 1000, 2000, 2, 4, 0), (op, 1000, 2000, 2, 4, 1)]


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_traffic_model_averages_the_roots_traffic_over_the_group(op, n):
    """nccl-tests' S is n * count (src/gather.cu, src/scatter.cu); only the root receives
    (gather) or sends (scatter): (n-1) * count elements in all, (n-1)/n * count per member."""
    count = 1000
    assert array_elems(op, count, n) == n * count
    received = [(n - 1) * count if rank == 0 else 0 for rank in range(n)]  # root = 0, gather
    if op == "scatter":
        received = [0 if rank == 0 else count for rank in range(n)]
    assert avg_elems(op, count, n) == pytest.approx(sum(received) / n)
    assert avg_recv_factor(op, n) == pytest.approx(0.0 if n == 1 else (n - 1) / n**2)


def test_tables_keyed_by_op_accept_every_op():
    Equivalence(reference_op="gather", other_op="scatter", measured_on="none", note="test")
    for op in OPS:
        assert avg_elems(op, 8, 4) >= 0.0
