"""TEST TOOL: the line-by-line reference of the NCCL log reader, and generated jobs.

The reference is the line-by-line algorithm the columnar reader (:mod:`tracer.nccl.table`,
:mod:`tracer.nccl.columns`) replaces, kept only here:
:func:`tracer.nccl.records.iter_nccl_records` (records of each physical line, read as Python's
text mode reads the file, invalid bytes as lone surrogates), then one COLL record at a time
resolved as the pre-columnar parser did (seq, cached resolution, nranks check; a record that
lost its prefix is not resolved), then the end-of-parse correction per communicator epoch.
:func:`assert_same` compares every entry point against it.

:func:`jobs` generates whole jobs of rendered lines (:mod:`tests.tools.nccl_render`: INIT
lines of every format 2.4 ... 2.29+, COLL lines 2.18 ... 2.30, PyTorch comm lines) with the
damage real logs show: 2.26+ timestamps (also impossible ones), wrapped lines, records
interleaved on one line, foreign prefixes, lost prefixes, invalid bytes, CRLF / CR line ends,
pointer reuse after DESTROY, INIT lines after COLL lines, nranks disagreements, unsupported
ops. Synthetic text: never evidence of what NCCL prints (the real fixtures are).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import strategies as st

from tests.tools import nccl_render as R
from tracer.events import CollectiveEvent, to_table
from tracer.nccl.formats import ROOTED_OPS
from tracer.nccl.log import (
    ParseStats,
    iter_nccl_events,
    nccl_logs_to_table,
    parse_nccl_logs,
    write_nccl_parquet,
)
from tracer.nccl.records import (
    CollRecord,
    InitRecord,
    ParseIssue,
    TorchCommRecord,
    iter_nccl_records,
)
from tracer.nccl.resolve import Resolver, nranks_issue, proc_key

def reference(sources: list[tuple[str, list[str]]]):
    """``(events, streaming events, issues, stats, comms)`` line by line; ``sources``:
    ``(name, physical lines)``."""
    r, stats = Resolver(), ParseStats()
    events, epochs, issues = [], [], []
    for name, lines in sources:
        for rec in iter_nccl_records(lines, file=name, stats=stats):
            if type(rec) is ParseIssue:
                issues.append(rec)
            elif type(rec) is InitRecord:
                r.init(rec)
            elif type(rec) is TorchCommRecord:
                r.torch(rec)
            else:
                out = reference_coll(r, rec)
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


def reference_coll(r: Resolver, rec: CollRecord):
    """``(event, epoch)`` of one COLL record, or the nranks issue."""
    if rec.unattributed:  # no process: nothing to resolve, no call index
        return CollectiveEvent(
            source="nccl_log", op=rec.op, group_size=rec.nranks, count=rec.count,
            dtype=rec.dtype, root=rec.root if rec.op in ROOTED_OPS else None,
            source_ref=f"{rec.file}:{rec.line_no}", comm=rec.comm), None
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


def text_lines(path: Path) -> list[str]:
    """The physical lines of ``path`` as Python's text mode reads them (universal newlines),
    an invalid UTF-8 byte as a lone surrogate."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return list(f)


def assert_same(inputs, sources, tmp: Path | None = None) -> None:
    """The columnar entry points on ``inputs`` equal the reference on ``sources`` (``tmp``:
    a folder for the Parquet writer, which is checked too when given)."""
    events, streaming, issues, stats, comms = reference(sources)
    res = nccl_logs_to_table(inputs)
    assert res.table.equals(to_table(events)), first_diff(res.table, to_table(events))
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


def first_diff(a: pa.Table, b: pa.Table) -> str:
    """The first row and column where ``a`` and ``b`` differ, for a failure message."""
    if a.num_rows != b.num_rows:
        return f"rows {a.num_rows} != {b.num_rows}"
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return f"row {i} column {name}: {u!r} != {v!r}"
    return "schemas differ"


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
def coll(draw, comm: str) -> str:
    ev = CollectiveEvent(
        source="nccl_log", op=draw(st.sampled_from(OPS)), count=draw(st.integers(0, 10**18)),
        dtype=draw(st.sampled_from(DTYPES)), root=draw(st.integers(0, 3)), comm=comm,
        group_size=draw(st.sampled_from([None, 2, 4, 4])))
    return R.coll_line(ev, opcount=draw(st.integers(0, 300)))


