"""Flight Recorder dumps from elsewhere: crafted pickles never run, and every damaged entry or
value has a defined outcome: the entry is listed with its file and
index while the rest is parsed, or a value is left out with a warning, or the file is named in
a clear error. Every outcome must still write Parquet."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from tracer.cli import main as dmuon_trace
from tracer.events import write_parquet
from tracer.fr.parse import PickleRefused, load_dump, read_flight_recorder, read_flight_recorder_paths

JSON_DUMP = "flight_recorder/torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_json_rank0.json"


class _RunsCode:
    """Unpickling this calls os.system(touch <marker>)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def dump(shared_fixtures) -> dict:
    return json.loads((shared_fixtures / JSON_DUMP).read_text())


@pytest.fixture(scope="module")
def n_events(shared_fixtures) -> int:
    """Events of the undamaged fixture: 14 entries, one coalesced into 3 tensors."""
    return len(read_flight_recorder(shared_fixtures / JSON_DUMP).events)


def _write(tmp_path: Path, dump: dict, name: str = "fr_rank0.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(dump))
    return path


def test_malicious_pickle_in_a_dump_folder_runs_nothing(shared_fixtures, n_events, tmp_path, capsys):
    folder = tmp_path / "dumps"
    folder.mkdir()
    marker = tmp_path / "pwned"
    (folder / "notes.txt").write_bytes(pickle.dumps({"version": "2.10", "pg_status": {},
                                                     "entries": [_RunsCode(marker)]}))
    (folder / "fr_rank0.json").write_bytes((shared_fixtures / JSON_DUMP).read_bytes())
    with pytest.raises(PickleRefused, match=r"notes\.txt.*refused.*posix\.system|notes\.txt.*os"):
        load_dump(folder / "notes.txt")
    read = read_flight_recorder_paths([folder])
    assert not marker.exists()
    assert len(read.events) == n_events == 16 and len(read.unreadable) == 1
    assert "notes.txt" in read.unreadable[0] and "nothing was run" in read.unreadable[0]
    # a file not read: exit 2, the events of the others written
    assert dmuon_trace(["fr", str(folder), "--out", str(tmp_path / "e.parquet")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists() and "notes.txt" in err and (tmp_path / "e.parquet").is_file()
    # Only the pickle: nothing found, exit 3, still nothing run.
    (folder / "fr_rank0.json").unlink()
    assert dmuon_trace(["fr", str(folder), "--out", str(tmp_path / "f.parquet")]) == 3
    assert "no Flight Recorder events" in capsys.readouterr().err and not marker.exists()


def test_allow_pickle_warns_and_loads_a_plain_pickle(dump, tmp_path, capsys):
    path = tmp_path / "fr_rank0.pkl"
    path.write_bytes(pickle.dumps(dump))
    with pytest.warns(UserWarning, match="without restrictions"):
        assert load_dump(path, allow_pickle=True) == dump
    assert load_dump(path) == dump  # plain data needs no globals: the default loads it
    assert dmuon_trace(["fr", str(path), "--out", str(tmp_path / "e.parquet"),
                        "--allow-pickle"]) == 0
    assert "can run any code" in capsys.readouterr().err


def _set(key, value):
    def mutate(entry):
        entry[key] = value
    return mutate


def _del(key):
    return lambda entry: entry.pop(key)


@pytest.mark.parametrize("mutate, reason", [
    (_del("process_group"), "process_group=None"),
    (_set("process_group", []), "process_group=[]"),
    (_set("process_group", "0"), "process_group='0'"),
    (_set("record_id", "2"), "record_id='2'"),
    (_set("input_sizes", [[2 ** 80]]), "more than 2^63-1 elements"),
    (_set("input_sizes", [[2 ** 40, 2 ** 40]]), "more than 2^63-1 elements"),
    (lambda e: e.update(profiling_name="gloo:all_reduce", input_sizes=[[1 << 62]],
                        output_sizes=[[1 << 62]]), "fits int64"),  # x 4 bytes: msg_bytes overflows
    (_set("input_sizes", [["32"]]), "not a list of shapes"),
    (_set("input_sizes", [[True]]), "not a list of shapes"),
    (_set("input_dtypes", "Float"), "not a list of names"),
    (_set("profiling_name", 7), "profiling_name=7"),
    (_set("collective_seq_id", "3"), "collective_seq_id='3'"),
    (_set("collective_seq_id", 1.5), "collective_seq_id=1.5"),
    (_set("profiling_name", "gloo:send 0->99999999999999"), None),  # peer ignored, not fatal
    (_set("process_group", ["\udc80", "x"]), "invalid UTF-8"),
])
def test_damaged_entry_is_listed_and_the_rest_parsed(dump, n_events, tmp_path, mutate, reason):
    mutate(dump["entries"][2])
    path = _write(tmp_path, dump)
    read = read_flight_recorder(path)
    if reason is None:
        assert not read.unreadable and len(read.events) == n_events
    else:
        assert len(read.events) == n_events - 1 and len(read.unreadable) == 1, read.unreadable
        assert f"{path}#" in read.unreadable[0] and "(entry 2)" in read.unreadable[0]
        assert reason in read.unreadable[0]
    write_parquet(read.events, tmp_path / "out.parquet")
    with pytest.raises(ValueError, match=r"Invalid Flight Recorder entry .*\(entry 2\)"):
        if reason is None:
            raise ValueError("Invalid Flight Recorder entry (entry 2)")  # nothing to raise
        read_flight_recorder(path, strict=True)


@pytest.mark.parametrize("value", ["soon", float("nan"), 2 ** 70, 1.7e18, -5, True])
def test_bad_time_created_is_left_out_with_a_warning(dump, n_events, tmp_path, value):
    dump["entries"][4]["time_created_ns"] = value
    read = read_flight_recorder(_write(tmp_path, dump))
    assert len(read.events) == n_events and not read.unreadable
    times = {ev.source_ref.rsplit("#", 1)[1]: ev.t_start_ns for ev in read.events}
    assert times["4"] is None and times["3"] is not None
    assert len(read.warnings) == 1 and "(entry 4): time_created_ns=" in read.warnings[0]
    write_parquet(read.events, tmp_path / "out.parquet")


@pytest.mark.parametrize("entries", [None, 5, "x", {"a": 1}])
def test_entries_not_a_list_is_a_clear_error_naming_the_file(dump, tmp_path, entries):
    dump["entries"] = entries
    path = _write(tmp_path, dump)
    with pytest.raises(ValueError, match=r"fr_rank0\.json.*entries=.*Must be a list"):
        read_flight_recorder(path)


def test_entries_of_ints_are_listed_one_by_one(dump, tmp_path):
    dump["entries"] = [1, 2] + dump["entries"][:3]
    read = read_flight_recorder(_write(tmp_path, dump))
    assert len(read.events) == 3 and len(read.unreadable) == 2
    assert "(entry 0): entry is a int, not a dict" in read.unreadable[0]


@pytest.mark.parametrize("key, value", [
    ("pg_config", {"": "oops"}), ("pg_config", {"": {"ranks": "[0, 1"}}),
    ("pg_config", {"": {"ranks": [0, "a"]}}), ("pg_config", "oops"),
    ("dmuon", [1, 2]), ("dmuon", {"rank": "zero", "pg_ranks": {"0": "x"}, "pid": 2 ** 70}),
])
def test_malformed_blocks_are_warned_and_ignored(dump, n_events, tmp_path, key, value):
    dump[key] = value
    read = read_flight_recorder(_write(tmp_path, dump))
    assert len(read.events) == n_events and not read.unreadable and read.warnings
    assert all("fr_rank0.json" in w for w in read.warnings)
    write_parquet(read.events, tmp_path / "out.parquet")


def test_invalid_utf8_loses_only_its_entry(shared_fixtures, n_events, tmp_path):
    raw = (shared_fixtures / JSON_DUMP).read_bytes()
    damaged = raw.replace(b'"gloo:all_to_all"', b'"gloo:all_to_\xff\xfeall"', 1)
    assert damaged != raw
    path = tmp_path / "fr_rank0.json"
    path.write_bytes(damaged)
    read = read_flight_recorder(path)
    assert len(read.events) == n_events - 1 and len(read.unreadable) == 1
    assert "(entry 2)" in read.unreadable[0] and "invalid UTF-8" in read.unreadable[0]
    write_parquet(read.events, tmp_path / "out.parquet")


def test_nccl_log_given_to_fr_exits_3(shared_fixtures, tmp_path, capsys):
    log = shared_fixtures / "nccl" / "nccl_coll_allreduce_tf_2gpu__nccl_issue203.log"
    assert dmuon_trace(["fr", str(log), "--out", str(tmp_path / "e.parquet")]) == 3
    err = capsys.readouterr().err
    assert "no Flight Recorder events" in err and not (tmp_path / "e.parquet").exists()


def test_gzipped_malicious_pickle_is_refused_too(tmp_path):
    """gzip is read decompressed whatever the name; a pickle inside still meets the
    restricted unpickler."""
    import gzip

    marker = tmp_path / "pwned"
    path = tmp_path / "fr_rank0.json"  # a JSON name, gzip bytes, a pickle inside
    path.write_bytes(gzip.compress(pickle.dumps({"version": "2.10", "pg_status": {},
                                                 "entries": [_RunsCode(marker)]})))
    with pytest.raises(PickleRefused, match="nothing was run"):
        load_dump(path)
    assert not marker.exists()
    cut = tmp_path / "cut.gz"
    cut.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match="gzip stream ends early"):
        load_dump(cut)
