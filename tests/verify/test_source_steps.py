"""A source that lost a call anywhere in a step it recorded fails, not only inside the window.

No processes: the Flight Recorder's events are made from the prediction as gloo's recorder
writes them (a reduce_scatter as an all_reduce of the whole input), one step after another on a
system-clock timeline with setup calls before the first step, as the runner reads a dump. The
bug: a call lost in a warm-up step passed the window's one-to-one check in all three of
``crosscheck``'s alignments; now :func:`verify.sources.steps.step_completeness` (and the
runner's ``_fr_step_check``) fail naming the source, the step, the op and the count.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.builders import tinygpt_layout
from tracer.crosscheck import crosscheck, profile_for
from tracer.events import CollectiveEvent
from tracer.fr.parse import fr_window
from verify.compare import compare_run
from verify.run import runner
from verify.sources.steps import evicted_steps, split_steps, step_completeness

WARMUP, MEASURED = 4, 2
STEP_NS = 1_000_000
T0 = 1_796_000_000_000_000_000  # ns since the epoch, as FR's time_created_ns
GLOO_FR = profile_for("flight_recorder", "gloo")


def _marks(steps: int = WARMUP + MEASURED) -> list[int]:
    return [T0 + s * STEP_NS for s in range(steps + 1)]


def _interposer(layout, step: int) -> list[CollectiveEvent]:
    return [CollectiveEvent(source="interposer", op=e.op, rank=e.rank, group_id=e.group_id,
                            group_size=e.group_size, count=e.count, dtype=e.dtype, root=e.root,
                            phase=e.phase, in_elems=e.in_elems, out_elems=e.out_elems,
                            seq=step, t_start_ns=T0 + step * STEP_NS)
            for e in layout.predict_calls()]


def _fr_lifetime(layout, steps: int = WARMUP + MEASURED) -> list[CollectiveEvent]:
    """Every rank's FR events: two setup calls per rank before step 0, then ``steps`` steps, each
    call with its group's running seq and a time inside its step."""
    out, seq = [], {}
    for rank in range(layout.world_size):
        world = ",".join(map(str, range(layout.world_size)))
        for i in range(2):  # building the mode: outside every step
            seq[(rank, world)] = seq.get((rank, world), -1) + 1
            out.append(CollectiveEvent(source="flight_recorder", op="broadcast", rank=rank,
                                       group_id=world, group_size=layout.world_size, count=7,
                                       dtype="float32", seq=seq[(rank, world)], comm=world,
                                       t_start_ns=T0 - 100 + i, source_ref=f"r{rank}#setup{i}"))
    for step in range(steps):
        calls = [e for e in layout.predict_calls() if e.op not in GLOO_FR.unobserved_ops]
        for i, e in enumerate(calls):
            eq = GLOO_FR.equivalence_for(e.op)
            op, count = (e.op, e.count) if eq is None else (eq.other_op, e.count * e.group_size)
            key = (e.rank, e.group_id)
            seq[key] = seq.get(key, -1) + 1
            out.append(CollectiveEvent(
                source="flight_recorder", op=op, rank=e.rank, group_id=e.group_id,
                group_size=e.group_size, count=count, dtype=e.dtype,
                in_elems=e.in_elems if op == "all_to_all" else None,
                out_elems=e.out_elems if op == "all_to_all" else None,
                seq=seq[key], comm=e.group_id, t_start_ns=T0 + step * STEP_NS + 10 + i,
                source_ref=f"r{e.rank}#{step}.{i}"))
    return out


def _before_window(events):
    return [ev for ev in events if ev.t_start_ns < T0 + WARMUP * STEP_NS]


def _lose(events, step: int, op: str, rank: int = 1):
    """``events`` less the first ``op`` of ``rank`` in ``step``: a call the source lost."""
    lost = next(ev for ev in events if ev.rank == rank and ev.op == op
                and T0 + step * STEP_NS <= ev.t_start_ns < T0 + (step + 1) * STEP_NS)
    return [ev for ev in events if ev is not lost], lost


#: dmuon-z2 at W = 4 on gloo as the default run records it (its layout.json): one unit
#: all_to_all'd, FSDP2 on the root only.
LAYOUT = dataclasses.replace(
    tinygpt_layout("dmuon-z2", 4, dmuon_auto_flat=True, dmuon_block_order=("blocks.0", "blocks.1"),
                   dmuon_coalesce_bytes=2_000_000, dmuon_reduce_by_gather=True,
                   dmuon_uneven_aligned=True), fsdp_modules=("",))


