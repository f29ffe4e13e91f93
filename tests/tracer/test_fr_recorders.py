"""Flight Recorder on NCCL: the recorders of the backends in use are dumped.

ProcessGroupNCCL records into the CUDA recorder, dumped by
``torch._C._distributed_c10d._dump_nccl_trace_json``, which the CPU wheel does not have. These
tests run a real one-rank gloo group (its entries come from the real CPU recorder) and stand
in for the NCCL dump function with a monkeypatched one returning a dump in the shape
ProcessGroupNCCL writes (profiling names ``nccl:...``, ``pg_config`` with ranks): only a GPU
build would show the real one. Without the fix ``dump_flight_recorder`` called
``_dump_fr_trace_json`` only: the NCCL stand-in was never called, an ``nccl`` group's dump held
no NCCL entry, and under ``cpu:gloo,cuda:nccl`` the NCCL entries were missing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

from tracer.backends import backend_names, device_type, parse_backend, report_backend, uses_nccl
from tracer.fr import dump as fr_dump
from tracer.fr.parse import dump_flight_recorder, flight_recorder_enabled, fr_window, read_flight_recorder

C10D = torch._C._distributed_c10d


def _nccl_entry(seq: int, t_ns: int, name: str = "nccl:all_reduce", count: int = 8) -> dict:
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": name,
            "time_created_ns": t_ns, "input_sizes": [[count]], "input_dtypes": ["Float"],
            "output_sizes": [[count]], "output_dtypes": ["Float"], "state": "completed",
            "is_p2p": False, "retired": True, "timeout_ms": 600000}


class _NcclStandIn:
    """Stands in for ``_dump_nccl_trace_json``: records its calls, returns JSON bytes."""

    def __init__(self, entries: list[dict]) -> None:
        self.entries, self.calls = entries, []

    def __call__(self, includeCollectives=None, onlyActive=None):  # noqa: N803 - torch's names
        self.calls.append(includeCollectives)
        dump = {"version": "2.10", "comm_lib_version": "2.27.5", "nccl_comm_state": {},
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}},
                "pg_status": {}, "entries": self.entries if includeCollectives is not False else []}
        return json.dumps(dump).encode()


@contextlib.contextmanager
def _gloo_group(tmp_path):
    """A real one-rank gloo default group (FR on) with two calls, destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        yield
    finally:
        dist.destroy_process_group()


