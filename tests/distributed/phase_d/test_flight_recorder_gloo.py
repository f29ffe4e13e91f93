"""Flight Recorder on a real 4-rank gloo run, and the cross-check against the issued calls.

One run (module fixture) issues every collective on the world and on the subgroup [1, 2, 3]
and dumps FR at the window's start and end. The reference events are built from the calls as
issued (what the interposer records), independently of FR.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import DistributedPool
from tracer.crosscheck import crosscheck
from tracer.events import CollectiveEvent, group_id_from_ranks
from tracer.fr.parse import (
    dump_flight_recorder,
    flight_recorder_enabled,
    flight_recorder_env,
    fr_window,
    read_flight_recorder,
)

pytestmark = pytest.mark.distributed

WORLD_SIZE = 4
SUBGROUP = [1, 2, 3]


class _Calls:
    """Interposer-like reference: one event per issued call, seq 0-based per group."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.events: list[CollectiveEvent] = []
        self._seq: dict[str, int] = {}

    def record(self, op, group, count, dtype, root=None):
        ranks = dist.get_process_group_ranks(group)
        gid = group_id_from_ranks(ranks)
        seq = self._seq.get(gid, 0)
        self._seq[gid] = seq + 1
        self.events.append(CollectiveEvent(
            source="interposer", op=op, rank=self.rank, group_id=gid, group_size=len(ranks),
            group_rank=dist.get_group_rank(group, self.rank), seq=seq, count=count,
            dtype=None if dtype is None else str(dtype).removeprefix("torch."), root=root,
            source_ref=f"test call {op}"))


def _every_collective(g, calls: _Calls) -> None:
    """Every collective type DMuon and its baselines use, plus p2p, on group ``g``."""
    n, me = dist.get_world_size(g), dist.get_rank(g)
    glob = lambda r: dist.get_global_rank(g, r)  # noqa: E731
    dist.all_reduce(torch.ones(10), group=g)
    calls.record("all_reduce", g, 10, torch.float32)
    dist.reduce(torch.ones(11), dst=glob(0), group=g)
    calls.record("reduce", g, 11, torch.float32, root=0)
    dist.broadcast(torch.ones(12, dtype=torch.bfloat16), src=glob(1), group=g)
    calls.record("broadcast", g, 12, torch.bfloat16, root=1)
    dist.all_gather_into_tensor(torch.empty(13 * n), torch.ones(13), group=g)
    calls.record("all_gather", g, 13, torch.float32)
    dist.reduce_scatter_tensor(torch.empty(14), torch.ones(14 * n), group=g)
    calls.record("reduce_scatter", g, 14, torch.float32)
    dist.all_to_all_single(torch.empty(15 * n), torch.ones(15 * n), group=g)
    calls.record("all_to_all", g, 15, torch.float32)
    if me == 0:
        dist.send(torch.ones(16), dst=glob(1), group=g)
        calls.record("send", g, 16, torch.float32, root=1)
    elif me == 1:
        dist.recv(torch.empty(16), src=glob(0), group=g)
        calls.record("recv", g, 16, torch.float32, root=0)
    dist.barrier(group=g)
    calls.record("barrier", g, None, None)
    dist.all_reduce(torch.ones(18, dtype=torch.float64), op=dist.ReduceOp.AVG, group=g)
    calls.record("all_reduce", g, 18, torch.float64)
    dist.all_reduce(torch.ones(20, dtype=torch.int64), group=g, async_op=True).wait()
    calls.record("all_reduce", g, 20, torch.int64)
    dist.all_reduce_coalesced([torch.ones(3), torch.ones(4)], group=g)
    calls.record("all_reduce", g, 3, torch.float32)
    calls.record("all_reduce", g, 4, torch.float32)
    gathered = [torch.empty(5) for _ in range(n)] if me == n - 1 else None
    dist.gather(torch.ones(5), gathered, dst=glob(n - 1), group=g)
    calls.record("gather", g, 5, torch.float32, root=n - 1)
    chunks = [torch.ones(6, dtype=torch.float16) for _ in range(n)] if me == 0 else None
    dist.scatter(torch.empty(6, dtype=torch.float16), chunks, src=glob(0), group=g)
    calls.record("scatter", g, 6, torch.float16, root=0)


def _run_window(out_dir: str) -> list[CollectiveEvent]:
    rank = dist.get_rank()
    sub = dist.new_group(SUBGROUP)  # collective over all ranks, not a communication call
    dist.all_reduce(torch.ones(3))  # before the window: FR keeps it, the reference does not
    dump_flight_recorder(Path(out_dir) / "before", rank)
    calls = _Calls()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # *_into_tensor/_tensor deprecations
        _every_collective(dist.group.WORLD, calls)
        if rank in SUBGROUP:
            _every_collective(sub, calls)
    dump_flight_recorder(Path(out_dir) / "after", rank)
    dump_flight_recorder(Path(out_dir) / "pickle", rank, fmt="pickle")
    return calls.events


