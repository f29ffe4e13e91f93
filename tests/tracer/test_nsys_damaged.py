"""nsys exports from elsewhere: an empty NVTX table, corrupt pages, NULL
thread ids, text where integers belong and invalid UTF-8 each get a defined outcome: no events
and a warning, a clear error naming the file, or a skipped row named by table, column, rowid."""

from __future__ import annotations

import random
import sqlite3

import pytest

from tests.nsys_builders import MAIN, REAL, build_export, global_tid, nsys_ddl
from tracer.cli import main as dmuon_trace
from tracer.events import write_parquet
from tracer.nsys.parse import parse_nsys

NCCL_DOM = 3


@pytest.fixture(scope="module")
def ddl(shared_fixtures):
    return nsys_ddl(shared_fixtures)


def _export(tmp_path, ddl, nvtx=None, **kw):
    rows = [(0, None, 75, "NCCL", MAIN, NCCL_DOM), (100, 200, 59, "ncclAllReduce", MAIN, NCCL_DOM),
            (300, 400, 59, "ncclBroadcast", MAIN, NCCL_DOM)] if nvtx is None else nvtx
    return build_export(tmp_path / "x.sqlite", ddl, nvtx=rows, **kw)


def _update(path, sql, *args):
    conn = sqlite3.connect(path)
    conn.execute(sql, args)
    conn.commit()
    conn.close()


def test_empty_nvtx_table_gives_no_events_and_a_warning(tmp_path, ddl, capsys):
    path = _export(tmp_path, ddl, nvtx=[])
    res = parse_nsys(path)
    assert res.events == [] and not res.issues
    assert any("NVTX_EVENTS is empty" in w for w in res.warnings)
    assert dmuon_trace(["nsys", str(path), "--out", str(tmp_path / "e.parquet")]) == 3
    assert "no NCCL collective ranges" in capsys.readouterr().err
    assert not (tmp_path / "e.parquet").exists()


def test_corrupt_pages_are_a_clear_error_naming_the_file(shared_fixtures, tmp_path, capsys):
    raw = bytearray((shared_fixtures / REAL).read_bytes())
    start = len(raw) // 2 // 4096 * 4096
    rng = random.Random(1)
    raw[start:start + 8 * 4096] = bytes(rng.getrandbits(8) for _ in range(8 * 4096))
    path = tmp_path / "corrupt.sqlite"
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"corrupt\.sqlite.*SQLite failed.*damaged or truncated"):
        parse_nsys(path)
    assert dmuon_trace(["nsys", str(path), "--out", str(tmp_path / "e.parquet")]) == 2
    assert "corrupt.sqlite" in capsys.readouterr().err
    truncated = tmp_path / "truncated.sqlite"
    truncated.write_bytes((shared_fixtures / REAL).read_bytes()[: 40 * 4096])
    with pytest.raises(ValueError, match=r"truncated\.sqlite"):
        parse_nsys(truncated)


@pytest.mark.parametrize("sql, column", [
    ("UPDATE NVTX_EVENTS SET globalTid = NULL WHERE text = 'ncclBroadcast'", "globalTid"),
    ("UPDATE NVTX_EVENTS SET start = 'soon' WHERE text = 'ncclBroadcast'", "start"),
    ("UPDATE NVTX_EVENTS SET end = 'later' WHERE text = 'ncclBroadcast'", "end"),
    ("UPDATE NVTX_EVENTS SET domainId = 'x' WHERE text = 'ncclBroadcast'", "domainId"),
    ("UPDATE NVTX_EVENTS SET start = 1.5 WHERE text = 'ncclBroadcast'", "start"),
    ("UPDATE NVTX_EVENTS SET text = X'0102' WHERE text = 'ncclBroadcast'", "name"),
])
def test_bad_value_skips_its_row_naming_table_column_rowid(tmp_path, ddl, sql, column):
    path = _export(tmp_path, ddl)
    rowid = sqlite3.connect(path).execute(
        "SELECT rowid FROM NVTX_EVENTS WHERE text = 'ncclBroadcast'").fetchone()[0]
    _update(path, sql)
    res = parse_nsys(path)
    assert [e.op for e in res.events] == ["all_reduce"]
    (issue,) = res.issues
    assert issue.startswith(f"x.sqlite#NVTX_EVENTS.{rowid}: column {column}=") and "skipped" in issue
    assert any("1 damaged row(s) skipped" in w for w in res.warnings)
    write_parquet(res.events, tmp_path / "e.parquet")


def test_invalid_utf8_in_a_range_name_skips_that_row(tmp_path, ddl):
    path = _export(tmp_path, ddl)
    _update(path, "UPDATE NVTX_EVENTS SET text = CAST(X'6e63636cff' AS TEXT) "
                  "WHERE text = 'ncclBroadcast'")
    res = parse_nsys(path)
    assert [e.op for e in res.events] == ["all_reduce"]
    assert len(res.issues) == 1 and "invalid UTF-8" in res.issues[0]


KERNEL, LAUNCH = 1, 2


def _with_kernels(tmp_path, ddl):
    strings = [(KERNEL, "ncclDevKernel_AllReduce_RING_LL"), (LAUNCH, "cuLaunchKernelEx")]
    runtime = [(150, 160, MAIN, 7, LAUNCH), (350, 360, MAIN, 8, LAUNCH)]
    kernels = [(1000, 1500, 0, 7, global_tid(10, 0), KERNEL),
               (2000, 2100, 0, 8, global_tid(10, 0), KERNEL)]
    return _export(tmp_path, ddl, strings=strings, runtime=runtime, kernels=kernels)


@pytest.mark.parametrize("sql, table, column", [
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET globalPid = NULL WHERE correlationId = 8",
     "CUPTI_ACTIVITY_KIND_KERNEL", "globalPid"),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'x' WHERE correlationId = 8",
     "CUPTI_ACTIVITY_KIND_KERNEL", "start"),
    ("UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET globalTid = NULL WHERE correlationId = 8",
     "CUPTI_ACTIVITY_KIND_RUNTIME", "globalTid"),
    ("UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET start = 'x' WHERE correlationId = 8",
     "CUPTI_ACTIVITY_KIND_RUNTIME", "start"),
])
def test_bad_kernel_or_launch_rows_are_issues(tmp_path, ddl, sql, table, column):
    path = _with_kernels(tmp_path, ddl)
    assert parse_nsys(path).details["n_kernels"].tolist() == [1, 1]
    _update(path, sql)
    res = parse_nsys(path)
    assert [e.op for e in res.events] == ["all_reduce", "broadcast"]
    assert res.details["n_kernels"].tolist() == [1, 0]
    (issue,) = res.issues
    assert f"#{table}." in issue and f"column {column}=" in issue


def test_meta_values_of_another_type_do_not_break_the_probe(tmp_path, ddl):
    path = _export(tmp_path, ddl, meta={"EXPORT_SCHEMA_VERSION": "3.25.0",
                                        "EXPORT_PARAM_INCLUDE_BLOBS": 1})
    assert [e.op for e in parse_nsys(path).events] == ["all_reduce", "broadcast"]
