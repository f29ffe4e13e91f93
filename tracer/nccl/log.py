"""NCCL_DEBUG=INFO log parser: COLL lines -> events (:class:`tracer.events.CollectiveEvent`,
or rows of :data:`tracer.events.EVENT_SCHEMA`).

Inputs: one file per process (``NCCL_DEBUG_FILE=nccl.%h.%p``), many such files, or one mixed
stream (stdout of a whole job). Formats: :mod:`tracer.nccl.formats` (NCCL 2.4 to 2.30, RCCL,
PyTorch's ``ProcessGroupNCCL created ncclComm_`` lines). Capture with
``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL``: without INIT lines no rank is known.

Entry points, all over one streaming implementation (:mod:`tracer.nccl.table`):

- :func:`iter_nccl_records`: physical lines -> :class:`CollRecord`, :class:`InitRecord`,
  :class:`TorchCommRecord` and :class:`ParseIssue` (no cross-line state beyond one wrapped
  line; :mod:`tracer.nccl.records`).
- :func:`iter_nccl_events`: events, each resolved from the INIT lines seen *before* it in its
  stream (the usual order: NCCL logs INIT before the first collective). Memory: one block of
  lines and the communicator state.
- :func:`nccl_logs_to_table` (an Arrow table), :func:`parse_nccl_logs` (a list of events):
  the whole job. Events whose communicator's identity changed later (INIT line after its COLL
  lines in a mixed stream, a wider communicator created later) are corrected at the end, per
  communicator epoch, so the result does not depend on line order. Hold every event.
- :func:`write_nccl_parquet` (``dmuon-trace nccl``): the same rows as
  :func:`nccl_logs_to_table`, streamed to Parquet; the end correction, when one is needed,
  is a second streaming pass over the written file. Memory does not grow with the log.

Speed: lines of the per-process shape (``[timestamp] host:pid:tid [dev] NCCL INFO <Op>: ...``
at column 0, see :data:`tracer.nccl.formats.FAST_COLL_LINE_RE2`) are read from files in bulk
(RE2 + numpy: several 100k lines/s on one core, ``benchmarks/bench_nccl_parser.py``). Every
other line (mixed streams with foreign prefixes such as mpirun's ``[1] ``, records
interleaved on one line, wrapped lines, INIT and PyTorch lines) takes the general per-line
path: the same results, about 5x slower. In-memory ``(name, lines)`` inputs go in blocks of
1024 lines, with more fixed cost per line than files. Events as Python objects
(:func:`parse_nccl_logs`, :func:`iter_nccl_events`) cost about 10 us each on top.

Communicator identity (``group_id``, equal on every member), first that applies:

1. ``commId`` of the INIT line (NCCL 2.16+, and 2.21-2.22 split lines), e.g. ``0x5ae77eb5ea4ec1ee``;
2. split communicators without commId (2.23+): ``<parent group_id>/split<splitCount>/color<c>``
   (``splitCount``/``childCount`` from 2.24; omitted for 2.23);
3. PyTorch's process-group id from a ``created ncclComm_`` line: ``torch_pg:<id>``;
4. otherwise process-local, **not shared across processes**: ``local:<host>:<pid>:<comm>``
   (``local:<file>:<comm>`` when the prefix has no host/pid). Match such groups by size and
   call order.

``group_rank`` is the comm's ``rank`` from its INIT line (NCCL's rank is the rank inside the
communicator) or PyTorch's ``Rank r``; ``rank`` (the world rank) is PyTorch's default_pg rank
when logged, else the group rank on the widest communicator of the same process and CUDA
device (the world communicator in torchrun jobs), else ``None``. A comm pointer reused after
``Destroy COMPLETE`` (or initialised again after COLL lines) is a new epoch: ``seq`` restarts
and its identity is resolved on its own.

Defined outcomes (each tested):

- COLL line for a comm with no INIT line: event with ``rank``/``group_rank`` ``None``,
  ``group_size`` from ``[nranks=]``, a ``local:`` group_id; listed in the summary, not an issue.
- unknown datatype number: event with ``dtype=None`` and an issue (call counts stay right).
- ``[nranks=]`` disagreeing with the size known for its comm (its INIT line, or its earlier
  COLL lines): issue, no event; the call still counts in ``seq``.
- Gather / Scatter (2.28+): ``gather`` / ``scatter`` events, ``count`` per rank as logged (the
  send count of gather, the receive count of scatter), ``root`` kept. AllToAllv: issue
  ``unsupported op``, no event (not in ``OPS``).
- COLL line without its ``stream`` field: joined with up to 3 following non-NCCL lines
  (copy/paste wraps; a line holding another ``<Op>: opCount`` is never joined); still
  incomplete, or the last line of the input: issue, no event.
- COLL record whose ``[timestamp] host:pid:tid [dev] NCCL INFO`` prefix was lost (found by
  ``<Op>: opCount`` anywhere a record's text does not cover: a line without ``NCCL INFO``,
  after another record, after foreign text): an *unattributed* event. Its ``source_ref``,
  op, count, dtype, root, comm and ``[nranks=]`` (as ``group_size``) are kept; ``host``,
  ``pid``, ``cuda_dev``, ``t_start_ns`` are null, and it is **not resolved**: ``rank``,
  ``group_rank``, ``group_id`` and ``seq`` are null, and it neither counts in any
  communicator's ``seq`` nor is checked against its size. A comm pointer is a per-process
  address (equal values in two processes are common), so it cannot say whose call it was;
  the prefixed calls of that process keep their numbering (one call short). Counted as
  "unattributed" in the summary (``ParseStats.unattributed``), not as a COLL or non-NCCL line.
  Text glued before the op name is read from its end when one op name fits and is not the
  end of a longer one (``"doneSend"``: Send); when two fit (``"0x1fAllGather"``: AllGather
  or Gather after ``"…All"``), when letters are glued to Reduce, Gather or Scatter
  (``"stepReduce"``, ``"AlReduce"``: maybe a mangled AllReduce), or when the name is split
  by or follows punctuation or other non-ASCII text (``"All Reduce"``, ``"Al-Reduce"``) it
  is an issue, no event (:func:`tracer.nccl.formats.lost_op_name`). A blank or digits
  before it are foreign text (``"loss 2.5 Reduce"``). INIT lines that lost their prefix are
  plain text.
- a line with invalid UTF-8 (files are decoded with ``errors="surrogateescape"``; in-memory
  lines holding lone surrogates): issue naming the byte and column, the line is not parsed;
  the other lines are.
- anything that looks like a COLL record but does not read exactly is an issue with
  ``file:line`` and an excerpt, never an event of another op. After ``NCCL INFO `` the op
  name must start the message and be one of :data:`tracer.nccl.formats.NCCL_OP_NAMES`
  (``All-Reduce:``, ``All Reduce:``, ``All\u200bReduce:``, ``AllReduce :`` are issues: the
  marker owns the first ``: opCount`` of its message, unless an INIT line ends before it);
  without a prefix, a name split by characters that are not ASCII letters (``All
  Reduce``) has two readings and is an issue, like glued text with two readings; a record
  holding its ``stream`` field whose fields are out of NCCL's format is an issue naming the
  first such field (not joined with the next lines); ``opCount`` written otherwise
  (``AllReduce:opCount``) is an issue. Excerpts are at most
  :data:`tracer.nccl.formats.EXCERPT_CHARS` characters, centred on the field that failed;
  past :data:`tracer.nccl.records.MAX_LINE_ISSUES` issues on one physical line, the rest
  are one issue counting them.
- a number that its event column cannot hold (count or count x dtype bytes >= 2**63; root,
  nranks, cudaDev, INIT rank / nranks, PyTorch Rank outside int32; any number of more than
  40 digits), a pointer of more than 64 characters: issue naming the field, with an excerpt
  around it; record skipped.
- terminal colours (ANSI escape sequences, anywhere), and a UTF-8 byte-order mark, CR or NUL
  bytes before a line's text or before a prefix: removed before parsing, counted in
  ``ParseStats.stripped`` and the summary. A prefix is read from at most the last
  :data:`tracer.nccl.formats.PREFIX_WINDOW` characters before its marker; a run of text
  without blanks past that (a glued host of kilobytes, a pid of thousands of digits) is an
  issue, record skipped.
- timestamps: ``[YYYY-mm-dd HH:MM:SS[.frac]]``, ``T`` between date and clock, an optional zone
  (``Z``, ``UTC``, ``+HH``, ``+HHMM``, ``+HH:MM``, converted to UTC). An impossible one
  (February 30, month 13, outside 1677-2262, the int64 ns range) or a bracketed time in
  another format right before the host: issue naming the line, event kept with
  ``t_start_ns`` null.
- files: gzip (by its first bytes, whatever the name) is read decompressed; a file that is
  binary (a NUL byte and no NCCL text in its first 8 KiB), unreadable or not a regular file
  is left out; a gzip stream damaged or truncated part-way is read up to there. Each is
  listed in the result's ``unread`` with its reason and is an issue (line 0, or the line
  where reading stopped).
- NCCL lines of other subsystems (TUNING, P2P, NET, ...), WARN, CALL: counted as ignored.
  Lines without ``NCCL``: plain program output, counted, never issues.
- ``strict=True``: :class:`NcclLogError` (a ValueError) on the first issue.

Memory on a long physical line: the line (bytes and text), plus a bounded amount (records are
resolved :data:`tracer.nccl.table.FLUSH_RECORDS` at a time, issue texts are excerpts, the
Parquet writer holds at most a row group). A line of more than
:data:`tracer.nccl.formats.LONG_LINE` bytes holding non-ASCII characters is read one byte per
character (:class:`tracer.nccl.formats.ByteLine`), so its text costs its size in bytes
whatever its characters; measured bound in ``tests/nccl/test_nccl_memory.py``.

Time: linear in the input on any line (no regex search backtracks over a long run; the
formerly quadratic prefix, INIT and PyTorch patterns are read by anchored or bounded
matches, see :mod:`tracer.nccl.formats`; ``tests/nccl/test_nccl_linear.py``).
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracer.events import EVENT_SCHEMA, CollectiveEvent
from tracer.nccl.columns import expand_paths
from tracer.nccl.records import (
    CollRecord,
    InitRecord,
    NcclLogError,
    ParseIssue,
    ParseStats,
    Record,
    TorchCommRecord,
    iter_nccl_records,
)
from tracer.nccl.resolve import CommInfo
from tracer.nccl.table import BATCH_SCHEMA, EventBatches, apply_final_fixes

__all__ = [
    "CollRecord", "CommInfo", "InitRecord", "NcclLogError", "NcclLogResult",
    "NcclParquetResult", "NcclTableResult", "ParseIssue", "ParseStats", "Record",
    "TorchCommRecord", "expand_paths", "iter_nccl_events", "iter_nccl_records",
    "nccl_logs_to_table", "parse_nccl_logs", "register_cli", "write_nccl_parquet",
]

#: Rows per Parquet row group written by :func:`write_nccl_parquet`.
ROW_GROUP_ROWS = 1 << 16


def _events(batch: pa.RecordBatch) -> Iterator[CollectiveEvent]:
    for row in batch.to_pylist():
        yield CollectiveEvent(**row)


def iter_nccl_events(paths, *, strict: bool = False, issues: list | None = None,
                     stats: ParseStats | None = None) -> Iterator[CollectiveEvent]:
    """Events of NCCL logs, streaming; identities resolved from lines seen so far.

    Args:
        paths: a file or directory path, a list of them, or ``(name, lines)`` pairs.
        strict: raise :class:`NcclLogError` on the first issue.
        issues: issues are appended here; without it, a ``UserWarning`` at the end names
            how many there were and the first one.
        stats: line counts, updated in place.
    """
    parser = EventBatches(strict=strict)
    if issues is not None:
        parser.issues = issues
    if stats is not None:
        parser.stats = stats
    for batch, _ in parser.batches(paths):
        yield from _events(batch)
    if issues is None and parser.issues:
        import warnings

        warnings.warn(f"{len(parser.issues)} unreadable NCCL log line(s); first: "
                      f"{parser.issues[0]}. Pass issues=[] to collect them, or strict=True to "
                      "stop.", stacklevel=2)


def _summary(files: list[str], stats: ParseStats, n_events: int, ops: Counter, ranks: list,
             comms: list[CommInfo], issues: list[ParseIssue], issue_count: int,
             max_issues: int, unread: list | None = None) -> str:
    """Human-readable summary: files left out, events per op, communicators, ranks, issues
    (file:line)."""
    from tabulate import tabulate

    st = stats
    unread = unread or []
    out = []
    if unread:
        out.append(f"files not read (or not to their end): {len(unread)}")
        out.extend(f"  {path}: {reason}" for path, reason in unread[:40])
        if len(unread) > 40:
            out.append(f"  ... {len(unread) - 40} more")
    out += [f"NCCL logs: {len(files)} file(s), {st.lines} lines: {st.coll_lines} COLL, "
           f"{st.unattributed} unattributed COLL, "
           f"{st.init_lines} INIT, {st.torch_lines} PyTorch comm, {st.continuation_lines} "
           f"continuation, {sum(st.ignored.values())} other NCCL (ignored: "
           f"{dict(st.ignored) or 'none'}), {st.plain_lines} non-NCCL",
           f"events: {n_events}; ranks of events: {ranks or 'unknown'}"]
    if st.stripped:
        out.append("removed before parsing (terminal colours, a byte-order mark, CR or NUL "
                   "before a prefix; never part of a record): " + ", ".join(
                       f"{n} {kind}" for kind, n in sorted(st.stripped.items())))
    if ops:
        out.append(tabulate(sorted(ops.items()), headers=["op", "events"]))
    rows = [(c.group_id, c.nranks, c.group_rank, c.rank, c.host, c.pid, c.comm, c.calls,
             c.init_ref or "no INIT line") for c in comms]
    if len(rows) > 40:
        rows = rows[:40] + [("...", None, None, None, None, None, f"{len(rows) - 40} more",
                             None, None)]
    if rows:
        out.append(tabulate(rows, headers=["group_id", "nranks", "group_rank", "rank", "host",
                                           "pid", "comm", "calls", "init"]))
    no_init = [c for c in comms if c.init_ref is None and c.calls]
    if no_init:
        out.append(f"{len(no_init)} communicator(s) with COLL lines but no INIT line: rank "
                   "unknown, group_id process-local (capture with NCCL_DEBUG_SUBSYS=INIT,COLL)")
    if st.unattributed:
        out.append(f"{st.unattributed} unattributed COLL record(s): their 'host:pid:tid [dev] "
                   "NCCL INFO' prefix was lost (interleaved output); events with host, pid, "
                   "rank, group_id and seq unknown (null), found by source_ref")
    out.append(f"unreadable lines: {issue_count}")
    shown = issues[:max_issues]
    out.extend(f"  {issue}" for issue in shown)
    if issue_count > len(shown):
        out.append(f"  ... {issue_count - len(shown)} more")
    return "\n".join(out)


def _table_ops_ranks(table: pa.Table | pa.RecordBatch) -> tuple[Counter, set]:
    ops = Counter({d["values"]: d["counts"] for d in pc.value_counts(table["op"]).to_pylist()})
    return ops, set(pc.unique(table["rank"]).drop_null().to_pylist())


@dataclass
class NcclLogResult:
    """Everything parsed from a set of NCCL logs."""

    events: list[CollectiveEvent]
    comms: list[CommInfo]
    issues: list[ParseIssue]
    stats: ParseStats
    files: list[str]
    unread: list[tuple[str, str]] = field(default_factory=list)

    def summary(self, max_issues: int = 10) -> str:
        """Human-readable summary: events per op, communicators, ranks, issues (file:line)."""
        ranks = sorted({ev.rank for ev in self.events if ev.rank is not None})
        return _summary(self.files, self.stats, len(self.events),
                        Counter(ev.op for ev in self.events), ranks, self.comms, self.issues,
                        len(self.issues), max_issues, self.unread)


@dataclass
class NcclTableResult:
    """:func:`nccl_logs_to_table`'s result: ``table`` has :data:`tracer.events.EVENT_SCHEMA`,
    one row per event in input order (the rows of :func:`parse_nccl_logs`' events)."""

    table: pa.Table
    comms: list[CommInfo]
    issues: list[ParseIssue]
    stats: ParseStats
    files: list[str]
    unread: list[tuple[str, str]] = field(default_factory=list)

    def summary(self, max_issues: int = 10) -> str:
        """Human-readable summary: events per op, communicators, ranks, issues (file:line)."""
        ops, ranks = _table_ops_ranks(self.table)
        return _summary(self.files, self.stats, self.table.num_rows, ops, sorted(ranks),
                        self.comms, self.issues, len(self.issues), max_issues, self.unread)


def nccl_logs_to_table(paths, *, strict: bool = False) -> NcclTableResult:
    """Parse NCCL_DEBUG=INFO logs into an Arrow table of events (rules: module docstring).

    Args:
        paths: a file or directory path, a list of them, or ``(name, lines)`` pairs.
        strict: raise :class:`NcclLogError` (a ValueError) on the first issue.

    Returns:
        :class:`NcclTableResult`; rows in input order, ``seq`` 0-based per communicator
        epoch per process, ``msg_bytes = count * dtype_bytes``.

    Raises:
        ValueError: a path does not exist; in strict mode, the first unreadable line.
    """
    parser = EventBatches(strict=strict)
    batches, epochs = [], []
    for batch, epoch in parser.batches(paths):
        batches.append(batch)
        epochs.append(epoch)
    table = pa.Table.from_batches(batches, schema=BATCH_SCHEMA).cast(EVENT_SCHEMA)
    if epochs:
        table = apply_final_fixes(table, np.concatenate(epochs),
                                  parser.resolver.final_fixes())
    return NcclTableResult(table, parser.resolver.comm_infos(), parser.issues, parser.stats,
                           parser.files, parser.unread)


def parse_nccl_logs(paths, *, strict: bool = False) -> NcclLogResult:
    """Parse NCCL_DEBUG=INFO logs into events (see the module docstring for the rules).

    Args:
        paths: a file or directory path, a list of them, or ``(name, lines)`` pairs.
        strict: raise :class:`NcclLogError` (a ValueError) on the first issue.

    Returns:
        :class:`NcclLogResult`; events in input order, ``seq`` 0-based per communicator
        per process: the rows of :func:`nccl_logs_to_table` as events.

    Raises:
        ValueError: a path does not exist; in strict mode, the first unreadable line.
    """
    res = nccl_logs_to_table(paths, strict=strict)
    events = [ev for batch in res.table.to_batches() for ev in _events(batch)]
    return NcclLogResult(events, res.comms, res.issues, res.stats, res.files, res.unread)


@dataclass
class NcclParquetResult:
    """:func:`write_nccl_parquet`'s result. ``path`` is ``None`` when nothing was written (no
    event); ``issues`` holds the first ``max_issues`` issues, ``issue_count`` counts all;
    ``ops``: events per op; ``ranks``: world ranks of the events."""

    path: Path | None
    rows: int
    ops: Counter
    ranks: list[int]
    comms: list[CommInfo]
    issues: list[ParseIssue]
    issue_count: int
    stats: ParseStats
    files: list[str]
    unread: list[tuple[str, str]] = field(default_factory=list)

    def summary(self, max_issues: int = 10) -> str:
        """Human-readable summary: events per op, communicators, ranks, issues (file:line)."""
        return _summary(self.files, self.stats, self.rows, self.ops, self.ranks, self.comms,
                        self.issues, self.issue_count, max_issues, self.unread)


def write_nccl_parquet(paths, out: str | os.PathLike, *, strict: bool = False,
                       max_issues: int | None = None) -> NcclParquetResult:
    """Parse NCCL logs straight into a Parquet file of events, in bounded memory.

    The rows equal :func:`nccl_logs_to_table`'s (schema :data:`tracer.events.EVENT_SCHEMA`,
    row groups of at least :data:`ROW_GROUP_ROWS` rows but the last). They are written as
    they are parsed, with each row's communicator epoch in a side file (8 bytes a row); when
    the end-of-parse correction applies to any row, a second pass streams the written file
    into its corrected copy. ``out`` is replaced only when the parse succeeds with at least
    one event (the files are written next to it as ``.<name>.<pid>.*.tmp`` first).

    Args:
        paths: a file or directory path, a list of them, or ``(name, lines)`` pairs.
        out: the Parquet file to write; its directory is created.
        strict: raise :class:`NcclLogError` (a ValueError) on the first issue, writing
            nothing.
        max_issues: keep only the first this many issues (all when ``None``).

    Raises:
        ValueError: a path does not exist; in strict mode, the first unreadable line.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = [out.with_name(f".{out.name}.{os.getpid()}.{k}.tmp") for k in ("rows", "epoch", "fix")]
    parser = EventBatches(strict=strict, keep_issues=max_issues)
    ops, ranks, rows = Counter(), set(), 0
    seen = np.zeros(0, bool)  # epochs with rows (a bitmap: one byte per epoch)
    try:
        with _writer(tmp[0], BATCH_SCHEMA) as writer, open(tmp[1], "wb") as ef:
            group: list[pa.RecordBatch] = []
            for batch, epoch in parser.batches(paths):
                group.append(batch)
                epoch.astype(np.int64).tofile(ef)
                hit = epoch[epoch >= 0]
                if len(hit):
                    if hit.max() >= len(seen):
                        seen = np.concatenate([seen, np.zeros(2 * int(hit.max()) + 1 - len(seen),
                                                              bool)])
                    seen[hit] = True
                rows += batch.num_rows
                if sum(b.num_rows for b in group) >= ROW_GROUP_ROWS:
                    _write_group(writer, group, ops, ranks)
            _write_group(writer, group, ops, ranks)
        fixes = {e: v for e, v in parser.resolver.final_fixes().items()
                 if e < len(seen) and seen[e]}
        if rows and fixes:
            ranks = set()
            _rewrite_fixed(tmp[0], tmp[1], tmp[2], fixes, ranks)
            os.replace(tmp[2], tmp[0])
        if rows:
            os.replace(tmp[0], out)
    finally:
        for p in tmp:
            p.unlink(missing_ok=True)
    return NcclParquetResult(out if rows else None, rows, ops, sorted(ranks),
                             parser.resolver.comm_infos(), parser.issues, parser.issue_count,
                             parser.stats, parser.files, parser.unread)


def _writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    """A Parquet writer whose file reads back as :data:`EVENT_SCHEMA` (dictionary columns are
    stored as plain Parquet strings: no Arrow schema is stored). Columns with one value a row
    skip dictionary encoding: ``source_ref`` (no min/max statistics either), and ``seq`` and
    ``t_start_ns``, which rise along a stream and are delta-encoded."""
    delta = {"seq": "DELTA_BINARY_PACKED", "t_start_ns": "DELTA_BINARY_PACKED"}
    names = [f.name for f in schema]
    return pq.ParquetWriter(
        path, schema, store_schema=False, column_encoding=delta,
        use_dictionary=[n for n in names if n not in delta and n != "source_ref"],
        write_statistics=[n for n in names if n != "source_ref"])


def _write_group(writer: pq.ParquetWriter, group: list, ops: Counter, ranks: set) -> None:
    if not group:
        return
    table = pa.Table.from_batches(group, schema=BATCH_SCHEMA).unify_dictionaries()
    group.clear()
    batch_ops, batch_ranks = _table_ops_ranks(table)
    ops.update(batch_ops)
    ranks.update(batch_ranks)
    writer.write_table(table, row_group_size=max(table.num_rows, 1))


def _rewrite_fixed(src: Path, epochs: Path, dst: Path, fixes: dict, ranks: set) -> None:
    """Stream ``src`` into ``dst`` with the end-of-parse correction applied."""
    source = pq.ParquetFile(src)
    with _writer(dst, EVENT_SCHEMA) as writer, open(epochs, "rb") as ef:
        for i in range(source.num_row_groups):
            table = source.read_row_group(i)
            epoch = np.fromfile(ef, np.int64, table.num_rows)
            table = apply_final_fixes(table, epoch, fixes)
            ranks.update(_table_ops_ranks(table)[1])
            writer.write_table(table, row_group_size=max(table.num_rows, 1))


# ---------------------------------------------------------------------------- CLI

_EPILOG = """\
inputs:
  PATH is an NCCL_DEBUG=INFO log (NCCL 2.4-2.30 or RCCL; one file per process, e.g.
  NCCL_DEBUG_FILE=nccl.%h.%p, or a whole job's mixed stdout), gzipped or not (gzip is known
  by its first bytes, whatever the name), or a directory, read recursively: every
  non-hidden file (restrict with --glob; the --out file itself is never read). A file that
  is not a log is left out and named in the summary with its reason: binary (a NUL byte in
  its first 8 KiB, decompressed, and no NCCL text there), unreadable, not a regular file
  (FIFO, socket, a folder behind a symlink), a damaged gzip stream. A gzip stream that
  ends early is read up to there, and named too. Capture with NCCL_DEBUG=INFO
  NCCL_DEBUG_SUBSYS=INIT,COLL.

  Terminal colours (ANSI escape sequences), a UTF-8 byte-order mark, CR and NUL bytes
  before a line's prefix are removed before parsing and counted in the summary. A line
  that looks like a COLL line but does not parse exactly (an op name such as All-Reduce,
  a field out of NCCL's format, a number no column holds) is an issue with file:line and
  an excerpt, never an event of another op.

output (--out, Parquet, tracer.events.EVENT_SCHEMA), one row per COLL line:
  op          all_reduce, all_gather, reduce_scatter, broadcast, reduce, send, recv, all_to_all,
              gather, scatter
  count       elements per rank as logged (NCCL's count argument); msg_bytes = count * dtype_bytes
  dtype       torch name from NCCL's datatype enum
  rank        world rank (see tracer.nccl.log); group_rank / group_size: rank in / size of the comm
  group_id    commId, <parent>/split<n>/color<c>, torch_pg:<id>, or local:<host>:<pid>:<comm>
  seq         0-based call index per communicator per process
  root        root (broadcast, reduce, gather, scatter) or peer (send, recv); else empty
  comm, pid, host, cuda_dev (the bracketed CUDA device, not the rank), source_ref (file:line),
  t_start_ns  from the NCCL 2.26+ [timestamp] prefix: YYYY-mm-dd HH:MM:SS[.frac], T between
              date and time allowed, an optional zone (Z, UTC, +HH, +HHMM, +HH:MM) converted
              to UTC; without a zone read as UTC. Empty without a timestamp; an unreadable
              one (impossible date, other format) is an issue naming the line.
  A COLL line whose "host:pid:tid [dev] NCCL INFO" prefix was lost (interleaved stdout) is
  an unattributed event: host, pid, rank, group_id and seq empty (see tracer.nccl.log).

exit status:
  0 events written, every input read; 2 bad arguments or path, --strict and an unreadable
  line or file (nothing written), or a file left out or not read to its end (the events of
  the other files are written; the summary names the files); 3 no COLL lines found
  (nothing written).
"""


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``nccl PATH... --out events.parquet [--strict]`` to ``dmuon-trace``."""
    p = subparsers.add_parser(
        "nccl", help="NCCL_DEBUG=INFO logs -> events.parquet",
        description="Parse NCCL_DEBUG=INFO logs into canonical collective events and print a "
                    "summary (events per op, communicators, ranks, unreadable lines).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files or directories")
    p.add_argument("--out", required=True, help="output Parquet file (events)")
    p.add_argument("--strict", action="store_true",
                   help="stop with exit status 2 at the first unreadable line or file")
    p.add_argument("--glob", default=None, help="only files matching this pattern in "
                   "directories (e.g. '*.log'); default: every file")
    p.add_argument("--max-issues", type=int, default=10,
                   help="unreadable lines to print (default 10)")
    p.set_defaults(func=_cli_main)
    return p


def _cli_main(args) -> int:
    import sys

    from tracer.cli import EXIT_BAD_INPUT, EXIT_NOTHING_FOUND, EXIT_OK

    prog = "dmuon-trace nccl"
    try:
        skipped: list[tuple[str, str]] = []
        out = Path(args.out).resolve()
        files = [f for f in expand_paths(args.paths, glob=args.glob, skipped=skipped)
                 if f.resolve() != out]  # the output of an earlier run in the input folder
        if args.strict and skipped:
            raise ValueError(f"Invalid NCCL log {skipped[0][0]!r}: {skipped[0][1]} "
                             "(--strict: every file must be read)")
        result = write_nccl_parquet(files, args.out, strict=args.strict,
                                    max_issues=max(args.max_issues, 0))
    except ValueError as exc:  # NcclLogError (--strict) included
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result.unread[:0] = skipped
    args.dropped = (result.issue_count, str(result.issues[0]) if result.issues else "")  # tracer.cli
    print(result.summary(max_issues=args.max_issues))
    if not result.rows:
        if files:
            why = (f"no COLL lines found in {len(files)} file(s); was NCCL_DEBUG=INFO with "
                   "NCCL_DEBUG_SUBSYS including COLL set?")
        else:
            why = "no file could be read"
        if result.unread:
            why += (f" ({len(result.unread)} file(s) not read, listed above; first: "
                    f"{result.unread[0][0]}: {result.unread[0][1]})")
        print(f"{prog}: error: {why}; nothing written", file=sys.stderr)
        return EXIT_NOTHING_FOUND
    print(f"wrote {result.rows} events to {result.path}")
    if result.unread:
        first = result.unread[0]
        print(f"{prog}: error: {len(result.unread)} file(s) not read or not read to their end "
              f"(listed above; first: {first[0]}: {first[1]}); the events of the others were "
              "written", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK
