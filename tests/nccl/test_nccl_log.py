"""NCCL_DEBUG=INFO log parser (tracer.nccl.log) on the real fixtures and on edge cases.

Fixtures: ../shared/fixtures/nccl/ (sources in shared/fixtures/SOURCES.md: NVIDIA/nccl
#203, #584, #734, #740, #1238, #1412, #1453, #1765, #1814, #2241 and PR #1973;
NVIDIA/nccl-tests#29; pytorch/torchtitan#1369; NCCL docs troubleshooting/logging.rst and
plugins/profiler/inspector/README.md; an unattributed public PyTorch training log).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools import nccl_render as R
from tracer.events import CollectiveEvent, read_parquet
from tracer.nccl.log import (
    NcclLogError,
    register_cli,
    ParseStats,
    iter_nccl_events,
    iter_nccl_records,
    parse_nccl_logs,
)


def _key(ev: CollectiveEvent) -> tuple:
    line = int(ev.source_ref.rsplit(":", 1)[1])
    return (line, ev.op, ev.count, ev.dtype, ev.group_size, ev.comm, ev.rank, ev.group_rank,
            ev.seq, ev.root, ev.host, ev.pid, ev.cuda_dev)


def _parse(fixtures: Path, name: str):
    path = fixtures / "nccl" / name
    res = parse_nccl_logs(path)
    assert res.files == [str(path)]
    assert all(ev.source == "nccl_log" and ev.source_ref.startswith(str(path)) for ev in res.events)
    return res


F32, AR = "float32", "all_reduce"

# (line, op, count, dtype, nranks, comm, rank, group_rank, seq, root, host, pid, cuda_dev)
EXPECTED_EVENTS = {
    "nccl_coll_allreduce_nranks1_trailingspace__nccl_issue1238.log": [
        (i + 1, AR, 33554432, F32, 1, "0x5631f0816b40", None, None, i, None, "ip-172-31-54-74",
         30125, 0) for i in range(3)],
    "nccl_coll_allreduce_tf_2gpu__nccl_issue203.log": [
        (1, AR, 64, F32, 2, "0x7f0c741162f0", None, None, 0, None, "gpu1", 13135, 0),
        (2, AR, 64, F32, 2, "0x7f0c7410f0e0", None, None, 0, None, "gpu1", 13135, 1),
        (3, AR, 237184, F32, 2, "0x7f0c741162f0", None, None, 1, None, "gpu1", 13135, 0),
        (4, AR, 237184, F32, 2, "0x7f0c7410f0e0", None, None, 1, None, "gpu1", 13135, 1),
        (5, AR, 386560, F32, 2, "0x7f0c741162f0", None, None, 2, None, "gpu1", 13135, 0),
        (6, AR, 386560, F32, 2, "0x7f0c7410f0e0", None, None, 2, None, "gpu1", 13135, 1),
        (7, AR, 8192, F32, 2, "0x7f0c7410f0e0", None, None, 3, None, "gpu1", 13135, 1)],
    # datatype 0 is ncclInt8 (the upstream report's title says uint8; the enum decides).
    "nccl_coll_broadcast_uint8_linewrapped__nccl_issue740.log": [
        (1, "broadcast", 16384, "int8", 8, "0x155468002fb0", None, None, 0, 3, "se01gn002", 3874078, 0),
        (3, "broadcast", 16384, "int8", 8, "0x155468002fb0", None, None, 0, 3, "se01gn002", 3874080, 0),
        (5, "broadcast", 16384, "int8", 8, "0x155468002fb0", None, None, 0, 3, "se01gn002", 3874076, 0),
        (7, "broadcast", 16384, "int8", 8, "0x15545c002fb0", None, None, 0, 4, "se01gn002", 3874075, 0)],
    "nccl_coll_send_nilsendbuff_v2.14.3__nccl_issue734.log": [
        (1, "send", 257536, F32, 2, "0x7ff73c00d690", None, None, 0, 1, None, None, None)],
    "nccl_coll_sendrecv_oldformat__nccl_issue584.log": [
        (1, "send", 2420736, F32, 2, "0x7f5128002e10", None, None, 0, 1, "ubuntu", 199574, 1),
        (2, "send", 2420736, F32, 2, "0x7f5128002e10", None, None, 1, 1, "ubuntu", 199574, 1),
        (3, "send", 2420736, F32, 2, "0x7f5128002e10", None, None, 2, 1, "ubuntu", 199574, 1),
        (4, "send", 2420736, F32, 2, "0x7f5128002e10", None, None, 3, 1, "ubuntu", 199574, 1),
        (8, "send", 2420736, F32, 2, "0x7f516c002e10", None, None, 0, 0, "ubuntu", 199574, 1),
        (9, "send", 2420736, F32, 2, "0x7f516c002e10", None, None, 1, 0, "ubuntu", 199574, 1),
        (10, "recv", 2420736, F32, 2, "0x7f5128002e10", None, None, 4, 1, "ubuntu", 199574, 1)],
    "nccl_coll_tp_allgather_reducescatter__torchtitan_issue1369.log": [
        (1, "all_gather", 2097152, F32, 2, "0x55fca23fc0f0", None, None, 0, None, "hopper01", 191370, 1),
        (2, "reduce_scatter", 2097152, F32, 2, "0x55e290bd32d0", None, None, 0, None, "hopper01", 191369, 0),
        (3, "all_gather", 2097152, F32, 2, "0x55e290bd32d0", None, None, 1, None, "hopper01", 191369, 0),
        (4, "reduce_scatter", 2097152, F32, 2, "0x55fca23fc0f0", None, None, 1, None, "hopper01", 191370, 1),
        (5, "all_gather", 2097152, F32, 2, "0x55fca23fc0f0", None, None, 2, None, "hopper01", 191370, 1),
        (6, AR, 1, F32, 2, "0x55e290bd32d0", None, None, 2, None, "hopper01", 191369, 0),
        (7, AR, 1, F32, 2, "0x55e290bd32d0", None, None, 3, None, "hopper01", 191369, 0)],
    "nccl_docs_logging_examples_v2.30__nccl_docs_logging_rst.txt": [
        (15, AR, 2, F32, 2, "0x...", None, None, 0, None, "node-01", 1896279, 0),
        (16, AR, 2, F32, 2, "0x...", None, None, 1, None, "node-01", 1896279, 0)],
}

# comms of the INIT / PyTorch fixtures: (group_id, nranks, group_rank, rank, host, pid, comm)
EXPECTED_COMMS = {
    "nccl_init_complete_2.18-2.20_format__nccl_issue1814.log": [
        ("0x5ae77eb5ea4ec1ee", 64, r, r, "hostname-test", pid, comm) for r, pid, comm in [
            (36, 984, "0x557fe785f7a0"), (34, 982, "0x560dfc7a10e0"),
            (32, 980, "0x55986b8b8560"), (35, 983, "0x55f01c18e490")]],
    # One process, 8 GPUs: each comm is its own (pid, cudaDev) rank.
    "nccl_init_complete_ncclCommInitRank_format__nccl_issue1412.log": [
        ("0x49bbd7790311d5eb", 16, r, r, "swat1-04", 2017630, comm) for r, comm in [
            (6, "0x8ec0ac0"), (4, "0x8e48640"), (0, "0x8d57d40"), (1, "0x8d93f80"),
            (5, "0x8e84880")]],
    # 2.4: no commId, so the identity is process-local (the same pointer in two processes).
    "nccl_init_complete_v2.4_format__nccltests_issue29.log": [
        (f"local:{h}:{pid}:{comm}", 32, r, r, h, pid, comm) for r, h, pid, comm in [
            (15, "server2", 23920, "0x7f5780001ca0"), (17, "server3", 15217, "0x7fd178001ca0"),
            (9, "server2", 23914, "0x7f7e7c001ca0"), (20, "server3", 15220, "0x7f7e7c001ca0")]],
    "nccl_init_start_2.29plus_prefixstripped__nccl_issue2241.log": [
        ("0x3a2114e6388df547", 2, 0, 0, None, None, "0x7213b7800000"),
        ("0x3a2114e6388df547", 2, 1, 1, None, None, "0x7213b0e8c000")],
    "pytorch_pgnccl_created_ncclComm_rocm__unattributed_file.log": [
        ("torch_pg:0", None, r, r, None, None, comm) for r, comm in [
            (5, "0x555b8d27b370"), (4, "0x55cec3d7ed80"), (3, "0x55b616e29000"),
            (7, "0x5646eabe8fc0"), (0, "0x55efff5bd950")]],
    "nccl_docs_logging_examples_v2.30__nccl_docs_logging_rst.txt": [
        ("0x...", 2, 0, 0, "node-01", 1895902, "0x..."),
        ("local:node-01:1896279:0x...", 2, None, None, "node-01", 1896279, "0x...")],
}

# (ignored NCCL lines by kind, plain lines, continuation lines) where worth pinning
EXPECTED_STATS = {
    "nccl_docs_logging_examples_v2.30__nccl_docs_logging_rst.txt":
        ({"WARN": 1, "CALL": 4, "INFO (other subsystems)": 14}, 11, 0),
    "nccl_tuning_v2.21-2.22_format_mpirun_prefixed__nccl_issue1453.log":
        ({"INFO (other subsystems)": 4}, 1, 0),
    "nccl_coll_broadcast_uint8_linewrapped__nccl_issue740.log": ({}, 0, 4),
    "nccl_coll_sendrecv_oldformat__nccl_issue584.log": ({}, 3, 0),
    "nccl_init_complete_ncclCommInitRank_format__nccl_issue1412.log":
        ({"INFO (other subsystems)": 3}, 0, 0),
    "nccl_inspector_output_examples__nccl_plugins_profiler_inspector_README.txt": ({}, 82, 0),
    "nccl_profiler_plugin_example_trace__nccl_issue1765.json.txt": ({}, 5, 0),
    "nccl_profiler_plugin_example_trace_v5__nccl_pr1973.json.txt": ({}, 5, 0),
    "pytorch_pgnccl_created_ncclComm_rocm__unattributed_file.log": ({}, 3, 0),
}

ALL_FIXTURES = sorted(set(EXPECTED_EVENTS) | set(EXPECTED_COMMS) | set(EXPECTED_STATS))


def test_every_nccl_fixture_has_expectations(shared_fixtures):
    assert sorted(p.name for p in (shared_fixtures / "nccl").iterdir()) == ALL_FIXTURES


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fixture_events_comms_and_no_issues(shared_fixtures, name):
    res = _parse(shared_fixtures, name)
    assert [_key(ev) for ev in res.events] == EXPECTED_EVENTS.get(name, [])
    assert res.issues == []  # none of the real fixtures has an unreadable line
    if name in EXPECTED_COMMS:
        got = [(c.group_id, c.nranks, c.group_rank, c.rank, c.host, c.pid, c.comm)
               for c in res.comms]
        assert got == EXPECTED_COMMS[name]
    if name in EXPECTED_STATS:
        ignored, plain, cont = EXPECTED_STATS[name]
        assert (dict(res.stats.ignored), res.stats.plain_lines,
                res.stats.continuation_lines) == (ignored, plain, cont)
    assert "unreadable lines: 0" in res.summary()


def test_pytorch_comm_lines_have_no_device_where_the_raw_byte_was_lost(shared_fixtures):
    path = shared_fixtures / "nccl" / "pytorch_pgnccl_created_ncclComm_rocm__unattributed_file.log"
    with open(path) as f:
        recs = list(iter_nccl_records(f))
    assert [(r.pg, r.pg_name, r.group_rank, r.cuda_dev, r.tid) for r in recs][:2] == [
        ("0", "default_pg", 5, None, 58629), ("0", "default_pg", 4, None, 58628)]
    # As PyTorch prints it: c10::DeviceIndex streamed as a raw int8_t character.
    raw = ("I0527 15:16:57.738664 58629 ProcessGroupNCCL.cpp:2183] [PG 1 (tp) Rank 1] "
           "ProcessGroupNCCL created ncclComm_ 0x55 on CUDA device: \x05\n")
    (rec,) = iter_nccl_records([raw])
    assert (rec.pg, rec.pg_name, rec.cuda_dev) == ("1", "tp", 5)


# ------------------------------------------------------------------ edge cases (synthetic)

P = "node-01:100:100 [0] NCCL INFO "
COLL = ("AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count 8 datatype 7 op 0 root 0 "
        "comm 0xc0 [nranks=2] stream 0x5")


def _lines(*lines: str) -> list[tuple[str, list[str]]]:
    return [("mem", [ln + "\n" for ln in lines])]


def test_truncated_last_line_is_an_issue_not_an_event():
    res = parse_nccl_logs(_lines(P + COLL, P + COLL[:60]))
    assert len(res.events) == 1
    (issue,) = res.issues
    assert (issue.file, issue.line_no) == ("mem", 2)
    assert "at end of input" in issue.reason
    with pytest.raises(NcclLogError, match="mem:2"):
        parse_nccl_logs(_lines(P + COLL, P + COLL[:60]), strict=True)


def test_wrap_before_count_is_joined_and_cut_before_next_record_is_an_issue():
    cut = COLL.index(" count")
    res = parse_nccl_logs(_lines(P + COLL[:cut], COLL[cut:], P + COLL[:cut], P + COLL))
    assert [(_key(e)[0], e.count, e.seq) for e in res.events] == [(1, 8, 0), (4, 8, 1)]
    assert [(i.line_no, "truncated" in i.reason) for i in res.issues] == [(3, True)]
    assert res.stats.continuation_lines == 1


def test_unknown_datatype_keeps_the_event_and_reports_it():
    res = parse_nccl_logs(_lines(P + COLL.replace("datatype 7", "datatype 13")))
    (ev,) = res.events
    assert (ev.dtype, ev.count, ev.msg_bytes) == (None, 8, None)
    (issue,) = res.issues
    assert "unknown datatype 13" in issue.reason


def test_gather_scatter_are_events_and_alltoallv_an_unsupported_op_issue():
    """NCCL 2.28+ Gather / Scatter: count is per rank (send count of gather, receive count of
    scatter), root kept; AllToAllv has no canonical op."""
    gather = COLL.replace("AllReduce", "Gather").replace("root 0", "root 1")
    res = parse_nccl_logs(_lines(P + gather, P + COLL.replace("AllReduce", "Scatter"),
                                 P + COLL.replace("AllReduce", "AllToAllv")))
    assert [(e.op, e.count, e.msg_bytes, e.root, e.seq) for e in res.events] == [
        ("gather", 8, 32, 1, 0), ("scatter", 8, 32, 0, 1)]
    assert [i.reason.split(" (")[0] for i in res.issues] == ["unsupported op 'AllToAllv'"]


def test_interleaved_records_on_one_physical_line_and_foreign_prefixes():
    ts = "[2026-05-05 06:16:47.250] "
    line = ("(RayTrainWorker pid=7, ip=10.0.0.2) " + ts + P + COLL
            + "[1] node-02:200:201 [3] NCCL INFO " + COLL.replace("0xc0", "0xd0") + "   ")
    res = parse_nccl_logs(_lines("step 1 loss 3.2", line))
    assert [(e.host, e.pid, e.cuda_dev, e.comm, _key(e)[0]) for e in res.events] == [
        ("node-01", 100, 0, "0xc0", 2), ("node-02", 200, 3, "0xd0", 2)]
    assert res.events[0].t_start_ns == 1777961807_250_000_000
    assert res.events[1].t_start_ns is None
    assert res.issues == [] and res.stats.plain_lines == 1


def test_split_comms_share_group_id_across_processes_and_pointer_reuse_restarts_seq():
    files = []
    for rank in range(4):
        host, pid, dev = "n0", 1000 + rank, rank
        pre = R.prefix(host, pid, pid, dev)
        world, tp = f"0xa{rank}", f"0xb{rank}"
        lines = [pre + R.init_line(version="2.24", comm=world, rank=rank, nranks=4,
                                   cuda_dev=dev, comm_id="0xfeed"),
                 pre + R.init_line(version="2.24", comm=tp, rank=rank % 2, nranks=2,
                                   cuda_dev=dev, parent=world, color=rank // 2, key=rank,
                                   split_count=1),
                 pre + COLL.replace("0xc0", tp),
                 pre + f"comm {tp} rank {rank % 2} nranks 2 cudaDev {dev} busId 1 - Destroy COMPLETE",
                 pre + R.init_line(version="2.24", comm=tp, rank=rank % 2, nranks=2,
                                   cuda_dev=dev, parent=world, color=rank // 2, key=rank,
                                   split_count=2),
                 pre + COLL.replace("0xc0", tp)]
        files.append((f"rank{rank}.log", [ln + "\n" for ln in lines]))
    res = parse_nccl_logs(files)
    assert res.issues == []
    got = [(e.rank, e.group_id, e.group_rank, e.group_size, e.seq) for e in res.events]
    assert got == [(r, f"0xfeed/split{s}/color{r // 2}", r % 2, 2, 0)
                   for r in range(4) for s in (1, 2)]


def test_init_after_coll_in_a_mixed_stream_is_resolved_by_parse_but_not_by_streaming():
    lines = _lines(P + COLL, P + R.init_line(version="2.21", comm="0xc0", rank=1, nranks=2,
                                             cuda_dev=0, comm_id="0x77"))
    (ev,) = parse_nccl_logs(lines).events
    assert (ev.rank, ev.group_rank, ev.group_id) == (1, 1, "0x77")
    (ev,) = iter_nccl_events(lines)
    assert (ev.rank, ev.group_rank, ev.group_id) == (None, None, "local:node-01:100:0xc0")


def test_nranks_disagreeing_with_init_is_an_issue():
    res = parse_nccl_logs(_lines(
        P + R.init_line(version="2.18", comm="0xc0", rank=0, nranks=4, cuda_dev=0,
                        comm_id="0x1"), P + COLL))
    assert res.events == [] and "nranks=2 disagrees" in res.issues[0].reason


def test_four_rank_run_rendered_per_process_parses_back_exactly(tmp_path):
    """4 ranks, world comm (commId) + 2 TP split comms, several ops, one file per process,
    NCCL 2.21 INIT format with START and COMPLETE lines, 2.26+ timestamps."""
    expected = []
    for rank in range(4):
        host, pid, dev = f"node{rank // 2}", 5000 + rank, rank % 2
        world, tp = f"0x7f00{rank}0", f"0x7f00{rank}8"
        tp_id = f"0xtp{rank // 2}"
        lines = [
            R.prefix(host, pid, pid, dev) + R.init_line(
                version="2.21", comm=world, rank=rank, nranks=4, cuda_dev=dev,
                comm_id="0x5ae7", state=s) for s in ("START", "COMPLETE")]
        lines.append(R.prefix(host, pid, pid + 1, dev) + R.init_line(
            version="2.21", comm=tp, rank=rank % 2, nranks=2, cuda_dev=dev, parent=world,
            color=rank // 2, key=rank, comm_id=tp_id))
        calls = [("broadcast", world, 4, 0, "0x5ae7", 1000, "bfloat16", 0),
                 ("all_gather", tp, 2, None, tp_id, 512, "float32", None),
                 ("reduce", world, 4, 0, "0x5ae7", 1000, "bfloat16", 2),
                 ("all_reduce", world, 4, 0, "0x5ae7", 1, "float32", None),
                 ("reduce_scatter", tp, 2, None, tp_id, 256, "float32", None),
                 ("send", tp, 2, None, tp_id, 77, "uint8", 1 - rank % 2),
                 ("all_to_all", world, 4, 0, "0x5ae7", 9, "int64", None)]
        seqs: dict[str, int] = {}
        for i, (op, comm, n, _, gid, count, dtype, root) in enumerate(calls):
            seq = seqs[comm] = seqs.get(comm, -1) + 1
            ev = CollectiveEvent(
                source="nccl_log", op=op, rank=rank, group_id=gid, group_size=n,
                group_rank=rank if n == 4 else rank % 2, seq=seq, count=count, dtype=dtype,
                root=root, t_start_ns=1_700_000_000_000_000_000 + i * 1000_000,
                source_ref=f"{tmp_path / f'nccl.{host}.{pid}'}:{len(lines) + 1}", pid=pid,
                host=host, cuda_dev=dev, comm=comm)
            lines.append(R.event_line(ev, opcount=i))
            expected.append(ev)
        (tmp_path / f"nccl.{host}.{pid}").write_text("\n".join(lines) + "\n")
    res = parse_nccl_logs(tmp_path)
    assert res.issues == []
    assert sorted(res.events, key=lambda e: e.source_ref) == sorted(
        expected, key=lambda e: e.source_ref)
    # the same through the streaming path
    assert sorted(iter_nccl_events(tmp_path), key=lambda e: e.source_ref) == sorted(
        expected, key=lambda e: e.source_ref)


def test_streaming_memory_does_not_grow_with_the_log():
    import tracemalloc

    def lines(n):
        for i in range(n):
            yield P + COLL.replace("opCount 0", f"opCount {i:x}") + "\n"

    peaks = []
    for n in (1_000, 8_000):
        stats = ParseStats()
        tracemalloc.start()
        count = sum(1 for _ in iter_nccl_events([("gen", lines(n))], stats=stats))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert count == n == stats.coll_lines
    assert peaks[1] < peaks[0] * 1.5 + 64 * 1024, peaks


# ------------------------------------------------------------------ CLI


def cli_main(argv: list[str]) -> int:
    """``dmuon-trace nccl ...`` through this module's register_cli only (tracer.cli also
    imports the other subcommands' modules)."""
    import argparse

    parser = argparse.ArgumentParser(prog="dmuon-trace")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_help_explains_inputs_outputs_and_columns(capsys):
    with pytest.raises(SystemExit):
        cli_main(["nccl", "--help"])
    text = capsys.readouterr().out
    for word in ("NCCL_DEBUG_SUBSYS=INIT,COLL", "group_id", "cuda_dev", "exit status", "--strict"):
        assert word in text


