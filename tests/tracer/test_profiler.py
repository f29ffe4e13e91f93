"""tracer.profiler on the real torch.profiler fixture (../shared/fixtures/profiler/: torch 2.13.0
CPU build, gloo, 4 ranks, rank 0's collective events from export_chrome_trace; two probe
processes, see SOURCES.md and the CommDebugMode counts next to it), on a hand-built
``record_param_comms`` trace, and through ``dmuon-trace profiler``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tracer.cli import main as dmuon_trace
from tracer.events import CollectiveEvent, read_parquet
from tracer.profiler import profiler_source_events, read_profiler_trace, read_profiler_traces

REPO = Path(__file__).resolve().parents[2]
TRACE = "profiler/torch2.13cpu_gloo_ws4_profiler_chrome_trace_collective_events_rank0.json"


@pytest.fixture
def fixture_trace(shared_fixtures):
    return read_profiler_trace(shared_fixtures / TRACE)


def test_fixture_exact_events(fixture_trace):
    t = fixture_trace
    assert t.kind == "c10d_ops" and t.rank == 0 and t.issues == []
    got = [(e.op, e.count, e.dtype, e.root, e.group_size) for e in t.events]
    assert got == [
        # probe 1: all_reduce f32[1024]; all_gather_into_tensor bf16[256]->[1024];
        # reduce_scatter_tensor f32[512]->[128]; broadcast f64[300] from 0; list all_gather
        # i64[10]; send f32[77] to 1; barrier
        ("all_reduce", 1024, "float32", None, None),
        ("all_gather", 256, "bfloat16", None, 4),
        ("reduce_scatter", 128, "float32", None, 4),
        ("broadcast", 300, "float64", 0, None),
        ("all_gather", 10, "int64", None, None),
        ("send", 77, "float32", 1, None),
        ("barrier", None, None, None, None),
        # probe 2: all_reduce f32[1000]; funcol all_reduce f32[100] (its nested c10d op, once);
        # all_to_all_single f32[32] (group size not in the trace: no per-peer count);
        # reduce f32[50] to 0; gather f32[5]; scatter f32[6]; all_reduce_coalesced [3], [4]
        ("all_reduce", 1000, "float32", None, None),
        ("all_reduce", 100, "float32", None, None),
        ("all_to_all", None, "float32", None, None),
        ("reduce", 50, "float32", 0, None),
        ("gather", 5, "float32", 0, None),
        ("scatter", 6, "float32", 0, None),
        ("all_reduce", 3, "float32", None, None),
        ("all_reduce", 4, "float32", None, None),
    ]
    a2a = [(e.in_elems, e.out_elems) for e in t.events if e.op == "all_to_all"]
    assert a2a == [(32, 32)]  # its totals are known (Input Dims), the per-peer count is not
    assert [e.seq for e in t.events] == list(range(15))  # no group in the trace: one counter
    assert {e.group_id for e in t.events} == {None}
    assert t.backend_events == 14 and t.backend_unpaired == 0
    assert t.ignored == Counter({"_c10d_functional::wait_tensor": 3, "_c10d_functional::all_reduce": 1,
                                 "_c10d_functional::_wrap_tensor_autograd": 1})


def test_fixture_agrees_with_commdebugmode_counts(fixture_trace, shared_fixtures):
    # CommDebugMode (same probes) counts calls per c10d op; coalesced calls and the funcol
    # wrapper count once there. Send and barrier are not in its table.
    counts = json.loads((shared_fixtures / "profiler/torch2.13cpu_gloo_ws4_commdebugmode_counts_rank0.json").read_text())
    total = sum(counts["probe1_CommDebugMode_counts"].values()) + sum(counts["probe2_CommDebugMode_counts"].values())
    calls = {e.source_ref for e in fixture_trace.events if e.op not in ("send", "barrier")}
    # CommDebugMode counts the funcol all_reduce once, as c10d_functional.all_reduce; the
    # profiler's events hold it once too, as its nested c10d::allreduce_
    assert len(calls) == total == 12


def test_record_param_comms_events_are_preferred(tmp_path):
    # Hand-built from the keys of torch/csrc/profiler/util.h (what ProcessGroupNCCL writes);
    # the CPU build's gloo writes none, so no real trace of this kind exists here.
    def rpc(ts, name, n_in, n_out, dtype, ranks="[0, 1, 2, 3]", size=4, seq=0):
        return {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1,
                "ts": ts, "dur": 1.0, "args": {"Collective name": name, "In msg nelems": n_in,
                "Out msg nelems": n_out, "dtype": dtype, "Group size": size,
                "Process Group Ranks": ranks, "Process Group Name": "0", "Seq": seq}}
    trace = {"traceEvents": [
        rpc(10.0, "_allgather_base", 256, 1024, "BFloat16"),
        rpc(11.0, "_reduce_scatter_base", 512, 128, "Float", seq=1),
        rpc(12.0, "broadcast", 300, 300, "Double", ranks="[1, 3]", size=2),
        rpc(13.0, "wait", 0, 0, "Float"),
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 9.0, "dur": 5.0, "args": {}},
    ], "distributedInfo": {"rank": 3}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    t = read_profiler_trace(path)
    assert t.kind == "record_param_comms" and t.rank == 3
    assert [(e.op, e.count, e.dtype, e.group_id, e.group_size, e.seq) for e in t.events] == [
        ("all_gather", 256, "bfloat16", "0,1,2,3", 4, 0),
        ("reduce_scatter", 128, "float32", "0,1,2,3", 4, 1),
        ("broadcast", 300, "float64", "1,3", 2, 0),
    ]
    assert t.ignored == Counter({"wait": 1})


def test_errors_name_the_file(tmp_path):
    bad = tmp_path / "rank0.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"Invalid profiler trace .*rank0\.json"):
        read_profiler_trace(bad)
    (tmp_path / "x.json").write_text(json.dumps({"traceEvents": [], "distributedInfo": {"rank": 0}}))
    with pytest.raises(ValueError, match=r"ranks \[0\] appear in more than one file"):
        read_profiler_traces([tmp_path / "x.json", tmp_path / "x.json"])
    with pytest.raises(ValueError, match=r"Invalid trace path"):
        read_profiler_traces([tmp_path / "missing.json"])


def test_cli_writes_parquet_and_summary(shared_fixtures, tmp_path, capsys):
    out = tmp_path / "ev.parquet"
    assert dmuon_trace(["profiler", str(shared_fixtures / TRACE), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 trace(s), 15 events, ranks [0]" in text and "unpaired 0" in text
    events = read_parquet(out)
    assert len(events) == 15 and {e.source for e in events} == {"profiler"}


def test_profiler_module_imports_without_torch():
    code = "import sys, tracer.profiler; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-1500:]


def test_groupless_events_compare_per_rank():
    ref = [CollectiveEvent(source="interposer", op="broadcast", rank=0, group_id="0,1", count=4, dtype="float32")]
    other = [CollectiveEvent(source="profiler", op="broadcast", rank=0, count=4, dtype="float32")]
    r, o, note = profiler_source_events(ref, other)
    assert r[0].group_id is None and o[0].group_id is None and "per rank" in note
    keyed = [other[0].replace(group_id="0,1")]
    assert profiler_source_events(ref, keyed)[2] is None


def _nccl_kineto_trace(rank: int, calls: list[tuple]) -> dict:
    """A Chrome trace in the shape Kineto writes for ProcessGroupNCCL (no GPU here: gloo writes
    no ``record_param_comms``, checked on torch 2.13.0+cpu and 2.11.0+cu130 with 2 gloo ranks).
    Per call, as on a CUDA run: the ``c10d::`` dispatcher op, the ``record_param_comms``
    ``cpu_op`` inside it with the args of ``torch/csrc/profiler/util.h`` (names checked in
    this torch's ``libtorch_cpu.so``: ``Collective name``, ``dtype``, ``In msg nelems``, ``Out
    msg nelems``, ``In split size``, ``Out split size``, ``Global rank start``, ``Global rank
    stride``, ``Group size``, ``Process Group Name``, ``Process Group Description``, ``Process
    Group Ranks``, ``Rank``; ranks and splits as text), and the NCCL kernel on the GPU stream
    carrying the same args."""
    events, ts = [], 1000.0
    for c10d_op, name, n_in, n_out, dtype, kernel in calls:
        comm_args = {"Collective name": name, "dtype": dtype, "In msg nelems": n_in,
                     "Out msg nelems": n_out, "In split size": "[]", "Out split size": "[]",
                     "Global rank start": 0, "Global rank stride": 1, "Group size": 2,
                     "Process Group Name": "0", "Process Group Description": "default_pg",
                     "Process Group Ranks": "[0, 1]", "Rank": rank}
        events += [
            {"ph": "X", "cat": "cpu_op", "name": f"c10d::{c10d_op}", "pid": 77, "tid": 77,
             "ts": ts, "dur": 40.0, "args": {"External id": len(events), "Input Dims": [[n_in]],
                                             "Input type": ["ScalarList"], "Concrete Inputs": [""]}},
            {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 77, "tid": 77,
             "ts": ts + 1.0, "dur": 30.0, "args": {"External id": len(events) + 1,
                                                   "Record function id": 0, **comm_args}},
            {"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7, "ts": ts + 50.0,
             "dur": 12.0, "args": {"External id": len(events) + 1, "device": 0, "stream": 7,
                                   **comm_args}},
        ]
        ts += 100.0
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2,
            "pg_count": 1, "pg_config": [{"pg_name": "0", "pg_desc": "default_pg",
                                          "backend_config": "cuda:nccl", "pg_size": 2,
                                          "ranks": [0, 1]}], "nccl_version": "2.27.5"},
            "traceEvents": events}


def test_record_param_comms_branch_cross_checks_against_the_interposer(tmp_path):
    """The branch that gates NCCL runs, through read_profiler_traces and the cross-check as the
    harness calls them; a planted size error must fail it."""
    from tracer.crosscheck import crosscheck

    calls = [("_allgather_base_", "_allgather_base", 256, 512, "BFloat16",
              "ncclDevKernel_AllGather_RING_LL"),
             ("_reduce_scatter_base_", "_reduce_scatter_base", 512, 256, "Float",
              "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"),
             ("broadcast_", "broadcast", 300, 300, "Float", "ncclDevKernel_Broadcast_RING_LL"),
             ("allreduce_", "allreduce", 64, 64, "Bool", "ncclDevKernel_AllReduce_Sum_u8_RING_LL")]
    for r in range(2):
        (tmp_path / f"trace_rank{r}.json").write_text(json.dumps(_nccl_kineto_trace(r, calls)))
    traces = read_profiler_traces([tmp_path])
    assert [t.kind for t in traces] == ["record_param_comms"] * 2
    events = [e for t in traces for e in t.events]
    assert [(e.op, e.count, e.dtype, e.group_id) for e in events[:4]] == [
        ("all_gather", 256, "bfloat16", "0,1"), ("reduce_scatter", 256, "float32", "0,1"),
        ("broadcast", 300, "float32", "0,1"), ("all_reduce", 64, "bool", "0,1")]

    def interposer(count_of_broadcast=300):
        return [CollectiveEvent(source="interposer", op=op, rank=r, group_id="0,1", group_size=2,
                                group_rank=r, seq=i, count=c, dtype=dt, root=root)
                for r in range(2) for i, (op, c, dt, root) in enumerate([
                    ("all_gather", 256, "bfloat16", None), ("reduce_scatter", 256, "float32", None),
                    ("broadcast", count_of_broadcast, "float32", 0), ("all_reduce", 64, "bool", None)])]
    ref, prof, note = profiler_source_events(interposer(), events)
    assert note is None  # every event knows its group: compared per group, not as one sequence
    check = crosscheck(ref, prof, source="profiler", backend="nccl")
    assert check.passed and check.matched == 8, check.lines()
    ref, prof, _ = profiler_source_events(interposer(count_of_broadcast=301), events)
    bad = crosscheck(ref, prof, source="profiler", backend="nccl")
    assert not bad.passed and bad.unmatched == 2