def _dump_state() -> tuple[bool, str]:
    enabled = flight_recorder_enabled()
    try:
        dump_flight_recorder("/nonexistent-never-written", dist.get_rank())
    except ValueError as exc:
        return enabled, str(exc)
    return enabled, ""


def _run_window_with_interposer(out_dir: str):
    from tracer.interposer import Interposer

    rank = dist.get_rank()
    twin = dist.new_group(list(range(WORLD_SIZE)))  # a 2nd process group over the world's ranks
    dump_flight_recorder(Path(out_dir) / "before", rank)
    by_hand = _Calls()
    with warnings.catch_warnings(), Interposer() as recorder:
        warnings.simplefilter("ignore", FutureWarning)
        _every_collective(dist.group.WORLD, by_hand)
        _every_collective(twin, by_hand)
    dump_flight_recorder(Path(out_dir) / "after", rank)
    return recorder.events, by_hand.events


@pytest.fixture(scope="module")
def fr_pool():
    """4 gloo ranks with Flight Recorder on, shared by this module's runs."""
    with DistributedPool(WORLD_SIZE, env=flight_recorder_env(), timeout_s=120) as pool:
        yield pool


@pytest.fixture(scope="module")
def fr_run(fr_pool, tmp_path_factory):
    """(dump folder, reference events of all ranks) of one real 4-rank gloo window."""
    out = tmp_path_factory.mktemp("fr_gloo")
    per_rank = fr_pool.run(_run_window, str(out))
    return out, [ev for evs in per_rank for ev in evs]


def _read(folder: Path) -> list[CollectiveEvent]:
    events = []
    for rank in range(WORLD_SIZE):
        path = next(folder.glob(f"fr_rank{rank}.*"))
        read = read_flight_recorder(path)
        assert read.unreadable == []
        assert set(read.states) == {"scheduled"}  # gloo never updates FR states
        events += read.events
    return events


def test_fr_window_holds_exactly_the_issued_calls_as_gloo_records_them(fr_run):
    out, _ = fr_run
    window = fr_window(_read(out / "before"), _read(out / "after"))
    world, sub = "0,1,2,3", "1,2,3"
    for rank in range(WORLD_SIZE):
        mine = [e for e in window if e.rank == rank]
        groups = [(world, 4)] + ([(sub, 3)] if rank in SUBGROUP else [])
        expected = []
        for gid, n in groups:
            expected += [
                ("all_reduce", gid, n, 10, "float32"),
                ("reduce", gid, n, 11, "float32"),
                ("broadcast", gid, n, 12, "bfloat16"),
                ("all_gather", gid, n, 13, "float32"),
                ("all_reduce", gid, n, 14 * n, "float32"),  # reduce_scatter_tensor on gloo
                ("all_to_all", gid, n, 15, "float32"),
                # send/recv: no entry on gloo
                ("barrier", gid, n, None, None),
                ("all_reduce", gid, n, 18, "float64"),
                ("all_reduce", gid, n, 20, "int64"),
                ("all_reduce", gid, n, 3, "float32"),  # all_reduce_coalesced: one entry,
                ("all_reduce", gid, n, 4, "float32"),  # one event per tensor
                ("gather", gid, n, 5, "float32"),  # inputs on every rank
                ("scatter", gid, n, 6, "float16"),  # outputs on every rank
            ]
        got = [(e.op, e.group_id, e.group_size, e.count, e.dtype) for e in mine]
        assert got == expected, f"rank {rank}"
        for gid, _ in groups:
            seqs = [e.seq for e in mine if e.group_id == gid]
            # consecutive collective_seq_id; the coalesced entry's two tensors share one
            assert seqs == list(range(seqs[0], seqs[0] + 10)) + [seqs[0] + 9, seqs[0] + 10,
                                                                  seqs[0] + 11]
            ranks = [int(r) for r in gid.split(",")]
            assert {e.group_rank for e in mine if e.group_id == gid} == {ranks.index(rank)}
        assert all(f"fr_rank{rank}.json#" in e.source_ref for e in mine)


def test_pickle_dump_parses_to_the_same_events_as_json(fr_run):
    out, _ = fr_run
    strip = lambda evs: [e.replace(source_ref="") for e in evs]  # noqa: E731
    assert strip(_read(out / "pickle")) == strip(_read(out / "after"))


