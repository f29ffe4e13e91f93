import pytest

from tracer.events import CollectiveEvent, read_parquet, to_frame, write_parquet


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
    events = [_ev(), _ev(seq=1, count=None, dtype=None, msg_bytes=12, source="nsys")]
    path = write_parquet(events, tmp_path / "e.parquet")
    assert read_parquet(path) == events
    frame = to_frame(events)
    assert list(frame["msg_bytes"]) == [40, 12]
