"""Linear time on any line: long adversarial lines parse within a bound
measured as a ratio to reading the same file, and the linear matchers that replaced the
quadratic regex searches return what those regexes define.

Before the fix a 20 KB blob before ``NCCL INFO`` took 27 s (prefix search), a 70 KB INIT line
repeating ``comm … cudaDev 0`` 10 s, and ``[PG 0 (`` repeated was quadratic too; a 10 MB line
would have taken months. Each run below holds MB-long runs of those shapes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.nccl import formats as fmt
from tracer.nccl.log import iter_nccl_records, nccl_logs_to_table

#: Parse CPU time / read CPU time allowed. Measured 11-33 on the shared dev machine (per-line
#: path on these lines); a quadratic path on MB-long runs is more than 10**4.
RATIO_MAX = 100

P = "node-01:100:100 [0] NCCL INFO "
COLL = ("AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count 8 datatype 7 op 0 root 0 "
        "comm 0xc0 [nranks=2] stream 0x5")


def _rep(unit: str, size: int) -> str:
    return unit * max(1, size // len(unit))


def _info_pieces(size: int) -> list[str]:
    """Shapes that were (or could be) super-linear on lines with ``NCCL INFO`` markers."""
    return [_rep("x", size) + "NCCL INFO " + COLL,  # blob before the marker: prefix search
            P + _rep("comm 0x1 rank 0 nranks 2 cudaDev 0 ", size) + "Init COMPLETE ",
            P + _rep("nccl", size) + " Init COMPLETE ",  # INIT function name
            P + "AllReduce: opCount 0 sendbuff " + _rep("0", size) + " recvbuff",
            P + "AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count " + _rep("9", size)
            + " datatype 7 op 0 root 0 comm 0x1 stream 0x2",  # a count int() refuses
            _rep("A", size) + ": opCount 1 ",  # op name of a lost prefix
            _rep(" ", size), _rep("[", size),
            _rep(":1", size) + " [0] NCCL INFO " + COLL,  # host:pid:tid fields
            _rep("- Init START ", size), _rep("[2026-05-05 06:16:47.", size)]


def _plain_pieces(size: int) -> list[str]:
    """Shapes for lines without ``NCCL INFO``: PyTorch comm lines, lost prefixes."""
    return [_rep("[PG 0 (", size) + " ProcessGroupNCCL created ncclComm_ 0x1 on CUDA device:",
            _rep("I0527 15:16:57.1 ", size),
            _rep("AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count 8 ", size // 4),
            _rep("Send", size) + ": opCount "]


def _cpu_s(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def _read(path: Path) -> None:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for _ in f:
            pass


def _records(path: Path) -> list:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return list(iter_nccl_records(f, file=str(path)))


def _assert_linear(path: Path) -> tuple:
    """Both paths (columnar reader, per-line records) within :data:`RATIO_MAX` of reading."""
    read_s = min(_cpu_s(lambda: _read(path)) for _ in range(5))
    out = {}
    table_s = _cpu_s(lambda: out.setdefault("table", nccl_logs_to_table(path)))
    records_s = _cpu_s(lambda: out.setdefault("records", _records(path)))
    assert table_s < RATIO_MAX * read_s, (table_s, read_s)
    assert records_s < RATIO_MAX * read_s, (records_s, read_s)
    return out["table"], out["records"]


@pytest.mark.parametrize("kind", ["info", "plain"])
def test_a_10_mb_line_parses_in_linear_time(tmp_path, kind):
    pieces = _info_pieces if kind == "info" else _plain_pieces
    scale = 1.05 * 10 * 2**20 / len("".join(pieces(10_000)))
    line = "".join(pieces(int(10_000 * scale) + 100))
    path = tmp_path / "one.log"
    path.write_text(line + "\n")
    assert path.stat().st_size >= 10 * 2**20
    res, records = _assert_linear(path)
    assert res.stats.lines == 1
    if kind == "info":  # one whole COLL record; the rest are issues, not events: ": opCount"
        # after a run of letters no op name can end, and the record whose "host:pid:tid"
        # is megabytes of ":1" (its prefix runs past the window read before a marker)
        assert res.table.num_rows == 1 and len(res.issues) == 6
        assert any("prefix runs past" in i.reason for i in res.issues)
        # the record whose count no column holds is an issue at the records layer too
        assert [r.count for r in records if type(r).__name__ == "CollRecord"] == [8]
    else:
        assert res.table.num_rows == 0 and res.stats.torch_lines == 0
        assert all(i.line_no == 1 for i in res.issues)


def test_1000_long_lines_parse_in_linear_time(tmp_path):
    size = 10_000
    shapes = _info_pieces(size) + _plain_pieces(size) + [
        _rep("h", size) + ":1:2 [0] NCCL INFO " + COLL,  # a 10 KB host
        P + COLL + _rep(" ", size)]
    lines = [shapes[i % len(shapes)] for i in range(1000)]
    path = tmp_path / "many.log"
    path.write_text("\n".join(lines) + "\n")
    res, _ = _assert_linear(path)
    assert res.stats.lines == 1000
    assert res.table.num_rows >= sum(1 for ln in lines if ln.startswith(P + COLL))
    # a 10 KB host is glued text, not a host: an issue naming the line, not an event
    glued = {i + 1 for i, ln in enumerate(lines) if ln.startswith("hhhh")}
    assert glued <= {i.line_no for i in res.issues if "prefix runs past" in i.reason}


# ------------------------------------------------------------ the matchers equal their regex

PREFIX_WORDS = ["[", "]", " ", ":", "1", "23", "-", "h", "x", ".", ",", "\t", "0", "[3] ",
                "h:1:2", ":9:9 ", "[2026-05-05 06:16:47] ", "[2026-05-05T06:16:47.5] ",
                "2026-05-05 06:16:47", "[2026-05-05T06:16:47Z] ", "[2026-05-05 06:16:47+02:00] ",
                "[2026-05-05 06:16:47.25 -0530] ", "[2026-05-05 06:16:47 UTC] ", "Z", "+02",
                "-05:30", " UTC", "+"]
INIT_WORDS = ["comm 0x1 ", "rank 0 ", "nranks 2 ", "cudaDev 0", "cudaDev -1 ", " ", "-", "- ",
              "Init ", "START", "COMPLETE", "Destroy ", "Abort ", "nccl", "ncclCommInitRank ",
              "x", "\n", " - Init COMPLETE", "commId 0x5 ", "comm comm "]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PREFIX_WORDS), max_size=10).map("".join))
def test_read_prefix_is_the_leftmost_prefix_re_match(text):
    # the whole text: lo = 0, hi and the window its length; the match's start is dropped
    assert fmt.read_prefix(text, 0, len(text), len(text))[:5] == fmt.PREFIX_RE.search(text).groups()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(INIT_WORDS), max_size=14).map("".join))
def test_match_init_span_is_the_leftmost_init_re_match(body):
    m = fmt.INIT_RE.search(body)
    groups = fmt.match_init_span(body)
    if groups is not None:  # the middle comes back as its bounds in ``body``
        func, comm, rank, nranks, dev, a, b, what, state = groups
        groups = (func, comm, rank, nranks, dev, body[a:b], what, state)
    assert groups == (None if m is None else m.groups())


def test_old_shapes_that_hung_are_fast_and_read_right():
    """The shapes of the issue, 1 MB each, and what the records say."""
    blob = "x" * 2**20
    (rec,) = iter_nccl_records([blob + " " + P + COLL])
    assert (rec.host, rec.pid, rec.count) == ("node-01", 100, 8)
    # glued to the host: read within the last PREFIX_WINDOW characters; a host running past
    # them is an issue, not a host of a megabyte (nor a record of the file's process)
    (rec,) = iter_nccl_records(["x" * 3000 + P + COLL])
    assert (rec.host, rec.pid, rec.count) == ("x" * 3000 + "node-01", 100, 8)
    (issue,) = iter_nccl_records([blob + P + COLL])
    assert "prefix runs past 4,096 characters" in issue.reason
    init = P + "comm 0x1 rank 0 nranks 2 cudaDev 0 " * 30_000 + "- Init COMPLETE"
    (rec,) = iter_nccl_records([init])
    assert (rec.comm, rec.rank, rec.nranks, rec.state) == ("0x1", 0, 2, "COMPLETE")
    torch = "[PG 0 (" * 150_000 + "x) Rank 3] ProcessGroupNCCL created ncclComm_ 0x9 on CUDA device:"
    (rec,) = iter_nccl_records([torch])
    assert (rec.pg, rec.pg_name, rec.group_rank, rec.comm) == ("0", "x", 3, "0x9")