def test_crosscheck_passes_on_exact_window(fr_run):
    out, reference = fr_run
    window = fr_window(_read(out / "before"), _read(out / "after"))
    check = crosscheck(reference, window, source="flight_recorder", backend="gloo")
    assert check.mismatches == [], "\n".join(check.lines())
    p2p = [e for e in reference if e.op in ("send", "recv")]
    assert len(p2p) == 4  # world: ranks 0->1, subgroup: ranks 1->2
    assert check.skipped == 4
    assert check.as_report() == {"events": len(reference) - 4, "matched": len(reference) - 4,
                                 "unmatched": 0, "pass": True, "size_unknown": 0}


def test_crosscheck_passes_with_tail_and_seq_alignment_on_lifetime_dump(fr_run):
    out, reference = fr_run
    lifetime = _read(out / "after")
    tail = crosscheck(reference, lifetime, source="flight_recorder", backend="gloo", align="tail")
    assert tail.passed, "\n".join(tail.lines())
    assert tail.outside_window == len(lifetime) - tail.events > 0
    first = {}
    for e in _read(out / "before"):
        first[(e.rank, e.group_id)] = max(first.get((e.rank, e.group_id), 0), e.seq + 1)
    for e in lifetime:  # the subgroup is new: its window starts at seq 0
        first.setdefault((e.rank, e.group_id), 0)
    by_seq = crosscheck(reference, lifetime, source="flight_recorder", backend="gloo",
                        align=first)
    assert by_seq.passed and by_seq.matched == tail.matched
    exact = crosscheck(reference, lifetime, source="flight_recorder", backend="gloo")
    assert not exact.passed and all("extra in flight_recorder" in m.reason
                                    for m in exact.mismatches)


def test_crosscheck_lists_every_disagreement(fr_run):
    out, reference = fr_run
    window = fr_window(_read(out / "before"), _read(out / "after"))
    # Without gloo's profile, every reduce_scatter (7 rank-group pairs) and p2p call fails.
    plain = crosscheck(reference, window, source="flight_recorder")
    assert not plain.passed
    rs = [m for m in plain.mismatches if m.reference and m.reference.startswith("reduce_scatter")]
    assert len(rs) == 7 and all("op differs, count differs" == m.reason for m in rs)
    assert sum("missing in flight_recorder" in m.reason for m in plain.mismatches) == 4
    # A wrong dtype, a wrong count and a missing call, on rank 2's subgroup.
    edited, dropped = [], None
    for e in reference:
        if (e.rank, e.group_id) == (2, "1,2,3") and e.seq == 0:
            e = e.replace(dtype="bfloat16")
        elif (e.rank, e.group_id) == (2, "1,2,3") and e.seq == 1:
            e = e.replace(count=12, msg_bytes=None)
        elif (e.rank, e.group_id) == (3, "0,1,2,3") and e.op == "all_to_all":
            dropped = e
            continue
        edited.append(e)
    check = crosscheck(edited, window, source="flight_recorder", backend="gloo")
    assert not check.passed and check.unmatched == 3
    text = [str(m) for m in check.mismatches]
    assert any(t.startswith("rank 2 group 1,2,3 seq 0: dtype differs") for t in text), text
    assert any(t.startswith("rank 2 group 1,2,3 seq 1") and "count differs" in t for t in text)
    assert any(t.startswith("rank 3 group 0,1,2,3") and "extra in flight_recorder" in t
               and "all_to_all count=15" in t for t in text), text
    assert dropped is not None


def test_dump_raises_when_flight_recorder_is_disabled():
    with DistributedPool(2, env={"TORCH_FR_BUFFER_SIZE": "0"}, timeout_s=60) as pool:
        results = pool.run(_dump_state)
    for enabled, message in results:
        assert enabled is False
        assert "Flight Recorder" in message and "TORCH_FR_BUFFER_SIZE" in message


def test_crosscheck_against_the_real_interposer(fr_pool, tmp_path):
    pytest.importorskip("tracer.interposer")
    per_rank = fr_pool.run(_run_window_with_interposer, str(tmp_path))
    recorded = [ev for evs, _ in per_rank for ev in evs]
    by_hand = [ev for _, evs in per_rank for ev in evs]
    fields = lambda evs: [(e.rank, e.op, e.group_id, e.seq, e.count, e.dtype, e.root)  # noqa: E731
                          for e in evs]
    assert fields(recorded) == fields(by_hand)  # the interposer sees the calls as issued
    window = fr_window(_read(tmp_path / "before"), _read(tmp_path / "after"))
    check = crosscheck(recorded, window, source="flight_recorder", backend="gloo")
    assert check.passed, "\n".join(check.lines())
    # two process groups over ranks 0-3 share group_id "0,1,2,3": FR numbers each on its own
    # counter, the interposer on one; order-based pairing still lines them up
    assert check.matched == len(recorded) - check.skipped and check.skipped == 4
