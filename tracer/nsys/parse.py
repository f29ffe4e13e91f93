"""Nsight Systems SQLite exports -> :class:`~tracer.events.CollectiveEvent` (``source="nsys"``).

Input: the file written by ``nsys export --type sqlite [--include-blobs=true] REPORT.nsys-rep``.
Format facts (validated on nsys 2026.2.1, export schema 3.25.0; /work/shared/TRACE_FORMATS.md):

- ``META_DATA_EXPORT(name, value)``: ``EXPORT_PRODUCT_VERSION``, ``EXPORT_SCHEMA_VERSION``,
  ``EXPORT_PARAM_INCLUDE_BLOBS``. Probed first, with the table / column sets in
  ``sqlite_master``: nsys omits tables it has no data for.
- ``NVTX_EVENTS``: one row per NVTX event; ``eventType`` 59 = push/pop range, 60 = start/end
  range, 75 = domain create (domain name in ``text``). Names are ``COALESCE(text,
  StringIds.value via textId)``. Times in ns. ``globalTid`` packs the process and thread:
  ``pid = (globalTid >> 24) & 0xFFFFFF``, ``tid = globalTid & 0xFFFFFF``.
- NCCL wraps every API call in a push/pop range of domain ``NCCL`` named after it
  (``ncclAllReduce``, ``ncclSend``, ``ncclGroupStart``, ...); :data:`NCCL_API_TO_OP` maps the
  collectives, every other name is counted in ``NsysResult.other_api_counts``.
- ``CUPTI_ACTIVITY_KIND_KERNEL``: GPU kernels (``ncclKernel_*`` up to NCCL 2.18,
  ``ncclDevKernel_*`` from 2.19, name via ``shortName`` -> ``StringIds``). A kernel's
  ``correlationId`` equals that of its launch call in ``CUPTI_ACTIVITY_KIND_RUNTIME`` *of the
  same process* (ids repeat across processes). The launch happens inside the NCCL range that
  issued it: the collective's own range, or ``ncclGroupEnd`` for grouped calls, in which case
  the kernel serves every collective of that group.

Event fields: ``op`` from the range name, ``pid`` from ``globalTid``, ``t_start_ns`` /
``t_end_ns`` from the range, ``cuda_dev`` from the linked kernel's ``deviceId`` (CUPTI's device
index), ``phase`` / ``module`` from DMuon's NVTX ranges (below), ``source_ref``
``"<file name>#NVTX_EVENTS.<rowid>"``. ``rank``, ``group_*``, ``seq``, ``count`` and
``msg_bytes`` stay ``None``: sizes, communicator and rank are only in the payload blob, which
is not decoded (see :mod:`tracer.nsys.payload` and ``NsysResult.sizes_unavailable_reason``).
The thread id, kernel names and GPU durations are in ``NsysResult.details`` (one row per event).

Attribution: DMuon's spans (:func:`dmuon.annotate.span`) are push/pop ranges in NVTX domain
``DMuon`` with messages ``dmuon.<what> [<module>] [owner=<k>]``. An NCCL range gets the module
of the innermost span on the same thread that contains it in time. A range named
``dmuon.phase <name>`` (:func:`dmuon.annotate.phase`) sets the phase: innermost containing
phase range on the same thread, else, since DMuon's phase is process-wide and autograd runs
backward hooks on its own threads, on any thread of the process. Ranges ``dmuon.window <name>``
(:func:`dmuon.annotate.window`, around verify-traffic's measured steps) are not spans: they
are listed in ``NsysResult.windows`` for selecting a window's events.
"""

from __future__ import annotations

import argparse
import re
import sqlite3
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from tabulate import tabulate

from tracer.events import CollectiveEvent, write_parquet
from tracer.inputs import is_gzip
from tracer.nsys.payload import COMM_ENTRY_NAME, locate_payload_fields, sizes_unavailable_reason

#: NCCL API range name -> canonical op (NCCL ``src/collectives.cc`` / ``src/enqueue.cc``).
NCCL_API_TO_OP: dict[str, str] = {
    "ncclAllReduce": "all_reduce",
    "ncclAllGather": "all_gather",
    "ncclReduceScatter": "reduce_scatter",
    "ncclBroadcast": "broadcast",
    "ncclReduce": "reduce",
    "ncclSend": "send",
    "ncclRecv": "recv",
    "ncclAlltoAll": "all_to_all",  # ncclAlltoAll, ncclGather, ncclScatter: NCCL 2.28+
    "ncclGather": "gather",
    "ncclScatter": "scatter",
}
EVENT_TYPE_PUSH_POP = 59
EVENT_TYPE_START_END = 60
EVENT_TYPE_DOMAIN_CREATE = 75
NCCL_DOMAIN = "NCCL"
DMUON_DOMAIN = "DMuon"
#: Export schema versions this parser was validated against (the fixture's).
VALIDATED_SCHEMA_VERSIONS: tuple[str, ...] = ("3.25.0",)
SUPPORTED_SCHEMA_MAJOR = "3"
_REQUIRED_NVTX_COLUMNS = ("start", "end", "eventType", "globalTid", "domainId", "text")
_SPAN_RE = re.compile(r"^(?P<name>dmuon\.[\w.]+)(?: (?P<module>[^\s=]+))?(?: owner=(?P<owner>\d+))?$")
_PHASE_RE = re.compile(r"^dmuon\.phase (?P<phase>\S+)$")
_WINDOW_RE = re.compile(r"^dmuon\.window (?P<window>\S+)$")