def test_cli_writes_events_and_summary(shared_fixtures, tmp_path, capsys):
    out = tmp_path / "events.parquet"
    rc = cli_main(["nccl", str(shared_fixtures / "nccl"), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    events = read_parquet(out)
    assert len(events) == sum(len(v) for v in EXPECTED_EVENTS.values())
    assert "broadcast" in text and "0x5ae77eb5ea4ec1ee" in text and "unreadable lines: 0" in text


def test_cli_exit_codes(tmp_path, capsys):
    bad = tmp_path / "bad.log"
    bad.write_text(P + COLL + "\n" + P + COLL[:40] + "\n")
    out = str(tmp_path / "e.parquet")
    assert cli_main(["nccl", str(bad), "--out", out]) == 0
    assert "bad.log:2: truncated" in capsys.readouterr().out
    assert cli_main(["nccl", str(bad), "--out", out, "--strict"]) == 2
    assert "bad.log:2" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text("hello\n")
    assert cli_main(["nccl", str(empty), "--out", out]) == 3
    assert cli_main(["nccl", str(tmp_path / "missing"), "--out", out]) == 2
    assert "Must be an existing file or directory" in capsys.readouterr().err


def test_streaming_issues_are_collected_or_warned_never_dropped():
    lines = _lines(P + COLL, P + COLL[:50])
    issues: list = []
    assert len(list(iter_nccl_events(lines, issues=issues))) == 1
    assert [i.line_no for i in issues] == [2]
    with pytest.warns(UserWarning, match="1 unreadable NCCL log line"):
        list(iter_nccl_events(lines))


def test_rccl_trailing_fields_and_crlf_line_ends():
    res = parse_nccl_logs([("rccl", [P + COLL + " task 0 globalrank 3\r\n", P + COLL + "\r\n"])])
    assert [(e.op, e.count, e.seq) for e in res.events] == [("all_reduce", 8, 0),
                                                           ("all_reduce", 8, 1)]
    assert res.issues == []


def test_impossible_timestamp_is_an_issue_and_the_event_is_kept():
    res = parse_nccl_logs(_lines("[2026-13-45 99:99:99] " + P + COLL))
    assert [(e.t_start_ns, e.count) for e in res.events] == [(None, 8)]
    (issue,) = res.issues
    assert (issue.line_no, issue.text) == (1, "[2026-13-45 99:99:99]")
    assert "no month 13" in issue.reason and "t_start_ns empty" in issue.reason


# ------------------------------------------------------------------ lost prefixes

TT = "nccl_coll_tp_allgather_reducescatter__torchtitan_issue1369.log"


def _fixture_lines(shared_fixtures, name: str) -> list[str]:
    with open(shared_fixtures / "nccl" / name) as f:
        return [ln.rstrip("\n") for ln in f]


def _cut(line: str) -> str:
    """The message of a real line, its 'host:pid:tid [dev] NCCL INFO ' prefix lost."""
    return line.split("NCCL INFO ", 1)[1]


def test_lost_prefix_lines_cut_from_real_logs_are_unattributed_events(shared_fixtures):
    tt = _fixture_lines(shared_fixtures, TT)
    send = _fixture_lines(shared_fixtures, "nccl_coll_sendrecv_oldformat__nccl_issue584.log")
    lines = [tt[0], _cut(tt[1]),  # alone on its line
             "step 3 loss 2.5 " + _cut(tt[2]),  # after another process's text
             tt[3] + _cut(send[0]),  # glued to a complete record
             _cut(tt[4]) + tt[5],  # a prefixed record glued after it
             "x" + _cut(send[1])]  # letters glued to the op name: one op name fits
    res = parse_nccl_logs([("mixed", [ln + "\n" for ln in lines])])
    assert res.issues == []
    got = [(e.source_ref, e.op, e.count, e.host, e.pid, e.rank, e.group_id, e.seq,
            e.group_size) for e in res.events]
    una = [g for g in got if g[3] is None]
    assert [(g[0], g[1]) for g in una] == [("mixed:2", "reduce_scatter"), ("mixed:3", "all_gather"),
                                          ("mixed:4", "send"), ("mixed:5", "all_gather"),
                                          ("mixed:6", "send")]
    assert all(g[4:8] == (None, None, None, None) and g[8] == 2 for g in una)
    assert [g[3] for g in got if g[3] is not None] == ["hopper01"] * 3  # not "0x…hopper01"
    assert res.stats.unattributed == 5 and res.stats.plain_lines == 0
    assert "5 unattributed COLL" in res.summary()
    # the prefixed calls keep their own numbering (lines 1 and 4: pid 191370, line 5: pid
    # 191369, whose earlier calls lost their prefix): unattributed rows count in no seq
    assert [(g[0], g[4], g[7]) for g in got if g[3] is not None] == [
        ("mixed:1", 191370, 0), ("mixed:4", 191370, 1), ("mixed:5", 191369, 0)]
    parse_nccl_logs([("mixed", lines)], strict=True)  # not an issue


def test_lost_prefix_edge_cases():
    lost = COLL.replace("AllReduce", "AllGather")
    res = parse_nccl_logs(_lines(
        P + COLL + " 0x1f" + lost,  # stream hex glued: "fAllGather" is AllGather or Gather
        lost[:40], lost[40:],  # a lost-prefix record wrapped: joined like any other
        P + COLL[:40], lost))  # a wrapped record is not continued by another record
    assert [(e.source_ref, e.host) for e in res.events] == [
        ("mem:1", "node-01"), ("mem:2", None), ("mem:5", None)]
    assert [(i.line_no, i.reason.split(" (")[0]) for i in res.issues] == [
        (1, "COLL line without its prefix whose op name is glued to the text before it"),
        (4, "truncated or malformed COLL line after joining 0 following line(s)")]
    assert "('fAllGather': the op is AllGather or Gather)" in res.issues[0].reason


def test_prefix_stripped_but_marker_kept_is_the_file_process_not_unattributed(shared_fixtures):
    res = _parse(shared_fixtures, "nccl_coll_send_nilsendbuff_v2.14.3__nccl_issue734.log")
    (ev,) = res.events
    assert (ev.seq, ev.group_id.startswith("local:"), res.stats.unattributed) == (0, True, 0)


# ------------------------------------------------------------------ damaged bytes and numbers


def test_invalid_utf8_line_is_an_issue_with_file_and_line_and_the_rest_parses(tmp_path):
    path = tmp_path / "bad.log"
    path.write_bytes((P + COLL + "\n").encode() + b"host\xff:1:1 [0] NCCL INFO " + COLL.encode()
                     + b"\nplain \xc3\x28 text\n" + (P + COLL + "\n").encode())
    res = parse_nccl_logs(path)
    assert [e.source_ref for e in res.events] == [f"{path}:1", f"{path}:4"]
    assert [(i.file, i.line_no, i.reason) for i in res.issues] == [
        (str(path), 2, "invalid UTF-8 (byte 0xff at column 5); line not parsed"),
        (str(path), 3, "invalid UTF-8 (byte 0xc3 at column 7); line not parsed")]
    assert "host\\udcff:1:1" in res.issues[0].text  # shown escaped, printable
    assert [e.seq for e in res.events] == [0, 1]


@pytest.mark.parametrize("line, reason", [
    (P + COLL.replace("count 8", "count " + "9" * 5000), "count <more than 40 digits> out of"),
    ("h:" + "1" * 1000 + ":1 [0] NCCL INFO " + COLL, "pid <more than 40 digits> out of"),
    ("h:" + "1" * 5000 + ":1 [0] NCCL INFO " + COLL, "the 'host:pid:tid [dev]' prefix runs "
     "past 4,096 characters"),
    (P + COLL.replace("root 0", "root -" + "1" * 99).replace("AllReduce", "Broadcast"),
     "root -<more than 40 digits> out of"),
])
def test_numbers_int_refuses_are_issues_not_tracebacks(line, reason):
    """int() raises beyond 4300 digits; such numbers are out of every column's range."""
    res = parse_nccl_logs(_lines(line, P + COLL))
    assert len(res.events) == 1 and res.issues[0].reason.startswith(reason)


def test_non_ascii_digits_are_not_numbers():
    """'²'.isdigit() is True but int('²') raises; NCCL and PyTorch print ASCII digits."""
    res = parse_nccl_logs(_lines(
        P + "comm 0xc0 rank 1 nranks 2 cudaDev 0 color \u00b2 key \u0663 - Init COMPLETE",
        "[PG 0 (default_pg) Rank 1] ProcessGroupNCCL created ncclComm_ 0xd0 on CUDA device: "
        "\u00b2", P + COLL.replace("count 8", "count \u0663")))
    assert res.events == [] and res.stats.init_lines == 1 and res.stats.torch_lines == 1
    (issue,) = res.issues
    assert issue.line_no == 3 and "malformed COLL line (field 'count'" in issue.reason
    comms = {c.comm: c for c in res.comms}
    assert comms["0xd0"].cuda_dev is None