def with_gloo_group_in_a_child(test):
    """Run ``test`` (which takes ``tmp_path``) in a forked child holding :func:`_gloo_group`.

    The Flight Recorder's ring outlives its group and no API clears it: a group run in the
    pytest process would leave entries that every rank the distributed tests' pools fork later
    inherits. The child's traceback, if any, fails the test here; a child silent for 120 s is
    killed and named."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: run the test, send its traceback (or nothing), exit at once
            os.close(read_fd)
            message = b""
            try:
                with _gloo_group(kwargs["tmp_path"]):
                    test(*args, **kwargs)
            except BaseException:
                message = traceback.format_exc().encode()
            os.write(write_fd, message)
            os._exit(0)
        os.close(write_fd)
        chunks = []
        try:
            while select.select([read_fd], [], [], 120)[0]:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            else:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"{test.__name__}: its forked child sent nothing for 120 s (killed)")
        finally:
            os.close(read_fd)
            os.waitpid(pid, 0)
        if chunks:
            pytest.fail(b"".join(chunks).decode(), pytrace=False)
    return run


def test_backend_strings_parse():
    assert parse_backend("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend("nccl") == {"cuda": "nccl"}
    assert parse_backend("GLOO") == {"cpu": "gloo", "cuda": "gloo"}
    assert backend_names("cuda:nccl") == {"nccl"} and uses_nccl("cpu:gloo,cuda:nccl")
    assert not uses_nccl("gloo") and device_type("cpu:gloo,cuda:nccl") == "cuda"
    assert device_type("gloo") == "cpu" and report_backend("cpu:gloo,cuda:nccl") == "nccl"
    assert parse_backend("mybackend") == {"*": "mybackend"}
    for bad in ("", "cpu:gloo,", "cpu:gloo,cpu:nccl", ":nccl", None):
        with pytest.raises(ValueError, match="Invalid backend="):
            parse_backend(bad)


def test_recorders_for_each_backend():
    assert fr_dump.recorders_for("nccl") == ["nccl"]
    assert fr_dump.recorders_for("gloo") == ["cpu"]
    assert fr_dump.recorders_for("cpu:gloo,cuda:nccl") == ["cpu", "nccl"]
    assert fr_dump.recorders_for("mpi") == []


@with_gloo_group_in_a_child
def test_nccl_group_dumps_the_nccl_recorder(tmp_path, monkeypatch):
    stand_in = _NcclStandIn([_nccl_entry(1, 10), _nccl_entry(2, 20, "nccl:_allgather_base")])
    monkeypatch.setattr(C10D, "_dump_nccl_trace_json", stand_in, raising=False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert flight_recorder_enabled()
    path = dump_flight_recorder(tmp_path / "fr", 0)
    assert stand_in.calls and stand_in.calls[-1] is True
    raw = json.loads(path.read_text())
    assert raw["dmuon"]["recorders"] == ["nccl"] and raw["dmuon"]["missing"] == []
    assert raw["comm_lib_version"] == "2.27.5"  # NCCL's dump as is (one recorder)
    events = read_flight_recorder(path).events
    assert [(e.op, e.count, e.comm, e.group_id) for e in events] == [
        ("all_reduce", 8, "0", "0"), ("all_gather", 8, "0", "0")]


@with_gloo_group_in_a_child
def test_mixed_group_merges_both_recorders_in_issue_order(tmp_path, monkeypatch):
    cpu_entries = json.loads(C10D._dump_fr_trace_json())["entries"]
    assert [e["profiling_name"] for e in cpu_entries][-2:] == ["gloo:all_reduce", "gloo:broadcast"]
    t_mid = (cpu_entries[-2]["time_created_ns"] + cpu_entries[-1]["time_created_ns"]) // 2
    stand_in = _NcclStandIn([_nccl_entry(1, t_mid, count=16)])
    monkeypatch.setattr(C10D, "_dump_nccl_trace_json", stand_in, raising=False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    path = dump_flight_recorder(tmp_path / "fr", 0)
    assert stand_in.calls
    raw = json.loads(path.read_text())
    assert raw["dmuon"]["recorders"] == ["cpu", "nccl"]
    assert [e["record_id"] for e in raw["entries"]] == list(range(len(raw["entries"])))
    events = read_flight_recorder(path).events
    tail = [(e.op, e.count, e.comm) for e in events][-3:]
    # issue order across recorders, by time; each backend's sequence apart in ``comm``
    assert tail == [("all_reduce", 4, "0@cpu"), ("all_reduce", 16, "0@nccl"), ("broadcast", 4, "0@cpu")]


def test_window_keeps_each_recorders_sequence(tmp_path):
    """Both backends of one pg number collective_seq_id from 1: a window by pg name alone
    dropped the NCCL call (seq 2 <= the gloo side's 5)."""
    def dump(entries):
        return {"version": "2.10", "pg_status": {}, "pg_config": {}, "entries": entries}
    cpu = dump([_nccl_entry(s, s, "gloo:all_reduce", 4) for s in range(1, 6)])
    before = fr_dump.merge_dumps({"cpu": cpu, "nccl": dump([_nccl_entry(1, 3)])})
    after = fr_dump.merge_dumps({"cpu": cpu, "nccl": dump([_nccl_entry(1, 3), _nccl_entry(2, 9)])})
    for name, dump in (("before", before), ("after", after)):
        (tmp_path / f"{name}_rank0.json").write_text(json.dumps(dump))
    window = fr_window(read_flight_recorder(tmp_path / "before_rank0.json").events,
                       read_flight_recorder(tmp_path / "after_rank0.json").events)
    assert [(e.op, e.count, e.comm, e.seq) for e in window] == [("all_reduce", 8, "0@nccl", 1)]


@with_gloo_group_in_a_child
def test_missing_nccl_dump_function_degrades_with_a_message(tmp_path, monkeypatch):
    monkeypatch.delattr(C10D, "_dump_nccl_trace_json", raising=False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.warns(RuntimeWarning, match="_dump_nccl_trace_json"):
        assert not flight_recorder_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ValueError, match=r"backend 'nccl'.*_dump_nccl_trace_json"):
            dump_flight_recorder(tmp_path / "fr", 0)
    # a mixed group still dumps gloo's recorder and names what is missing
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    with pytest.warns(RuntimeWarning, match="_dump_nccl_trace_json"):
        path = dump_flight_recorder(tmp_path / "fr", 0)
    raw = json.loads(path.read_text())
    assert raw["dmuon"]["recorders"] == ["cpu"]
    assert raw["dmuon"]["missing"] == ["_dump_nccl_trace_json"]
    assert read_flight_recorder(path).events
