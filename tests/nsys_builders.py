"""Small Nsight Systems exports for the tests, built with the real fixture's DDL.

Shared by test_nsys, test_nsys_damaged, test_nsys_verify and test_fuzz_nsys (a helper module:
test modules do not import each other). The real fixture is described in test_nsys.py.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

#: The real export, relative to the shared fixtures folder.
REAL = "nsys/nsys2026.2_h100_2gpu_nccl_sendrecv__nsys-ai_mfu_2gpu_after.sqlite"
#: The tables whose DDL :func:`nsys_ddl` copies from it.
TABLES = ("META_DATA_EXPORT", "StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL",
          "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_PAYLOAD_SCHEMAS", "NVTX_PAYLOAD_SCHEMA_ENTRIES")


def nsys_ddl(shared_fixtures: Path) -> dict[str, str]:
    """``{table: CREATE statement}`` of :data:`TABLES` in the real export (read-only)."""
    conn = sqlite3.connect(f"file:{shared_fixtures / REAL}?mode=ro", uri=True)
    try:
        return dict(conn.execute(
            f"SELECT name, sql FROM sqlite_master WHERE name IN ({','.join('?' * len(TABLES))})",
            TABLES))
    finally:
        conn.close()


def global_tid(pid: int, tid: int) -> int:
    """A ``globalTid`` of the form the fixture's have."""
    return (1 << 48) | (pid << 24) | tid


#: The main thread of the stand-in process of the small exports.
MAIN = global_tid(10, 10)


def build_export(path: Path, ddl: dict[str, str], *, meta=None, strings=(), nvtx=(), kernels=(),
                 runtime=(), entries=(), skip=()) -> Path:
    """A small export with the real file's DDL. ``nvtx`` rows: (start, end, eventType, text,
    globalTid, domainId[, binaryData])."""
    meta = {"EXPORT_PRODUCT_VERSION": "2026.2.1.210", "EXPORT_SCHEMA_VERSION": "3.25.0",
            "EXPORT_PARAM_INCLUDE_BLOBS": "true"} if meta is None else meta
    conn = sqlite3.connect(path)
    for name, sql in ddl.items():
        if name not in skip:
            conn.execute(sql)
    if "META_DATA_EXPORT" not in skip:
        conn.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)", meta.items())
    conn.executemany("INSERT INTO StringIds VALUES (?, ?)", strings)
    if "NVTX_EVENTS" not in skip:
        for row in nvtx:
            start, end, etype, text, gtid, dom, *blob = row
            conn.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, "
                         "domainId, binaryData) VALUES (?,?,?,?,?,?,?)",
                         (start, end, etype, text, gtid, dom, blob[0] if blob else None))
    for start, end, dev, corr, gpid, name_id in kernels:
        conn.execute(
            "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, "
            "correlationId, globalPid, demangledName, shortName, registersPerThread, gridX, gridY, "
            "gridZ, blockX, blockY, blockZ, staticSharedMemory, dynamicSharedMemory, "
            "localMemoryPerThread, localMemoryTotal, gridId, tensorSizeMinusOneElements) VALUES "
            "(?,?,?,1,7,?,?,?,?,0,1,1,1,1,1,1,0,0,0,0,0,'')",
            (start, end, dev, corr, gpid, name_id, name_id))
    for start, end, gtid, corr, name_id in runtime:
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME (start, end, eventClass, globalTid, "
                     "correlationId, nameId, returnValue) VALUES (?,?,0,?,?,?,0)",
                     (start, end, gtid, corr, name_id))
    for dom, schema, idx, name, offset in entries:
        conn.execute("INSERT INTO NVTX_PAYLOAD_SCHEMA_ENTRIES (domainId, schemaId, idx, type, "
                     "name, offset) VALUES (?,?,?,22,?,?)", (dom, schema, idx, name, offset))
    conn.commit()
    conn.close()
    return path
