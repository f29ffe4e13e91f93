"""NCCL_DEBUG=INFO logs -> Arrow record batches of events (:data:`tracer.events.EVENT_SCHEMA`),
streaming; the one implementation behind every entry point of :mod:`tracer.nccl.log`.

Per block of lines (:mod:`tracer.nccl.columns`): the fast lines' fields come in bulk; every
other line goes through the general path (:class:`tracer.nccl.records.LineParser`) in line
order, which keeps its state (wrapped lines) across fast lines exactly as line-by-line
reading would. The COLL rows of both are merged in stream order and resolved by
:class:`tracer.nccl.resolve.Resolver` segment by segment (INIT / PyTorch records end a
segment). Rows carry the resolution known at their line (what streaming gives) and their
communicator epoch, so :func:`apply_final_fixes` can correct them at the end. Rows of records
that lost their prefix (unattributed) skip resolution: rank, group_rank, group_id, seq and
epoch null, group_size as logged.

Memory: one block, the communicator state, and the issues kept (all, or a bounded number).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracer.nccl import formats as fmt
from tracer.events import DTYPE_BYTES, EVENT_SCHEMA, OPS
from tracer.nccl.columns import NULL, LineBlock, fast_coll_fields, source_refs, sources
from tracer.nccl.columns import InputReadError
from tracer.nccl.records import (
    CollRecord,
    InitRecord,
    LineParser,
    NcclLogError,
    ParseIssue,
    ParseStats,
    parse_prefix,
    timestamp_issue,
)
from tracer.nccl.resolve import Resolver, proc_key

_OPS = pa.array(OPS, pa.string())
_OP_INDEX = {op: i for i, op in enumerate(OPS)}
_ROOTED = np.array([op in fmt.ROOTED_OPS for op in OPS])
_NDT = max(fmt.NCCL_DATATYPES) + 1
_DTYPES = pa.array([fmt.NCCL_DATATYPES.get(i) for i in range(_NDT)], pa.string())
_DT_BYTES = np.array([DTYPE_BYTES.get(fmt.NCCL_DATATYPES.get(i), 0) for i in range(_NDT)])
_SOURCE = pa.array(["nccl_log"], pa.string())

#: Records of one block resolved together at most (a long line holding many records is
#: resolved in pieces, so memory does not grow with the line).
FLUSH_RECORDS = 1 << 12

#: Columns of few distinct values, dictionary-encoded in :data:`BATCH_SCHEMA`.
DICTIONARY_COLUMNS = ("source", "op", "group_id", "dtype", "host", "comm")
#: Schema of :meth:`EventBatches.batches`: :data:`tracer.events.EVENT_SCHEMA` with
#: :data:`DICTIONARY_COLUMNS` as ``dictionary<int32, string>`` (``.cast(EVENT_SCHEMA)`` gives
#: plain strings; Parquet stores both the same way).
BATCH_SCHEMA = pa.schema([
    pa.field(f.name, pa.dictionary(pa.int32(), pa.string()), f.nullable)
    if f.name in DICTIONARY_COLUMNS else f for f in EVENT_SCHEMA])


def _unread_issue(path: str, reason: str) -> ParseIssue:
    """A file left out or not read to its end, as an issue (line 0: the whole file)."""
    return ParseIssue(path, 0, f"file not read: {reason}", "")


class _Rows:
    """COLL rows of one block before resolution: numpy columns in stream order. ``pos``:
    where the record was read (line index in the block * stride + record index in the line);
    ``line_no``: the line it starts on (a wrapped record is read on a later line); ``una``:
    the record lost its prefix (not resolved, see :mod:`tracer.nccl.log`)."""

    __slots__ = ("pos", "line_no", "op", "count", "dt", "root", "comm", "nranks", "proc",
                 "t_ns", "t_valid", "una")

    def __init__(self, **cols):
        for k in self.__slots__:
            setattr(self, k, cols[k])

    def take(self, idx) -> _Rows:
        return _Rows(**{k: getattr(self, k)[idx] for k in self.__slots__})

    @staticmethod
    def concat(a: _Rows, b: _Rows) -> _Rows:
        joined = _Rows(**{k: np.concatenate([getattr(a, k), getattr(b, k)])
                          for k in _Rows.__slots__})
        return joined.take(np.argsort(joined.pos, kind="stable"))


class EventBatches:
    """Streaming parse of NCCL logs into event batches (see the module docstring).

    Args:
        strict: raise :class:`NcclLogError` at the first issue (after the rows before it).
        keep_issues: keep at most this many issues in ``issues`` (all when ``None``);
            ``issue_count`` counts every one.

    After iterating :meth:`batches`: ``stats``, ``files``, ``issues``, ``issue_count``,
    ``resolver`` (communicators, :meth:`Resolver.final_fixes`).
    """

    def __init__(self, *, strict: bool = False, keep_issues: int | None = None):
        self.resolver = Resolver()
        self.stats = ParseStats()
        self.files: list[str] = []
        self.unread: list[tuple[str, str]] = []
        self.issues: list[ParseIssue] = []
        self.issue_count = 0
        self.strict = strict
        self.keep_issues = keep_issues

    def batches(self, paths) -> Iterator[tuple[pa.RecordBatch, np.ndarray]]:
        """``(batch, epoch)`` per block with events (or per :data:`FLUSH_RECORDS` records of a
        long line): ``batch`` has :data:`BATCH_SCHEMA`, ``epoch`` (int64, one per row) the
        communicator epoch of each row. Files left out (binary, unreadable) or not read to
        their end (a damaged gzip stream) are listed in ``unread`` as ``(path, reason)``; a
        file that stops early also gives an issue at the line where it stopped."""
        told = 0  # files of self.unread already reported as issues
        for name, blocks in sources(paths, skipped=self.unread):
            told = self._tell_unread(told)
            self.files.append(name)
            parser = LineParser(name, self.stats)
            stopped = None
            try:
                for block in blocks:
                    yield from self._block(name, block, parser)
            except InputReadError as exc:
                stopped = exc
            issue = parser.finish()
            if issue is not None:
                self._emit([issue])
            if stopped is not None:
                self.unread.append((name, f"read up to line {stopped.line_no}: "
                                          f"{stopped.reason}"))
                told += 1
                self._emit([ParseIssue(name, stopped.line_no, f"file not read to its end: "
                                       f"{stopped.reason}; the lines after are lost", "")])
        self._tell_unread(told)

    def _tell_unread(self, told: int) -> int:
        """Issues (line 0) for the files left out since the first ``told`` of ``unread``."""
        if len(self.unread) > told:
            self._emit([_unread_issue(*u) for u in self.unread[told:]])
        return len(self.unread)

    def _emit(self, issues: list[ParseIssue]) -> None:
        if issues and self.strict:
            raise NcclLogError(issues[0])
        self.issue_count += len(issues)
        room = len(issues) if self.keep_issues is None else self.keep_issues - len(self.issues)
        self.issues.extend(issues[:max(room, 0)])

    def _block(self, file: str, block: LineBlock, parser: LineParser):
        """``(batch, epoch)`` of one block, one or more (a long line's records are resolved
        :data:`FLUSH_RECORDS` at a time); raises the strict-mode error after the rows before
        it."""
        n = len(block)
        self.stats.lines += n
        fast = fast_coll_fields(block)
        slow = np.ones(n, bool)
        # colls, barriers, issues: (line, sub, record); issues of fast lines (sub 1: after
        # an interrupted wrapped line's issue at sub 0, before the line's row)
        acc: tuple[list, list, list, list] = ([], [], [], [])
        colls, barriers, issues, fast_issues = acc
        if fast is not None:
            slow[fast.line] = False
            self.stats.coll_lines += len(fast.line)
            if fast.t_bad is not None and fast.t_bad.any():
                for i in fast.line[fast.t_bad].tolist():
                    text = block.text(i)
                    ts = text[1:text.index("]")]
                    fast_issues.append((i, 1, timestamp_issue(
                        file, block.first_line_no + i,
                        (f"[{ts}]", fmt.timestamp_problem(ts), False))))
        first, prev, done = block.first_line_no, -1, 0  # done: fast rows already resolved
        for i in np.flatnonzero(slow).tolist():
            if i > prev + 1:  # fast lines since the previous slow line
                issue = parser.interrupt()
                if issue is not None:
                    issues.append((prev + 1, 0, issue))
            for sub, rec in enumerate(parser.iter_feed(first + i, block.text(i)), 1):
                kind = type(rec)
                (issues if kind is ParseIssue else colls if kind is CollRecord
                 else barriers).append((i, sub, rec))
                if len(colls) + len(barriers) + len(issues) >= FLUSH_RECORDS:
                    upto = 0 if fast is None else int(np.searchsorted(fast.line, i))
                    yield from self._flush(file, block, fast, done, upto, acc, i)
                    done = upto
            prev = i
        if prev < n - 1:
            issue = parser.interrupt()
            if issue is not None:
                issues.append((prev + 1, 0, issue))
        yield from self._flush(file, block, fast, done, 0 if fast is None else len(fast.line),
                               acc, n)

    def _flush(self, file: str, block: LineBlock, fast, lo: int, hi: int, acc: tuple,
               line: int):
        """Resolve fast rows ``lo:hi`` and the records in ``acc`` (emptied), and issues of
        lines before ``line`` (those of fast lines are kept until their rows go)."""
        colls, barriers, issues, fast_issues = acc
        part = None if fast is None else fast.take(lo, hi)
        k = 0
        while k < len(fast_issues) and fast_issues[k][0] < line:
            k += 1
        now = issues + fast_issues[:k]
        issues.clear()
        del fast_issues[:k]
        stride = 2 + max((t[1] for t in colls + barriers + now), default=0)
        rows = self._rows(block, part, colls, stride)
        todo = (list(barriers), now)
        colls.clear()
        barriers.clear()
        if rows is None and not todo[0] and not todo[1]:
            return
        out, error = self._resolve(file, block, rows, todo[0], todo[1], stride)
        if out is not None:
            yield out
        if error is not None:
            raise error

    def _rows(self, block: LineBlock, fast, colls: list[tuple], stride: int) -> _Rows | None:
        procs: dict[tuple, int] = {}  # (host, pid, cuda_dev) -> index into self._procs
        self._procs: list[tuple] = []
        self._comms: list[str] = []
        rows = None
        if fast is not None:
            proc_idx = np.array([self._proc(procs, parse_prefix(p)) for p in fast.prefixes],
                                np.int64)
            self._comms = list(fast.comms)
            m = len(fast.line)
            rows = _Rows(pos=fast.line * stride + 1, line_no=fast.line + block.first_line_no,
                         op=fast.op,
                         count=fast.count, dt=fast.datatype, root=fast.root, comm=fast.comm,
                         nranks=fast.nranks, proc=proc_idx[fast.prefix],
                         t_ns=fast.t_ns if fast.t_ns is not None else np.zeros(m, np.int64),
                         t_valid=(fast.t_valid if fast.t_valid is not None
                                  else np.zeros(m, bool)),
                         una=np.zeros(m, bool))
        if colls:
            comm_index = {c: i for i, c in enumerate(self._comms)}
            for _, _, r in colls:
                if r.comm not in comm_index:
                    comm_index[r.comm] = len(self._comms)
                    self._comms.append(r.comm)
            recs = [r for _, _, r in colls]
            rooted = fmt.ROOTED_OPS
            slow = _Rows(
                pos=np.array([line * stride + sub for line, sub, _ in colls], np.int64),
                line_no=np.array([r.line_no for r in recs], np.int64),
                op=np.array([_OP_INDEX[r.op] for r in recs], np.int64),
                count=np.array([r.count for r in recs], np.int64),
                dt=np.array([-1 if r.dtype is None else r.datatype for r in recs], np.int64),
                root=np.array([r.root if r.op in rooted else 0 for r in recs], np.int64),
                comm=np.array([comm_index[r.comm] for r in recs], np.int64),
                nranks=np.array([NULL if r.nranks is None else r.nranks for r in recs],
                                np.int64),
                proc=np.array([self._proc(procs, (None, r.host, r.pid, None, r.cuda_dev))
                               for r in recs], np.int64),
                t_ns=np.array([r.t_start_ns or 0 for r in recs], np.int64),
                t_valid=np.array([r.t_start_ns is not None for r in recs], bool),
                una=np.array([r.unattributed for r in recs], bool))
            rows = slow if rows is None else _Rows.concat(rows, slow)
        return rows

    def _proc(self, index: dict, prefix: tuple) -> int:
        _, host, pid, _, dev = prefix
        key = (host, pid, dev)
        i = index.get(key)
        if i is None:
            i = index[key] = len(self._procs)
            self._procs.append(key)
        return i

    def _resolve(self, file, block, rows: _Rows | None, barriers, issues, stride):
        r = self.resolver
        segs = []
        nrows = 0 if rows is None else len(rows.pos)
        at = [b[0] * stride + b[1] for b in barriers]
        cuts = [0, *(np.searchsorted(rows.pos, at).tolist() if nrows else [0] * len(at)), nrows]
        for j in range(len(barriers) + 1):
            a, b = cuts[j], cuts[j + 1]
            if b > a:
                idx = slice(a, b)  # a view, unless unattributed rows (not resolved) are out
                if rows.una[a:b].any():
                    idx = np.arange(a, b)[~rows.una[a:b]]
                if len(rows.pos[idx]):
                    segs.append((idx, self._segment(file, rows, idx)))
            if j < len(barriers):
                rec = barriers[j][2]
                (r.init if type(rec) is InitRecord else r.torch)(rec)
        bad = np.zeros(nrows, bool)
        for idx, seg in segs:
            bad[idx] = seg.bad
            issues.extend((*divmod(int(rows.pos[idx][k]), stride), iss)
                          for k, iss in zip(np.flatnonzero(seg.bad).tolist(), seg.issues))
        issues.sort(key=lambda t: (t[0], t[1]))
        limit = nrows
        if issues and self.strict and rows is not None:
            limit = int(np.searchsorted(rows.pos, issues[0][0] * stride + issues[0][1]))
        out = None
        if nrows:
            out = self._batch(file, block, rows, segs, ~bad & (np.arange(nrows) < limit))
        if issues and self.strict:
            return out, NcclLogError(issues[0][2])
        self._emit([t[2] for t in issues])
        return out, None

    def _segment(self, file, rows: _Rows, idx: slice | np.ndarray):
        """Resolution of rows ``idx`` (a slice, or int64 ascending) of ``rows``."""
        procs = [proc_key(h, p, file) for h, p, _ in self._procs]
        proc_id = {p: i for i, p in enumerate(dict.fromkeys(procs))}
        same_proc = np.array([proc_id[p] for p in procs], np.int64)  # ignores cuda_dev
        ncomm = max(len(self._comms), 1)
        proc, comm = rows.proc[idx], rows.comm[idx]
        kk = same_proc[proc] * ncomm + comm
        if kk.min() == kk.max():
            firsts, key = np.array([0]), np.zeros(len(proc), np.int64)
        else:
            _, firsts, inv = np.unique(kk, return_index=True, return_inverse=True)
            order = np.argsort(firsts)
            rank_of = np.empty(len(order), np.int64)
            rank_of[order] = np.arange(len(order))
            key, firsts = rank_of[inv.ravel()], firsts[order]
        keys = [(procs[proc[f]], self._comms[comm[f]], self._procs[proc[f]][2])
                for f in firsts.tolist()]
        return self.resolver.resolve_segment(file, keys, key, rows.nranks[idx],
                                             rows.line_no[idx])

    def _batch(self, file, block, rows: _Rows, segs, keep: np.ndarray):
        nrows = len(rows.pos)
        res = {k: np.full(nrows, NULL) for k in ("rank", "group_rank", "group_size", "seq",
                                                 "epoch", "gid")}
        gids: list[str] = []
        for idx, seg in segs:
            for k in ("rank", "group_rank", "group_size", "seq", "epoch"):
                res[k][idx] = getattr(seg, k)
            res["gid"][idx] = seg.key + len(gids)
            gids.extend(seg.group_id)
        res["group_size"][rows.una] = rows.nranks[rows.una]  # as logged, or null
        if not keep.all():
            rows = rows.take(keep)
            res = {k: v[keep] for k, v in res.items()}
        m = len(rows.pos)
        if not m:
            return None
        hosts = [p[0] for p in self._procs]
        pid = np.array([NULL if p[1] is None else p[1] for p in self._procs], np.int64)
        dev = np.array([NULL if p[2] is None else p[2] for p in self._procs], np.int64)
        no_host = np.array([h is None for h in hosts])[rows.proc]
        dt_ok = rows.dt >= 0
        dt = np.where(dt_ok, rows.dt, 0)
        dt_bytes = _DT_BYTES[dt]
        cols = {
            "source": _dictionary(np.zeros(m, np.int32), _SOURCE),
            "op": _dictionary(rows.op, _OPS),
            "rank": _int32(res["rank"]),
            "group_id": _dictionary(res["gid"], pa.array(gids, pa.string()),
                                    res["gid"] == NULL),
            "group_size": _int32(res["group_size"]),
            "group_rank": _int32(res["group_rank"]),
            "seq": _nullable(res["seq"], pa.int64()),
            "count": pa.array(rows.count),
            "dtype": _dictionary(dt, _DTYPES, ~dt_ok),
            "dtype_bytes": pa.array(dt_bytes.astype(np.int32), mask=~dt_ok),
            "msg_bytes": pa.array(rows.count * dt_bytes, mask=~dt_ok),
            "root": pa.array(rows.root.astype(np.int32), mask=~_ROOTED[rows.op]),
            "phase": pa.nulls(m, pa.string()),
            "module": pa.nulls(m, pa.string()),
            "t_start_ns": pa.array(rows.t_ns, mask=~rows.t_valid),
            "t_end_ns": pa.nulls(m, pa.int64()),
            "source_ref": source_refs(file, rows.line_no),
            "pid": _nullable(pid[rows.proc], pa.int64()),
            "host": _dictionary(rows.proc, pa.array([h or "" for h in hosts], pa.string()),
                                no_host),
            "cuda_dev": _int32(dev[rows.proc]),
            "comm": _dictionary(rows.comm, pa.array(self._comms, pa.string())),
            "t_wait_start_ns": pa.nulls(m, pa.int64()),
            "t_waited_ns": pa.nulls(m, pa.int64()),
            "in_elems": pa.nulls(m, pa.int64()),  # NCCL logs an all_to_all's per-peer count only
            "out_elems": pa.nulls(m, pa.int64()),
        }
        batch = pa.RecordBatch.from_arrays(list(cols.values()), schema=BATCH_SCHEMA)
        return batch, res["epoch"]


def _dictionary(indices: np.ndarray, values: pa.Array, null: np.ndarray | None = None):
    """A dictionary column (int32 indices into ``values``; ``null``: rows that are null)."""
    idx = pa.array(indices.astype(np.int32), pa.int32(),
                   mask=null if null is not None and null.any() else None)
    return pa.DictionaryArray.from_arrays(idx, values, safe=False)


def _nullable(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    null = values == NULL
    return pa.array(values, type_, mask=null if null.any() else None)


def _int32(values: np.ndarray) -> pa.Array:
    null = values == NULL
    return pa.array(np.where(null, 0, values).astype(np.int32), pa.int32(),
                    mask=null if null.any() else None)


def apply_final_fixes(table: pa.Table | pa.RecordBatch, epoch: np.ndarray,
                      fixes: dict[int, tuple]):
    """``table`` with the rows of epochs in ``fixes`` (:meth:`Resolver.final_fixes`) given
    their final ``rank``, ``group_id``, ``group_rank`` and (where known) ``group_size``."""
    if not fixes or not len(epoch):
        return table
    hit = np.isin(epoch, np.fromiter(fixes, np.int64))
    if not hit.any():
        return table
    ids = sorted(fixes)
    where = np.searchsorted(ids, epoch[hit])
    vals = [fixes[e] for e in ids]
    idx = np.flatnonzero(hit)
    cols = {name: table.column(name) for name in table.schema.names}
    for field, pos in (("rank", 0), ("group_id", 1), ("group_rank", 2), ("group_size", 3)):
        per_epoch = pa.array([v[pos] for v in vals], table.schema.field(field).type)
        new = per_epoch.take(where)
        if field == "group_size":  # a fix without a size keeps the row's own
            new = pc.coalesce(new, table.column(field).take(idx))
        cols[field] = _scatter(table.column(field), idx, new)
    make = pa.Table if isinstance(table, pa.Table) else pa.RecordBatch
    return make.from_arrays(list(cols.values()), schema=table.schema)


def _scatter(column, idx: np.ndarray, values) -> pa.Array:
    """``column`` with ``column[idx] = values``."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    n = len(column)
    src = np.arange(n)
    src[idx] = n + np.arange(len(idx))
    return pa.concat_arrays([column, values]).take(src)