def test_clean_lifetime_every_step_complete():
    steps, outside = split_steps(_fr_lifetime(LAYOUT), _marks())
    assert sorted(steps) == list(range(WARMUP + MEASURED)) and len(outside) == 8  # setup calls
    result = step_completeness(LAYOUT, {s: evs for s, evs in steps.items() if s < WARMUP},
                               source="flight_recorder", profile=GLOO_FR, window_steps=MEASURED)
    assert result["pass"] and result["steps_checked"] == [0, 1, 2, 3] and not result["lines"]


@pytest.mark.parametrize("step", [0, 2, 3])
@pytest.mark.parametrize("op", ["all_gather", "all_reduce", "all_to_all"])
def test_call_lost_before_the_window_passed_every_alignment_and_now_fails(step, op):
    """The bug and its control. dmuon-z2 on gloo: all_gather (forward), all_reduce (FR's
    record of the backward reduce_scatter), all_to_all (DMuon's own)."""
    lifetime = _fr_lifetime(LAYOUT)
    lossy, lost = _lose(lifetime, step, op)
    reference = [ev for s in range(WARMUP, WARMUP + MEASURED) for ev in _interposer(LAYOUT, s)]
    window = fr_window(_before_window(lifetime), lossy)  # what the runner compares
    first_seq = {}
    for ev in lossy:
        if ev.t_start_ns >= T0 + WARMUP * STEP_NS:
            first_seq.setdefault((ev.rank, ev.group_id), ev.seq)
    # before: every alignment of the window check passes, the lost call counted nowhere
    for other, align in ((window, "exact"), (lossy, "tail"), (lossy, first_seq)):
        check = crosscheck(reference, other, source="flight_recorder", backend="gloo", align=align)
        assert check.passed, (align, check.lines())
        if align != "exact":  # said, not silent: the calls it left uncompared
            assert any("outside the window not compared" in n for n in check.notes), check.notes
    # now: the step that lost it fails, naming source, step, rank, op and count
    steps, _ = split_steps(lossy, _marks())
    result = step_completeness(LAYOUT, {s: evs for s, evs in steps.items() if s < WARMUP},
                               source="flight_recorder", profile=GLOO_FR, window_steps=MEASURED)
    assert not result["pass"]
    assert [(i["step"], i["rank"], i["op"], i["count"], i["missing"]) for i in result["incomplete"]] \
        == [(step, 1, op, lost.count, 1)]
    size = (f"in_elems={lost.in_elems} out_elems={lost.out_elems}" if op == "all_to_all"
            else f"count={lost.count}")
    n = result["incomplete"][0]["predicted"]  # the step's calls of that key on that rank
    assert n == sum(1 for ev in steps[step] if ev.rank == 1 and ev.op == op and ev.count == lost.count
                    and ev.in_elems == lost.in_elems) + 1
    issued = (f" (a reduce_scatter count={lost.count // 4}, as flight_recorder records it)"
              if op == "all_reduce" else "")  # gloo's FR: a reduce_scatter as an all_reduce
    assert result["lines"] == [f"step {step} rank 1: 1 of {n} x {op} {size} float32 group "
                               f"{lost.group_id} missing in flight_recorder{issued}"]


@pytest.mark.parametrize("source", ["interposer", "flight_recorder", "profiler"])
def test_call_lost_inside_the_window_fails_every_default_source(source):
    """The control inside the window, for each source the default CPU run uses."""
    window = [ev for s in range(WARMUP, WARMUP + MEASURED) for ev in _interposer(LAYOUT, s)]
    lossy, lost = _lose(window, WARMUP + 1, "all_gather")
    if source == "interposer":
        run = compare_run(LAYOUT, lossy, steps=MEASURED, ns_calls=MEASURED * LAYOUT.ns_calls_per_step())
        assert not run["pass"]
        assert [(m["rank"], m["op"], m["count"], m["n"]) for m in run["missing"]] \
            == [(1, "all_gather", lost.count, 1)]
        return
    if source == "flight_recorder":  # as gloo's recorder writes them, the window's part
        lifetime = _fr_lifetime(LAYOUT)
        other = fr_window(_before_window(lifetime), _lose(lifetime, WARMUP + 1, "all_gather")[0])
    else:
        other = [dataclasses.replace(ev, source=source) for ev in lossy]
    check = crosscheck(window, other, source=source, backend="gloo")
    assert not check.passed
    assert any(f"missing in {source}" in str(m) and "all_gather" in str(m) for m in check.mismatches)


