"""tracer.nsys.parse / tracer.nsys.payload against a real Nsight Systems export and small exports
built here with the same DDL.

Real fixture: ``nsys/nsys2026.2_h100_2gpu_nccl_sendrecv__nsys-ai_mfu_2gpu_after.sqlite`` from
GindaChen/nsys-ai tests/fixtures/mfu_2gpu_after.sqlite (MIT), a trimmed Nsight Systems 2026.2.1
export (schema 3.25.0) of a 2-GPU H100 run with NCCL 2.25.1, exported without blobs
(see ../shared/fixtures/SOURCES.md). The expected figures were counted independently with the
``sqlite3`` shell while writing these tests; the query is quoted next to each figure.
"""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from tests.nsys_builders import MAIN, REAL, build_export, global_tid, nsys_ddl
from tracer.events import OPS, read_parquet
from tracer.nsys.parse import NCCL_API_TO_OP, parse_nsys, probe_export, register_cli
from tracer.nsys.payload import locate_payload_fields



@pytest.fixture(scope="module")
def real(shared_fixtures):
    return parse_nsys(shared_fixtures / REAL)


# --- the real export ------------------------------------------------------------------------

def test_real_export_versions_and_flags(real):
    # SELECT name, value FROM META_DATA_EXPORT
    assert real.info.product_version == "2026.2.1.210"
    assert real.info.schema_version == "3.25.0"
    assert real.info.include_blobs is False


def test_real_export_ops_processes_and_non_collectives(real):
    # SELECT s.value, count(*) FROM NVTX_EVENTS e JOIN StringIds s ON s.id=e.textId
    #   WHERE e.domainId=1 GROUP BY 1  -> ncclSend 120, ncclRecv 120, ncclGroupStart 60,
    #   ncclGroupEnd 60, ncclCommCount 60 (420 rows in domain 1)
    ops = [ev.op for ev in real.events]
    assert len(ops) == 240
    assert ops.count("send") == 120 and ops.count("recv") == 120
    assert real.other_api_counts == {"ncclCommCount": 60, "ncclGroupStart": 60, "ncclGroupEnd": 60}
    # ... GROUP BY (globalTid>>24)&0xFFFFFF, globalTid&0xFFFFFF -> (148,148) and (149,149), 120 each
    assert {ev.pid for ev in real.events} == {148, 149}
    per_thread = real.details.groupby(["pid", "tid"]).size().to_dict()
    assert per_thread == {(148, 148): 120, (149, 149): 120}
    assert all(ev.source == "nsys" and ev.msg_bytes is None and ev.rank is None
               for ev in real.events)
    # No NvtxDomainCreate (eventType 75) row survived the trimming: the domain is inferred.
    assert real.nccl_domain_source.startswith("inferred")


def test_real_export_one_range_exactly(real, shared_fixtures):
    # SELECT rowid,start,end FROM NVTX_EVENTS WHERE textId=129496 ORDER BY start LIMIT 1
    #   -> 764 | 72905303822 | 72905306942 (ncclSend on globalTid 281477476515989)
    ref = f"{Path(REAL).name}#NVTX_EVENTS.764"
    (ev,) = [e for e in real.events if e.source_ref == ref]
    assert (ev.op, ev.pid, ev.t_start_ns, ev.t_end_ns) == ("send", 149, 72905303822, 72905306942)
    assert ev.cuda_dev == 1  # its kernel ran on deviceId 1 (CUPTI_ACTIVITY_KIND_KERNEL)
    row = real.details[real.details["source_ref"] == ref]
    assert (row["pid"].tolist(), row["tid"].tolist()) == ([149], [149])  # globalTid 281477476515989