@dataclass(frozen=True)
class NsysWindow:
    """A ``dmuon.window <name>`` range (:func:`dmuon.annotate.window`): a measured window of
    process ``pid`` from ``t_start_ns`` to ``t_end_ns`` (export clock, ns)."""

    name: str
    pid: int
    t_start_ns: int
    t_end_ns: int
    source_ref: str

    def contains(self, ev: CollectiveEvent) -> bool:
        """Whether ``ev`` was issued by this process inside the window."""
        return (ev.pid == self.pid and ev.t_start_ns is not None
                and self.t_start_ns <= ev.t_start_ns <= self.t_end_ns)

DETAIL_COLUMNS = (
    "event_index", "source_ref", "nvtx_rowid", "global_tid", "pid", "tid", "api_name",
    "nccl_group", "kernel_names", "n_kernels", "gpu_start_ns", "gpu_end_ns", "gpu_dur_ns",
    "kernel_shared_by", "dmuon_span", "owner", "phase_match",
)
KERNEL_COLUMNS = (
    "kernel_ref", "kernel_name", "start_ns", "end_ns", "gpu_dur_ns", "device_id", "stream_id",
    "correlation_id", "pid", "launch_tid", "launch_start_ns", "launch_range", "linked_events",
    "unlinked_reason",
)


@dataclass(frozen=True)
class ExportInfo:
    """What :func:`probe_export` learnt before any query: tables, columns, versions, flags."""

    path: Path
    tables: dict[str, tuple[str, ...]]
    meta: dict[str, str]
    product_version: str | None
    schema_version: str | None
    include_blobs: bool | None


@dataclass
class NsysResult:
    """Everything parsed from one export.

    Attributes:
        events: one :class:`CollectiveEvent` per NCCL collective range, in (pid, tid, start) order.
        details: one row per event (:data:`DETAIL_COLUMNS`, keyed by ``event_index`` = position
            in ``events`` and by ``source_ref``): tid, ``nccl_group`` (per-thread index of the
            ncclGroupStart/End block, <NA> outside one), linked kernel names, ``gpu_dur_ns``
            (sum of linked kernels' end - start, ns), ``kernel_shared_by`` (collectives served
            by the same launch: a grouped launch's duration covers all of them), innermost
            DMuon span message and owner, ``phase_match`` (``"thread"`` / ``"process"``).
        kernels: one row per NCCL kernel (:data:`KERNEL_COLUMNS`), with ``unlinked_reason``
            where it could not be tied to a range.
        other_api_counts: NCCL-domain range names that are not collectives -> count.
        sizes_unavailable_reason: why ``msg_bytes`` is ``None`` (always set, see module doc).
        payload_fields: :func:`tracer.nsys.payload.locate_payload_fields`.
        warnings: non-fatal findings (unvalidated schema version, inferred domains, ...).
        windows: DMuon's ``dmuon.window <name>`` ranges (measured windows), by start.
        issues: ``"<file>#<table>.<rowid>: column <c>=<value> is <type>; must be ..."`` for
            every row skipped because a value the parser needs is damaged (text in ``start``,
            NULL ``globalTid`` / ``globalPid``, invalid UTF-8 in a name, ...).
    """

    info: ExportInfo
    events: list[CollectiveEvent]
    details: pd.DataFrame
    kernels: pd.DataFrame
    other_api_counts: dict[str, int]
    sizes_unavailable_reason: str
    payload_fields: pd.DataFrame
    nccl_domain_source: str
    n_dmuon_ranges: int = 0
    warnings: list[str] = field(default_factory=list)
    windows: list[NsysWindow] = field(default_factory=list)
    issues: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """Human-readable summary: events per op, processes / threads, kernels, sizes."""
        lines = [
            f"nsys export {self.info.path.name}: nsys {self.info.product_version}, schema "
            f"{self.info.schema_version}, blobs={self.info.include_blobs}; NCCL domain "
            f"{self.nccl_domain_source}"
        ]
        ops = Counter(ev.op for ev in self.events)
        lines.append(tabulate(sorted(ops.items()), headers=["op", "events"]))
        if self.other_api_counts:
            lines.append("NCCL API ranges that are not collectives (not events): " + ", ".join(
                f"{k}={v}" for k, v in sorted(self.other_api_counts.items())))
        d = self.details
        if len(d):
            per_thread = d.groupby(["pid", "tid"]).agg(
                events=("event_index", "size"), with_kernel=("n_kernels", lambda s: int((s > 0).sum()))
            ).reset_index()
            lines.append(tabulate(per_thread.values.tolist(),
                                  headers=["pid", "tid", "events", "events with kernel"]))
        k = self.kernels
        linked = int(k["unlinked_reason"].isna().sum()) if len(k) else 0
        lines.append(f"NCCL kernels: {len(k)}, linked to ranges: {linked}")
        for reason, n in (k["unlinked_reason"].value_counts().items() if len(k) else []):
            lines.append(f"  unlinked ({n}): {reason}")
        attributed = sum(ev.module is not None for ev in self.events)
        phased = sum(ev.phase is not None for ev in self.events)
        lines.append(f"DMuon ranges: {self.n_dmuon_ranges}; events with module: {attributed}, "
                     f"with phase: {phased}")
        lines.append(f"sizes unavailable: {self.sizes_unavailable_reason}")
        lines.extend(f"warning: {w}" for w in self.warnings)
        if self.issues:
            lines.append(f"{len(self.issues)} damaged row(s) skipped:")
            lines.extend(f"  {i}" for i in self.issues[:20])
            if len(self.issues) > 20:
                lines.append(f"  ... and {len(self.issues) - 20} more")
        return "\n".join(lines)


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    # Invalid UTF-8 must not abort a whole query: undecodable bytes become lone surrogates,
    # and the rows holding them are reported as issues (_load_ranges).
    conn.text_factory = lambda b: b.decode("utf-8", errors="surrogateescape")
    return conn


