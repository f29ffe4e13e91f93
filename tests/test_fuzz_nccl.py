"""Fuzzing the NCCL_DEBUG=INFO parser (issue 11): byte-level mutations of every real fixture
in ../shared/fixtures/nccl/, grammar-generated logs (INIT formats 2.4 ... 2.29+, COLL lines
2.18 ... 2.30, 2.26+ timestamps, PyTorch comm lines; tests/tools/nccl_reference.py) mutated
the same way, and lines of repeated format words (long-line shapes).

Every input must give a defined outcome: events and issues, never an exception (strict mode:
only :class:`tracer.nccl.log.NcclLogError`, carrying the first issue); no hang (each input has
a CPU-time limit, tests/fuzzing.py); and the columnar reader (RE2 + numpy fast path, in-memory
blocks, Parquet writer) equals the line-by-line reference, as files read in small chunks and
as in-memory lines. The default run (300 derandomized inputs) takes about 10 s on an idle
machine (40 s at load 15); the ``slow`` variants (``make test-all``, 3,000 random inputs)
about ten times that.
"""

from __future__ import annotations

import io
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SHARED_FIXTURES
from tests.fuzzing import apply, fast, mutations, slow, time_limit
from tests.tools.nccl_reference import assert_same, jobs, text_lines
from tracer.nccl import columns as nccl_columns
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


@fast(160)
@given(FIXTURE_NAMES, mutations(TOKENS), CHUNKS)
def test_mutated_fixtures(name, edits, chunk):
    _need_fixtures()
    _fixture_case(name, edits, chunk)


@fast(80)
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


@fast(60)
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