def test_real_export_kernels_linked_through_group_end(real):
    # SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id=k.shortName
    #   WHERE s.value LIKE 'ncclDevKernel%'  -> 62 (and 0 'ncclKernel%')
    # Linked: same correlationId in CUPTI_ACTIVITY_KIND_RUNTIME of the same process
    #   ((r.globalTid>>24)=(k.globalPid>>24)) and the launch inside an ncclGroupEnd range on the
    #   launching thread -> 60; the other 2 were launched before the trimmed window.
    k = real.kernels
    assert len(k) == 62 and set(k["kernel_name"]) == {"ncclDevKernel_SendRecv"}
    linked = k[k["unlinked_reason"].isna()]
    assert len(linked) == 60
    assert set(linked["launch_range"]) == {"ncclGroupEnd"}
    assert set(linked["linked_events"]) == {4}  # 2 ncclSend + 2 ncclRecv per group
    assert k["unlinked_reason"].dropna().str.startswith("launch call not in").all()
    # SUM(k.end-k.start) over kernels with a same-process launch row -> 33515702 ns
    assert int(linked["gpu_dur_ns"].sum()) == 33515702
    d = real.details
    assert (d["n_kernels"] == 1).all() and (d["kernel_shared_by"] == 4).all()
    assert d["nccl_group"].notna().all()
    # 30 groups per thread, each named by its per-thread index 0..29
    assert sorted(d[d["pid"] == 148]["nccl_group"].unique()) == list(range(30))


def test_real_export_sizes_unavailable_with_reason(real):
    reason = real.sizes_unavailable_reason
    assert "EXPORT_PARAM_INCLUDE_BLOBS=false" in reason
    assert "binaryData is NULL on all 240" in reason
    assert "--include-blobs=true" in reason
    # SELECT DISTINCT schemaId FROM NVTX_PAYLOAD_SCHEMA_ENTRIES WHERE name='Message size [bytes]'
    f = real.payload_fields
    sizes = sorted(f[f["field"] == "msg_bytes"]["schema_id"].unique())
    assert sizes == [16777220, 16777222, 16777223, 16777225, 16777226]
    assert set(f[f["field"] == "msg_bytes"]["offset_bytes"]) == {8}
    # ... WHERE name='NCCL communicator ID' -> 8 schemas (duplicated rows deduplicated)
    assert len(f[f["field"] == "comm"]) == 8


def _cli(argv: list[str]) -> int:
    """``dmuon-trace`` with only this subcommand (the other modules are tested elsewhere)."""
    parser = argparse.ArgumentParser(prog="dmuon-trace")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_writes_parquet_and_summary(shared_fixtures, tmp_path, capsys):
    out = tmp_path / "events.parquet"
    rc = _cli(["nsys", str(shared_fixtures / REAL), "--out", str(out),
                   "--details-out", str(tmp_path / "d.parquet")])
    assert rc == 0
    assert len(read_parquet(out)) == 240
    text = capsys.readouterr().out
    assert "NCCL kernels: 62, linked to ranges: 60" in text
    assert "sizes unavailable: exported without blobs" in text
    assert (tmp_path / "d.parquet").is_file()


def test_cli_help_and_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _cli(["nsys", "--help"])
    assert "t_start_ns" in capsys.readouterr().out
    bad = tmp_path / "x.sqlite"
    bad.write_text("not sqlite at all" * 100)
    assert _cli(["nsys", str(bad), "--out", str(tmp_path / "e.parquet")]) == 2
    assert "not an SQLite file" in capsys.readouterr().err


# --- small exports with the real DDL -------------------------------------------------------

@pytest.fixture(scope="module")
def ddl(shared_fixtures):
    return nsys_ddl(shared_fixtures)


AUTOGRAD, OTHER_PROC = global_tid(10, 11), global_tid(20, 20)
NCCL_DOM, DMUON_DOM = 3, 4
KERNEL_NAME = 1


def _col(frame, name: str) -> list:
    """A column as plain Python values, missing values as None."""
    return [None if pd.isna(v) else v for v in frame[name]]


