"""Fuzzing ``dmuon-verify check``: mutated event tables (rows dropped, duplicated,
altered; columns retyped or nulled; bytes of the Parquet file damaged). Every input must give
exit 0 / 1 with each difference named, or exit 2 with a message: never a traceback. With
``--steps`` fixed, the named differences must add up exactly to the rows dropped and added."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import apply, fast, mutations, slow, time_limit
from tests.builders import CHECK_LAYOUT, measured
from tracer.events import to_table, write_parquet
from verify.check import check_events
from verify.cli import main as dmuon_verify

STEPS = 2
EVENTS = measured(STEPS)
FIELDS = ("rank", "op", "count", "dtype", "group_size", "root", "phase", "group_id")


def _run_cli(args: list[str], what: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            time_limit(20, what):
        try:
            rc = dmuon_verify(args)
        except SystemExit as exc:  # argparse
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


@st.composite
def row_edits(draw):
    n = len(EVENTS)
    drop = draw(st.sets(st.integers(0, n - 1), max_size=6))
    dup = draw(st.lists(st.integers(0, n - 1), max_size=6))
    return sorted(drop), dup


def _multiset_property(drop, dup):
    events = [ev for i, ev in enumerate(EVENTS) if i not in drop]
    events += [EVENTS[i].replace(source_ref=f"dup#{k}") for k, i in enumerate(dup)]
    with time_limit(20, f"events with rows {drop} dropped and {dup} duplicated"):
        result = check_events(events, CHECK_LAYOUT, STEPS)
    missing = sum(n for _, n in result["missing"])
    unexpected = sum(n for _, n in result["unexpected"])
    key = lambda ev: tuple(getattr(ev, f) for f in FIELDS)  # noqa: E731
    delta = Counter(map(key, EVENTS))
    delta.subtract(Counter(map(key, events)))
    assert missing == sum(v for v in delta.values() if v > 0)
    assert unexpected == sum(-v for v in delta.values() if v < 0)
    assert result["pass"] == (missing == unexpected == 0 and not result["partial"])
    refs = [r for call in result["unexpected_calls"] for r in call["source_refs"]]
    assert len(refs) == unexpected


@fast(40)
@given(edits=row_edits())
def test_dropped_and_duplicated_rows_are_counted_exactly(edits):
    _multiset_property(*edits)


COLUMN_MUTATIONS = st.sampled_from([
    ("count", lambda a: pa.array([None if x is None else float(x) for x in a.to_pylist()])),
    ("count", lambda a: pa.array([None if x is None else str(x) for x in a.to_pylist()])),
    ("rank", lambda a: pa.array([None if x is None else str(x) for x in a.to_pylist()])),
    ("rank", lambda a: pa.array([None] * len(a), pa.int32())),
    ("phase", lambda a: pa.array([None] + a.to_pylist()[1:], pa.string())),
    ("op", lambda a: pa.array(["nonsense"] + a.to_pylist()[1:])),
    ("count", lambda a: pa.array([-1] + a.to_pylist()[1:], pa.int64())),
    ("msg_bytes", lambda a: pa.array([7] + a.to_pylist()[1:], pa.int64())),
    ("group_id", lambda a: pa.array([None] + a.to_pylist()[1:], pa.string())),
    ("source_ref", lambda a: pa.array([None] + a.to_pylist()[1:], pa.string())),
])
ROW_CHANGES = st.lists(st.tuples(
    st.integers(0, len(EVENTS) - 1),
    st.sampled_from(["count", "rank", "op", "phase", "dtype", "root"]),
    st.one_of(st.none(), st.integers(-5, 2 ** 31), st.sampled_from(["broadcast", "x", "backward"]))),
    max_size=4)


def _cli_case(column_mutation, row_changes, steps, byte_edits):
    events = list(EVENTS)
    for i, name, value in row_changes:
        try:
            events[i] = events[i].replace(**{name: value})
        except (ValueError, TypeError):
            pass  # not a representable event: the column mutations cover bad types
    table = to_table(events)
    if column_mutation is not None:
        name, change = column_mutation
        table = table.set_column(table.schema.get_field_index(name), name, change(table.column(name)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.parquet"
        pq.write_table(table, path)
        if byte_edits:
            path.write_bytes(apply(path.read_bytes(), byte_edits))
        (Path(tmp) / "layout.json").write_text(json.dumps(CHECK_LAYOUT.to_dict()))
        args = ["check", str(path), "--against", tmp] + ([] if steps is None else ["--steps", str(steps)])
        what = (f"table with column {column_mutation[0] if column_mutation else None!r} mutated, "
                f"row changes {row_changes!r}, byte edits {byte_edits!r}, steps {steps}")
        rc, out, err = _run_cli(args, what)
    assert rc in (0, 1, 2), (rc, out, err)
    if rc == 2:
        assert err.strip() and not out.strip()
    else:
        assert out.rstrip().endswith("PASS" if rc == 0 else "FAIL") and not err


@fast(40)
@given(column_mutation=st.none() | COLUMN_MUTATIONS, row_changes=ROW_CHANGES,
       steps=st.none() | st.integers(-1, 3), byte_edits=st.just([]) | mutations(max_edits=2))
def test_mutated_tables_exit_0_1_or_2_without_traceback(column_mutation, row_changes, steps, byte_edits):
    _cli_case(column_mutation, row_changes, steps, byte_edits)


@pytest.mark.slow
@slow(2000)
@given(column_mutation=st.none() | COLUMN_MUTATIONS, row_changes=ROW_CHANGES,
       steps=st.none() | st.integers(-1, 3), byte_edits=st.just([]) | mutations(max_edits=4))
def test_mutated_tables_long(column_mutation, row_changes, steps, byte_edits):
    _cli_case(column_mutation, row_changes, steps, byte_edits)


@pytest.mark.slow
@slow(2000)
@given(edits=row_edits())
def test_dropped_and_duplicated_rows_long(edits):
    _multiset_property(*edits)


def test_unmutated_table_passes(tmp_path):
    write_parquet(EVENTS, tmp_path / "e.parquet")
    (tmp_path / "layout.json").write_text(json.dumps(CHECK_LAYOUT.to_dict()))
    assert _run_cli(["check", str(tmp_path / "e.parquet"), "--against", str(tmp_path)],
                    "the unmutated table")[0] == 0