def probe_export(path: str | Path) -> ExportInfo:
    """Read ``sqlite_master`` and ``META_DATA_EXPORT`` of an nsys SQLite export.

    Raises:
        ValueError: the file does not exist, is not SQLite, or has neither ``StringIds`` nor
            ``META_DATA_EXPORT`` (not an nsys export).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Invalid nsys export path={str(path)!r}. Must be an existing file "
                         "written by `nsys export --type sqlite`.")
    try:
        gzipped = is_gzip(path)
    except OSError as exc:
        raise ValueError(f"Invalid nsys export path={str(path)!r}: cannot read it "
                         f"({exc}).") from None
    if gzipped:
        raise ValueError(f"Invalid nsys export path={str(path)!r}: it is gzip-compressed, and "
                         "SQLite reads only the plain file. Must be decompressed first (gunzip "
                         "-k it).")
    try:
        conn = _connect(path)
    except sqlite3.Error as exc:
        raise ValueError(f"Invalid nsys export path={str(path)!r}: SQLite cannot open it "
                         f"({exc}). Must be a readable file written by `nsys export --type "
                         "sqlite`.") from None
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        tables = {n: tuple(r[1] for r in conn.execute(f'PRAGMA table_info("{n}")')) for n in names}
        meta = {str(k): str(v) for k, v in conn.execute(
            "SELECT name, value FROM META_DATA_EXPORT")} if "META_DATA_EXPORT" in tables else {}
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
        # a damaged schema can make SQLite's own error text undecodable: Python then raises
        # UnicodeDecodeError for the message (found by tests/tracer/test_fuzz_nsys.py)
        raise ValueError(f"Invalid nsys export path={str(path)!r}: not an SQLite file ({exc}). "
                         "Must be written by `nsys export --type sqlite`.") from None
    finally:
        conn.close()
    if "StringIds" not in tables and "META_DATA_EXPORT" not in tables:
        raise ValueError(f"Invalid nsys export path={str(path)!r}: SQLite without StringIds or "
                         "META_DATA_EXPORT. Must be written by `nsys export --type sqlite`.")
    blobs = meta.get("EXPORT_PARAM_INCLUDE_BLOBS")
    return ExportInfo(path, tables, meta, meta.get("EXPORT_PRODUCT_VERSION"),
                      meta.get("EXPORT_SCHEMA_VERSION"),
                      None if blobs is None else blobs.lower() == "true")


def _check_schema(info: ExportInfo, allow_unknown_schema: bool) -> list[str]:
    warnings = []
    version = info.schema_version
    if version is None or version.split(".")[0] != SUPPORTED_SCHEMA_MAJOR:
        msg = (f"Invalid nsys export schema_version={version!r} in {info.path.name} "
               f"(nsys {info.product_version}). Must be {SUPPORTED_SCHEMA_MAJOR}.x "
               f"(validated: {', '.join(VALIDATED_SCHEMA_VERSIONS)}): re-export with nsys "
               "2026.2, or pass allow_unknown_schema=True (--allow-unknown-schema) to try the "
               "probed columns anyway.")
        if not allow_unknown_schema:
            raise ValueError(msg)
        warnings.append(f"unknown export schema {version!r}; parsed by probed columns only")
    elif version not in VALIDATED_SCHEMA_VERSIONS:
        warnings.append(f"export schema {version} not validated (validated: "
                        f"{', '.join(VALIDATED_SCHEMA_VERSIONS)}); columns were probed")
    if "NVTX_EVENTS" not in info.tables:
        raise ValueError(f"Invalid nsys export {info.path.name}: no NVTX_EVENTS table (nsys writes "
                         "it only when NVTX was traced). Must be captured with `nsys profile -t "
                         "cuda,nvtx` on a program using NCCL >= 2.16 or DMuon spans.")
    missing = [c for c in _REQUIRED_NVTX_COLUMNS if c not in info.tables["NVTX_EVENTS"]]
    if missing:
        raise ValueError(f"Invalid nsys export {info.path.name}: NVTX_EVENTS lacks columns "
                         f"{missing}. Must have {list(_REQUIRED_NVTX_COLUMNS)} (schema 3.x).")
    return warnings


def _name_sql(info: ExportInfo) -> tuple[str, str]:
    """SQL for a range's name, and the join it needs."""
    if "textId" in info.tables["NVTX_EVENTS"] and "StringIds" in info.tables:
        return "COALESCE(e.text, s.value)", "LEFT JOIN StringIds s ON s.id = e.textId"
    return "e.text", ""


