"""Property tests of tracer.nccl.log: no crash on any text; rendered lines parse back.

Rendered lines come from tests/tools/nccl_render.py (a test tool, not evidence); the real-format
checks are in test_nccl_log.py against ../shared/fixtures/nccl/.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tools import nccl_render as R
from tracer.events import CollectiveEvent
from tracer.nccl.formats import DATATYPE_NUMBERS, ROOTED_OPS
from tracer.nccl.log import ParseIssue, iter_nccl_records, parse_nccl_logs

REAL = ("hopper01:191370:191425 [1] NCCL INFO AllGather: opCount d sendbuff 0x7fa921200000 "
        "recvbuff 0x7fa915800000 count 2097152 datatype 7 op 0 root 0 comm 0x55fca23fc0f0 "
        "[nranks=2] stream 0x55fca193e8e0")  # pytorch/torchtitan#1369 fixture, line 1

NOISE = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)
TOKENS = st.sampled_from(["NCCL INFO ", "NCCL WARN ", ": opCount ", " stream", "comm 0x1 ",
                          " rank 1 nranks 2 cudaDev 0 - Init COMPLETE", "[0] ", "\n",
                          "created ncclComm_ ", "[PG 0 (x) Rank 1] ", " count 5", "0x1f ",
                          "[2026-13-45 99:99:99] ", "[2026-05-05 06:16:47.5] ", "h:1:2 "])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(NOISE, st.lists(st.one_of(TOKENS, NOISE), max_size=8).map("".join)),
                max_size=12))
def test_never_crashes_on_arbitrary_text(lines):
    res = parse_nccl_logs([("fuzz", lines)])
    for issue in res.issues:
        assert isinstance(issue, ParseIssue) and issue.file == "fuzz" and issue.line_no >= 1
    assert res.stats.lines == len(lines)
    res.summary()


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(REAL)), st.integers(0, 30), NOISE)
def test_mutated_real_line_yields_an_event_or_an_issue_never_a_crash(pos, cut, junk):
    line = REAL[:pos] + junk + REAL[pos + cut:]
    res = parse_nccl_logs([("mut", [line + "\n"])])
    assert len(res.events) <= 1
    if "NCCL INFO " in line and ": opCount" in line and not res.events:
        assert res.issues or res.stats.ignored


EVENTS = st.builds(
    lambda op, count, dtype, root, comm, n, host, pid, dev, ts: CollectiveEvent(
        source="nccl_log", op=op, count=count, dtype=dtype,
        root=root % n if op in ROOTED_OPS else None,  # a root outside [0, n) is an issue
        comm=f"0x{comm:x}", group_size=n, host=host, pid=pid, cuda_dev=dev, t_start_ns=ts),
    st.sampled_from(sorted(R.NCCL_NAME)), st.integers(0, 2**40),
    st.sampled_from(sorted(DATATYPE_NUMBERS)),
    st.integers(0, 1023), st.integers(1, 2**48), st.integers(1, 4096),
    st.from_regex(r"[a-z][a-z0-9\-]{0,15}", fullmatch=True), st.integers(1, 2**22),
    st.integers(0, 15), st.one_of(st.none(), st.integers(0, 2**61).map(lambda t: t - t % 1000)))


@settings(max_examples=150, deadline=None)
@given(EVENTS, st.sampled_from(["", "[3] ", "(RayTrainWorker pid=9, ip=10.1.2.3) "]),
       st.sampled_from(["", " ", "  \t"]), st.integers(0, 2**32))
def test_rendered_line_parses_back_to_the_same_event(ev, foreign, trailing, opcount):
    line = foreign + R.event_line(ev, opcount=opcount) + trailing + "\n"
    res = parse_nccl_logs([("r", [line])])
    assert res.issues == []
    (got,) = res.events
    assert got == ev.replace(seq=0, source_ref="r:1",
                             group_id=f"local:{ev.host}:{ev.pid}:{ev.comm}")
    (rec,) = iter_nccl_records([line])
    assert (rec.opcount, rec.datatype) == (opcount, DATATYPE_NUMBERS[ev.dtype])