def test_ddp_first_step_buckets_by_total_elements():
    """Step 0's rule: DDP's first buckets are cut in parameter order, so step 0 asks for their
    total elements; from step 1 on, every bucket. A step 0 short of elements still fails."""
    layout = tinygpt_layout("ddp-muon", 4, ddp_bucket_cap_bytes=64 * 1024, ddp_first_bucket_cap_bytes=None)
    buckets = [e for e in layout.predict_calls() if e.rank == 0]
    assert len(buckets) > 2  # several buckets: a different cut is visible
    total = sum(e.count for e in buckets)
    recut = lambda counts: [CollectiveEvent(  # noqa: E731
        source="flight_recorder", op="all_reduce", rank=r, group_id="0,1,2,3", group_size=4,
        count=c, dtype="float32") for r in range(4) for c in counts]
    other_cut = recut([total // 2, total - total // 2])
    check = lambda steps: step_completeness(layout, steps, source="flight_recorder",  # noqa: E731
                                            profile=GLOO_FR, window_steps=MEASURED)
    assert check({0: other_cut})["pass"]
    assert not check({1: other_cut})["pass"]
    short = check({0: recut([total // 2])})
    assert not short["pass"]
    assert short["lines"][0] == (f"step 0 rank 0: {total - total // 2} of {total} elements of DDP's "
                                 "bucket all_reduces (float32) group 0,1,2,3 missing in flight_recorder")


def test_ring_buffer_eviction_is_reported_not_failed():
    """FR's ring buffer: steps that began before its oldest kept entry are listed as not recorded
    (with the reason) when the buffer wrapped; without a wrap the same gap fails."""
    marks = _marks()
    lifetime = [ev for ev in _fr_lifetime(LAYOUT) if ev.t_start_ns >= T0 + STEP_NS + 13]  # 0, part of 1 gone
    assert evicted_steps(marks, min(ev.t_start_ns for ev in lifetime), wrapped=True) == [0, 1]
    assert evicted_steps(marks, min(ev.t_start_ns for ev in lifetime), wrapped=False) == []
    steps, _ = split_steps(lifetime, marks)
    pre = {s: evs for s, evs in steps.items() if s < WARMUP}
    kept = step_completeness(LAYOUT, pre, source="flight_recorder", profile=GLOO_FR, window_steps=MEASURED,
                             not_recorded={0: "overwritten", 1: "overwritten"})
    assert kept["pass"] and kept["steps_checked"] == [2, 3]
    assert kept["steps_not_recorded"] == {"0": "overwritten", "1": "overwritten"}
    assert not step_completeness(LAYOUT, pre, source="flight_recorder", profile=GLOO_FR,
                                 window_steps=MEASURED)["pass"]


def test_split_steps_rejects_bad_marks():
    with pytest.raises(ValueError, match="Invalid marks_ns"):
        split_steps([], [T0])
    with pytest.raises(ValueError, match="non-decreasing"):
        split_steps([], [T0, T0 - 1])


class _Read:
    def __init__(self, events):
        self.events = events


def _ref_ids(events):
    """FR's source_refs as the parser writes them: ``<file>#<record_id>``."""
    return [dataclasses.replace(ev, source_ref=f"fr_rank{ev.rank}.json#{i}")
            for i, ev in enumerate(events)]


def _gathered(per_rank_steps: list[dict]) -> list[dict]:
    return [{"fr_steps": s, "layout": LAYOUT} for s in per_rank_steps]


def _runner_fr(events, marks):
    """What every rank sends (``runner._fr_steps``) for its own FR events."""
    per_rank = []
    for rank in range(4):
        mine = _ref_ids([ev for ev in events if ev.rank == rank])
        window = [ev for ev in mine if ev.t_start_ns >= marks[WARMUP]]
        per_rank.append(runner._fr_steps(_Read(mine), window, marks, WARMUP))
    return per_rank


def _fr_source(per_rank) -> dict:
    src = {"pass": True, "mismatches": []}
    runner._fr_step_check(src, _gathered(per_rank), MEASURED, "gloo")
    return src


def test_runner_fails_the_flight_recorder_source_on_a_lost_warmup_call():
    marks = _marks()
    clean = _fr_source(_runner_fr(_fr_lifetime(LAYOUT), marks))
    assert clean["pass"] and clean["steps"] == {"checked": [0, 1, 2, 3], "not_recorded": {}, "incomplete": 0}
    lossy, lost = _lose(_fr_lifetime(LAYOUT), 1, "all_to_all", rank=2)
    src = _fr_source(_runner_fr(lossy, marks))
    assert not src["pass"] and src["steps"]["incomplete"] == 1
    assert src["mismatches"][0].startswith("step 1 rank 2: 1 of ")
    assert " x all_to_all in_elems=" in src["mismatches"][0]
    assert src["mismatches"][0].endswith("missing in flight_recorder")


def test_runner_fails_when_fr_seq_and_the_step_marks_disagree():
    """The guard on the clock: an event FR's seq puts in the window but the marks before it."""
    marks = _marks()
    per_rank = []
    for rank in range(4):
        mine = _ref_ids([ev for ev in _fr_lifetime(LAYOUT) if ev.rank == rank])
        window = [ev for ev in mine if ev.t_start_ns >= marks[WARMUP] - (STEP_NS if rank == 3 else 0)]
        per_rank.append(runner._fr_steps(_Read(mine), window, marks, WARMUP))
    src = _fr_source(per_rank)
    assert not src["pass"]
    assert "FR's seq and the step marks" in src["mismatches"][-1]


def test_runner_reports_a_wrapped_ring_buffer():
    """Record ids that do not start at 0: the buffer overwrote older entries; the steps that
    began before its oldest kept entry are named with the buffer's size, the rest checked."""
    marks = _marks()
    per_rank = []
    for rank in range(4):
        mine = _ref_ids([ev for ev in _fr_lifetime(LAYOUT) if ev.rank == rank])
        kept = mine[4:]  # the 2 setup calls and 2 of step 0 overwritten
        window = [ev for ev in kept if ev.t_start_ns >= marks[WARMUP]]
        per_rank.append(runner._fr_steps(_Read(kept), window, marks, WARMUP))
    src = _fr_source(per_rank)
    assert src["pass"], src["mismatches"]
    assert src["steps"]["checked"] == [1, 2, 3] and list(src["steps"]["not_recorded"]) == ["0"]
    assert "ring buffer" in src["steps"]["not_recorded"]["0"]


class _WithWindowCalls:
    """``LAYOUT`` plus per-window calls, as EP's token all_to_all (sizes from the window's
    routing): two uneven all_to_alls per rank per step, sized differently each step."""

    mode = LAYOUT.mode

    def predict_calls(self):
        return LAYOUT.predict_calls()

    def window_calls(self, steps):
        return [dataclasses.replace(e, phase="activations", module="moe", in_elems=100 + s,
                                    out_elems=90 + s, count=None)
                for s in range(2 * steps) for e in LAYOUT.predict_calls() if e.op == "all_to_all"
                and e.phase == "forward"]


def test_window_calls_asked_per_step_by_count():
    """Calls a layout lists per window are asked for per step by (rank, group, op) count: a
    step with one all_to_all fewer fails, whatever their sizes."""
    layout = _WithWindowCalls()
    steps, _ = split_steps(_fr_lifetime(LAYOUT), _marks())
    first = {ev.rank: ev for ev in reversed(steps[1]) if ev.op == "all_to_all"}
    tokens = [dataclasses.replace(ev, in_elems=7, out_elems=5, count=None)  # two per rank: any size
              for _, ev in sorted(first.items()) for _ in range(2)]
    assert sorted(ev.rank for ev in tokens) == sorted(2 * list(range(LAYOUT.world_size)))
    check = lambda evs: step_completeness(layout, {1: evs}, source="flight_recorder",  # noqa: E731
                                          profile=GLOO_FR, window_steps=MEASURED)
    assert check(steps[1] + tokens)["pass"]
    short = check(steps[1] + tokens[1:])
    assert not short["pass"]
    assert short["lines"] == ["step 1 rank 0: 1 of 4 x all_to_all (any size) group 0,1,2,3 "
                              "missing in flight_recorder"]
    dmuon_own = [ev for ev in steps[1] if not (ev.op == "all_to_all" and ev.rank == 0)]
    assert not check(dmuon_own + tokens)["pass"]  # DMuon's own all_to_alls still by size