def _bad_rows(frame: pd.DataFrame, table: str, checks: dict[str, tuple[str, ...]], ref,
              issues: list[str]) -> pd.DataFrame:
    """``frame`` without the rows whose SQLite value types (``typeof_<column>`` columns) are
    not among ``checks[column]``; each dropped row is an issue naming table, column, rowid."""
    bad = pd.Series(False, index=frame.index)
    for column, allowed in checks.items():
        wrong = ~frame[f"typeof_{column}"].isin(allowed)
        if not wrong.any():
            continue
        for row in frame[wrong & ~bad].itertuples():
            value = getattr(row, f"value_{column}") if f"value_{column}" in frame else None
            kind = getattr(row, f"typeof_{column}")
            issues.append(f"{ref(table, row.rowid)}: column {column}={str(value)[:40]!r} is "
                          f"{kind}; must be {' or '.join(allowed)} (row skipped)")
        bad |= wrong
    return frame[~bad].drop(columns=[c for c in frame.columns
                                     if c.startswith(("typeof_", "value_"))])


def _undecodable(text) -> bool:
    """Whether ``text`` holds lone surrogates (invalid UTF-8 read with surrogateescape)."""
    if not isinstance(text, str):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _load_ranges(conn: sqlite3.Connection, info: ExportInfo, ref, issues: list[str]) -> pd.DataFrame:
    """All non-default-domain ranges plus domain-create rows, with pid/tid and blob flags.

    Rows whose ``start`` / ``end`` / ``globalTid`` / ``domainId`` are not integers (text,
    NULL where required) or whose name is not text (or holds invalid UTF-8) are skipped with
    an issue each.
    """
    name, join = _name_sql(info)
    cols = info.tables["NVTX_EVENTS"]
    blob = "e.binaryData IS NOT NULL" if "binaryData" in cols else "0"
    checked = {"start": "e.start", "end": "e.end", "globalTid": "e.globalTid",
               "domainId": "e.domainId", "name": name}
    sql = (f"SELECT e.rowid, e.start, e.end, e.eventType, e.globalTid, e.domainId, {name}, {blob}, "
           + ", ".join(f"typeof({v})" for v in checked.values()) + ", "
           + ", ".join(checked.values())
           + f" FROM NVTX_EVENTS e {join} WHERE e.domainId != 0 AND e.eventType IN (?, ?, ?)")
    rows = []
    for row in conn.execute(sql, (EVENT_TYPE_PUSH_POP, EVENT_TYPE_START_END,
                                  EVENT_TYPE_DOMAIN_CREATE)):
        if _undecodable(row[6]):
            issues.append(f"{ref('NVTX_EVENTS', row[0])}: column text holds invalid UTF-8 "
                          f"({row[6].encode('utf-8', 'backslashreplace')[:60]!r}) (row skipped)")
        else:
            rows.append(row)
    frame = pd.DataFrame(
        rows,
        columns=["rowid", "start", "end", "event_type", "global_tid", "domain_id", "name_", "has_blob"]
        + [f"typeof_{c}" for c in checked] + [f"value_{c}" for c in checked],
    )
    frame = _bad_rows(frame, "NVTX_EVENTS", {
        "start": ("integer",), "end": ("integer", "null"), "globalTid": ("integer",),
        "domainId": ("integer",), "name": ("text", "null")}, ref, issues)
    frame = frame.astype({"rowid": "int64", "start": "int64", "global_tid": "int64",
                          "domain_id": "int64", "event_type": "int64"})
    gtid = frame["global_tid"].to_numpy()
    frame["pid"] = (gtid >> 24) & 0xFFFFFF
    frame["tid"] = gtid & 0xFFFFFF
    return frame


def _domain_keys(ranges: pd.DataFrame, domain: str, name_test) -> tuple[set, str]:
    """(pid, domainId) pairs of ``domain``: from domain-create rows, else inferred by names."""
    created = ranges[(ranges["event_type"] == EVENT_TYPE_DOMAIN_CREATE) & (ranges["name_"] == domain)]
    if len(created):
        return set(zip(created["pid"], created["domain_id"])), "from NvtxDomainCreate rows"
    spans = ranges[ranges["event_type"] != EVENT_TYPE_DOMAIN_CREATE]
    hits = spans[spans["name_"].fillna("").map(name_test).astype(bool)]
    keys = set(zip(hits["pid"], hits["domain_id"]))
    return keys, f"inferred from range names (no NvtxDomainCreate row names {domain!r})"


