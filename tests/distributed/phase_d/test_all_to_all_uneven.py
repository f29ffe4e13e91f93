"""Uneven all_to_all_single on a real 4-rank gloo run, as three sources record it.

DMuon's gloo aligned groups of unequal buckets move as all_to_alls whose chunks differ by rank
(docs/traffic-model.md, "Aligned groups"). One window issues such calls (the broadcast shape:
this rank's part repeated to every peer, every rank's part received; the reduce shape: every
peer's part sent, this rank's part received from each), an even one, one whose splits differ
but whose totals are equal and divisible, and, on two 2-rank subgroups, an uneven one with
async_op and an even one without splits. The interposer, the Flight Recorder and
torch.profiler must record every call with the same totals (``in_elems`` / ``out_elems``) and
the same count rule (``tracer.events.all_to_all_count``); the expected values are written
out here from the splits, independently of any source.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tracer.crosscheck import crosscheck
from tracer.fr.parse import dump_flight_recorder, fr_window, read_flight_recorder
from tracer.profiler import profiler_source_events, read_profiler_trace

pytestmark = pytest.mark.distributed

PARTS = [7, 7, 5, 5]  # TinyGPT's owner shares at W = 4, in d² (docs/traffic-model.md)
SKEWED = [6, 8, 4, 6]  # ranks 0 and 3: equal, divisible totals although the splits differ
PAIRS = ([0, 2], [1, 3])  # replicate-like subgroups
PAIR_PARTS = {0: 7, 2: 5, 1: 7, 3: 5}


def _window(out_dir: str) -> list:
    from tracer.interposer import Interposer

    rank, n = dist.get_rank(), 4
    pairs = [dist.new_group(p) for p in PAIRS]  # every rank creates both, in the same order
    pair = pairs[rank % 2]
    mine = [PAIR_PARTS[r] for r in PAIRS[rank % 2]]
    dump_flight_recorder(Path(out_dir) / "before", rank)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof, \
            Interposer() as recorder:
        me = PARTS[rank]
        dist.all_to_all_single(torch.empty(sum(PARTS)), torch.ones(n * me),  # broadcast shape
                               output_split_sizes=PARTS, input_split_sizes=[me] * n)
        dist.all_to_all_single(torch.empty(n * me), torch.ones(sum(PARTS)),  # reduce shape
                               output_split_sizes=[me] * n, input_split_sizes=PARTS)
        dist.all_to_all_single(torch.empty(24), torch.ones(24))  # even: 6 per peer
        skew = SKEWED[rank]
        dist.all_to_all_single(torch.empty(sum(SKEWED), dtype=torch.bfloat16),
                               torch.ones(n * skew, dtype=torch.bfloat16),
                               output_split_sizes=SKEWED, input_split_sizes=[skew] * n)
        pm = PAIR_PARTS[rank]
        dist.all_to_all_single(torch.empty(sum(mine)), torch.ones(2 * pm), output_split_sizes=mine,
                               input_split_sizes=[pm] * 2, group=pair, async_op=True).wait()
        dist.all_to_all_single(torch.empty(10), torch.ones(10), group=pair)  # even, no splits
    dump_flight_recorder(Path(out_dir) / "after", rank)
    prof.export_chrome_trace(str(Path(out_dir) / f"profiler_rank{rank}.json"))
    return recorder.events


def _expected(rank: int) -> list[tuple]:
    """(group_id, group_size, count, in_elems, out_elems, dtype) of each call, from the splits."""
    me, skew, pm = PARTS[rank], SKEWED[rank], PAIR_PARTS[rank]
    pair = PAIRS[rank % 2]
    pair_gid = ",".join(map(str, pair))
    pair_out = sum(PAIR_PARTS[r] for r in pair)
    return [
        ("0,1,2,3", 4, None, 4 * me, 24, "float32"),  # 28 or 20 in, 24 out: uneven
        ("0,1,2,3", 4, None, 24, 4 * me, "float32"),
        ("0,1,2,3", 4, 6, 24, 24, "float32"),
        ("0,1,2,3", 4, 6 if 4 * skew == 24 else None, 4 * skew, 24, "bfloat16"),
        (pair_gid, 2, None, 2 * pm, pair_out, "float32"),
        (pair_gid, 2, 5, 10, 10, "float32"),
    ]


@pytest.fixture(scope="module")
def uneven_run(pool4, tmp_path_factory):
    out = tmp_path_factory.mktemp("a2a_uneven")
    per_rank = pool4.run(_window, str(out))
    return out, [ev for evs in per_rank for ev in evs]


def _fr(folder: Path, rank: int) -> list:
    read = read_flight_recorder(folder / f"fr_rank{rank}.json")
    assert read.unreadable == []  # an uneven all_to_all parses (it used to be refused)
    return read.events


def test_interposer_records_the_totals_and_the_count_rule(uneven_run):
    _, events = uneven_run
    for rank in range(4):
        mine = [e for e in events if e.rank == rank]
        got = [(e.group_id, e.group_size, e.count, e.in_elems, e.out_elems, e.dtype) for e in mine]
        assert got == _expected(rank), rank
        assert all(e.op == "all_to_all" for e in mine)
        assert [e.msg_bytes for e in mine][:3] == [None, None, 24]
        assert "in_splits=[" in mine[0].source_ref  # the splits stay in the note


def test_flight_recorder_and_profiler_record_it_identically(uneven_run):
    out, events = uneven_run
    fr = [ev for rank in range(4)
          for ev in fr_window(_fr(out / "before", rank), _fr(out / "after", rank))]
    prof = [ev for rank in range(4)
            for ev in read_profiler_trace(out / f"profiler_rank{rank}.json").events]
    for rank in range(4):
        want = _expected(rank)
        mine = [e for e in fr if e.rank == rank]
        assert [(e.group_id, e.group_size, e.count, e.in_elems, e.out_elems, e.dtype)
                for e in mine] == want, rank
        # profiler: no process group in a gloo trace of several groups; the group size comes
        # from the split sizes, so the even calls without splits have totals but no count
        mine = [e for e in prof if e.rank == rank]
        no_splits = {2: (None, None, 24, 24, "float32"), 5: (None, None, 10, 10, "float32")}
        assert [(e.group_size, e.count, e.in_elems, e.out_elems, e.dtype) for e in mine] == \
            [no_splits.get(i, w[1:]) for i, w in enumerate(want)], rank
    check = crosscheck(events, fr, source="flight_recorder", backend="gloo")
    assert check.passed and check.matched == len(events), "\n".join(check.lines())
    ref, other, note = profiler_source_events(events, prof)
    check = crosscheck(ref, other, source="profiler", backend="gloo")
    assert note and check.passed and check.matched == len(events) and check.size_unknown == 0, \
        "\n".join(check.lines())
    # a wrong total on one side is caught, by name
    first = next(i for i, e in enumerate(fr) if e.rank == 2)
    edited = [e.replace(out_elems=e.out_elems + 1) if i == first else e for i, e in enumerate(fr)]
    check = crosscheck(events, edited, source="flight_recorder", backend="gloo")
    assert not check.passed and [m.reason for m in check.mismatches] == ["out_elems differs"]
