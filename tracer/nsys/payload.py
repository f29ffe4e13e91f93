"""Where NCCL's NVTX payload fields live in an nsys SQLite export, and why sizes stay unset.

Since NCCL 2.16 every collective API range in the ``NCCL`` NVTX domain carries an extended
payload (``nvtxPayloadSchema``): ``Message size [bytes]`` (count x type size, per rank), from
2.25 ``NCCL communicator ID``, and op-specific extras (``Root``, ``Peer rank``, ``Reduction
operation``). In NCCL 2.16-2.24 Broadcast / Send / Recv name the size field ``Bytes``
(source: NCCL ``src/include/nvtx_payload_schemas.h`` at those tags, summarised in
/work/shared/TRACE_FORMATS.md, "Nsight Systems").

An export describes the schemas in two tables (DDL of nsys 2026.2.1, schema 3.25.0):

- ``NVTX_PAYLOAD_SCHEMAS(domainId, schemaId, name, type, flags, numEntries, payloadSize, alignTo)``
- ``NVTX_PAYLOAD_SCHEMA_ENTRIES(domainId, schemaId, idx, flags, type, name, description,
  arrayOrUnionDetail, offset)``

Schema ids move between NCCL versions, so fields are found by entry **name**. The values
themselves are only in ``NVTX_EVENTS.binaryData``, which is NULL unless the report was exported
with ``--include-blobs=true``. The blob's layout (how a row names its schema, header bytes
before the static payload) is not documented, and no export with blobs has been available to
validate a decoder against. This module therefore *locates* the fields and explains why sizes
are unavailable; it never decodes a blob. Sizes must come from the interposer or the NCCL log.
"""

from __future__ import annotations

import sqlite3

import pandas as pd

#: Entry names that hold the per-rank message size, by NCCL version (2.25+ first).
SIZE_ENTRY_NAMES: tuple[str, ...] = ("Message size [bytes]", "Bytes")
#: Entry name of the communicator identity (NCCL 2.25+).
COMM_ENTRY_NAME = "NCCL communicator ID"

#: Columns of :func:`locate_payload_fields`'s frame.
PAYLOAD_FIELD_COLUMNS: tuple[str, ...] = (
    "domain_id", "schema_id", "field", "entry_name", "entry_type", "offset_bytes",
    "payload_size_bytes",
)

BLOB_DECODER_STATUS = (
    "the binaryData layout of NVTX extended payloads is undocumented and no decoder has been "
    "validated against a real export with blobs, so DMuon does not decode it (sizes are left "
    "unset rather than guessed); take sizes from the interposer or the NCCL log"
)


def locate_payload_fields(
    conn: sqlite3.Connection, tables: dict[str, tuple[str, ...]], domain_ids: set[int]
) -> pd.DataFrame:
    """Payload schema entries of the NCCL domain(s) that carry a size or communicator id.

    Args:
        conn: open connection to the export.
        tables: table name -> column names, as probed from ``sqlite_master``.
        domain_ids: ``domainId`` values of the NCCL NVTX domain.

    Returns:
        One row per distinct (domain, schema, entry) with columns
        :data:`PAYLOAD_FIELD_COLUMNS`: ``field`` is ``"msg_bytes"`` or ``"comm"``;
        ``offset_bytes`` is the entry's offset inside the static payload as the export states
        it (NULL for the first entry in the fixture); ``payload_size_bytes`` the schema's
        static payload size where ``NVTX_PAYLOAD_SCHEMAS`` has it. Empty when the tables are
        absent. Exports may list a schema twice (one row per process); rows are deduplicated.
    """
    if "NVTX_PAYLOAD_SCHEMA_ENTRIES" not in tables or not domain_ids:
        return pd.DataFrame(columns=list(PAYLOAD_FIELD_COLUMNS))
    names = (*SIZE_ENTRY_NAMES, COMM_ENTRY_NAME)
    dom_marks = ",".join("?" * len(domain_ids))
    name_marks = ",".join("?" * len(names))
    has_schemas = "NVTX_PAYLOAD_SCHEMAS" in tables
    size_sql = (
        "(SELECT MAX(s.payloadSize) FROM NVTX_PAYLOAD_SCHEMAS s "
        "WHERE s.domainId = e.domainId AND s.schemaId = e.schemaId)"
        if has_schemas
        else "NULL"
    )
    rows = conn.execute(
        f"SELECT DISTINCT e.domainId, e.schemaId, e.name, e.type, e.offset, {size_sql} "
        f"FROM NVTX_PAYLOAD_SCHEMA_ENTRIES e WHERE e.domainId IN ({dom_marks}) "
        f"AND e.name IN ({name_marks}) ORDER BY e.domainId, e.schemaId, e.idx",
        (*sorted(domain_ids), *names),
    ).fetchall()
    out = [
        (dom, schema, "comm" if name == COMM_ENTRY_NAME else "msg_bytes", name, typ, off, size)
        for dom, schema, name, typ, off, size in rows
    ]
    return pd.DataFrame(out, columns=list(PAYLOAD_FIELD_COLUMNS))


def sizes_unavailable_reason(
    *,
    include_blobs_flag: bool | None,
    n_ranges: int,
    n_ranges_with_blob: int,
    fields: pd.DataFrame,
    has_entries_table: bool,
) -> str:
    """Why ``msg_bytes`` is ``None`` on every nsys event of this export (never empty).

    Args:
        include_blobs_flag: ``META_DATA_EXPORT.EXPORT_PARAM_INCLUDE_BLOBS`` (``None`` if absent).
        n_ranges: NCCL collective ranges turned into events.
        n_ranges_with_blob: how many of them have a non-NULL ``binaryData``.
        fields: :func:`locate_payload_fields`'s result.
        has_entries_table: whether ``NVTX_PAYLOAD_SCHEMA_ENTRIES`` exists.
    """
    size_fields = fields[fields["field"] == "msg_bytes"]
    if not has_entries_table:
        where = (
            "the export has no NVTX_PAYLOAD_SCHEMA_ENTRIES table (NCCL < 2.16 registers no "
            "payload schema, or the capture lacked NCCL's NVTX ranges)"
        )
    elif size_fields.empty:
        where = (
            f"the NCCL domain registered no payload entry named {' or '.join(map(repr, SIZE_ENTRY_NAMES))}"
        )
    else:
        schemas = sorted(set(int(s) for s in size_fields["schema_id"]))
        where = (
            f"the size field is located ({size_fields['entry_name'].iloc[0]!r} in payload "
            f"schemas {schemas})"
        )
    if n_ranges_with_blob == 0:
        flag = {True: "true", False: "false", None: "absent"}[include_blobs_flag]
        return (
            f"exported without blobs: META_DATA_EXPORT EXPORT_PARAM_INCLUDE_BLOBS={flag} and "
            f"binaryData is NULL on all {n_ranges} NCCL collective ranges; {where}, but the "
            "values are not in the file. Re-export with `nsys export --type sqlite "
            "--include-blobs=true REPORT.nsys-rep`; even then " + BLOB_DECODER_STATUS
        )
    return (
        f"binaryData present on {n_ranges_with_blob} of {n_ranges} NCCL collective ranges and "
        f"{where}, but " + BLOB_DECODER_STATUS
    )
