"""Flight Recorder parser on the real fixture dumps, its CLI, and the cross-check logic.

Fixtures (see ../shared/fixtures/SOURCES.md): produced on torch 2.13.0 CPU build, gloo,
4 ranks, rank 0's dumps:
- ``torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_json_rank0.json``: ``_dump_fr_trace_json()``
- ``torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_pickle_rank0.as_json.json``:
  ``_dump_fr_trace()`` unpickled and re-serialised as JSON.
"""

from __future__ import annotations

import argparse
import json
import pickle

from pathlib import Path

import pytest
import torch

from tracer.crosscheck import FLIGHT_RECORDER_GLOO, Equivalence, crosscheck
from tracer.events import CollectiveEvent, read_parquet
from tracer.fr.parse import (
    FR_DTYPES,
    register_cli,
    fr_window,
    flight_recorder_env,
    load_dump,
    read_flight_recorder,
    read_flight_recorder_paths,
)

JSON_DUMP = "flight_recorder/torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_json_rank0.json"
PICKLE_AS_JSON = (
    "flight_recorder/torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_pickle_rank0.as_json.json"
)
W = "0,1,2,3"


def cli_main(argv):
    """``dmuon-trace`` with only this module's subcommand (others are built elsewhere)."""
    parser = argparse.ArgumentParser(prog="dmuon-trace")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _rows(events):
    return [(e.op, e.seq, e.count, e.dtype, e.msg_bytes) for e in events]


def test_json_fixture_exact_events(shared_fixtures):
    read = read_flight_recorder(shared_fixtures / JSON_DUMP)
    once = [  # (op, seq offset, count, dtype, msg_bytes); seq = collective_seq_id - 1
        ("all_reduce", 0, 1000, "float32", 4000),
        ("all_reduce", 1, 100, "float32", 400),
        ("all_to_all", 2, 8, "float32", 32),  # input 32 over 4 ranks: 8 per peer
        ("reduce", 3, 50, "float32", 200),
        ("gather", 4, 5, "float32", 20),  # input [5], output [4, 5] (this rank is the root)
        ("scatter", 5, 6, "float32", 24),  # input [4, 6] (root), output [6]
        ("all_reduce", 6, 3, "float32", 12),  # all_reduce_coalesced of [3] and [4]:
        ("all_reduce", 6, 4, "float32", 16),  # one event per tensor, one seq
    ]
    expected = [(op, s, c, d, b) for op, s, c, d, b in once]
    expected += [(op, s + 7, c, d, b) for op, s, c, d, b in once]
    assert _rows(read.events) == expected
    assert {(e.rank, e.group_id, e.group_size, e.group_rank, e.comm) for e in read.events} == {
        (0, W, 4, 0, "0")
    }
    assert all(e.source == "flight_recorder" and e.root is None for e in read.events)
    assert read.events[0].source_ref == f"{shared_fixtures / JSON_DUMP}#0"
    assert [e.source_ref.rsplit("#")[1] for e in read.events[6:8]] == ["6.0", "6.1"]
    assert read.events[0].t_start_ns == 1795938099686074607 and read.events[0].t_end_ns is None
    assert read.unreadable == []
    assert read.states == {"scheduled": 14}


def test_pickle_as_json_fixture_exact_events(shared_fixtures):
    read = read_flight_recorder(shared_fixtures / PICKLE_AS_JSON)
    once = [
        ("all_reduce", 0, 1024, "float32", 4096),
        ("all_gather", 1, 256, "bfloat16", 512),  # input [256], output [4, 256]
        ("all_reduce", 2, 512, "float32", 2048),  # reduce_scatter_tensor, recorded so by gloo
        ("broadcast", 3, 300, "float64", 2400),
        ("all_gather", 4, 10, "int64", 80),
        ("barrier", 5, None, None, None),
    ]
    expected = once + [(op, s + 6, c, d, b) for op, s, c, d, b in once]
    assert _rows(read.events) == expected
    assert read.unreadable == []
    assert {(e.rank, e.group_id, e.group_size) for e in read.events} == {(0, W, 4)}


def _with_unknown_op(shared_fixtures, tmp_path) -> Path:
    """The JSON fixture with record 4 renamed to an op FR_OPS does not know."""
    dump = json.loads((shared_fixtures / JSON_DUMP).read_text())
    dump["entries"][4]["profiling_name"] = "gloo:allgather_future_op"
    path = tmp_path / "fr_rank0.json"
    path.write_text(json.dumps(dump))
    return path


