"""The NCCL-log source of verify-traffic, end to end on logs rendered from a real run.

A real 4-rank gloo run of dmuon-hsdp-z3 (world, shard and replicate groups) gives each rank's
interposer events, with ``coalesce="block"``: per-owner calls, as on NCCL (gloo's aligned
groups of unequal buckets move as uneven all_to_alls, which NCCL never runs: DMuon keeps
NCCL's groups equal, and NCCL logs an uneven all_to_all_single as per-peer Send/Recv); the test tool ``tests/tools/nccl_job.py`` renders them as one NCCL 2.21
log per process around a window (synthetic text, a plumbing test, not evidence about NCCL).
Each rank's part (:func:`verify.sources.nccl_source.rank_window`) and rank 0's part
(:func:`verify.sources.nccl_source.nccl_source_report`) then run as in the harness.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.distributed.phase_d import traffic_tasks
from tests.tools.nccl_job import render_job
from tracer.nccl.expect import Lowering
from verify.sources.nccl_source import nccl_source_report, rank_window

pytestmark = pytest.mark.distributed

MODE = "dmuon-hsdp-z3"


@pytest.fixture(scope="module")
def measured(pool4):
    results = pool4.run(traffic_tasks.measure_mode, MODE, coalesce="block")
    return {r: res["events"] for r, res in enumerate(results)}, results[0]["layout"]


def _report(folder: Path, measured, *, version="2.21", edit=None, windows_edit=None, ranks=None):
    by_rank, layout = measured
    windows = render_job(folder, by_rank, world_size=layout.world_size, version=version)
    if edit is not None:
        edit(windows)
    if windows_edit is not None:
        windows = [windows_edit(w) for w in windows]
    per_rank = [rank_window(w) for w in windows if ranks is None or w.rank in ranks]
    interposer = [ev for r in sorted(by_rank) for ev in by_rank[r]]
    # the tool renders one line per interposer call (gloo's gathers as NCCL 2.28's Gather):
    # expect that lowering, not torch's Send/Recv one (tests/nccl/test_nccl_expect.py)
    return nccl_source_report(per_rank, interposer, layout, steps=2,
                              lowering=Lowering(alltoall_native=True, gather_native=True))


def test_rendered_logs_match_interposer_and_theory(tmp_path, measured):
    by_rank, _ = measured
    report = _report(tmp_path, measured)
    n = sum(len(v) for v in by_rank.values())
    assert report["pass"], report["mismatches"][:5]
    assert (report["events"], report["matched"], report["unmatched"]) == (n, n, 0)
    assert report["theory"]["pass"] and "group_id" in report["theory"]["key"]
    assert len({ev.group_id for evs in by_rank.values() for ev in evs}) >= 3  # world, shard, replicate


def _drop_line(windows, rank, offset):
    path = Path(windows[rank].file)
    lines = path.read_text().splitlines(keepends=True)
    del lines[windows[rank].first_line + offset]
    path.write_text("".join(lines))


def test_a_dropped_call_fails_both_checks(tmp_path, measured):
    report = _report(tmp_path, measured, edit=lambda w: _drop_line(w, 1, 3),
                     windows_edit=lambda w: dataclasses.replace(w, last_line=w.last_line - (w.rank == 1)))
    assert not report["pass"]
    assert report["unmatched"] == 1
    assert any("rank 1" in m and "missing in nccl_log" in m for m in report["mismatches"])
    assert not report["theory"]["pass"] and len(report["theory"]["missing"]) == 1


def test_a_changed_count_is_named(tmp_path, measured):
    def edit(windows):
        path = Path(windows[2].file)
        lines = path.read_text().splitlines(keepends=True)
        i = windows[2].first_line + 1  # 0-based index of the window's second line
        head, tail = lines[i].split(" count ", 1)
        count, rest = tail.split(" ", 1)
        lines[i] = f"{head} count {int(count) + 1} {rest}"
        path.write_text("".join(lines))

    report = _report(tmp_path, measured, edit=edit)
    assert not report["pass"] and report["unmatched"] == 1
    assert any("rank 2" in m and "count differs" in m for m in report["mismatches"])


def test_a_window_opened_one_line_early_catches_a_warmup_call(tmp_path, measured):
    # line first_line is the INIT-subsystem chatter; first_line - 1 is the last warm-up call
    report = _report(tmp_path, measured,
                     windows_edit=lambda w: dataclasses.replace(w, first_line=w.first_line - 2))
    assert not report["pass"]
    assert any("extra in nccl_log" in m for m in report["mismatches"])


def test_a_missing_rank_log_is_named(tmp_path, measured):
    report = _report(tmp_path, measured, ranks={0, 1, 2})
    assert not report["pass"]
    assert any("windows from ranks [0, 1, 2]" in m for m in report["mismatches"])
    assert any("nranks=4" in m for m in report["mismatches"])


def test_logs_without_comm_id_cannot_be_matched_and_say_why(tmp_path, measured):
    report = _report(tmp_path, measured, version="2.4")  # INIT lines carry no commId before 2.16
    assert not report["pass"]
    assert any("NCCL < 2.16" in m for m in report["mismatches"])
