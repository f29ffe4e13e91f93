"""Fuzzing the Flight Recorder parser: byte-level mutations of the real dumps (JSON
and pickled) and grammar-generated dumps. Every input must give events that write to Parquet
plus listed issues, or a documented ``ValueError``: no other exception, no hang (per-input
limit), nothing dropped silently, and a pickle never calls anything."""

from __future__ import annotations

import json
import math
import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import apply, fast, mutations, slow, time_limit
from tracer.events import write_parquet
from tracer.fr.parse import FR_DTYPES, FR_OPS, read_flight_recorder, summary_lines

FIXTURES = ("flight_recorder/torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_json_rank0.json",
            "flight_recorder/torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_pickle_rank0.as_json.json")
LIMIT_S = 10.0


@pytest.fixture(scope="module")
def seeds(shared_fixtures) -> list[bytes]:
    """The real dumps as JSON bytes and as pickles (protocol 2, as torch writes, and 5)."""
    out = []
    for name in FIXTURES:
        raw = (shared_fixtures / name).read_bytes()
        dump = json.loads(raw)
        out += [raw, pickle.dumps(dump, protocol=2), pickle.dumps(dump, protocol=5)]
    return out


def _parse_and_write(raw: bytes, what: str) -> None:
    """The property every input must satisfy (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fr_rank1.json"
        path.write_bytes(raw)
        with time_limit(LIMIT_S, what):
            try:
                read = read_flight_recorder(path)
            except ValueError as exc:
                assert str(path) in str(exc)  # a file-level error names the file
                return
            write_parquet(read.events, Path(tmp) / "events.parquet")
            "\n".join(summary_lines(read)).encode("utf-8")  # printable as it is
        for issue in read.unreadable + read.warnings:
            assert issue.startswith(str(path))


def _check(seeds, seed_index, edits):
    seed = seed_index % len(seeds)
    _parse_and_write(apply(seeds[seed], edits),
                     f"seed {seed} (of {len(seeds)}) mutated by {edits!r}")


@fast(60)
@given(seed_index=st.integers(0, 5), edits=mutations(max_edits=4))
def test_byte_mutations_of_real_dumps(seeds, seed_index, edits):
    _check(seeds, seed_index, edits)


@pytest.mark.slow
@slow(3000)
@given(seed_index=st.integers(0, 5), edits=mutations(max_edits=12))
def test_byte_mutations_of_real_dumps_long(seeds, seed_index, edits):
    _check(seeds, seed_index, edits)


# --------------------------------------------------------------------------- grammar
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 80), 2 ** 80) | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
SHAPE = st.lists(st.integers(0, 2 ** 70) | st.integers(0, 64), max_size=3)
PLAUSIBLE = {
    "profiling_name": st.builds(lambda b, op, meta: f"{b}:{op}{meta}", st.sampled_from(["gloo", "nccl", ""]),
                                st.sampled_from(sorted(FR_OPS) + ["bogus"]),
                                st.sampled_from(["", " 0->1", " 1<-0", " 0->99999999999"])),
    "process_group": st.lists(st.sampled_from(["0", "1", "", "\udc80"]), min_size=0, max_size=2),
    "input_sizes": st.lists(SHAPE, max_size=3),
    "output_sizes": st.lists(SHAPE, max_size=3),
    "input_dtypes": st.lists(st.sampled_from(sorted(FR_DTYPES) + ["Nope"]), max_size=3),
    "output_dtypes": st.lists(st.sampled_from(sorted(FR_DTYPES)), max_size=3),
    "collective_seq_id": st.integers(0, 2 ** 64),
    "is_p2p": st.booleans(),
    "state": st.sampled_from(["scheduled", "completed"]),
    "time_created_ns": st.integers(0, 2 ** 70) | st.floats(),
    "time_discovered_completed_ns": st.integers(0, 2 ** 64),
}
RANKS = st.lists(st.integers(-1, 2 ** 40), max_size=4)


@st.composite
def entries(draw, index: int):
    entry = {}
    for key, plausible in PLAUSIBLE.items():
        choice = draw(st.integers(0, 9))
        if choice < 7:
            entry[key] = draw(plausible)
        elif choice < 9:
            entry[key] = draw(JUNK)
    # unique valid record ids, or junk that is never a valid one (so accounting is exact)
    entry["record_id"] = index if draw(st.booleans()) or index % 3 else draw(
        st.none() | st.text(max_size=3) | st.floats() | st.integers(max_value=-1)
        | st.integers(min_value=2 ** 63))
    return entry


@st.composite
def dumps(draw):
    n = draw(st.integers(0, 6))
    entry_list = [draw(entries(i)) if draw(st.integers(0, 9)) else draw(JUNK) for i in range(n)]
    dump = {"version": "2.10", "pg_status": {}, "entries": entry_list}
    if draw(st.booleans()):
        dump["pg_config"] = draw(st.dictionaries(
            st.sampled_from(["", "0", "1"]),
            st.fixed_dictionaries({"ranks": RANKS.map(str) | RANKS | JUNK}) | JUNK, max_size=2) | JUNK)
    if draw(st.booleans()):
        dump["dmuon"] = draw(st.fixed_dictionaries(
            {}, optional={"rank": st.integers(-1, 2 ** 40) | JUNK, "pid": st.integers(0, 2 ** 70),
                          "host": st.text(max_size=5), "pg_ranks": st.dictionaries(
                              st.sampled_from(["0", "1"]), RANKS | JUNK, max_size=2) | JUNK}) | JUNK)
    return dump


def _serialise(dump: dict, as_pickle: bool) -> bytes:
    if as_pickle:
        return pickle.dumps(dump)
    return json.dumps(dump).encode("utf-8", errors="surrogatepass")


def _grammar(dump, as_pickle):
    raw = _serialise(dump, as_pickle)
    _parse_and_write(raw, f"generated dump ({'pickle' if as_pickle else 'JSON'}) {dump!r:.300}")
    with tempfile.TemporaryDirectory() as tmp:  # nothing dropped silently: exact accounting
        path = Path(tmp) / "fr.json"
        path.write_bytes(raw)
        read = read_flight_recorder(path)
        produced = {ev.source_ref.split("#")[-1].split(".")[0] for ev in read.events}
        assert len(produced) + len(read.unreadable) == len(dump["entries"])
        for ev in read.events:
            assert ev.t_start_ns is None or (isinstance(ev.t_start_ns, int) and ev.t_start_ns > 0)
            assert ev.count is None or 0 <= ev.count < 2 ** 63
            assert ev.msg_bytes is None or ev.msg_bytes < 2 ** 63
            assert not (isinstance(ev.t_start_ns, float) and math.isnan(ev.t_start_ns))


@fast(80)
@given(dump=dumps(), as_pickle=st.booleans())
def test_grammar_generated_dumps(dump, as_pickle):
    _grammar(dump, as_pickle)


@pytest.mark.slow
@slow(3000)
@given(dump=dumps(), as_pickle=st.booleans())
def test_grammar_generated_dumps_long(dump, as_pickle):
    _grammar(dump, as_pickle)