def test_unsupported_entry_is_unreadable_and_strict_raises(shared_fixtures, tmp_path):
    path = _with_unknown_op(shared_fixtures, tmp_path)
    read = read_flight_recorder(path)
    assert len(read.unreadable) == 1 and "#4 (entry 4): unsupported op" in read.unreadable[0]
    assert "gloo:allgather_future_op" in read.unreadable[0]
    with pytest.raises(ValueError, match=r"Invalid Flight Recorder entry .*#4 \(entry 4\): unsupported op"):
        read_flight_recorder(path, strict=True)


def test_real_pickle_file_loads_like_json(shared_fixtures, tmp_path):
    dump = json.loads((shared_fixtures / PICKLE_AS_JSON).read_text())
    path = tmp_path / "nccl_trace_rank_2"  # FR's own file naming: rank from the name
    path.write_bytes(pickle.dumps(dump))
    read = read_flight_recorder(path)
    as_json = read_flight_recorder(shared_fixtures / PICKLE_AS_JSON)
    assert _rows(read.events) == _rows(as_json.events)
    assert {e.rank for e in read.events} == {2}
    assert {e.group_rank for e in read.events} == {2}


def test_pg_ranks_override_and_unknown_group(shared_fixtures, tmp_path):
    read = read_flight_recorder(shared_fixtures / PICKLE_AS_JSON, pg_ranks={"0": [4, 0, 6, 2]})
    assert {(e.group_id, e.group_size, e.group_rank) for e in read.events} == {("0,2,4,6", 4, 0)}
    dump = json.loads((shared_fixtures / PICKLE_AS_JSON).read_text())
    dump["pg_config"][""]["ranks"] = "[]"  # what a gloo subgroup member's dump holds
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(dump))
    read = read_flight_recorder(path)
    assert {(e.rank, e.group_id, e.group_size, e.comm) for e in read.events} == {
        (None, None, None, "0")
    }
    # all_gather still has its per-rank send count without the group size
    assert [e.count for e in read.events if e.op == "all_gather"] == [256, 10, 256, 10]


def test_fr_dtype_names_are_torch_scalar_type_names():
    # c10 ScalarType names are what tensor.type() prints: torch.<Name>Tensor.
    for fr_name, torch_name in FR_DTYPES.items():
        dtype = getattr(torch, torch_name, None)
        if dtype is None:
            continue  # e.g. complex32 has no torch attribute on every build
        if dtype == torch.complex32:
            continue  # torch.empty(..., dtype=complex32).type() is unsupported
        assert torch.empty(0, dtype=dtype).type() == f"torch.{fr_name}Tensor"


def test_bad_inputs_give_clear_errors(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="Invalid Flight Recorder dump .*notes.txt"):
        load_dump(bad)
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="missing keys 'version'/'pg_status'"):
        load_dump(other)
    with pytest.raises(ValueError, match="does not exist"):
        read_flight_recorder_paths([tmp_path / "missing"])
    read = read_flight_recorder_paths([tmp_path])
    assert read.events == [] and len(read.unreadable) == 2
    with pytest.raises(ValueError, match="buffer_entries=0"):
        flight_recorder_env(0)
    assert flight_recorder_env(64) == {"TORCH_FR_BUFFER_SIZE": "64"}


