import pytest

import pandas as pd
import pyarrow.parquet as pq

from tracer.events import (
    CollectiveEvent,
    all_to_all_count,
    all_to_all_elems,
    read_parquet,
    to_table,
    write_parquet,
)


def _ev(**kw):
    base = dict(source="interposer", op="all_gather", rank=1, group_id="0,1", group_size=2,
                group_rank=1, seq=0, count=10, dtype="float32", phase="forward",
                source_ref="test")
    base.update(kw)
    return CollectiveEvent(**base)


def test_msg_bytes_derived_from_count_and_dtype():
    assert _ev().msg_bytes == 40
    assert _ev(dtype="bfloat16").dtype_bytes == 2


def test_inconsistent_msg_bytes_is_rejected():
    with pytest.raises(ValueError, match="msg_bytes=41"):
        _ev(msg_bytes=41)


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="op='allgather'"):
        _ev(op="allgather")


def test_parquet_round_trip(tmp_path):
    events = [_ev(t_start_ns=5, t_end_ns=6, t_wait_start_ns=8, t_waited_ns=9), _ev(seq=1, count=None, dtype=None, msg_bytes=12, source="nsys"),
              _ev(seq=2, op="all_to_all", group_size=4, count=None, in_elems=28, out_elems=24),
              _ev(seq=3, op="all_to_all", group_size=4, count=6, in_elems=24, out_elems=24)]
    path = write_parquet(events, tmp_path / "e.parquet")
    assert read_parquet(path) == events
    frame = to_table(events).to_pandas(types_mapper=pd.ArrowDtype)  # nullable integer columns
    assert frame["msg_bytes"].tolist()[:2] == [40, 12] and frame["msg_bytes"].tolist()[3] == 24
    assert frame["msg_bytes"].isna().tolist() == [False, False, True, False]
    assert frame["in_elems"].isna().tolist() == [True, True, False, False]


def test_all_to_all_count_rule():
    """One rule for every source: the per-peer count where the totals are equal and split
    evenly, else none (an uneven all_to_all has no single NCCL count)."""
    assert all_to_all_count(24, 24, 4) == 6
    assert all_to_all_count(28, 24, 4) is None  # input 7 x 4, output 7 + 7 + 5 + 5
    assert all_to_all_count(3, 3, 2) is None  # equal totals, not divisible
    assert all_to_all_count(24, 24, None) is None and all_to_all_count(None, 24, 4) is None
    assert all_to_all_elems("all_to_all", 6, 4, None, None) == (24, 24)  # an NCCL log's count
    assert all_to_all_elems("all_to_all", None, 4, 28, 24) == (28, 24)
    assert all_to_all_elems("all_gather", 6, 4, None, None) == (None, None)


def test_all_to_all_fields_are_checked():
    ev = _ev(op="all_to_all", group_size=4, count=None, in_elems=28, out_elems=24)
    assert ev.msg_bytes is None
    with pytest.raises(ValueError, match="count=7 for an all_to_all with in_elems=28"):
        _ev(op="all_to_all", group_size=4, count=7, in_elems=28, out_elems=24)
    with pytest.raises(ValueError, match="count=None for an all_to_all .* Must be 6"):
        _ev(op="all_to_all", group_size=4, count=None, in_elems=24, out_elems=24)
    with pytest.raises(ValueError, match="msg_bytes None"):
        _ev(op="all_to_all", group_size=4, count=None, msg_bytes=8, in_elems=28, out_elems=24)
    with pytest.raises(ValueError, match="in_elems=8, out_elems=None for op='all_gather'"):
        _ev(in_elems=8)
    with pytest.raises(ValueError, match="in_elems=-1"):
        _ev(op="all_to_all", group_size=None, count=None, in_elems=-1, out_elems=4)
    # group size unknown (a profiler trace of several groups): totals kept, count unknown
    assert _ev(op="all_to_all", group_size=None, count=None, in_elems=24, out_elems=24).count is None


def test_wait_times_out_of_order_are_rejected():
    assert _ev(t_start_ns=5, t_end_ns=6, t_wait_start_ns=8, t_waited_ns=9).in_flight_ns == 4
    with pytest.raises(ValueError, match="t_wait_start_ns=5, t_waited_ns=9. Must be in that order"):
        _ev(t_start_ns=1, t_end_ns=6, t_wait_start_ns=5, t_waited_ns=9)
    with pytest.raises(ValueError, match="t_wait_start_ns=8 with t_waited_ns=None"):
        _ev(t_end_ns=6, t_wait_start_ns=8)


def test_file_written_before_the_wait_columns_reads_with_them_empty(tmp_path):
    old = to_table([_ev(t_start_ns=5, t_end_ns=6)]).drop_columns(["t_wait_start_ns", "t_waited_ns"])
    pq.write_table(old, tmp_path / "old.parquet")
    [ev] = read_parquet(tmp_path / "old.parquet")
    assert ev == _ev(t_start_ns=5, t_end_ns=6) and ev.t_waited_ns is None


def test_file_written_before_the_all_to_all_totals_reads_with_them_empty(tmp_path):
    even = _ev(op="all_to_all", group_size=4, count=6)  # as every source wrote it before
    old = to_table([even]).drop_columns(["in_elems", "out_elems"])
    pq.write_table(old, tmp_path / "old.parquet")
    [ev] = read_parquet(tmp_path / "old.parquet")
    assert ev == even and ev.in_elems is None and ev.out_elems is None
