"""tracer.crosscheck against a source without sizes (an nsys report whose payload is not
decoded): pairs compared by op only pass and are counted, while a missing, extra or reordered
call, an op, dtype or root that differs, and a size known on both sides that differs fail."""

from __future__ import annotations

import pytest

from tracer.crosscheck import crosscheck
from tracer.events import CollectiveEvent

GROUP = "0,1,2,3"


def _ref(op, seq, count=None, dtype=None, *, root=None, rank=0):
    return CollectiveEvent(source="interposer", op=op, rank=rank, group_id=GROUP, group_size=4,
                           seq=seq, count=count, dtype=dtype, root=root,
                           source_ref=f"interposer:rank{rank}:#{seq}")


def _reference():
    return [_ref("broadcast", 0, 8, "float32", root=1), _ref("all_reduce", 1, 4, "float32"),
            _ref("reduce", 2, 5, "bfloat16", root=0), _ref("barrier", 3)]


def _nsys(ref, **changes):
    """What nsys knows of the reference calls: op, rank and process only (no size, no root)."""
    return [CollectiveEvent(source="nsys", op=e.op, rank=e.rank, group_id=e.group_id,
                            source_ref=f"r.sqlite#NVTX_EVENTS.{i}", **changes)
            for i, e in enumerate(ref)]


def _reasons(check):
    return [m.reason for m in check.mismatches]


def test_sizeless_source_passes_by_op_and_is_counted_everywhere():
    check = crosscheck(_reference(), _nsys(_reference()), source="nsys", backend="nccl")
    assert check.passed and check.mismatches == []
    assert (check.matched, check.unmatched, check.size_unknown) == (4, 0, 3)  # barrier: no size
    assert check.as_report() == {"events": 4, "matched": 4, "unmatched": 0, "pass": True,
                                 "size_unknown": 3}
    head, *notes = check.lines()
    assert head == ("nsys: PASS events=4 matched=4 unmatched=0 skipped=0 outside_window=0 "
                    "size_unknown=3")
    assert notes == [("  note: 3 of 4 pairs compared by op only (dtype / root where both know "
                      "them): nsys has no size for them, so their sizes are not verified")]


def test_sizes_known_everywhere_count_no_size_unknown():
    ref = _reference()
    other = [e.replace(source="nsys") for e in ref]
    check = crosscheck(ref, other, source="nsys")
    assert check.passed and check.size_unknown == 0 and check.notes == []
    assert check.as_report()["size_unknown"] == 0


def test_missing_call_fails_without_sizes():
    ref = _reference()
    check = crosscheck(ref, _nsys(ref[:1] + ref[2:]), source="nsys")
    assert not check.passed
    assert _reasons(check) == ["missing in nsys"]
    assert "reference all_reduce count=4 float32" in str(check.mismatches[0])
    assert (check.matched, check.unmatched, check.size_unknown) == (3, 1, 2)


def test_extra_call_fails_without_sizes():
    ref = _reference()
    other = _nsys(ref + [_ref("all_gather", 4, 2, "float32")])
    check = crosscheck(ref, other, source="nsys")
    assert not check.passed and _reasons(check) == ["extra in nsys"]
    assert "other all_gather (r.sqlite#NVTX_EVENTS.4)" in str(check.mismatches[0])


def test_op_mismatch_fails_without_sizes():
    ref = _reference()
    other = _nsys(ref)
    other[1] = other[1].replace(op="all_gather")
    check = crosscheck(ref, other, source="nsys")
    assert not check.passed and _reasons(check) == ["op differs"]
    assert check.size_unknown == 3  # the differing pair was still compared without a size


def test_reordered_calls_fail_without_sizes():
    ref = _reference()
    other = _nsys([ref[1], ref[0], ref[2], ref[3]])
    check = crosscheck(ref, other, source="nsys")
    assert not check.passed
    assert sorted(_reasons(check)) == ["extra in nsys", "missing in nsys"]


def test_dtype_and_root_still_compared_where_both_know_them():
    ref = _reference()
    other = _nsys(ref)
    other[2] = other[2].replace(dtype="float32")  # reference reduce is bfloat16
    assert _reasons(crosscheck(ref, other, source="nsys")) == ["dtype differs"]
    other = _nsys(ref)
    other[0] = other[0].replace(root=3)  # reference broadcast root is 1
    assert _reasons(crosscheck(ref, other, source="nsys")) == ["root differs"]


def test_size_known_on_both_sides_and_different_fails_in_a_mixed_sequence():
    ref = _reference()
    other = _nsys(ref)
    other[1] = other[1].replace(msg_bytes=16)  # = 4 float32: agrees
    check = crosscheck(ref, other, source="nsys")
    assert check.passed and check.size_unknown == 2
    other[1] = other[1].replace(msg_bytes=404)
    check = crosscheck(ref, other, source="nsys")
    assert not check.passed and _reasons(check) == ["msg_bytes differs"]
    assert check.size_unknown == 2


def test_size_known_only_to_the_other_source_fails():
    # An uneven all_to_all has no single count in the reference (tracer/interposer.py).
    ref = [_ref("all_to_all", 0, None, "float32")]
    other = _nsys(ref, msg_bytes=64)
    check = crosscheck(ref, other, source="nsys")
    assert not check.passed and _reasons(check) == ["msg_bytes unknown in reference"]
    # Neither side knows it: compared by op only.
    check = crosscheck(ref, _nsys(ref), source="nsys")
    assert check.passed and check.size_unknown == 1


@pytest.mark.parametrize("align", ["exact", "tail"])
def test_per_rank_keys_without_group_ids(align):
    # As verify.sources.nsys_verify compares: group ids cleared on both sides, ranks from pids.
    ref = [e.replace(group_id=None, seq=None) for e in _reference()
           + [_ref("all_reduce", 0, 4, "float32", rank=1)]]
    other = _nsys(ref)
    check = crosscheck(ref, other, source="nsys", align=align)
    assert check.passed and check.matched == 5 and check.size_unknown == 4
    check = crosscheck(ref, other[:4], source="nsys", align=align)
    assert not check.passed
    assert [str(m).split(":")[0] for m in check.mismatches] == ["rank 1 group None"]