@st.composite
def init(draw, comm: str) -> str:
    nranks = draw(st.sampled_from([2, 4, 8]))
    return R.init_line(
        version=draw(st.sampled_from(R.VERSIONS)), comm=comm,
        rank=draw(st.integers(0, nranks - 1)), nranks=nranks, cuda_dev=draw(st.integers(0, 1)),
        comm_id=draw(st.sampled_from(["0x11", "0x22"])),
        parent=draw(st.sampled_from([None, None, *COMMS])), color=draw(st.integers(0, 1)),
        key=0, split_count=draw(st.integers(1, 2)),
        state=draw(st.sampled_from(["START", "COMPLETE"])))


@st.composite
def story(draw) -> list[str]:
    """Messages (no prefix) of one process: a call, an INIT, or a short life of a comm."""
    comm = draw(st.sampled_from(COMMS))
    kind = draw(st.sampled_from(["coll"] * 6 + ["init", "reuse", "late", "torch", "odd"]))
    if kind == "coll":
        return [draw(coll(comm)) for _ in range(draw(st.integers(1, 4)))]
    if kind == "init":
        return [draw(init(comm))]
    if kind == "reuse":  # INIT, calls, DESTROY, INIT again, calls: two epochs
        return [draw(init(comm)), draw(coll(comm)),
                R.destroy_line(comm=comm, rank=0, nranks=4, cuda_dev=0), draw(init(comm)),
                draw(coll(comm))]
    if kind == "late":  # calls before the INIT line (a mixed stream)
        return [draw(coll(comm)), draw(coll(comm)), draw(init(comm))]
    if kind == "torch":
        return ["TORCH " + R.torch_comm_line(
            pg=draw(st.sampled_from(["0", "1"])),
            pg_name=draw(st.sampled_from(["default_pg", "tp"])), rank=draw(st.integers(0, 3)),
            comm=comm, tid=draw(st.sampled_from([100, 101, 7])),
            cuda_dev=draw(st.integers(1, 7)))]
    return [draw(st.sampled_from(ODD)).format(comm=comm)]


@st.composite
def physical_lines(draw, pid_lines: list[tuple[tuple, str]]) -> list[str]:
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
        how = draw(st.sampled_from(["plain"] * 6 + ["wrap", "join", "cut", "stream", "lost",
                                                    "badbyte"]))
        if how == "wrap" and " count" in line:  # copy/paste wrap inside the message
            cut = line.index(" count") + draw(st.integers(0, 6))
            out += [line[:cut], line[cut:]]
        elif how == "stream" and line.rstrip().endswith(("stream 0x5", "0x55aa00000000")):
            head, _, tail = line.rstrip().rpartition(" ")
            out += [head, " " + tail]  # NVIDIA/nccl#740's wrap: the stream pointer alone
        elif how == "join" and out:
            out[-1] += line  # another rank's line without its newline
        elif how == "cut":
            out.append(line[:draw(st.integers(0, len(line)))])
        elif how == "lost":  # the prefix swallowed; maybe text glued before the message
            glue = draw(st.sampled_from(["", "", "[1] ", "loss 2.5 ", "0x5f", "done", "(x) "]))
            if draw(st.booleans()) and out:
                out[-1] += glue + msg  # after another line, without its newline
            else:
                out.append(glue + msg)
        elif how == "badbyte":  # an invalid UTF-8 byte (lone surrogate, as text mode reads it)
            at = draw(st.integers(0, len(line)))
            out.append(line[:at] + draw(st.sampled_from(["\udcff", "\udc80"])) + line[at:])
        else:
            out.append(line)
        if draw(st.integers(0, 12)) == 0:
            out.append(draw(st.sampled_from(["", "step 3 loss 2.5", "   "])))
    return out


@st.composite
def jobs(draw):
    """``(sources as (name, lines), line ends)``: one log per process or one mixed stream.
    Lines may hold lone surrogates: write files with ``errors="surrogateescape"``."""
    stories = draw(st.lists(st.tuples(st.sampled_from(PROCS), story()), max_size=25))
    msgs = [(proc, msg) for proc, story in stories for msg in story]
    if draw(st.booleans()):  # one mixed stream (stdout of the whole job)
        sources = [("mixed.log", draw(physical_lines(msgs)))]
    else:
        sources = [(f"nccl.{h}.{p}.{d}", draw(physical_lines([m for m in msgs if m[0] == proc])))
                   for proc in PROCS for h, p, d in [proc]]
    ends = draw(st.lists(st.sampled_from(["\n", "\n", "\n", "\r\n", "\r"]), min_size=1,
                         max_size=4))
    return sources, ends

