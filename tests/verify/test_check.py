"""``dmuon-verify check``: per-rank alignment, named missing / unexpected calls, up-front input
validation. The prediction is the harness's own for a small DMuon layout."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.builders import CHECK_LAYOUT, measured
from tracer.events import to_table, write_parquet
from verify.check import check_events, report_lines
from verify.cli import main as dmuon_verify


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "layout.json").write_text(json.dumps(CHECK_LAYOUT.to_dict()))
    return tmp_path


def test_exact_events_pass_and_steps_are_inferred_per_rank():
    events = measured(3)
    result = check_events(events, CHECK_LAYOUT)
    assert result["pass"] and result["steps"] == 3 and result["ranks"] == [0, 1, 2, 3]
    assert result["steps_by_rank"] == {0: 3, 1: 3, 2: 3, 3: 3}
    assert result["predicted"] == len(events) and "phase" in result["key"]


def test_dropped_row_is_named_with_its_module_without_steps():
    events = measured(2)
    dropped = next(ev for ev in events if ev.rank == 2 and ev.op == "broadcast")
    result = check_events([ev for ev in events if ev is not dropped], CHECK_LAYOUT)
    assert not result["pass"] and result["steps"] == 2 and not result["unexpected"]
    (call,) = result["missing_calls"]
    assert (call["rank"], call["op"], call["count"], call["n"]) == (2, "broadcast", dropped.count, 1)
    assert call["modules"] == [dropped.module]
    text = "\n".join(report_lines(result, CHECK_LAYOUT.mode))
    assert "missing (1):" in text and "rank 2: 1 x broadcast" in text and dropped.module in text


def test_duplicated_row_is_named_with_its_source_ref():
    events = measured(2)
    extra = events[5].replace(source_ref="copy#99")
    result = check_events(events + [extra], CHECK_LAYOUT)
    assert not result["pass"] and not result["missing"]
    (call,) = result["unexpected_calls"]
    assert call["n"] == 1 and call["source_refs"] == ["copy#99"] and call["rank"] == extra.rank


def test_partial_rank_set_is_flagged_not_misread():
    events = [ev for ev in measured(2) if ev.rank in (0, 1)]
    result = check_events(events, CHECK_LAYOUT)
    assert result["partial"] and result["absent_ranks"] == [2, 3] and not result["pass"]
    assert result["steps"] == 2 and not result["missing"] and not result["unexpected"]
    assert "partial rank set: no events for ranks [2, 3]" in "\n".join(report_lines(result, "m"))


def test_one_null_phase_is_rejected_not_dropped_from_the_key():
    events = measured(1)
    events[3] = events[3].replace(phase=None)
    with pytest.raises(ValueError, match=r"1 of \d+ event\(s\) have no phase \(first: events_rank"):
        check_events(events, CHECK_LAYOUT)


def test_null_rank_and_null_count_are_rejected():
    events = measured(1)
    with pytest.raises(ValueError, match="rank=None"):
        check_events(events[:1] + [events[1].replace(rank=None)], CHECK_LAYOUT)
    with pytest.raises(ValueError, match="count=None"):
        check_events(events[:1] + [events[1].replace(count=None, msg_bytes=None)], CHECK_LAYOUT)


@pytest.mark.parametrize("steps", [0, -1, 1.5, "2"])
def test_bad_steps_rejected(steps):
    with pytest.raises(ValueError, match="Invalid steps="):
        check_events(measured(1), CHECK_LAYOUT, steps)


def _write_with(path, events, column, array):
    table = to_table(events)
    table = table.set_column(table.schema.get_field_index(column), column, array)
    pq.write_table(table, path)


@pytest.mark.parametrize("column, array_of", [
    ("count", lambda t: pa.array([float(x) for x in t.column("count").to_pylist()])),
    ("rank", lambda t: pa.array([str(x) for x in t.column("rank").to_pylist()])),
    ("count", lambda t: pa.array([str(x) for x in t.column("count").to_pylist()])),
])
def test_column_types_are_checked_up_front(run_dir, tmp_path, capsys, column, array_of):
    events = measured(1)
    path = tmp_path / "bad.parquet"
    _write_with(path, events, column, array_of(to_table(events)))
    assert dmuon_verify(["check", str(path), "--against", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"column {column!r} has type" in err and "bad.parquet" in err


def test_cli_exit_codes_and_streams(run_dir, tmp_path, capsys):
    events = measured(2)
    good = write_parquet(events, tmp_path / "good.parquet")
    assert dmuon_verify(["check", str(good), "--against", str(run_dir)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    bad = write_parquet(events[1:], tmp_path / "dropped.parquet")
    assert dmuon_verify(["check", str(bad), "--against", str(run_dir)]) == 1
    assert "missing (1):" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        dmuon_verify(["check", str(good), "--against", str(run_dir), "--steps", "0"])
    assert exc.value.code == 2 and "must be an int >= 1" in capsys.readouterr().err
    assert dmuon_verify(["check", str(tmp_path / "none.parquet"), "--against", str(run_dir)]) == 2
    assert "not readable as Parquet" in capsys.readouterr().err
    assert dmuon_verify(["check", str(good), "--against", str(tmp_path / "nowhere")]) == 2
    assert "no layout.json" in capsys.readouterr().err


def test_blank_group_size_is_filled_from_the_rank_list_not_a_false_mismatch():
    """torch.profiler leaves ``Group size`` blank on some calls (a DDP run's bucket all_reduce):
    before, every such event was 'unexpected' and its predicted twin 'missing'."""
    events = measured(2)
    assert all(ev.group_id and ev.group_size for ev in events)
    blank = [ev.replace(group_size=None) if i % 2 else ev for i, ev in enumerate(events)]
    result = check_events(blank, CHECK_LAYOUT)
    assert result["pass"] and "group_size" in result["key"]
    assert result["notes"] == [f"group_size filled from the group's rank list on {len(events) // 2} event(s)"]


def test_blank_group_size_without_a_rank_list_leaves_the_key_and_says_so():
    events = [ev.replace(group_size=None, group_id=None) if ev.rank == 1 else ev.replace(group_id=None)
              for ev in measured(2)]
    result = check_events(events, CHECK_LAYOUT)
    assert result["pass"] and "group_size" not in result["key"]
    assert "group_size left out of the key" in "\n".join(report_lines(result, "m"))
    # the rest of the key still compares every call: a wrong count on a blank-size event fails
    i = next(i for i, ev in enumerate(events) if ev.rank == 1 and ev.op == "broadcast")
    events[i] = events[i].replace(count=events[i].count + 1, msg_bytes=None)
    assert not check_events(events, CHECK_LAYOUT)["pass"]