def _attribution_export(tmp_path, ddl, **kw):
    create = [(0, None, 75, "NCCL", MAIN, NCCL_DOM), (0, None, 75, "DMuon", MAIN, DMUON_DOM)]
    nvtx = create + [
        (50, 5000, 59, "dmuon.window dmuon-z3", MAIN, DMUON_DOM),  # a window, not a module span
        (100, 1000, 59, "dmuon.phase forward", MAIN, DMUON_DOM),
        (110, 400, 59, "dmuon.broadcast blocks.0.mlp.fc1 owner=2", MAIN, DMUON_DOM),
        (120, 200, 59, "ncclBroadcast", MAIN, NCCL_DOM),           # forward, fc1, owner 2
        (500, 900, 59, "dmuon.broadcast blocks.1.attn owner=0", MAIN, DMUON_DOM),
        (510, 600, 59, "ncclGroupStart", MAIN, NCCL_DOM),
        (610, 650, 59, "ncclBroadcast", MAIN, NCCL_DOM),            # grouped, fc in blocks.1
        (660, 700, 59, "ncclBroadcast", MAIN, NCCL_DOM),
        (710, 800, 59, "ncclGroupEnd", MAIN, NCCL_DOM),
        (1100, 1300, 59, "ncclAllReduce", MAIN, NCCL_DOM),          # outside every DMuon range
        (2000, 3000, 59, "dmuon.phase backward", MAIN, DMUON_DOM),
        (2100, 2900, 59, "dmuon.reduce blocks.0.mlp.fc1 owner=2", AUTOGRAD, DMUON_DOM),
        (2200, 2300, 59, "ncclReduce", AUTOGRAD, NCCL_DOM),         # phase from another thread
        (2400, 2500, 59, "ncclGroupEnd", AUTOGRAD, NCCL_DOM),       # its GroupStart not captured
    ]
    strings = [(KERNEL_NAME, "ncclDevKernel_Broadcast_RING_LL"), (2, "cuLaunchKernelEx"),
               (3, "vectorized_elementwise_kernel")]
    runtime = [(150, 160, MAIN, 7, 2), (720, 730, MAIN, 8, 2), (1150, 1160, MAIN, 9, 2),
               (20, 30, OTHER_PROC, 9, 2)]  # correlationId 9 repeats in another process
    kernels = [(5000, 5600, 0, 7, global_tid(10, 0), KERNEL_NAME),
               (6000, 6300, 0, 8, global_tid(10, 0), KERNEL_NAME),
               (7000, 7100, 0, 9, global_tid(10, 0), KERNEL_NAME),
               (7200, 7300, 0, 10, global_tid(10, 0), 3)]  # not an NCCL kernel: ignored
    return build_export(tmp_path / "attr.sqlite", ddl, strings=strings, nvtx=nvtx,
                        kernels=kernels, runtime=runtime, **kw)


def test_attribution_by_containment_and_kernel_links(tmp_path, ddl):
    res = parse_nsys(_attribution_export(tmp_path, ddl))
    assert res.nccl_domain_source == "from NvtxDomainCreate rows"
    got = [(e.op, e.phase, e.module, e.t_start_ns) for e in res.events]
    assert got == [
        ("broadcast", "forward", "blocks.0.mlp.fc1", 120),
        ("broadcast", "forward", "blocks.1.attn", 610),
        ("broadcast", "forward", "blocks.1.attn", 660),
        ("all_reduce", None, None, 1100),
        ("reduce", "backward", "blocks.0.mlp.fc1", 2200),
    ]
    assert _col(res.details, "owner") == [2, 0, 0, None, 2]
    assert _col(res.details, "phase_match") == ["thread"] * 3 + [None, "process"]
    assert _col(res.details, "tid") == [10, 10, 10, 10, 11]
    # kernels: own range (corr 7), group end -> both grouped broadcasts (corr 8), own range
    # (corr 9, the same id in pid 20 is ignored); the elementwise kernel is not NCCL.
    assert _col(res.details, "gpu_dur_ns") == [600, 300, 300, 100, None]
    assert _col(res.details, "kernel_shared_by") == [1, 2, 2, 1, None]
    assert _col(res.details, "nccl_group") == [None, 0, 0, None, None]
    assert res.other_api_counts == {"ncclGroupStart": 1, "ncclGroupEnd": 2}
    assert len(res.kernels) == 3 and res.kernels["unlinked_reason"].isna().all()
    assert res.n_dmuon_ranges == 6
    (window,) = res.windows
    assert (window.name, window.pid, window.t_start_ns, window.t_end_ns) == ("dmuon-z3", 10, 50, 5000)
    assert all(window.contains(e) for e in res.events)


