"""Fuzzing the nsys export parser: byte-level mutations of the real export and
grammar-generated exports (the real DDL, rows of every SQLite type). Every input must parse to
events that write to Parquet (with damaged rows listed) or raise the documented ``ValueError``
naming the file: no other exception, no hang (per-input limit)."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import apply, fast, mutations, slow, time_limit
from tests.nsys_builders import REAL, global_tid, nsys_ddl
from tracer.events import write_parquet
from tracer.nsys.parse import NCCL_API_TO_OP, parse_nsys

LIMIT_S = 20.0


@pytest.fixture(scope="module")
def real_bytes(shared_fixtures) -> bytes:
    return (shared_fixtures / REAL).read_bytes()


@pytest.fixture(scope="module")
def ddl(shared_fixtures) -> dict[str, str]:
    return nsys_ddl(shared_fixtures)


def _parse_and_write(path: Path, what: str) -> None:
    with time_limit(LIMIT_S, what):
        try:
            res = parse_nsys(path)
        except ValueError as exc:
            assert path.name in str(exc)
            return
        write_parquet(res.events, path.with_suffix(".parquet"))
        res.details.to_parquet(path.with_suffix(".details.parquet"))
        res.kernels.to_parquet(path.with_suffix(".kernels.parquet"))
        res.summary().encode("utf-8")
    for issue in res.issues:
        assert issue.startswith(f"{path.name}#") and "column" in issue or "UTF-8" in issue


def _mutated(real_bytes, edits):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mutated.sqlite"
        path.write_bytes(apply(real_bytes, edits))
        _parse_and_write(path, f"{REAL} mutated by {edits!r}")


# The header and schema pages come first: aim some of the edits (flips, byte replacements)
# at the first 2 % of the file.
NEAR_START = 0.02


@fast(5)
@given(edits=mutations(max_edits=3, near_start=NEAR_START))
def test_byte_mutations_of_the_real_export(real_bytes, edits):
    _mutated(real_bytes, edits)


@pytest.mark.slow
@slow(300)
@given(edits=mutations(max_edits=8, near_start=NEAR_START))
def test_byte_mutations_of_the_real_export_long(real_bytes, edits):
    _mutated(real_bytes, edits)


def test_a_schema_byte_that_breaks_sqlites_error_text_is_a_clear_error(real_bytes):
    """Found by the long profile: 0x80 in the schema page makes SQLite's own error message
    undecodable (UnicodeDecodeError from ``execute``); it must name the file like any damage."""
    _mutated(real_bytes, [("set", 0.016304164917378693, b"\x80")])


# --------------------------------------------------------------------------- grammar
ANY = (st.none() | st.integers(-(2 ** 63), 2 ** 63 - 1) | st.floats(allow_nan=True)
       | st.text(max_size=6) | st.binary(max_size=6))
SMALL_INT = st.integers(0, 10_000)
NAMES = st.sampled_from(sorted(NCCL_API_TO_OP) + [
    "ncclGroupStart", "ncclGroupEnd", "NCCL", "DMuon", "dmuon.phase forward", "dmuon.phase x y",
    "dmuon.broadcast blocks.0 owner=1", "dmuon.window w", "dmuon.reduce m owner=99999999999"])
GTIDS = st.sampled_from([global_tid(10, 10), global_tid(10, 11), global_tid(20, 20), 0])
SOMETIMES = lambda good: good | good | good | ANY  # noqa: E731 - mostly plausible, sometimes any


@st.composite
def exports(draw):
    nvtx = draw(st.lists(st.tuples(
        SOMETIMES(SMALL_INT), SOMETIMES(SMALL_INT | st.none()),
        SOMETIMES(st.sampled_from([59, 60, 75])), SOMETIMES(NAMES | st.text(max_size=8)),
        SOMETIMES(GTIDS), SOMETIMES(st.sampled_from([0, 1, 3, 4]))), max_size=25))
    kernels = draw(st.lists(st.tuples(
        SOMETIMES(SMALL_INT), SOMETIMES(SMALL_INT), SOMETIMES(st.integers(0, 3)),
        SOMETIMES(st.integers(0, 8)), SOMETIMES(GTIDS), st.sampled_from([1, 2])), max_size=6))
    runtime = draw(st.lists(st.tuples(
        SOMETIMES(SMALL_INT), SOMETIMES(SMALL_INT), SOMETIMES(GTIDS), SOMETIMES(st.integers(0, 8)),
        st.just(3)), max_size=6))
    return nvtx, kernels, runtime


def _build(path: Path, ddl, nvtx, kernels, runtime) -> None:
    """Rows inserted as drawn: SQLite keeps any type in any column (type affinity only)."""
    conn = sqlite3.connect(path)
    for sql in ddl.values():
        conn.execute(sql.replace("NOT NULL", ""))
    conn.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)",
                     [("EXPORT_SCHEMA_VERSION", "3.25.0"), ("EXPORT_PARAM_INCLUDE_BLOBS", "false")])
    conn.executemany("INSERT INTO StringIds VALUES (?, ?)",
                     [(1, "ncclDevKernel_AllReduce_RING_LL"), (2, "ncclKernel_x"), (3, "cuLaunchKernel")])
    conn.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) "
                     "VALUES (?,?,?,?,?,?)", nvtx)
    conn.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, correlationId, "
                     "globalPid, shortName, demangledName) VALUES (?,?,?,?,?,?,?)",
                     [(*k, k[-1]) for k in kernels])
    conn.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME (start, end, globalTid, correlationId, "
                     "nameId) VALUES (?,?,?,?,?)", runtime)
    conn.commit()
    conn.close()


def _generated(ddl, export):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "generated.sqlite"
        _build(path, ddl, *export)
        with time_limit(LIMIT_S, f"generated export {export!r:.300}"):
            res = parse_nsys(path)  # a well-formed file: no error at all, whatever the rows
        write_parquet(res.events, path.with_suffix(".parquet"))
        res.details.to_parquet(path.with_suffix(".details.parquet"))
        res.kernels.to_parquet(path.with_suffix(".kernels.parquet"))
        res.summary().encode("utf-8")
        nccl_rows = sum(1 for row in export[0] if row[3] in NCCL_API_TO_OP)
        assert len(res.events) <= nccl_rows


@fast(30)
@given(export=exports())
def test_grammar_generated_exports(ddl, export):
    _generated(ddl, export)


@pytest.mark.slow
@slow(2000)
@given(export=exports())
def test_grammar_generated_exports_long(ddl, export):
    _generated(ddl, export)
