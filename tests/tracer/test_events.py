import pytest

import pyarrow.parquet as pq

from tracer.events import CollectiveEvent, read_parquet, to_frame, to_table, write_parquet


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
    events = [_ev(t_start_ns=5, t_end_ns=6, t_wait_start_ns=8, t_waited_ns=9), _ev(seq=1, count=None, dtype=None, msg_bytes=12, source="nsys")]
    path = write_parquet(events, tmp_path / "e.parquet")
    assert read_parquet(path) == events
    frame = to_frame(events)
    assert list(frame["msg_bytes"]) == [40, 12]


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