def test_blobs_present_are_not_decoded(tmp_path, ddl):
    nvtx = [(0, None, 75, "NCCL", MAIN, 9), (10, 20, 59, "ncclAllGather", MAIN, 9, b"\x01" * 24),
            (30, 40, 59, "ncclBroadcast", MAIN, 9, None)]
    # Schema ids and names as NCCL 2.16-2.24 register them ("Bytes" for Broadcast).
    entries = [(9, 77, 0, "NCCL communicator ID", None), (9, 77, 1, "Message size [bytes]", 8),
               (9, 78, 0, "Bytes", 8)]
    res = parse_nsys(build_export(tmp_path / "b.sqlite", ddl, nvtx=nvtx, entries=entries))
    assert [e.msg_bytes for e in res.events] == [None, None]
    assert res.sizes_unavailable_reason.startswith("binaryData present on 1 of 2 NCCL")
    assert "no decoder has been validated" in res.sizes_unavailable_reason
    f = res.payload_fields
    assert sorted(zip(f["schema_id"], f["field"], f["entry_name"])) == [
        (77, "comm", "NCCL communicator ID"), (77, "msg_bytes", "Message size [bytes]"),
        (78, "msg_bytes", "Bytes")]


def test_locate_payload_fields_only_in_nccl_domain(tmp_path, ddl):
    path = build_export(tmp_path / "p.sqlite", ddl, entries=[
        (1, 5, 1, "Message size [bytes]", 8), (2, 6, 1, "Message size [bytes]", 8)])
    conn = sqlite3.connect(path)
    info = probe_export(path)
    assert list(locate_payload_fields(conn, info.tables, {2})["schema_id"]) == [6]
    assert locate_payload_fields(conn, {}, {2}).empty
    conn.close()


def test_export_without_blobs_or_payload_tables(tmp_path, ddl):
    nvtx = [(10, 20, 59, "ncclAllReduce", MAIN, 1)]
    meta = {"EXPORT_SCHEMA_VERSION": "3.25.0", "EXPORT_PARAM_INCLUDE_BLOBS": "false"}
    res = parse_nsys(build_export(tmp_path / "n.sqlite", ddl, meta=meta, nvtx=nvtx, skip=(
        "NVTX_PAYLOAD_SCHEMAS", "NVTX_PAYLOAD_SCHEMA_ENTRIES", "CUPTI_ACTIVITY_KIND_KERNEL",
        "CUPTI_ACTIVITY_KIND_RUNTIME")))
    assert [e.op for e in res.events] == ["all_reduce"]
    assert "no NVTX_PAYLOAD_SCHEMA_ENTRIES table" in res.sizes_unavailable_reason
    assert "INCLUDE_BLOBS=false" in res.sizes_unavailable_reason
    assert any("CUPTI_ACTIVITY_KIND_KERNEL" in w for w in res.warnings)
    assert res.kernels.empty and res.details["n_kernels"].tolist() == [0]


def test_missing_nvtx_table_is_a_clear_error(tmp_path, ddl):
    path = build_export(tmp_path / "m.sqlite", ddl, skip=("NVTX_EVENTS",))
    with pytest.raises(ValueError, match=r"no NVTX_EVENTS table.*-t cuda,nvtx"):
        parse_nsys(path)


@pytest.mark.parametrize("version", ["4.0.0", None])
def test_unknown_schema_version_raises_unless_allowed(tmp_path, ddl, version):
    meta = {} if version is None else {"EXPORT_SCHEMA_VERSION": version}
    path = build_export(tmp_path / "v.sqlite", ddl, meta=meta,
                        nvtx=[(10, 20, 59, "ncclSend", MAIN, 1)])
    with pytest.raises(ValueError, match=f"schema_version={version!r}.*allow_unknown_schema"):
        parse_nsys(path)
    res = parse_nsys(path, allow_unknown_schema=True)
    assert [e.op for e in res.events] == ["send"]
    assert any("unknown export schema" in w for w in res.warnings)


def test_newer_minor_schema_warns_only(tmp_path, ddl):
    path = build_export(tmp_path / "w.sqlite", ddl, meta={"EXPORT_SCHEMA_VERSION": "3.26.0"},
                        nvtx=[(10, 20, 59, "ncclRecv", MAIN, 1)])
    res = parse_nsys(path)
    assert any("3.26.0 not validated" in w for w in res.warnings)


def test_not_an_export(tmp_path):
    with pytest.raises(ValueError, match="Must be an existing file"):
        parse_nsys(tmp_path / "absent.sqlite")
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(ValueError, match="without StringIds or META_DATA_EXPORT"):
        parse_nsys(other)


def test_op_table_covers_the_canonical_ops():
    assert set(NCCL_API_TO_OP.values()) == set(OPS) - {"barrier"}  # NCCL has no barrier call
    assert len(NCCL_API_TO_OP) == 10
