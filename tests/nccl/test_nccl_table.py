"""The columnar NCCL log reader (tracer.nccl.table, tracer.nccl.columns) against a reference.

The reference is the line-by-line algorithm the columnar reader replaces (test tool
tests/tools/nccl_reference.py). Inputs: every real fixture under ../shared/fixtures/nccl/,
and hypothesis-generated jobs of rendered lines (that tool's :func:`jobs`). The longer fuzz
run (byte mutations, long lines) is tests/nccl/test_fuzz_nccl.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fast, slow
from tests.tools import nccl_render as R
from tests.tools.nccl_reference import assert_same, jobs, text_lines
from tracer.nccl import columns as nccl_columns
from tracer.nccl.formats import timestamp_ns
from tracer.nccl.log import (
    NcclLogError,
    iter_nccl_events,
    parse_nccl_logs,
    write_nccl_parquet,
)

# ------------------------------------------------------------------ real fixtures


def test_every_real_fixture_equals_the_reference(shared_fixtures, tmp_path, monkeypatch):
    monkeypatch.setattr(nccl_columns, "CHUNK_BYTES", 700)  # many blocks, cuts inside wraps
    paths = sorted((shared_fixtures / "nccl").iterdir())
    for path in paths:
        assert_same(path, [(str(path), text_lines(path))], tmp_path)
    assert_same(paths, [(str(p), text_lines(p)) for p in paths], tmp_path)


# ------------------------------------------------------------------ generated jobs

@fast(20)
@given(jobs(), st.sampled_from([64, 300, 4096]), st.booleans())
def test_generated_jobs_equal_the_reference(job, chunk_bytes, last_newline):
    _generated_job_case(job, chunk_bytes, last_newline)


@pytest.mark.slow
@slow(300)
@given(jobs(), st.sampled_from([64, 300, 4096]), st.booleans())
def test_generated_jobs_equal_the_reference_long(job, chunk_bytes, last_newline):
    _generated_job_case(job, chunk_bytes, last_newline)


def _generated_job_case(job, chunk_bytes, last_newline):
    sources, ends = job
    # in memory: each element one physical line
    mem = [(name, [ln + ends[i % len(ends)] for i, ln in enumerate(lines)])
           for name, lines in sources]
    assert_same(mem, mem)
    # as files, read in small chunks: line ends as Python's text mode sees them
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for name, lines in mem:
            path = Path(d) / name
            text = "".join(lines)
            if not last_newline:
                text = text.rstrip("\r\n")
            path.write_bytes(text.encode("utf-8", "surrogateescape"))
            paths.append(path)
        old = nccl_columns.CHUNK_BYTES
        nccl_columns.CHUNK_BYTES = chunk_bytes
        try:
            assert_same(paths, [(str(p), text_lines(p)) for p in paths], Path(d))
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
    assert_same([("m", lines)], [("m", lines)])


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
    assert_same([("m", lines)], [("m", lines)])


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


def test_timestamps_outside_int64_ns_are_issues_and_read_as_none():
    lines = [R.timestamp_text(2262, 4, 12, 0, 0, 0) + P + COLL,
             R.timestamp_text(1677, 9, 20, 0, 0, 0) + P + COLL,
             R.timestamp_text(1969, 12, 31, 23, 59, 59, "5") + P + COLL,
             R.timestamp_text(2262, 4, 11, 23, 47, 16, "854775807") + P + COLL,
             R.timestamp_text(2262, 4, 11, 23, 47, 16, "854775808") + P + COLL]
    res = parse_nccl_logs([("m", lines)])
    assert [e.t_start_ns for e in res.events] == [None, None, -500_000_000, 2**63 - 1, None]
    assert [(i.line_no, "outside 1677-09-21 .. 2262-04-11" in i.reason) for i in res.issues] == [
        (1, True), (2, True), (5, True)]
    assert_same([("m", lines)], [("m", lines)])
    with pytest.raises(ValueError, match="2262-04-11"):
        timestamp_ns("9999-01-01 00:00:00")


def test_universal_newlines_and_a_last_line_without_newline(tmp_path):
    path = tmp_path / "crlf.log"
    path.write_bytes((P + COLL + "\r\n" + P + COLL + "\r" + "\r\n" + P + COLL).encode())
    assert [e.source_ref for e in parse_nccl_logs(path).events] == [
        f"{path}:1", f"{path}:2", f"{path}:4"]
    assert_same(path, [(str(path), text_lines(path))])


def test_source_refs_match_python_formatting():
    lines = np.array([1, 9, 10, 99, 100, 12345678901, 7, 10**18])
    assert nccl_columns.source_refs("dir/é.log", lines).to_pylist() == [
        f"dir/é.log:{n}" for n in lines.tolist()]
    assert nccl_columns.source_refs("x", np.array([], np.int64)).to_pylist() == []


def test_parquet_pass_holds_bounded_memory(tmp_path, monkeypatch):
    """Python-side peak (tracemalloc: blocks, numpy arrays, which Arrow columns share) is the
    same for 4x the lines: one block and one row group at a time."""
    import tracemalloc

    from tracer.nccl import log as nccl_log

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
    path.write_text("x" * 100_000 + " " + P + COLL + "\n" + P + COLL)
    assert [e.source_ref for e in parse_nccl_logs(path).events] == [f"{path}:1", f"{path}:2"]
    assert_same(path, [(str(path), text_lines(path))])
    lines = ["\udcff" + P + COLL, P + COLL]  # invalid UTF-8 in memory: a lone surrogate
    res = parse_nccl_logs([("m", lines)])
    assert [e.source_ref for e in res.events] == ["m:2"]
    assert [(i.line_no, i.reason) for i in res.issues] == [
        (1, "invalid UTF-8 (byte 0xff at column 1); line not parsed")]
    assert_same([("m", lines)], [("m", lines)])


@fast(60)
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
