"""The columnar NCCL log reader (tracer.nccl_table, tracer.nccl_columns) against a reference.

The reference below is the line-by-line algorithm the columnar reader replaces, kept only
here: :func:`tracer.nccl_records.iter_nccl_records` (records of each physical line, read
as Python's text mode reads the file), then one COLL record at a time resolved as the
pre-columnar parser did (seq, cached resolution, nranks check), then the end-of-parse
correction per communicator epoch. Inputs: every real fixture under
../shared/fixtures/nccl/, and hypothesis-generated jobs of rendered lines (test tool
tests/tools/nccl_render.py): 2.26+ timestamps (also impossible ones), wrapped lines, records
interleaved on one line, foreign prefixes, CRLF / CR line ends, pointer reuse after DESTROY,
INIT lines after COLL lines, PyTorch comm lines, nranks disagreements, unsupported ops.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tools import nccl_render as R
from tracer import nccl_columns
from tracer.events import CollectiveEvent, to_table
from tracer.nccl_formats import ROOTED_OPS, timestamp_ns
from tracer.nccl_log import (
    NcclLogError,
    ParseStats,
    iter_nccl_events,
    nccl_logs_to_table,
    parse_nccl_logs,
    write_nccl_parquet,
)
from tracer.nccl_records import (
    CollRecord,
    InitRecord,
    ParseIssue,
    TorchCommRecord,
    iter_nccl_records,
)
from tracer.nccl_resolve import Resolver, nranks_issue, proc_key
from tracer.nccl_table import _range_issue

# ------------------------------------------------------------------ the reference


def _reference(sources: list[tuple[str, list[str]]]):
    """``(events, streaming events, issues, stats, comms)`` line by line."""
    r, stats = Resolver(), ParseStats()
    events, epochs, issues = [], [], []
    for name, lines in sources:
        for rec in iter_nccl_records(lines, file=name, stats=stats):
            if type(rec) is ParseIssue:
                issues.append(rec)
                continue
            bad = _range_issue(rec, name)
            if bad is not None:
                issues.append(bad)
            elif type(rec) is InitRecord:
                r.init(rec)
            elif type(rec) is TorchCommRecord:
                r.torch(rec)
            else:
                out = _reference_coll(r, rec)
                if type(out) is ParseIssue:
                    issues.append(out)
                else:
                    events.append(out[0])
                    epochs.append(out[1])
    streaming = list(events)
    fixes = r.final_fixes()
    for i, (ev, epoch) in enumerate(zip(events, epochs)):
        if epoch in fixes:
            rank, gid, group_rank, nranks = fixes[epoch]
            events[i] = ev.replace(rank=rank, group_id=gid, group_rank=group_rank,
                                   group_size=ev.group_size if nranks is None else nranks)
    return events, streaming, issues, stats, r.comm_infos()


def _reference_coll(r: Resolver, rec: CollRecord):
    proc = proc_key(rec.host, rec.pid, rec.file)
    c = r.comms.get((proc, rec.comm))
    if c is None:
        c = r._new(proc, rec.comm, rec.file, cuda_dev=rec.cuda_dev)
    if c.used_version != r.version:
        res = r.resolve(c)
        if c.used != res:
            if c.used is not None:
                c.stale = True
            c.used = res
        c.used_version = r.version
    rank, group_id, group_rank, nranks = c.used
    seq = c.calls
    c.calls += 1
    if rec.nranks is not None:
        if nranks is not None and nranks != rec.nranks:
            return nranks_issue(rec.file, rec.line_no, rec.nranks, c, nranks)
        nranks = c.nranks_seen = rec.nranks
    return CollectiveEvent(
        source="nccl_log", op=rec.op, rank=rank, group_id=group_id, group_size=nranks,
        group_rank=group_rank, seq=seq, count=rec.count, dtype=rec.dtype,
        root=rec.root if rec.op in ROOTED_OPS else None, t_start_ns=rec.t_start_ns,
        source_ref=f"{rec.file}:{rec.line_no}", pid=rec.pid, host=rec.host,
        cuda_dev=rec.cuda_dev, comm=rec.comm), c.idx


def _text_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return list(f)


def _assert_same(inputs, sources, tmp: Path | None = None) -> None:
    """The columnar entry points on ``inputs`` equal the reference on ``sources``."""
    events, streaming, issues, stats, comms = _reference(sources)
    res = nccl_logs_to_table(inputs)
    assert res.table.equals(to_table(events)), _first_diff(res.table, to_table(events))
    assert (res.issues, res.stats, res.comms) == (issues, stats, comms)
    assert [s for s, _ in sources] == res.files
    assert parse_nccl_logs(inputs).events == events
    got: list = []
    assert list(iter_nccl_events(inputs, issues=got)) == streaming
    assert got == issues
    if tmp is not None:
        (tmp / "events.parquet").unlink(missing_ok=True)
        out = write_nccl_parquet(inputs, tmp / "events.parquet", max_issues=3)
        assert (out.rows, out.issue_count, out.issues) == (len(events), len(issues), issues[:3])
        if events:
            assert pq.read_table(out.path).equals(res.table)
            assert out.summary(max_issues=3) == res.summary(max_issues=3)
        else:
            assert out.path is None and not (tmp / "events.parquet").exists()


def _first_diff(a: pa.Table, b: pa.Table) -> str:
    if a.num_rows != b.num_rows:
        return f"rows {a.num_rows} != {b.num_rows}"
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return f"row {i} column {name}: {u!r} != {v!r}"
    return "schemas differ"


# ------------------------------------------------------------------ real fixtures


def test_every_real_fixture_equals_the_reference(shared_fixtures, tmp_path, monkeypatch):
    monkeypatch.setattr(nccl_columns, "CHUNK_BYTES", 700)  # many blocks, cuts inside wraps
    paths = sorted((shared_fixtures / "nccl").iterdir())
    for path in paths:
        _assert_same(path, [(str(path), _text_lines(path))], tmp_path)
    _assert_same(paths, [(str(p), _text_lines(p)) for p in paths], tmp_path)


# ------------------------------------------------------------------ generated jobs

OPS = sorted(R.NCCL_NAME)
DTYPES = ["float32", "bfloat16", "int64", "uint8", "float8_e5m2"]
COMMS = ["0xa0", "0xb0", "0x7f00c0"]
PROCS = [("n0", 100, 0), ("n0", 101, 1), ("n1", 100, 0)]  # (host, pid, cudaDev)

TIMESTAMPS = st.one_of(
    st.integers(-(2**62), 2**62).map(lambda t: R.prefix("h", 1, 1, 0, t).split("h:1:1")[0]),
    st.builds(R.timestamp_text, st.integers(0, 9999), st.integers(0, 13),
              st.integers(0, 32), st.integers(0, 25), st.integers(0, 61),
              st.integers(0, 61), st.text("0123456789", max_size=12)),
)


ODD = [
    ("AllReduce: opCount 1 sendbuff 0x1 recvbuff 0x2 count 8 datatype 13 op 0 root 0 "
     "comm {comm} [nranks=2] stream 0x5"),  # unknown datatype: event and issue
    ("AllToAllv: opCount 1 sendbuff 0x1 recvbuff 0x2 count 8 datatype 7 op 0 root 0 "
     "comm {comm} [nranks=2] stream 0x5"),  # no canonical op
    ("AllReduce: opCount 1 sendbuff 0x1 recvbuff 0x2 count 99999999999999999999 datatype 7 "
     "op 0 root 0 comm {comm} stream 0x5"),  # does not fit int64
    ("Broadcast: opCount 1 sendbuff 0x1 recvbuff 0x2 count 8 datatype 7 op 0 root "
     "4294967296 comm {comm} stream 0x5"),  # root does not fit int32
    "AllReduce: 33554432 Bytes -> Algo RING proto SIMPLE channel{{Lo..Hi}}={{0..31}}",
    "Channel 00/02 :    0   1",
]


@st.composite
def _coll(draw, comm: str) -> str:
    ev = CollectiveEvent(
        source="nccl_log", op=draw(st.sampled_from(OPS)), count=draw(st.integers(0, 10**18)),
        dtype=draw(st.sampled_from(DTYPES)), root=draw(st.integers(0, 3)), comm=comm,
        group_size=draw(st.sampled_from([None, 2, 4, 4])))
    return R.coll_line(ev, opcount=draw(st.integers(0, 300)))


@st.composite
def _init(draw, comm: str) -> str:
    nranks = draw(st.sampled_from([2, 4, 8]))
    return R.init_line(
        version=draw(st.sampled_from(R.VERSIONS)), comm=comm,
        rank=draw(st.integers(0, nranks - 1)), nranks=nranks, cuda_dev=draw(st.integers(0, 1)),
        comm_id=draw(st.sampled_from(["0x11", "0x22"])),
        parent=draw(st.sampled_from([None, None, *COMMS])), color=draw(st.integers(0, 1)),
        key=0, split_count=draw(st.integers(1, 2)),
        state=draw(st.sampled_from(["START", "COMPLETE"])))


@st.composite
def _story(draw) -> list[str]:
    """Messages (no prefix) of one process: a call, an INIT, or a short life of a comm."""
    comm = draw(st.sampled_from(COMMS))
    kind = draw(st.sampled_from(["coll"] * 6 + ["init", "reuse", "late", "torch", "odd"]))
    if kind == "coll":
        return [draw(_coll(comm)) for _ in range(draw(st.integers(1, 4)))]
    if kind == "init":
        return [draw(_init(comm))]
    if kind == "reuse":  # INIT, calls, DESTROY, INIT again, calls: two epochs
        return [draw(_init(comm)), draw(_coll(comm)),
                R.destroy_line(comm=comm, rank=0, nranks=4, cuda_dev=0), draw(_init(comm)),
                draw(_coll(comm))]
    if kind == "late":  # calls before the INIT line (a mixed stream)
        return [draw(_coll(comm)), draw(_coll(comm)), draw(_init(comm))]
    if kind == "torch":
        return ["TORCH " + R.torch_comm_line(
            pg=draw(st.sampled_from(["0", "1"])),
            pg_name=draw(st.sampled_from(["default_pg", "tp"])), rank=draw(st.integers(0, 3)),
            comm=comm, tid=draw(st.sampled_from([100, 101, 7])),
            cuda_dev=draw(st.integers(1, 7)))]
    return [draw(st.sampled_from(ODD)).format(comm=comm)]


@st.composite
def _physical_lines(draw, pid_lines: list[tuple[tuple, str]]) -> list[str]:
    """Render messages of processes as physical lines with the damage real logs show."""
    out: list[str] = []
    for (host, pid, dev), msg in pid_lines:
        if msg.startswith("TORCH "):
            out.append(msg[6:])
            continue
        ts = draw(st.one_of(st.just(""), st.just(""), TIMESTAMPS))
        foreign = draw(st.sampled_from(["", "", "", "[1] ", "(RayTrainWorker pid=9) "]))
        line = foreign + ts + f"{host}:{pid}:{pid} [{dev}] NCCL INFO " + msg
        line += draw(st.sampled_from(["", "", " ", " \t"]))
        how = draw(st.sampled_from(["plain"] * 6 + ["wrap", "join", "cut", "stream"]))
        if how == "wrap" and " count" in line:  # copy/paste wrap inside the message
            cut = line.index(" count") + draw(st.integers(0, 6))
            out += [line[:cut], line[cut:]]
        elif how == "stream" and line.rstrip().endswith(("stream 0x5", "0x55aa00000000")):
            head, _, tail = line.rstrip().rpartition(" ")
            out += [head, " " + tail]  # NCCL issue 740's wrap: the stream pointer alone
        elif how == "join" and out:
            out[-1] += line  # another rank's line without its newline
        elif how == "cut":
            out.append(line[:draw(st.integers(0, len(line)))])
        else:
            out.append(line)
        if draw(st.integers(0, 12)) == 0:
            out.append(draw(st.sampled_from(["", "step 3 loss 2.5", "   "])))
    return out


@st.composite
def _job(draw):
    """``(sources as (name, lines), line ends)``: one log per process or one mixed stream."""
    stories = draw(st.lists(st.tuples(st.sampled_from(PROCS), _story()), max_size=25))
    msgs = [(proc, msg) for proc, story in stories for msg in story]
    if draw(st.booleans()):  # one mixed stream (stdout of the whole job)
        sources = [("mixed.log", draw(_physical_lines(msgs)))]
    else:
        sources = [(f"nccl.{h}.{p}.{d}", draw(_physical_lines([m for m in msgs if m[0] == proc])))
                   for proc in PROCS for h, p, d in [proc]]
    ends = draw(st.lists(st.sampled_from(["\n", "\n", "\n", "\r\n", "\r"]), min_size=1,
                         max_size=4))
    return sources, ends


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_job(), st.sampled_from([64, 300, 4096]), st.booleans())
def test_generated_jobs_equal_the_reference(job, chunk_bytes, last_newline):
    sources, ends = job
    # in memory: each element one physical line
    mem = [(name, [ln + ends[i % len(ends)] for i, ln in enumerate(lines)])
           for name, lines in sources]
    _assert_same(mem, mem)
    # as files, read in small chunks: line ends as Python's text mode sees them
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for name, lines in mem:
            path = Path(d) / name
            text = "".join(lines)
            if not last_newline:
                text = text.rstrip("\r\n")
            path.write_bytes(text.encode())
            paths.append(path)
        old = nccl_columns.CHUNK_BYTES
        nccl_columns.CHUNK_BYTES = chunk_bytes
        try:
            _assert_same(paths, [(str(p), _text_lines(p)) for p in paths], Path(d))
        finally:
            nccl_columns.CHUNK_BYTES = old


# ------------------------------------------------------------------ targeted cases

P = "node-01:100:100 [0] NCCL INFO "
COLL = ("AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count 8 datatype 7 op 0 root 0 "
        "comm 0xc0 [nranks=2] stream 0x5")


def test_fast_lines_are_taken_in_bulk_and_equal_the_general_path():
    lines = [P + COLL + "\n", "[2026-05-05 06:16:47.123456789123] " + P + COLL + "  \n",
             "[3] " + P + COLL + "\n"]
    (block,) = nccl_columns.line_blocks(lines)
    fields = nccl_columns.fast_coll_fields(block)
    assert fields.line.tolist() == [0, 1]  # a foreign prefix takes the general path
    assert fields.t_valid.tolist() == [False, True]
    assert fields.t_ns[1] == timestamp_ns("2026-05-05 06:16:47.123456789")
    _assert_same([("m", lines)], [("m", lines)])


def test_pointer_reuse_is_corrected_per_epoch_not_per_pointer():
    """An epoch of a reused pointer keeps its own identity when a later epoch of the same
    pointer is corrected at the end (the world rank arrives with a wider INIT line)."""
    lines = [P + R.init_line(version="2.18", comm="0xc0", rank=1, nranks=2, cuda_dev=0,
                             comm_id="0xaa"), P + COLL,
             P + R.destroy_line(comm="0xc0", rank=1, nranks=2, cuda_dev=0),
             P + R.init_line(version="2.18", comm="0xc0", rank=0, nranks=2, cuda_dev=0,
                             comm_id="0xbb"), P + COLL,
             P + R.init_line(version="2.18", comm="0xd0", rank=5, nranks=8, cuda_dev=0,
                             comm_id="0xcc")]
    res = parse_nccl_logs([("m", lines)])
    assert [(e.group_id, e.group_rank, e.rank, e.seq) for e in res.events] == [
        ("0xaa", 1, 5, 0), ("0xbb", 0, 5, 0)]
    _assert_same([("m", lines)], [("m", lines)])


def test_init_after_coll_needs_the_second_parquet_pass(tmp_path):
    lines = [P + COLL, P + COLL, P + R.init_line(version="2.21", comm="0xc0", rank=1,
                                                 nranks=2, cuda_dev=0, comm_id="0x77")]
    out = write_nccl_parquet([("m", lines)], tmp_path / "e.parquet")
    table = pq.read_table(out.path)
    assert table.column("group_id").to_pylist() == ["0x77", "0x77"]
    assert table.column("rank").to_pylist() == [1, 1] and out.ranks == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.parquet"]  # no temp files


def test_strict_parquet_writes_nothing_and_keeps_an_existing_file(tmp_path):
    out = tmp_path / "e.parquet"
    out.write_bytes(b"old")
    with pytest.raises(NcclLogError, match="m:2"):
        write_nccl_parquet([("m", [P + COLL, P + COLL[:40]])], out, strict=True)
    assert out.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [out]


def test_strict_streaming_yields_the_events_before_the_first_issue():
    lines = [P + COLL, P + COLL, P + COLL.replace("datatype 7", "datatype 12"), P + COLL]
    got = []
    with pytest.raises(NcclLogError, match="m:3"):
        for ev in iter_nccl_events([("m", lines)], strict=True):
            got.append(ev.seq)
    assert got == [0, 1]


def test_numbers_the_schema_cannot_hold_are_issues():
    res = parse_nccl_logs([("m", [
        P + COLL.replace("count 8", f"count {2**63}"),
        P + COLL.replace("count 8", f"count {2**61}"),  # * 4 bytes overflows msg_bytes
        P + COLL.replace("AllReduce", "Send").replace("root 0", f"root {2**31}"),
        P + COLL.replace("root 0", f"root {2**31}"),  # all_reduce: root is not stored
        P + R.init_line(version="2.18", comm="0xe0", rank=2**31, nranks=4, cuda_dev=0,
                        comm_id="0x1")])])
    assert [e.source_ref for e in res.events] == ["m:4"]
    assert [(i.line_no, i.reason.split(" out of range")[0]) for i in res.issues] == [
        (1, f"count {2**63}"), (2, f"count * dtype bytes {2**63}"), (3, f"root {2**31}"),
        (5, f"rank {2**31}")]


def test_timestamps_outside_int64_ns_read_as_none():
    lines = [R.timestamp_text(2262, 4, 12, 0, 0, 0) + P + COLL,
             R.timestamp_text(1677, 9, 20, 0, 0, 0) + P + COLL,
             R.timestamp_text(1969, 12, 31, 23, 59, 59, "5") + P + COLL,
             R.timestamp_text(2262, 4, 11, 23, 47, 16, "854775807") + P + COLL,
             R.timestamp_text(2262, 4, 11, 23, 47, 16, "854775808") + P + COLL]
    res = parse_nccl_logs([("m", lines)])
    assert [e.t_start_ns for e in res.events] == [None, None, -500_000_000, 2**63 - 1, None]
    _assert_same([("m", lines)], [("m", lines)])
    with pytest.raises(ValueError, match="2262-04-11"):
        timestamp_ns("9999-01-01 00:00:00")


def test_universal_newlines_and_a_last_line_without_newline(tmp_path):
    path = tmp_path / "crlf.log"
    path.write_bytes((P + COLL + "\r\n" + P + COLL + "\r" + "\r\n" + P + COLL).encode())
    assert [e.source_ref for e in parse_nccl_logs(path).events] == [
        f"{path}:1", f"{path}:2", f"{path}:4"]
    _assert_same(path, [(str(path), _text_lines(path))])


def test_source_refs_match_python_formatting():
    lines = np.array([1, 9, 10, 99, 100, 12345678901, 7, 10**18])
    assert nccl_columns.source_refs("dir/é.log", lines).to_pylist() == [
        f"dir/é.log:{n}" for n in lines.tolist()]
    assert nccl_columns.source_refs("x", np.array([], np.int64)).to_pylist() == []


def test_parquet_pass_holds_bounded_memory(tmp_path, monkeypatch):
    """Python-side peak (tracemalloc: blocks, numpy arrays, which Arrow columns share) is the
    same for 4x the lines: one block and one row group at a time."""
    import tracemalloc

    from tracer import nccl_log

    monkeypatch.setattr(nccl_columns, "CHUNK_BYTES", 1 << 18)
    monkeypatch.setattr(nccl_log, "ROW_GROUP_ROWS", 4096)
    peaks = []
    for n in (20_000, 80_000):
        path = tmp_path / f"{n}.log"
        with open(path, "w") as f:
            for i in range(n):
                f.write(P + COLL.replace("opCount 0", f"opCount {i:x}") + "\n")
        tracemalloc.start()
        out = write_nccl_parquet(path, tmp_path / f"{n}.parquet")
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert out.rows == n
    assert peaks[1] < peaks[0] * 1.3, peaks


def test_a_line_longer_than_a_chunk_and_lone_surrogates(tmp_path, monkeypatch):
    monkeypatch.setattr(nccl_columns, "CHUNK_BYTES", 1000)
    path = tmp_path / "long.log"
    path.write_text("x" * 100_000 + P + COLL + "\n" + P + COLL)
    assert [e.source_ref for e in parse_nccl_logs(path).events] == [f"{path}:1", f"{path}:2"]
    _assert_same(path, [(str(path), _text_lines(path))])
    res = parse_nccl_logs([("m", ["\udcff" + P + COLL, P + COLL])])  # Arrow holds no surrogate
    assert [e.host for e in res.events] == ["\ufffd" * 3 + "node-01", "node-01"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("0123456789", min_size=1, max_size=16),
                          st.text("x :[]=-", max_size=3)), min_size=1, max_size=30))
def test_bulk_digits_equal_int(tokens):
    """The fast path's SWAR reading of decimal fields, for every width 1..16."""
    text = "#" * 16 + "".join(f"{digits}{sep}" for digits, sep in tokens) + "#" * 8
    ends, pos = [], 16
    for digits, sep in tokens:
        pos += len(digits)
        ends.append(pos)
        pos += len(sep)
    ends = np.array(ends)
    begs = ends - np.array([len(d) for d, _ in tokens])
    data = text.encode()
    got = nccl_columns._uints(nccl_columns._words(data), begs, ends)
    assert got.tolist() == [int(d) for d, _ in tokens]