def test_cli_fr_writes_parquet_and_summary(shared_fixtures, tmp_path, capsys):
    out = tmp_path / "events.parquet"
    rc = cli_main(["fr", str(shared_fixtures / "flight_recorder"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    events = read_parquet(out)
    assert len(events) == 28 and {e.source for e in events} == {"flight_recorder"}
    assert events == read_flight_recorder_paths([shared_fixtures / "flight_recorder"]).events
    assert "2 dump(s), 28 events, ranks [0]" in printed and "gather" in printed
    assert "0,1,2,3" in printed
    unknown = _with_unknown_op(shared_fixtures, tmp_path)
    rc = cli_main(["fr", str(unknown), "--out", str(out), "--strict"])
    assert rc == 2 and "unsupported op" in capsys.readouterr().err
    rc = cli_main(["fr", str(shared_fixtures / JSON_DUMP), "--out", str(out), "--pg-ranks", "x"])
    assert rc == 2 and "Invalid --pg-ranks 'x'" in capsys.readouterr().err


def test_cli_fr_since_keeps_the_window_after_earlier_dumps(shared_fixtures, tmp_path, capsys):
    """A dump holds everything since the process started: --since the dumps taken at the
    window's start keeps only the newer events (a break-it trial fed a run's cumulative dumps
    to dmuon-verify check and got every earlier mode's calls as unexpected)."""
    dump = json.loads((shared_fixtures / JSON_DUMP).read_text())
    before = tmp_path / "before" / "fr_rank0.json"
    before.parent.mkdir()
    before.write_text(json.dumps({**dump, "entries": dump["entries"][:10]}))
    out = tmp_path / "window.parquet"
    rc = cli_main(["fr", str(shared_fixtures / JSON_DUMP), "--since", str(before.parent), "--out", str(out)])
    window = read_parquet(out)
    assert rc == 0 and f"--since: {len(window)} of 16 events are newer" in capsys.readouterr().out
    # the entries after the tenth (seq = collective_seq_id - 1 >= 10), a coalesced one as its events
    assert window and {e.seq for e in window} == {10, 11, 12, 13}
    rc = cli_main(["fr", str(before), "--since", str(shared_fixtures / JSON_DUMP), "--out", str(out)])
    assert rc == 3 and "no event is newer than the --since dumps'" in capsys.readouterr().err


def test_cli_fr_help_explains_inputs_outputs_columns(capsys):
    with pytest.raises(SystemExit):
        cli_main(["fr", "--help"])
    text = capsys.readouterr().out
    for word in ("_dump_fr_trace_json", "pickle", "Parquet", "group_id", "count", "msg_bytes",
                 "source_ref", "reduce_scatter_tensor"):
        assert word in text


# --------------------------------------------------------------------------- crosscheck
def _ref(op, seq, count, dtype, *, rank=0, gid=W, n=4, root=None):
    return CollectiveEvent(source="interposer", op=op, rank=rank, group_id=gid, group_size=n,
                           seq=seq, count=count, dtype=dtype, root=root)


def _fixture_reference():
    """The calls behind the pickle fixture, as issued (reduce_scatter_tensor of 512 -> 128)."""
    once = [("all_reduce", 1024, "float32"), ("all_gather", 256, "bfloat16"),
            ("reduce_scatter", 128, "float32"), ("broadcast", 300, "float64"),
            ("all_gather", 10, "int64"), ("barrier", None, None)]
    return [_ref(op, i, c, d) for i, (op, c, d) in enumerate(once + once)]


def test_crosscheck_fixture_with_gloo_profile(shared_fixtures):
    fr = read_flight_recorder(shared_fixtures / PICKLE_AS_JSON).events
    check = crosscheck(_fixture_reference(), fr, source="flight_recorder", backend="gloo")
    assert check.as_report() == {"events": 12, "matched": 12, "unmatched": 0, "pass": True,
                                 "size_unknown": 0}
    plain = crosscheck(_fixture_reference(), fr, source="flight_recorder")
    assert plain.as_report() == {"events": 12, "matched": 10, "unmatched": 2, "pass": False,
                                 "size_unknown": 0}
    assert [str(m).split(":")[0] for m in plain.mismatches] == [
        "rank 0 group 0,1,2,3 seq 2", "rank 0 group 0,1,2,3 seq 8"]
    assert "reference reduce_scatter count=128 float32" in str(plain.mismatches[0])
    assert "other all_reduce count=512 float32" in str(plain.mismatches[0])


def test_crosscheck_window_alignment(shared_fixtures):
    fr = read_flight_recorder(shared_fixtures / PICKLE_AS_JSON).events
    second = [e.replace(seq=e.seq - 6) for e in _fixture_reference()[6:]]  # window seqs 0..5
    tail = crosscheck(second, fr, source="flight_recorder", backend="gloo", align="tail")
    assert tail.passed and tail.matched == 6 and tail.outside_window == 6
    mapped = crosscheck(second, fr, source="flight_recorder", backend="gloo",
                        align={(0, W): 6})
    assert mapped.passed and mapped.matched == 6
    shifted = crosscheck(second, fr, source="flight_recorder", backend="gloo",
                         align={(0, W): 5})
    assert not shifted.passed
    with pytest.raises(ValueError, match="no first seq"):
        crosscheck(second, fr, source="flight_recorder", align={(1, W): 0})
    before = fr[:6]
    assert crosscheck(second, fr_window(before, fr), source="flight_recorder",
                      backend="gloo").passed


def test_fr_window_keeps_a_restarted_groups_calls(shared_fixtures):
    """A ring holding an earlier default group's entries (a forked rank inherits its parent's;
    a job may re-create its group) and a fresh group "0" whose seqs restart below them: the
    window is what the end dump holds that the start dump did not. Control: without the times
    that tell the entries apart, the window by seq drops the new calls the old seqs cover."""
    fr = read_flight_recorder(shared_fixtures / PICKLE_AS_JSON).events
    old, new = fr[:6], fr[6:]
    restarted = [e.replace(seq=e.seq - 6) for e in new]  # recorded after every old entry
    assert all(e.t_start_ns is not None for e in fr)
    assert fr_window(old, old + restarted) == restarted
    untimed = [e.replace(t_start_ns=None) for e in old + restarted]
    assert len(fr_window(untimed[:6], untimed)) < len(restarted)


def test_crosscheck_missing_extra_and_field_mismatches():
    ref = [_ref("broadcast", 0, 8, "float32", root=1), _ref("all_reduce", 1, 4, "float32"),
           _ref("send", 2, 3, "float32", root=2), _ref("reduce", 3, 5, "float32", root=0)]
    other = [e.replace(source="flight_recorder") for e in ref]
    assert crosscheck(ref, other, source="flight_recorder").passed
    wrong_root = [other[0].replace(root=3)] + other[1:]
    assert [m.reason for m in crosscheck(ref, wrong_root, source="flight_recorder").mismatches] \
        == ["root differs"]
    no_root = [other[0].replace(root=None)] + other[1:]  # root compared only where both know it
    assert crosscheck(ref, no_root, source="flight_recorder").passed
    missing = other[:1] + other[2:]
    check = crosscheck(ref, missing, source="flight_recorder")
    assert [m.reason for m in check.mismatches] == ["missing in flight_recorder"]
    assert check.matched == 3 and check.unmatched == 1
    extra = other + [other[1].replace(seq=4)]
    check = crosscheck(ref, extra, source="flight_recorder")
    assert [m.reason for m in check.mismatches] == ["extra in flight_recorder"]
    # gloo profile: the send is skipped, and an FR send would be an extra call
    check = crosscheck(ref, other, source="flight_recorder", profile=FLIGHT_RECORDER_GLOO)
    assert check.skipped == 1 and check.unmatched == 1
    with pytest.raises(ValueError, match="Must be 'flight_recorder' for every event"):
        crosscheck(ref, ref, source="flight_recorder")
    with pytest.raises(ValueError, match="Invalid source='gpu'"):
        crosscheck(ref, other, source="gpu")
    with pytest.raises(ValueError, match="Invalid align='head'"):
        crosscheck(ref, other, source="flight_recorder", align="head")
    empty = crosscheck([], [], source="flight_recorder")
    assert not empty.passed and "nothing compared" in empty.notes[0]


def test_crosscheck_compares_msg_bytes_when_count_unknown():
    ref = [_ref("all_gather", 0, 256, "bfloat16"), _ref("all_reduce", 1, 100, "float32"),
           _ref("barrier", 2, 1, "uint8")]
    nsys = [CollectiveEvent(source="nsys", op=e.op, rank=0, group_id=W, msg_bytes=e.msg_bytes)
            for e in ref]
    check = crosscheck(ref, nsys, source="nsys")
    assert check.passed and check.matched == 3
    nsys[1] = nsys[1].replace(msg_bytes=404)
    check = crosscheck(ref, nsys, source="nsys")
    assert [m.reason for m in check.mismatches] == ["msg_bytes differs"]


def test_equivalence_validates_its_fields():
    with pytest.raises(ValueError, match="count_scale='n'"):
        Equivalence(reference_op="reduce_scatter", other_op="all_reduce", count_scale="n",
                    measured_on="x", note="y")
    with pytest.raises(ValueError, match="other_op='allreduce'"):
        Equivalence(reference_op="reduce_scatter", other_op="allreduce", measured_on="x",
                    note="y")
