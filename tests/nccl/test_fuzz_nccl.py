"""Fuzzing the NCCL_DEBUG=INFO parser: byte-level mutations of every real fixture
in ../shared/fixtures/nccl/, grammar-generated logs (INIT formats 2.4 ... 2.29+, COLL lines
2.18 ... 2.30, 2.26+ timestamps, PyTorch comm lines; tests/tools/nccl_reference.py) mutated
the same way, and lines of repeated format words (long-line shapes).

Every input must give a defined outcome: events and issues, never an exception (strict mode:
only :class:`tracer.nccl.log.NcclLogError`, carrying the first issue); no hang (each input has
a CPU-time limit, tests/fuzzing.py); and the columnar reader (RE2 + numpy fast path, in-memory
blocks, Parquet writer) equals the line-by-line reference, as files read in small chunks and
as in-memory lines. The default run takes 115 derandomized inputs of these three classes;
the ``slow`` variants (``make test-all``, 3,000 random inputs) many times that.

The hostile classes add cases whose right outcome is known per line (about 5 s more):
op-name look-alikes (punctuation, blanks, zero-width and other invisible characters,
letters of other scripts, NUL, ESC inside or around a name, with and without a prefix;
colours, which are presentation), garbage before prefixes (BOM, ANSI escapes, CR, NUL, also
between records on one line), gzip (valid, truncated anywhere, gzip of garbage), folders
mixing good, zero-filled, gzipped, binary, empty files with FIFOs, broken symlinks and
folder symlinks, timestamps with zones (and impossible offsets), and oversized numbers in
every numeric field. Each asserts: no traceback, no event whose op differs from the line's
real op, and every line without its event an issue naming its file and line.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SHARED_FIXTURES
from tests.fuzzing import apply, fast, mutations, slow, time_limit
from tests.tools.nccl_reference import assert_same, jobs, text_lines
from tracer.nccl import columns as nccl_columns
from tracer.nccl import formats as fmt
from tracer.nccl.log import NcclLogError, nccl_logs_to_table

#: Per input, in CPU seconds. Inputs are at most a few hundred KB: a linear parse takes
#: milliseconds to a second; a super-linear one takes far longer.
LIMIT_S = 60

FIXTURES = (sorted(p.name for p in (SHARED_FIXTURES / "nccl").iterdir())
            if (SHARED_FIXTURES / "nccl").is_dir() else [])

#: Words of the formats worth inserting (markers, keywords, field shapes).
TOKENS = [t.encode() for t in (
    "NCCL INFO ", "NCCL WARN ", ": opCount ", "AllReduce: opCount 1 ", " stream ", " stream",
    " count ", "99999999999999999999999", " [nranks=", "] ", "comm 0x1 ", " rank 1 nranks 2 "
    "cudaDev 0 ", "- Init COMPLETE", "- Init START", " - Destroy COMPLETE", "ncclCommSplit ",
    " parent 0x1 splitCount 1 color 0 key 0", " commId 0x7 ", "[Rank 1] ",
    "[2026-05-05 06:16:47.123456] ", "[9999-99-99 99:99:99] ", "h:1:2 [0] ", "[3] ",
    "ProcessGroupNCCL created ncclComm_ 0x1 on CUDA device: \x03", "[PG 0 (default_pg) Rank 1] ",
    "I0527 15:16:57.738664 58629 ", "(nil)", "\r\n", "\r", "\n", "\u00b2", "\ufffd")]

@contextmanager
def _chunk_bytes(n: int | None):
    old = nccl_columns.CHUNK_BYTES
    nccl_columns.CHUNK_BYTES = n or old
    try:
        yield
    finally:
        nccl_columns.CHUNK_BYTES = old


def _check_bytes(data: list[tuple[str, bytes]], chunk: int | None, what: str) -> None:
    """``(name, bytes)`` inputs: as files and as in-memory lines, equal to the reference;
    strict mode raises exactly the first issue."""
    with tempfile.TemporaryDirectory() as d, _chunk_bytes(chunk), time_limit(LIMIT_S, what):
        paths = []
        for name, blob in data:
            paths.append(Path(d) / name)
            paths[-1].write_bytes(blob)
        # files left out (binary: a NUL without NCCL text) or read decompressed (a mutation
        # that made gzip's magic bytes) are not text the reference reads
        other = {str(p) for p in paths
                 if nccl_columns.skip_reason(p) is not None or nccl_columns.is_gzip(p)}
        texts = [p for p in paths if str(p) not in other]
        assert_same(texts, [(str(p), text_lines(p)) for p in texts], Path(d))
        mem = [(name, list(io.StringIO(blob.decode("utf-8", "surrogateescape"), newline=None)))
               for name, blob in data]
        assert_same(mem, mem)
        res = nccl_logs_to_table(paths)
        assert set(res.files) | {f for f, _ in res.unread} == {str(p) for p in paths}
        assert {f for f, _ in res.unread} <= {i.file for i in res.issues}  # named, never silent
        issues = res.issues
        if issues:
            with pytest.raises(NcclLogError) as err:
                nccl_logs_to_table(paths, strict=True)
            assert err.value.issue == issues[0]
        else:
            nccl_logs_to_table(paths, strict=True)


def _fixture_case(name: str, edits: list, chunk: int | None) -> None:
    blob = (SHARED_FIXTURES / "nccl" / name).read_bytes()
    _check_bytes([(name, apply(blob, edits))], chunk, f"{name} mutated by {edits!r}")


def _job_case(job, edits: list, chunk: int | None) -> None:
    sources, ends = job
    data = [(name, "".join(ln + ends[i % len(ends)] for i, ln in enumerate(lines))
             .encode("utf-8", "surrogateescape")) for name, lines in sources]
    if data:
        data[0] = (data[0][0], apply(data[0][1], edits))
    _check_bytes(data, chunk, f"generated job {sources!r} mutated by {edits!r}")


CHUNKS = st.sampled_from([None, 64, 700])
FIXTURE_NAMES = st.sampled_from(FIXTURES or ["<none>"])


def _need_fixtures():
    if not FIXTURES:
        pytest.skip(f"shared fixtures not found at {SHARED_FIXTURES} (set "
                    "DMUON_SHARED_FIXTURES)")


@fast(60)
@given(FIXTURE_NAMES, mutations(TOKENS), CHUNKS)
def test_mutated_fixtures(name, edits, chunk):
    _need_fixtures()
    _fixture_case(name, edits, chunk)


@fast(30)
@given(jobs(), mutations(TOKENS, max_edits=4), CHUNKS)
def test_mutated_generated_logs(job, edits, chunk):
    _job_case(job, edits, chunk)


WORDS = [w.decode() for w in TOKENS] + ["x", "0", " ", "[", ":1", "nccl", "[PG 0 (", "A",
                                        "comm 0x1 rank 0 nranks 2 cudaDev 0 "]


@st.composite
def _long_lines(draw) -> list[str]:
    """A few lines, each a handful of format words repeated up to thousands of times."""
    lines = []
    for _ in range(draw(st.integers(1, 3))):
        parts = draw(st.lists(st.tuples(st.sampled_from(WORDS), st.integers(1, 4000)),
                              min_size=1, max_size=4))
        lines.append("".join(word * n for word, n in parts) + "\n")
    return lines


@fast(25)
@given(_long_lines())
def test_lines_of_repeated_format_words(lines):
    _check_bytes([("long.log", "".join(lines).encode())], None, f"{lines!r:.300}")


@pytest.mark.slow
@slow(1600)
@given(FIXTURE_NAMES, mutations(TOKENS, max_edits=16), CHUNKS)
def test_mutated_fixtures_long(name, edits, chunk):
    _need_fixtures()
    _fixture_case(name, edits, chunk)


@pytest.mark.slow
@slow(800)
@given(jobs(), mutations(TOKENS, max_edits=8), CHUNKS)
def test_mutated_generated_logs_long(job, edits, chunk):
    _job_case(job, edits, chunk)


@pytest.mark.slow
@slow(600)
@given(_long_lines())
def test_lines_of_repeated_format_words_long(lines):
    _check_bytes([("long.log", "".join(lines).encode())], None, f"{lines!r:.300}")


# ------------------------------------------------------------------ hostile classes
#
# Each class below generates inputs whose right outcome is known per line, and asserts: no
# traceback (and no hang: the CPU-time limit), no event whose op differs from the line's real
# op (a line with no real op gives no event), and every line that gives no event gives an
# issue naming its file and line.

OPS = sorted(fmt.NCCL_OP_NAMES)
PREFIX = "node-01:100:100 [0] NCCL INFO "
#: Characters a look-alike puts inside or around an op name: punctuation, blanks, zero-width
#: and other invisible characters, letters of other scripts, digits, NUL, lone ESC.
JUNK = ["-", "_", ".", ",", ";", ":", "/", "\\", "|", "'", "(", ")", "[", "]", " ", "  ", "\t",
        "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u00a0", "\u202f", "\u3000",
        "\u00e9", "\u0301", "\u0410", "\u03b1", "\U0001d400", "\U0001F600", "5", "0x", "\x00",
        "\x1b", "\ufffd", "\u200e", "\u202e"]
#: Letters replaced by a character that looks the same (other scripts, fullwidth).
HOMOGLYPHS = {"A": "\u0391\u0410\uff21", "a": "\u0430\u03b1", "e": "\u0435\u0451\uff45",
              "c": "\u0441\u03f2", "o": "\u043e\u03bf", "l": "\u04cf\u0399\u217c",
              "d": "\u0501\u217e", "S": "\u0405\uff33", "G": "\u050c", "R": "\u13a1",
              "t": "\u0442", "r": "\u0433", "v": "\u03bd", "n": "\u0578", "s": "\u0455",
              "h": "\u04bb", "B": "\u0392", "T": "\u03a4"}
#: Terminal colours: presentation, the line's op is the name they wrap.
COLOURS = ["\x1b[0m", "\x1b[1;32m", "\x1b[38;5;208m", "\x1b]0;title\x07", "\x1b7"]


def _coll(op: str, count: int = 64, comm: str = "0xc0") -> str:
    return (f"{op}: opCount 1a sendbuff 0x1 recvbuff 0x2 count {count} datatype 7 op 0 "
            f"root 0 comm {comm} [nranks=2] stream 0x5")


@st.composite
def _lookalike(draw) -> tuple[str, str | None]:
    """``(line, real op name or None)``: a COLL line whose op name is damaged or dressed."""
    name = draw(st.sampled_from(OPS))
    prefixed = draw(st.booleans())
    how = draw(st.sampled_from(["inside", "homoglyph", "before", "after", "colour", "clean"]))
    junk = "".join(draw(st.lists(st.sampled_from(JUNK), min_size=1, max_size=3)))
    real: str | None = None
    if how == "inside":
        at = draw(st.integers(1, len(name) - 1))
        op = name[:at] + junk + name[at:]
    elif how == "homoglyph":
        spots = [i for i, ch in enumerate(name) if ch in HOMOGLYPHS]
        i = draw(st.sampled_from(spots))
        op = name[:i] + draw(st.sampled_from(HOMOGLYPHS[name[i]])) + name[i + 1:]
    elif how == "before":
        op = junk + name
        real = None if prefixed else name  # without a prefix: foreign text, or an issue
    elif how == "after":
        op = name + junk
    elif how == "colour":
        colour = draw(st.sampled_from(COLOURS))
        at = draw(st.integers(0, len(name)))
        op, real = name[:at] + colour + name[at:], name
    else:
        op, real = name, name
    return (PREFIX if prefixed else "") + _coll(op), real


def _assert_outcomes(res, file: str, reals: list[str | None]) -> None:
    """Per line ``i`` (1-based): events only of its real op, and an event or an issue."""
    by_line: dict[int, list[str]] = {}
    for row in res.table.select(["op", "source_ref"]).to_pylist():
        name, _, line = row["source_ref"].rpartition(":")
        assert name == file
        by_line.setdefault(int(line), []).append(row["op"])
    issued = {i.line_no for i in res.issues if i.file == file}
    for i, real in enumerate(reals, 1):
        ops = by_line.get(i, [])
        want = [] if real is None else [fmt.NCCL_OP_NAMES[real]]
        assert ops in ([], want), (i, real, ops)
        if not ops:
            assert i in issued, (i, real, "no event and no issue")


def _lookalike_case(lines: list[tuple[str, str | None]]) -> None:
    text = "".join(line + "\n" for line, _ in lines)
    reals = [real for _, real in lines]
    with time_limit(LIMIT_S, f"{lines!r:.300}"), tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lookalikes.log"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        _assert_outcomes(nccl_logs_to_table(path), str(path), reals)
        _assert_outcomes(nccl_logs_to_table([("mem", [ln + "\n" for ln, _ in lines])]), "mem",
                         reals)
        _check_bytes([("lookalikes.log", text.encode("utf-8", "surrogateescape"))], None,
                     "look-alikes")


@fast(25)
@given(st.lists(_lookalike(), min_size=1, max_size=12))
def test_op_name_lookalikes_never_become_events_of_another_op(lines):
    _lookalike_case(lines)


GARBAGE = ["\ufeff", "\ufeff\ufeff", "\x1b[32m", "\x1b[0m\x1b[1;36m", "\x1b]0;t\x07", "\r",
           "\x00", "\x00" * 7, "\x1b7"]


@st.composite
def _dressed_job(draw) -> tuple[list[str], int]:
    """Lines of one process (an INIT line, COLL lines) with garbage before their prefix,
    some records glued after another; ``(lines, records)``."""
    lines = [draw(st.sampled_from(GARBAGE + [""])) + PREFIX
             + "comm 0xc0 rank 1 nranks 2 cudaDev 0 busId 1000 commId 0x55 - Init COMPLETE"]
    n = draw(st.integers(1, 8))
    for k in range(n):
        junk = "".join(draw(st.lists(st.sampled_from(GARBAGE), min_size=1, max_size=3)))
        record = junk + PREFIX + _coll(draw(st.sampled_from(OPS)), count=k)
        if lines and draw(st.integers(0, 3)) == 0:
            # another record on the same physical line: BOM, CR, NUL separate it from the
            # text before; colours are removed, so a collector's blank does (no blank: the
            # host would carry the text before, as documented for glued records)
            if not any(c in junk for c in "\ufeff\r\x00"):
                record = " " + record
            lines[-1] += record
        else:
            lines.append(record)
    return lines, n


@fast(50)
@given(_dressed_job())
def test_garbage_before_prefixes_is_removed_and_counted(job):
    lines, n = job
    with time_limit(LIMIT_S, f"{lines!r:.300}"), tempfile.TemporaryDirectory() as d:
        path = Path(d) / "dressed.log"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        for source in (path, [("mem", [ln + "\n" for ln in lines])]):
            res = nccl_logs_to_table(source)
            rows = res.table.select(["host", "pid", "rank", "group_id", "count"]).to_pylist()
            assert [r["count"] for r in rows] == list(range(n)), res.issues
            assert {(r["host"], r["pid"], r["rank"], r["group_id"]) for r in rows} == {
                ("node-01", 100, 1, "0x55")}, rows
            assert res.issues == [] and sum(res.stats.stripped.values()) > 0


def _gzip_case(text: bytes, cut: float | None, garbage: bytes | None) -> None:
    import gzip

    with time_limit(LIMIT_S, f"gzip cut={cut}"), tempfile.TemporaryDirectory() as d:
        plain, packed = Path(d) / "plain.log", Path(d) / "packed.bin"
        plain.write_bytes(text)
        blob = gzip.compress(garbage if garbage is not None else text)
        if cut is not None:
            blob = blob[:int(len(blob) * cut)]
        packed.write_bytes(blob)
        res = nccl_logs_to_table(packed)  # no traceback, whatever the bytes
        assert res.files + [f for f, _ in res.unread] in ([str(packed)], [str(packed)] * 2)
        if garbage is not None or len(blob) < 2:  # not gzip at all: a line of text, or none
            return

        def rows(table, path):  # a file's own name is in its local group ids
            ids = [g and g.replace(str(path), "<file>") for g in table["group_id"].to_pylist()]
            return table.drop_columns(["source_ref", "group_id"]).append_column(
                "group_id", pa.array(ids, pa.string()))

        ref = rows(nccl_logs_to_table(plain).table, plain)
        got = rows(res.table, packed)
        if cut is None or cut == 1:
            assert got.equals(ref) and res.unread == []
        else:  # what was read is the start of the log; the file is named
            assert got.num_rows <= ref.num_rows
            assert got.equals(ref.slice(0, got.num_rows)), (got.num_rows, ref.num_rows)
            assert [f for f, _ in res.unread] == [str(packed)]
            assert any(i.file == str(packed) for i in res.issues)


@fast(40)
@given(FIXTURE_NAMES, st.one_of(st.none(), st.floats(0, 1)), st.booleans(),
       st.binary(max_size=3000))
def test_gzip_valid_truncated_or_of_garbage(name, cut, garbage, noise):
    _need_fixtures()
    text = (SHARED_FIXTURES / "nccl" / name).read_bytes() * 20
    _gzip_case(text, cut, noise if garbage else None)


@fast(25)
@given(st.lists(st.sampled_from(["good", "binary", "fifo", "broken", "dirlink", "gzip", "empty",
                                 "crashed", "garbage.gz"]), min_size=1, max_size=7))
def test_folders_mixing_good_binary_and_unreadable_files(kinds):
    import gzip

    _need_fixtures()
    text = (SHARED_FIXTURES / "nccl" / "nccl_coll_tp_allgather_reducescatter__"
            "torchtitan_issue1369.log").read_bytes()
    with time_limit(LIMIT_S, f"{kinds}"), tempfile.TemporaryDirectory() as d:
        folder = Path(d) / "logs"
        folder.mkdir()
        readable, events = set(), 0
        for i, kind in enumerate(kinds):
            p = folder / f"{i:02d}.{kind}"
            if kind == "good":
                p.write_bytes(text)
            elif kind == "crashed":
                p.write_bytes(b"\0" * 64 + text)
            elif kind == "gzip":
                p.write_bytes(gzip.compress(text))
            elif kind == "binary":
                p.write_bytes(b"PAR1\0\x15" * 40)
            elif kind == "garbage.gz":
                p.write_bytes(gzip.compress(bytes(range(256)) * 8))
            elif kind == "empty":
                p.write_bytes(b"")
            elif kind == "fifo":
                os.mkfifo(p)
            elif kind == "broken":
                p.symlink_to(Path(d) / "absent")
            else:
                p.symlink_to(Path(d))
            if kind in ("good", "crashed", "gzip", "empty"):
                readable.add(str(p))
                events += 7 * (kind != "empty")
        res = nccl_logs_to_table(folder)
        assert set(res.files) == readable and res.table.num_rows == events
        named = {f for f, _ in res.unread}
        assert named == {str(folder / f"{i:02d}.{k}") for i, k in enumerate(kinds)} - readable
        assert named <= {i.file for i in res.issues if i.line_no == 0}
        out = Path(d) / "e.parquet"
        from tracer.cli import main

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = main(["nccl", str(folder), "--out", str(out)])
        assert rc == (3 if not events else 2 if named else 0)


@st.composite
def _stamp(draw) -> tuple[str, int | None]:
    """``([timestamp] text, its UTC ns or None when it is no time)``."""
    import datetime as dt

    when = draw(st.datetimes(min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(2200, 1, 1)))
    hh, mm = draw(st.integers(0, 25)), draw(st.sampled_from([0, 15, 30, 45, 60, 99]))
    sign = draw(st.sampled_from("+-"))
    zone = draw(st.sampled_from(["", "Z", "UTC", " UTC", "hh", "hhmm", "hh:mm", " hh:mm"]))
    frac = draw(st.sampled_from(["", ".5", ".123456", ",25", ".123456789123"]))
    sep = draw(st.sampled_from([" ", "T"]))
    text = when.strftime(f"%Y-%m-%d{sep}%H:%M:%S") + frac
    offset = 0
    if "hh" in zone:
        ztext = zone.replace("hh", f"{sign}{hh:02d}").replace("mm", f"{mm:02d}")
        text += ztext
        offset = (1 if sign == "+" else -1) * (hh * 3600 + (mm if "mm" in zone else 0) * 60)
        if hh > 23 or ("mm" in zone and mm > 59):
            return f"[{text}] ", None
    else:
        text += zone
    frac_ns = int((frac[1:] + "0" * 9)[:9]) if frac else 0
    utc = when.replace(tzinfo=dt.timezone.utc).timestamp()
    return f"[{text}] ", (int(utc) - offset) * 10**9 + frac_ns


@fast(80)
@given(st.lists(_stamp(), min_size=1, max_size=8))
def test_timestamps_with_zones_are_utc_or_an_issue(stamps):
    lines = [text + PREFIX + _coll("AllReduce", count=i) for i, (text, _) in enumerate(stamps)]
    with time_limit(LIMIT_S, f"{stamps!r:.300}"):
        res = nccl_logs_to_table([("mem", [ln + "\n" for ln in lines])])
        got = res.table.column("t_start_ns").to_pylist()
        issued = {i.line_no for i in res.issues}
        assert len(got) == len(stamps)  # the event is kept either way
        for k, ((_, want), t) in enumerate(zip(stamps, got), 1):
            if want is None or not -(2**63) <= want < 2**63:
                assert t is None and k in issued, (k, stamps[k - 1], t)
            else:
                assert t == want and k not in issued, (k, stamps[k - 1], t, want)
        assert_same([("mem", lines)], [("mem", lines)])


@fast(60)
@given(st.lists(st.tuples(st.sampled_from(["count", "root", "nranks", "pid", "cudaDev"]),
                          st.integers(1, 60)), min_size=1, max_size=6))
def test_oversized_numbers_are_issues_naming_the_field(fields):
    lines, big = [], []
    for field, digits in fields:
        number = "9" * digits
        line = PREFIX + _coll("Broadcast")
        if field == "count":
            line = line.replace("count 64", f"count {number}")
        elif field == "root":
            line = line.replace("root 0", f"root {number}")
        elif field == "nranks":
            line = line.replace("[nranks=2]", f"[nranks={number}]")
        elif field == "pid":
            line = line.replace(":100:100 ", f":{number}:100 ")
        else:
            line = line.replace("[0] NCCL", f"[{number}] NCCL")
        lines.append(line)
        limit = {"count": 2**63 // 4, "pid": 2**63}.get(field, 2**31)
        big.append((field, int(number) >= limit))
    with time_limit(LIMIT_S, f"{fields}"):
        res = nccl_logs_to_table([("mem", [ln + "\n" for ln in lines])])
        refs = {int(r.rpartition(":")[2]) for r in res.table.column("source_ref").to_pylist()}
        for k, (field, over) in enumerate(big, 1):
            issues = [i for i in res.issues if i.line_no == k]
            if over:
                assert k not in refs and issues, (k, field)
                word = {"cudaDev": "cudaDev", "pid": "pid"}.get(field, field)
                assert issues[0].reason.startswith((word, "count * dtype bytes", "the 'host"))
                assert len(issues[0].text) <= fmt.EXCERPT_CHARS + 40
            elif field == "root":  # fits int32 but not [nranks=2]: an impossible call
                assert k not in refs and "impossible COLL line" in issues[0].reason, (k, issues)
            else:
                assert k in refs and not issues, (k, field, issues)
        assert_same([("mem", lines)], [("mem", lines)])


@pytest.mark.slow
@slow(600)
@given(st.lists(_lookalike(), min_size=1, max_size=30))
def test_op_name_lookalikes_long(lines):
    _lookalike_case(lines)


@pytest.mark.slow
@slow(400)
@given(FIXTURE_NAMES, st.one_of(st.none(), st.floats(0, 1)), st.booleans(),
       st.binary(max_size=20000))
def test_gzip_long(name, cut, garbage, noise):
    _need_fixtures()
    _gzip_case((SHARED_FIXTURES / "nccl" / name).read_bytes() * 20, cut,
               noise if garbage else None)