def _innermost(outer: pd.DataFrame, queries: list[tuple[int, int]]) -> list[int | None]:
    """For each query ``(start, end)``, the index label of the innermost row of ``outer``
    (latest start) with ``start <= query start`` and ``end >= query end``, else ``None``.

    One sweep over both sorted by start, with a stack of open ranges: O((n + q) log n) for
    properly nested push/pop ranges instead of a scan per query.
    """
    rows = sorted(zip(outer["start"], -outer["end"], outer.index))
    order = sorted(range(len(queries)), key=lambda i: queries[i][0])
    out: list[int | None] = [None] * len(queries)
    stack: list[tuple[int, int]] = []  # (end, label), in start order
    j = 0
    for i in order:
        q_start, q_end = queries[i]
        while j < len(rows) and rows[j][0] <= q_start:
            stack.append((-rows[j][1], rows[j][2]))
            j += 1
        while stack and stack[-1][0] < q_start:
            stack.pop()
        for end, label in reversed(stack):
            if end >= q_end:
                out[i] = label
                break
    return out


def _group_blocks(nccl: pd.DataFrame) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Per thread, ncclGroupStart/End nesting: collective rowid -> group index, and the
    rowid of each outermost ncclGroupEnd -> rowids of the collectives in its group."""
    member_of: dict[int, int] = {}
    members_by_end: dict[int, list[int]] = {}
    for _, thread in nccl.sort_values(["start", "rowid"]).groupby("global_tid", sort=False):
        depth, group, current = 0, -1, []
        for row in thread.itertuples():
            if row.name_ == "ncclGroupStart":
                if depth == 0:
                    group, current = group + 1, []
                depth += 1
            elif row.name_ == "ncclGroupEnd":
                if depth == 0:  # its ncclGroupStart lies before the export window
                    members_by_end[row.rowid] = []
                    continue
                depth -= 1
                if depth == 0:
                    members_by_end[row.rowid] = current
            elif row.name_ in NCCL_API_TO_OP and depth > 0:
                member_of[row.rowid] = group
                current.append(row.rowid)
    return member_of, members_by_end


def _load_kernels(conn: sqlite3.Connection, info: ExportInfo, ref,
                  issues: list[str]) -> tuple[pd.DataFrame, str | None]:
    """NCCL kernels with their launch call (same process, same correlationId); rows whose
    times, ids or device are not integers are skipped with an issue each."""
    columns = ["rowid", "start", "end", "device_id", "stream_id", "correlation_id",
               "global_pid", "kernel_name"]
    empty = pd.DataFrame(columns=columns)
    kcols = info.tables.get("CUPTI_ACTIVITY_KIND_KERNEL")
    if kcols is None or "StringIds" not in info.tables:
        return empty, "no CUPTI_ACTIVITY_KIND_KERNEL table (captured without `-t cuda`?)"
    name_col = "shortName" if "shortName" in kcols else "demangledName"
    checked = ("start", "end", "deviceId", "streamId", "correlationId", "globalPid")
    rows = []
    for row in conn.execute(
        f"SELECT k.rowid, k.start, k.end, k.deviceId, k.streamId, k.correlationId, k.globalPid, "
        f"s.value, " + ", ".join(f"typeof(k.{c})" for c in checked) + ", "
        + ", ".join(f"k.{c}" for c in checked)
        + f" FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.{name_col} "
        "WHERE s.value LIKE 'ncclKernel%' OR s.value LIKE 'ncclDevKernel%' ORDER BY k.rowid"):
        if _undecodable(row[7]):
            issues.append(f"{ref('CUPTI_ACTIVITY_KIND_KERNEL', row[0])}: kernel name holds "
                          "invalid UTF-8 (row skipped)")
        else:
            rows.append(row)
    kernels = pd.DataFrame(
        rows, columns=columns + [f"typeof_{c}" for c in checked] + [f"value_{c}" for c in checked])
    kernels = _bad_rows(kernels, "CUPTI_ACTIVITY_KIND_KERNEL",
                        {c: ("integer",) for c in checked}, ref, issues)
    kernels = kernels.astype({c: "int64" for c in columns[:-1]}).sort_values(["start", "rowid"])
    return kernels.reset_index(drop=True), None


def _load_launches(conn: sqlite3.Connection, info: ExportInfo, ids: list[int], ref,
                   issues: list[str]) -> pd.DataFrame:
    cols = ["correlation_id", "launch_gtid", "launch_start_ns", "launch_api"]
    if "CUPTI_ACTIVITY_KIND_RUNTIME" not in info.tables or not ids:
        return pd.DataFrame(columns=cols)
    checked = ("globalTid", "start")
    rows = []
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        rows += conn.execute(
            "SELECT r.correlationId, r.globalTid, r.start, s.value, r.rowid, "
            + ", ".join(f"typeof(r.{c})" for c in checked) + ", "
            + ", ".join(f"r.{c}" for c in checked)
            + " FROM CUPTI_ACTIVITY_KIND_RUNTIME r LEFT JOIN StringIds s ON s.id = r.nameId "
            f"WHERE r.correlationId IN ({','.join('?' * len(chunk))})", chunk).fetchall()
    frame = pd.DataFrame(rows, columns=cols + ["rowid"] + [f"typeof_{c}" for c in checked]
                         + [f"value_{c}" for c in checked])
    frame = _bad_rows(frame, "CUPTI_ACTIVITY_KIND_RUNTIME", {c: ("integer",) for c in checked},
                      ref, issues)
    return frame.drop(columns=["rowid"]).astype(
        {"correlation_id": "int64", "launch_gtid": "int64", "launch_start_ns": "int64"})


def _link_kernels(kernels: pd.DataFrame, launches: pd.DataFrame, nccl: pd.DataFrame,
                  members_by_end: dict[int, list[int]], ref) -> tuple[pd.DataFrame, dict]:
    """Tie each kernel to the NCCL range enclosing its launch; returns the kernel table and
    collective rowid -> list of kernel records."""
    launch_index = {}
    for row in launches.itertuples():  # correlation ids repeat across processes: key by pid too
        launch_index.setdefault((row.correlation_id, row.launch_gtid >> 24), row)
    out, pending = [], defaultdict(list)  # launch thread -> [(record, launch time)]
    for k in kernels.itertuples():
        rec = dict(kernel_ref=ref("CUPTI_ACTIVITY_KIND_KERNEL", k.rowid), kernel_name=k.kernel_name,
                   start_ns=k.start, end_ns=k.end, gpu_dur_ns=k.end - k.start, device_id=k.device_id,
                   stream_id=k.stream_id, correlation_id=k.correlation_id,
                   pid=(k.global_pid >> 24) & 0xFFFFFF, launch_tid=None, launch_start_ns=None,
                   launch_range=None, linked_events=0, unlinked_reason=None)
        out.append(rec)
        launch = launch_index.get((k.correlation_id, k.global_pid >> 24))
        if launch is None:
            rec["unlinked_reason"] = ("launch call not in CUPTI_ACTIVITY_KIND_RUNTIME (outside "
                                      "the export window, or CUDA API not traced)")
            continue
        rec.update(launch_tid=launch.launch_gtid & 0xFFFFFF, launch_start_ns=launch.launch_start_ns)
        rec["unlinked_reason"] = f"launch ({launch.launch_api}) not inside an NCCL range on its thread"
        pending[launch.launch_gtid].append(rec)
    per_event: dict[int, list] = defaultdict(list)
    closed = nccl.dropna(subset=["end"])
    for gtid, thread in closed.groupby("global_tid"):
        recs = pending.get(gtid, [])
        hits = _innermost(thread, [(r["launch_start_ns"], r["launch_start_ns"]) for r in recs])
        for rec, label in zip(recs, hits):
            if label is None:
                continue
            name, rowid = thread.at[label, "name_"], int(thread.at[label, "rowid"])
            rec["launch_range"] = name
            if name in NCCL_API_TO_OP:
                targets = [rowid]
            else:
                targets = members_by_end.get(rowid, []) if name == "ncclGroupEnd" else []
            rec["unlinked_reason"] = None if targets else f"launched inside {name}, no collective"
            rec["linked_events"] = len(targets)
            for target in targets:
                per_event[target].append(rec)
    table = pd.DataFrame(out, columns=list(KERNEL_COLUMNS))
    for col in ("start_ns", "end_ns", "gpu_dur_ns", "device_id", "stream_id", "correlation_id",
                "pid", "launch_tid", "launch_start_ns", "linked_events"):
        table[col] = table[col].astype("Int64")
    return table, per_event


def parse_nsys(path: str | Path, *, allow_unknown_schema: bool = False,
               progress: Callable[[str], None] | None = None) -> NsysResult:
    """Parse an nsys SQLite export into NCCL collective events, kernel links and attribution.

    Args:
        path: ``.sqlite`` written by ``nsys export --type sqlite``.
        allow_unknown_schema: parse an export whose ``EXPORT_SCHEMA_VERSION`` is missing or not
            3.x by its probed columns instead of raising.
        progress: called with the name of each stage as it starts (for a progress bar).

    Returns:
        :class:`NsysResult`. An export without NCCL ranges (or with an empty ``NVTX_EVENTS``)
        gives no events and a warning; rows with damaged values are skipped, each listed in
        ``NsysResult.issues`` with table, column and rowid.

    Raises:
        ValueError: missing / non-SQLite / non-nsys file, schema version not 3.x (unless
            allowed), no ``NVTX_EVENTS`` table, ``NVTX_EVENTS`` lacking required columns, or
            SQLite failing on a damaged file (corrupt pages, truncation); the message names
            the file.
    """
    info = probe_export(path)
    warnings = _check_schema(info, allow_unknown_schema)
    issues: list[str] = []

    def ref(table: str, rowid: int) -> str:
        return f"{info.path.name}#{table}.{rowid}"

    stage = progress or (lambda name: None)
    try:
        conn = _connect(info.path)
        stage("NVTX ranges")
        ranges = _load_ranges(conn, info, ref, issues)
        nccl_keys, nccl_source = _domain_keys(ranges, NCCL_DOMAIN, lambda n: n.startswith("nccl"))
        dmuon_keys, _ = _domain_keys(ranges, DMUON_DOMAIN, lambda n: n.startswith("dmuon."))
        spans = ranges[ranges["event_type"] != EVENT_TYPE_DOMAIN_CREATE]
        key = list(zip(spans["pid"], spans["domain_id"]))
        nccl = spans.iloc[[i for i, k in enumerate(key) if k in nccl_keys]]
        dmuon = spans.iloc[[i for i, k in enumerate(key) if k in dmuon_keys]]
        stage("kernels")
        kernels, kernel_problem = _load_kernels(conn, info, ref, issues)
        stage("launches")
        launches = _load_launches(conn, info, sorted(set(int(c) for c in kernels["correlation_id"])),
                                  ref, issues)
        fields = locate_payload_fields(conn, info.tables, {int(d) for _, d in nccl_keys})
    except (sqlite3.Error, UnicodeDecodeError) as exc:  # corrupt pages, truncated file, a
        # table of another shape; or an error text SQLite wrote with the damaged bytes
        raise ValueError(
            f"Invalid nsys export {str(info.path)!r}: SQLite failed while reading it "
            f"({type(exc).__name__}: {exc}); the file is damaged or truncated. Must be a "
            "complete export: re-run `nsys export --type sqlite REPORT.nsys-rep`.") from None
    finally:
        if "conn" in locals():
            conn.close()
    stage("events")
    if ranges.empty:
        warnings.append("no NVTX ranges outside the default domain (NVTX_EVENTS is empty or "
                        "holds only default-domain rows): no events")
    if nccl_source.startswith("inferred"):
        warnings.append(f"NCCL domain {nccl_source}")
    if kernel_problem:
        warnings.append(f"GPU kernels unavailable: {kernel_problem}")
    if nccl.empty:
        warnings.append("no NCCL-domain NVTX ranges: was NCCL >= 2.16 used, and NVTX traced?")
    if issues:
        warnings.append(f"{len(issues)} damaged row(s) skipped (NsysResult.issues); first: "
                        f"{issues[0]}")

    member_of, members_by_end = _group_blocks(nccl)
    kernel_table, kernels_by_event = _link_kernels(kernels, launches, nccl, members_by_end, ref)
    events, details = _build_events(nccl, dmuon, member_of, kernels_by_event, ref)
    colls = nccl[nccl["name_"].isin(NCCL_API_TO_OP)]
    other = Counter(n for n in nccl["name_"] if n not in NCCL_API_TO_OP)
    reason = sizes_unavailable_reason(
        include_blobs_flag=info.include_blobs, n_ranges=len(colls),
        n_ranges_with_blob=int(colls["has_blob"].sum()), fields=fields,
        has_entries_table="NVTX_PAYLOAD_SCHEMA_ENTRIES" in info.tables)
    if not fields.empty and COMM_ENTRY_NAME not in set(fields["entry_name"]):
        warnings.append("no 'NCCL communicator ID' payload entry (NCCL < 2.25)")
    return NsysResult(info, events, details, kernel_table, dict(other), reason, fields,
                      nccl_source, len(dmuon), warnings, _windows(dmuon, ref), issues)


def _windows(dmuon: pd.DataFrame, ref) -> list[NsysWindow]:
    out = []
    for row in dmuon.dropna(subset=["end"]).sort_values(["start", "rowid"]).itertuples():
        m = _WINDOW_RE.match(row.name_ or "")
        if m:
            out.append(NsysWindow(m["window"], int(row.pid), int(row.start), int(row.end),
                                  ref("NVTX_EVENTS", row.rowid)))
    return out


def _attribute(colls: pd.DataFrame, outer: pd.DataFrame, key: str) -> dict[int, int]:
    """Collective rowid -> index label of the innermost ``outer`` range containing it, matching
    rows on column ``key`` (``global_tid``: same thread; ``pid``: same process)."""
    found: dict[int, int] = {}
    closed = colls.dropna(subset=["end"])
    outer_by_key = {k: f for k, f in outer.dropna(subset=["end"]).groupby(key)}
    for k, group in closed.groupby(key):
        if k in outer_by_key:
            hits = _innermost(outer_by_key[k], list(zip(group["start"], group["end"])))
            found.update({r: h for r, h in zip(group["rowid"], hits) if h is not None})
    return found


def _build_events(nccl, dmuon, member_of, kernels_by_event, ref):
    colls = nccl[nccl["name_"].isin(NCCL_API_TO_OP)].sort_values(["pid", "tid", "start", "rowid"])
    names = dmuon["name_"].fillna("")
    is_phase = names.str.match(_PHASE_RE)
    phases = dmuon[is_phase]
    module_spans = dmuon[~is_phase & ~names.str.match(_WINDOW_RE) & names.str.match(_SPAN_RE)]
    span_of = _attribute(colls, module_spans, "global_tid")
    phase_of = {"thread": _attribute(colls, phases, "global_tid"),
                "process": _attribute(colls, phases, "pid")}
    events, rows = [], []
    for row in colls.itertuples():
        end = int(row.end) if pd.notna(row.end) else None
        span = dmuon.loc[span_of[row.rowid]] if row.rowid in span_of else None
        phase = phase_match = None
        for scope in ("thread", "process"):
            if row.rowid in phase_of[scope]:
                phase_name = dmuon.at[phase_of[scope][row.rowid], "name_"]
                phase, phase_match = _PHASE_RE.match(phase_name)["phase"], scope
                break
        match = _SPAN_RE.match(span["name_"]) if span is not None else None
        linked = kernels_by_event.get(row.rowid, [])
        devices = {k["device_id"] for k in linked}
        source_ref = ref("NVTX_EVENTS", row.rowid)
        events.append(CollectiveEvent(
            source="nsys", op=NCCL_API_TO_OP[row.name_], phase=phase,
            module=match["module"] if match else None, t_start_ns=int(row.start),
            t_end_ns=None if end is None else int(end), source_ref=source_ref, pid=int(row.pid),
            cuda_dev=int(devices.pop()) if len(devices) == 1 else None))
        rows.append(dict(
            event_index=len(rows), source_ref=source_ref, nvtx_rowid=row.rowid,
            global_tid=row.global_tid, pid=row.pid, tid=row.tid, api_name=row.name_,
            nccl_group=member_of.get(row.rowid), kernel_names=",".join(
                sorted({k["kernel_name"] for k in linked})) or None,
            n_kernels=len(linked), gpu_start_ns=min((k["start_ns"] for k in linked), default=None),
            gpu_end_ns=max((k["end_ns"] for k in linked), default=None),
            gpu_dur_ns=sum(k["gpu_dur_ns"] for k in linked) if linked else None,
            kernel_shared_by=max((k["linked_events"] for k in linked), default=None),
            dmuon_span=None if span is None else span["name_"],
            owner=int(match["owner"]) if match and match["owner"] else None,
            phase_match=phase_match))
    details = pd.DataFrame(rows, columns=list(DETAIL_COLUMNS))
    for col in ("nccl_group", "n_kernels", "gpu_start_ns", "gpu_end_ns", "gpu_dur_ns",
                "kernel_shared_by", "owner"):
        details[col] = details[col].astype("Int64")
    return events, details


#: Stages reported to ``parse_nsys(progress=...)``.
_STAGES = ("NVTX ranges", "kernels", "launches", "events")


def _run_cli(args) -> int:
    from tracer.cli import EXIT_BAD_INPUT, EXIT_NOTHING_FOUND, EXIT_OK
    from tracer.progress import wants_progress

    prog = "dmuon-trace nsys"
    bar = None
    if args.report.is_file() and wants_progress(args.report.stat().st_size):
        from tqdm import tqdm

        bar = tqdm(total=len(_STAGES), desc="nsys export", unit="stage", file=sys.stderr)
    try:
        result = parse_nsys(args.report, allow_unknown_schema=args.allow_unknown_schema,
                            progress=bar and (lambda name: (bar.set_postfix_str(name), bar.update())))
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if bar is not None:
            bar.close()
    print(result.summary())
    args.dropped = (len(result.issues), result.issues[0] if result.issues else "")  # tracer.cli
    if not result.events:
        print(f"{prog}: error: no NCCL collective ranges in {args.report} (see the warnings "
              "above); nothing written", file=sys.stderr)
        return EXIT_NOTHING_FOUND
    write_parquet(result.events, args.out)
    if args.details_out:
        Path(args.details_out).parent.mkdir(parents=True, exist_ok=True)
        result.details.to_parquet(args.details_out)
    if args.kernels_out:
        Path(args.kernels_out).parent.mkdir(parents=True, exist_ok=True)
        result.kernels.to_parquet(args.kernels_out)
    print(f"wrote {len(result.events)} events to {args.out}")
    return EXIT_OK


def register_cli(subparsers) -> None:
    """Add ``dmuon-trace nsys REPORT.sqlite --out events.parquet``."""
    p = subparsers.add_parser(
        "nsys", help="Nsight Systems SQLite export -> events Parquet",
        description=(
            "Read an Nsight Systems SQLite export (`nsys export --type sqlite "
            "--include-blobs=true REPORT.nsys-rep`) and write one event per NCCL collective "
            "NVTX range (ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclBroadcast, "
            "ncclReduce, ncclSend, ncclRecv, ncclAlltoAll) to Parquet with the CollectiveEvent "
            "columns (tracer/events.py): source='nsys', op, pid, t_start_ns, t_end_ns (ns, "
            "range bounds), cuda_dev (device of the linked NCCL kernel), phase and module (from "
            "DMuon's NVTX ranges by time containment), source_ref '<file>#NVTX_EVENTS.<rowid>'. "
            "rank, group, count and msg_bytes stay empty: they are only in the undecoded payload "
            "blob (the summary says why). ncclGroupStart/End and other API ranges are counted, "
            "not turned into events. Rows with damaged values (text in start, NULL globalTid, invalid "
            "UTF-8) are skipped and listed by table, column and rowid. Exit codes: 0 events "
            "written; 2 unreadable, damaged or unsupported export, or bad arguments; 3 no NCCL "
            "collective ranges (nothing written)."),
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100))
    p.add_argument("report", type=Path, help="the .sqlite export")
    p.add_argument("--out", type=Path, required=True, help="events Parquet to write")
    p.add_argument("--details-out", type=Path, default=None,
                   help="optional Parquet of per-event extras: tid, NCCL group, kernel names, "
                        "gpu_dur_ns, DMuon span (columns: " + ", ".join(DETAIL_COLUMNS) + ")")
    p.add_argument("--kernels-out", type=Path, default=None,
                   help="optional Parquet with one row per NCCL kernel and how it was linked")
    p.add_argument("--allow-unknown-schema", action="store_true",
                   help="parse an export whose schema version is not 3.x by its probed columns")
    p.set_defaults(func=_run_cli)
