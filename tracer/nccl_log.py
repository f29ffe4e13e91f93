"""NCCL_DEBUG=INFO log parser: COLL lines -> :class:`tracer.events.CollectiveEvent`.

Inputs: one file per process (``NCCL_DEBUG_FILE=nccl.%h.%p``), many such files, or one mixed
stream (stdout of a whole job). Formats: :mod:`tracer.nccl_formats` (NCCL 2.4 to 2.30, RCCL,
PyTorch's ``ProcessGroupNCCL created ncclComm_`` lines). Capture with
``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL``: without INIT lines no rank is known.

Three layers, all streaming (memory bounded by the number of communicators, not lines):

- :func:`iter_nccl_records`: physical lines -> :class:`CollRecord`, :class:`InitRecord`,
  :class:`TorchCommRecord` and :class:`ParseIssue` (no cross-line state beyond one wrapped
  line).
- :func:`iter_nccl_events`: records -> events, each resolved from the INIT lines seen *before*
  it in its stream (the usual order: NCCL logs INIT before the first collective).
- :func:`parse_nccl_logs`: the whole job. Events whose communicator's identity changed later
  (INIT line after its COLL lines in a mixed stream, a wider communicator created later) are
  corrected at the end, so the result does not depend on line order. Holds the events.

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
device (the world communicator in torchrun jobs), else ``None``.

Defined outcomes (each tested):

- COLL line for a comm with no INIT line: event with ``rank``/``group_rank`` ``None``,
  ``group_size`` from ``[nranks=]``, a ``local:`` group_id; listed in the summary, not an issue.
- unknown datatype number: event with ``dtype=None`` and an issue (call counts stay right).
- Gather / Scatter (2.28+), AllToAllv: issue ``unsupported op``, no event (not in ``OPS``).
- COLL line without its ``stream`` field: joined with up to 3 following non-NCCL lines
  (copy/paste wraps); still incomplete, or the last line of the input: issue, no event.
- NCCL lines of other subsystems (TUNING, P2P, NET, ...), WARN, CALL: counted as ignored.
  Lines without ``NCCL``: plain program output, counted, never issues.
- ``strict=True``: :class:`NcclLogError` (a ValueError) on the first issue.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tracer import nccl_formats as fmt
from tracer.events import CollectiveEvent, write_parquet

_MAX_JOINS = 3
_PREFIX_CACHE_MAX = 4096


class ParseIssue(NamedTuple):
    """A line the parser could not (fully) read. ``line_no`` is 1-based."""

    file: str
    line_no: int
    reason: str
    text: str

    def __str__(self) -> str:
        text = self.text if len(self.text) <= 160 else self.text[:157] + "..."
        return f"{self.file}:{self.line_no}: {self.reason}: {text!r}"


class NcclLogError(ValueError):
    """Raised in strict mode on the first :class:`ParseIssue` (``.issue``)."""

    def __init__(self, issue: ParseIssue):
        super().__init__(f"Invalid NCCL log line {issue}. Fix the log or parse with strict=False.")
        self.issue = issue


class CollRecord(NamedTuple):
    """One complete COLL line. ``count`` is per rank as logged; ``dtype`` is ``None`` for an
    unknown ``datatype`` number; ``t_start_ns`` from a 2.26+ timestamp prefix, else ``None``."""

    file: str
    line_no: int
    op: str
    nccl_op: str
    opcount: int
    count: int
    datatype: int
    dtype: str | None
    redop: int
    root: int
    comm: str
    nranks: int | None
    host: str | None
    pid: int | None
    tid: int | None
    cuda_dev: int | None
    t_start_ns: int | None


class InitRecord(NamedTuple):
    """An INIT (``state`` START / COMPLETE) or DESTROY / ABORT line (``state`` DESTROY)."""

    file: str
    line_no: int
    state: str
    func: str | None
    comm: str
    rank: int
    nranks: int
    cuda_dev: int
    comm_id: str | None
    parent: str | None
    split_count: int | None
    color: int | None
    key: int | None
    host: str | None
    pid: int | None
    tid: int | None


class TorchCommRecord(NamedTuple):
    """PyTorch ``[PG <pg> (<pg_name>) Rank <group_rank>] ProcessGroupNCCL created ncclComm_``."""

    file: str
    line_no: int
    pg: str
    pg_name: str | None
    group_rank: int
    comm: str
    cuda_dev: int | None
    tid: int | None


Record = CollRecord | InitRecord | TorchCommRecord | ParseIssue


@dataclass
class ParseStats:
    """Line counts of one parse (physical lines; a wrapped COLL line counts once as coll)."""

    lines: int = 0
    coll_lines: int = 0
    init_lines: int = 0
    torch_lines: int = 0
    continuation_lines: int = 0
    plain_lines: int = 0
    ignored: Counter = field(default_factory=Counter)  # NCCL lines not parsed, by kind


def _parse_prefix(text: str) -> tuple:
    """``(t_start_ns, host, pid, tid, cuda_dev)`` of the text before ``NCCL INFO``."""
    m = fmt.PREFIX_RE.search(text)
    ts, host, pid, tid, dev = m.groups()  # PREFIX_RE matches the empty string at the end
    try:
        t_ns = fmt.timestamp_ns(ts) if ts else None
    except ValueError:  # a bracketed date that is not a calendar date: not a timestamp
        t_ns = None
    return (t_ns, host, int(pid) if pid else None, int(tid) if tid else None,
            int(dev) if dev else None)


def iter_nccl_records(
    lines: Iterable[str], *, file: str = "<stream>", stats: ParseStats | None = None
) -> Iterator[Record]:
    """Records of one stream of NCCL log lines, in order (issues interleaved).

    Args:
        lines: physical lines (with or without ``\\n``), e.g. an open text file.
        file: name used in ``source_ref`` and issues.
        stats: updated in place with line counts, if given.

    Memory: one pending wrapped line and a bounded prefix cache.
    """
    st = stats if stats is not None else ParseStats()
    cache: dict[str, tuple] = {}
    pending: list | None = None  # [line_no, text, prefix tuple, joins]
    expect_tail = False
    mark = fmt.INFO_MARK
    coll_match = fmt.COLL_RE.match
    fast = fmt.FAST_COLL_LINE_RE.match
    new = tuple.__new__
    tails: dict[str, tuple] = {}  # fast-path prefix -> (host, pid, tid, cuda_dev, None)
    op_names, dtypes = fmt.NCCL_OP_NAMES, fmt.NCCL_DATATYPES_BY_TEXT
    line_no = 0
    for line_no, line in enumerate(lines, 1):
        if pending is None:
            m = fast(line)
            if m is not None:
                ptext, nccl_op, opc, count, dt, redop, root, comm, nranks = m.groups()
                op = op_names.get(nccl_op)
                dtype = dtypes.get(dt)
                if op is not None and dtype is not None:
                    tail = tails.get(ptext)
                    if tail is None:
                        if len(tails) >= _PREFIX_CACHE_MAX:
                            tails.clear()
                        tail = tails[ptext] = _parse_prefix(ptext)[1:] + (None,)
                    expect_tail = False
                    st.coll_lines += 1
                    yield new(CollRecord, (
                        file, line_no, op, nccl_op, int(opc, 16), int(count), int(dt), dtype,
                        int(redop), int(root), comm, int(nranks) if nranks else None) + tail)
                    continue
        if line.endswith("\n"):
            line = line[:-1]
            if line.endswith("\r"):
                line = line[:-1]
        if pending is not None:
            if "NCCL" not in line and line.strip():  # a continuation never holds a prefix
                pending[1] += line
                pending[3] += 1
                st.continuation_lines += 1
                m = coll_match(pending[1])
                if m is not None and m.group(9) is not None:
                    st.coll_lines += 1
                    yield from _coll_records(m, file, pending[0], pending[2])
                    expect_tail = m.group(9) == " stream" and m.end() == len(pending[1].rstrip())
                    pending = None
                elif pending[3] >= _MAX_JOINS:
                    yield _incomplete(file, pending)
                    pending = None
                continue
            yield _incomplete(file, pending)
            pending = None
        if "NCCL" not in line:
            if expect_tail and fmt.STREAM_TAIL_RE.match(line):
                st.continuation_lines += 1
            else:
                st.plain_lines += 1
            expect_tail = False
            continue
        expect_tail = False
        pos = line.find(mark)
        if pos < 0:
            yield from _non_info_line(line, file, line_no, st)
            continue
        lo = 0
        while pos >= 0:
            start = pos + 10
            nxt = line.find(mark, start)
            end = nxt if nxt >= 0 else len(line)
            ptext = line[lo:pos]
            prefix = cache.get(ptext)
            if prefix is None:
                if len(cache) >= _PREFIX_CACHE_MAX:
                    cache.clear()
                prefix = cache[ptext] = _parse_prefix(ptext)
            m = coll_match(line, start, end)
            if m is not None and m.group(9) is not None:
                st.coll_lines += 1
                yield from _coll_records(m, file, line_no, prefix)
                lo = m.end()
                expect_tail = nxt < 0 and m.group(9) == " stream"
            elif m is not None or fmt.COLL_HEAD_RE.match(line, start, end):
                if nxt < 0:
                    pending = [line_no, line[start:], prefix, 0]
                else:
                    yield ParseIssue(file, line_no, "incomplete COLL line (another record "
                                     "starts before its 'stream' field)", line[start:end])
                lo = end
            else:
                lo = start
                yield from _other_info(line[start:end], file, line_no, prefix, st)
            pos = nxt
    if pending is not None:
        yield _incomplete(file, pending, at_end=True)
    st.lines += line_no


def _incomplete(file: str, pending: list, at_end: bool = False) -> ParseIssue:
    where = "at end of input" if at_end else f"after joining {pending[3]} following line(s)"
    return ParseIssue(file, pending[0], f"truncated or malformed COLL line {where} (no "
                      "'stream' field; NCCL prints it last)", pending[1])


def _coll_records(m, file: str, line_no: int, prefix: tuple) -> Iterator[Record]:
    nccl_op, opc, count, dt, redop, root, comm, nranks, _ = m.groups()
    op = fmt.NCCL_OP_NAMES.get(nccl_op)
    if op is None:
        what = "unsupported op" if nccl_op in fmt.UNSUPPORTED_OP_NAMES else "unknown op"
        yield ParseIssue(file, line_no, f"{what} {nccl_op!r} (no canonical op in "
                         "tracer.events.OPS)", m.group(0))
        return
    datatype = int(dt)
    dtype = fmt.NCCL_DATATYPES.get(datatype)
    if dtype is None:
        yield ParseIssue(file, line_no, f"unknown datatype {datatype} (NCCL enum 0-11); "
                         "event kept with dtype=None", m.group(0))
    t_ns, host, pid, tid, dev = prefix
    yield CollRecord(file, line_no, op, nccl_op, int(opc, 16), int(count), datatype, dtype,
                     int(redop), int(root), comm, int(nranks) if nranks else None, host, pid,
                     tid, dev, t_ns)


def _other_info(body: str, file: str, line_no: int, prefix: tuple, st: ParseStats):
    if any(marker in body for marker in fmt.INIT_MARKERS):
        m = fmt.INIT_RE.search(body)
        if m is None:
            yield ParseIssue(file, line_no, "unreadable INIT/DESTROY line (expected 'comm %p "
                             "rank %d nranks %d cudaDev %d ... - Init COMPLETE')", body)
            return
        func, comm, rank, nranks, dev, rest, what, state = m.groups()
        f = dict(fmt.INIT_FIELD_RE.findall(rest))
        split = f.get("splitCount", f.get("childCount"))
        st.init_lines += 1
        _, host, pid, tid, _ = prefix
        yield InitRecord(
            file, line_no, state if what == "Init" else "DESTROY", func, comm, int(rank),
            int(nranks), int(dev), f.get("commId"), f.get("parent"),
            int(split) if split and split.lstrip("-").isdigit() else None,
            _int_or_none(f.get("color")), _int_or_none(f.get("key")), host, pid, tid)
        return
    st.ignored["INFO (other subsystems)"] += 1


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.rstrip("-")
    return int(text) if text.lstrip("-").isdigit() else None


def _non_info_line(line: str, file: str, line_no: int, st: ParseStats):
    if "created ncclComm_" in line:
        m = fmt.TORCH_COMM_RE.search(line)
        if m is None:
            yield ParseIssue(file, line_no, "unreadable PyTorch 'created ncclComm_' line "
                             "(expected '[PG <id> (<name>) Rank <r>] ProcessGroupNCCL created "
                             "ncclComm_ 0x... on CUDA device: '))", line)
            return
        pg, _guid, name, rank, comm = m.groups()
        g = fmt.GLOG_RE.search(line, 0, m.start())
        st.torch_lines += 1
        yield TorchCommRecord(file, line_no, pg, name, int(rank), comm,
                              fmt.decode_torch_device(line[m.end():]),
                              int(g.group(1)) if g else None)
        return
    for level in ("WARN", "CALL", "TRACE", "ABORT"):
        if f"NCCL {level}" in line:
            st.ignored[level] += 1
            return
    st.plain_lines += 1


# ---------------------------------------------------------------------------- resolution


@dataclass(frozen=True, slots=True)
class CommInfo:
    """One communicator as seen by one process (one epoch of a comm pointer).

    ``rank`` is the resolved world rank, ``group_rank`` the rank inside the communicator,
    ``nranks`` its size; ``init_ref`` is ``file:line`` of its INIT line (``None``: no INIT
    line was logged). ``calls`` counts its COLL lines.
    """

    comm: str
    host: str | None
    pid: int | None
    cuda_dev: int | None
    rank: int | None
    group_rank: int | None
    nranks: int | None
    group_id: str
    comm_id: str | None
    parent: str | None
    color: int | None
    split_count: int | None
    init_ref: str | None
    torch_pg: str | None
    calls: int


@dataclass(slots=True)
class _Comm:
    proc: tuple
    comm: str
    file: str
    cuda_dev: int | None = None
    init: InitRecord | None = None
    init_ref: str | None = None
    calls: int = 0
    nranks_seen: int | None = None
    destroyed: bool = False
    used: tuple | None = None  # resolution its events were built with
    used_version: int = -1  # resolver version `used` was computed at
    stale: bool = False


def _proc(host: str | None, pid: int | None, file: str) -> tuple:
    return (host, pid) if pid is not None else (f"file:{file}", None)


class _Resolver:
    """Comm pointer -> communicator state; turns records into events."""

    def __init__(self):
        self.comms: dict[tuple, _Comm] = {}
        self.history: list[_Comm] = []  # replaced epochs (pointer reuse)
        self.torch_by_file: dict[tuple, TorchCommRecord] = {}
        self.torch_by_tid: dict[tuple, TorchCommRecord] = {}
        self.widest: dict[tuple, tuple[int, int]] = {}  # (proc, dev) -> (nranks, rank)
        self.version = 0  # bumped by every INIT / PyTorch record: cached resolutions expire

    def feed(self, rec: Record) -> CollectiveEvent | ParseIssue | None:
        if type(rec) is CollRecord:
            return self._coll(rec)
        if type(rec) is InitRecord:
            return self._init(rec)
        if type(rec) is TorchCommRecord:
            self.version += 1
            self.torch_by_file[(rec.file, rec.comm)] = rec
            if rec.tid is not None:
                self.torch_by_tid[(rec.tid, rec.comm)] = rec
            return None
        return rec  # ParseIssue

    def _init(self, rec: InitRecord) -> ParseIssue | None:
        self.version += 1
        proc = _proc(rec.host, rec.pid, rec.file)
        key = (proc, rec.comm)
        c = self.comms.get(key)
        if rec.state == "DESTROY":
            if c is not None:
                c.destroyed = True
            return None
        if c is None or (c.init is not None and (c.calls or c.destroyed)):
            if c is not None:
                self.history.append(c)
            c = self.comms[key] = _Comm(proc, rec.comm, rec.file)
        elif c.calls:
            c.stale = True  # INIT after its COLL lines: events so far need correcting
        c.init = rec
        c.init_ref = f"{rec.file}:{rec.line_no}"
        c.cuda_dev = rec.cuda_dev
        wk = (proc, rec.cuda_dev)
        if rec.nranks > self.widest.get(wk, (0, 0))[0]:
            self.widest[wk] = (rec.nranks, rec.rank)
        return None

    def _coll(self, rec: CollRecord) -> CollectiveEvent | ParseIssue:
        (file, line_no, op, _, _, count, _, dtype, _, root, ptr, coll_nranks, host, pid, _,
         dev, t_ns) = rec
        proc = (host, pid) if pid is not None else (f"file:{file}", None)
        key = (proc, ptr)
        c = self.comms.get(key)
        if c is None:
            c = self.comms[key] = _Comm(proc, ptr, file, cuda_dev=dev)
        if c.used_version != self.version:
            res = self.resolve(c)
            if c.used != res:
                if c.used is not None:
                    c.stale = True
                c.used = res
            c.used_version = self.version
        rank, group_id, group_rank, nranks = c.used
        seq = c.calls
        c.calls = seq + 1
        if coll_nranks is not None:
            if nranks is not None and nranks != coll_nranks:
                return ParseIssue(file, line_no, f"nranks={coll_nranks} disagrees with the "
                                  f"INIT line {c.init_ref} (nranks {nranks})", ptr)
            nranks = c.nranks_seen = coll_nranks
        return CollectiveEvent(
            source="nccl_log", op=op, rank=rank, group_id=group_id, group_size=nranks,
            group_rank=group_rank, seq=seq, count=count, dtype=dtype,
            root=root if op in fmt.ROOTED_OPS else None, t_start_ns=t_ns,
            source_ref=f"{file}:{line_no}", pid=pid, host=host, cuda_dev=dev, comm=ptr)

    def _torch(self, c: _Comm) -> TorchCommRecord | None:
        t = self.torch_by_tid.get((c.proc[1], c.comm)) if c.proc[1] is not None else None
        return t or self.torch_by_file.get((c.file, c.comm))

    def group_id(self, c: _Comm, depth: int = 0) -> str:
        init = c.init
        if init is not None and init.comm_id:
            return init.comm_id
        if init is not None and init.parent and depth < 16:
            parent = self.comms.get((c.proc, init.parent))
            pgid = (self.group_id(parent, depth + 1) if parent is not None
                    else self._local(c.proc, init.parent))
            split = f"/split{init.split_count}" if init.split_count is not None else ""
            return f"{pgid}{split}/color{init.color}"
        t = self._torch(c)
        if t is not None:
            return f"torch_pg:{t.pg}"
        return self._local(c.proc, c.comm)

    @staticmethod
    def _local(proc: tuple, comm: str) -> str:
        where = proc[0] if proc[1] is None else f"{proc[0]}:{proc[1]}"
        return f"local:{where}:{comm}"

    def resolve(self, c: _Comm) -> tuple:
        """``(rank, group_id, group_rank, nranks)`` of a communicator from what is known now."""
        t = self._torch(c)
        group_rank = c.init.rank if c.init is not None else (t.group_rank if t else None)
        nranks = c.init.nranks if c.init is not None else c.nranks_seen
        rank = None
        if t is not None and t.pg_name == "default_pg":
            rank = t.group_rank
        elif c.init is not None:
            rank = self.widest.get((c.proc, c.cuda_dev), (0, None))[1]
        return (rank, self.group_id(c), group_rank, nranks)

    def all_comms(self) -> list[_Comm]:
        return self.history + list(self.comms.values())

    def info(self, c: _Comm) -> CommInfo:
        rank, gid, group_rank, nranks = self.resolve(c)
        init, t = c.init, self._torch(c)
        return CommInfo(
            comm=c.comm, host=c.proc[0] if c.proc[1] is not None else None, pid=c.proc[1],
            cuda_dev=c.cuda_dev, rank=rank, group_rank=group_rank, nranks=nranks, group_id=gid,
            comm_id=init.comm_id if init else None, parent=init.parent if init else None,
            color=init.color if init else None, split_count=init.split_count if init else None,
            init_ref=c.init_ref, torch_pg=t.pg if t else None, calls=c.calls)


# ---------------------------------------------------------------------------- inputs


def expand_paths(paths: Sequence[str | os.PathLike], *, glob: str | None = None) -> list[Path]:
    """Files named by ``paths``: files as given; directories recursively, every non-hidden
    regular file whose first 8 KiB holds no NUL byte (NCCL_DEBUG_FILE names have no fixed
    extension; binary files such as Parquet or SQLite are skipped), filtered by ``glob``
    (e.g. ``"*.log"``) if given. Sorted by path.

    Raises:
        ValueError: a path does not exist.
    """
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(q for q in p.rglob(glob or "*") if q.is_file()
                           and not any(part.startswith(".") for part in q.relative_to(p).parts))
            out.extend(q for q in found if _is_text(q))
        else:
            raise ValueError(f"Invalid NCCL log path {str(p)!r}. Must be an existing file or "
                             "directory.")
    return out


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _sources(paths) -> Iterator[tuple[str, Iterable[str]]]:
    """``(name, lines)`` per input: a path, a sequence of paths, or ``(name, lines)`` pairs."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    for item in paths:
        if isinstance(item, tuple):
            yield item
            continue
        for path in expand_paths([item]):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield str(path), f


def _resolved_events(paths, r: _Resolver, strict: bool, issues: list[ParseIssue],
                     stats: ParseStats | None, files: list[str] | None) -> Iterator[CollectiveEvent]:
    """Feed every record of every input to ``r``; yield events, collect issues (or raise)."""
    for name, lines in _sources(paths):
        if files is not None:
            files.append(name)
        for rec in iter_nccl_records(lines, file=name, stats=stats):
            out = r.feed(rec)
            if out is None:
                continue
            if type(out) is ParseIssue:
                if strict:
                    raise NcclLogError(out)
                issues.append(out)
                continue
            yield out


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
    own: list[ParseIssue] = [] if issues is None else issues
    yield from _resolved_events(paths, _Resolver(), strict, own, stats, None)
    if issues is None and own:
        import warnings

        warnings.warn(f"{len(own)} unreadable NCCL log line(s); first: {own[0]}. Pass "
                      "issues=[] to collect them, or strict=True to stop.", stacklevel=2)


@dataclass
class NcclLogResult:
    """Everything parsed from a set of NCCL logs."""

    events: list[CollectiveEvent]
    comms: list[CommInfo]
    issues: list[ParseIssue]
    stats: ParseStats
    files: list[str]

    def summary(self, max_issues: int = 10) -> str:
        """Human-readable summary: events per op, communicators, ranks, issues (file:line)."""
        return _render_summary(self, max_issues)


def _render_summary(res: NcclLogResult, max_issues: int) -> str:
    from tabulate import tabulate

    st = res.stats
    ops = Counter(ev.op for ev in res.events)
    ranks = sorted({ev.rank for ev in res.events if ev.rank is not None})
    out = [f"NCCL logs: {len(res.files)} file(s), {st.lines} lines: {st.coll_lines} COLL, "
           f"{st.init_lines} INIT, {st.torch_lines} PyTorch comm, {st.continuation_lines} "
           f"continuation, {sum(st.ignored.values())} other NCCL (ignored: "
           f"{dict(st.ignored) or 'none'}), {st.plain_lines} non-NCCL",
           f"events: {len(res.events)}; ranks of events: {ranks or 'unknown'}"]
    if ops:
        out.append(tabulate(sorted(ops.items()), headers=["op", "events"]))
    rows = [(c.group_id, c.nranks, c.group_rank, c.rank, c.host, c.pid, c.comm, c.calls,
             c.init_ref or "no INIT line") for c in res.comms]
    if len(rows) > 40:
        rows = rows[:40] + [("...", None, None, None, None, None, f"{len(rows) - 40} more",
                             None, None)]
    if rows:
        out.append(tabulate(rows, headers=["group_id", "nranks", "group_rank", "rank", "host",
                                           "pid", "comm", "calls", "init"]))
    no_init = [c for c in res.comms if c.init_ref is None and c.calls]
    if no_init:
        out.append(f"{len(no_init)} communicator(s) with COLL lines but no INIT line: rank "
                   "unknown, group_id process-local (capture with NCCL_DEBUG_SUBSYS=INIT,COLL)")
    out.append(f"unreadable lines: {len(res.issues)}")
    out.extend(f"  {issue}" for issue in res.issues[:max_issues])
    if len(res.issues) > max_issues:
        out.append(f"  ... {len(res.issues) - max_issues} more")
    return "\n".join(out)


def parse_nccl_logs(paths, *, strict: bool = False) -> NcclLogResult:
    """Parse NCCL_DEBUG=INFO logs into events (see the module docstring for the rules).

    Args:
        paths: a file or directory path, a list of them, or ``(name, lines)`` pairs.
        strict: raise :class:`NcclLogError` (a ValueError) on the first issue.

    Returns:
        :class:`NcclLogResult`; events in input order, ``seq`` 0-based per communicator
        per process.

    Raises:
        ValueError: a path does not exist; in strict mode, the first unreadable line.
    """
    r = _Resolver()
    stats = ParseStats()
    issues: list[ParseIssue] = []
    files: list[str] = []
    events = list(_resolved_events(paths, r, strict, issues, stats, files))
    _fix_stale(r, events)
    comms = [r.info(c) for c in r.all_comms()]
    seen = {(c.proc, c.comm) for c in r.all_comms()}
    for (file, ptr), t in r.torch_by_file.items():
        if not any(k[1] == ptr for k in seen):
            comms.append(CommInfo(
                comm=ptr, host=None, pid=None, cuda_dev=t.cuda_dev,
                rank=t.group_rank if t.pg_name == "default_pg" else None,
                group_rank=t.group_rank, nranks=None, group_id=f"torch_pg:{t.pg}", comm_id=None,
                parent=None, color=None, split_count=None, init_ref=f"{file}:{t.line_no}",
                torch_pg=t.pg, calls=0))
    return NcclLogResult(events, comms, issues, stats, files)


def _fix_stale(r: _Resolver, events: list[CollectiveEvent]) -> None:
    """Rebuild identity fields of events whose communicator resolved differently at the end."""
    final: dict[tuple, tuple] = {}
    for c in r.all_comms():
        res = r.resolve(c)
        if c.stale or (c.used is not None and c.used != res):
            final[(c.proc, c.comm)] = res
    if not final:
        return
    for i, ev in enumerate(events):
        file = ev.source_ref.rsplit(":", 1)[0]
        res = final.get((_proc(ev.host, ev.pid, file), ev.comm))
        if res is not None:
            rank, gid, group_rank, nranks = res
            events[i] = ev.replace(rank=rank, group_id=gid, group_rank=group_rank,
                                   group_size=ev.group_size if nranks is None else nranks)


# ---------------------------------------------------------------------------- CLI

_EPILOG = """\
inputs:
  PATH is an NCCL_DEBUG=INFO log (NCCL 2.4-2.30 or RCCL; one file per process, e.g.
  NCCL_DEBUG_FILE=nccl.%h.%p, or a whole job's mixed stdout) or a directory, read
  recursively: every non-hidden text file (files with a NUL byte in their first 8 KiB are
  skipped; restrict with --glob). Capture with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL.

output (--out, Parquet, tracer.events.EVENT_SCHEMA), one row per COLL line:
  op          all_reduce, all_gather, reduce_scatter, broadcast, reduce, send, recv, all_to_all
  count       elements per rank as logged (NCCL's count argument); msg_bytes = count * dtype_bytes
  dtype       torch name from NCCL's datatype enum
  rank        world rank (see tracer.nccl_log); group_rank / group_size: rank in / size of the comm
  group_id    commId, <parent>/split<n>/color<c>, torch_pg:<id>, or local:<host>:<pid>:<comm>
  seq         0-based call index per communicator per process
  root        root (broadcast, reduce) or peer (send, recv); empty for other ops
  comm, pid, host, cuda_dev (the bracketed CUDA device, not the rank), source_ref (file:line),
  t_start_ns  from the NCCL 2.26+ [timestamp] prefix, read as UTC; empty without it

exit status:
  0 events written; 1 --strict and an unreadable line (nothing written); 2 bad arguments or
  path; 3 no COLL lines found (nothing written).
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
                   help="stop with exit status 1 at the first unreadable line")
    p.add_argument("--glob", default=None, help="only files matching this pattern in "
                   "directories (e.g. '*.log'); default: every text file")
    p.add_argument("--max-issues", type=int, default=10,
                   help="unreadable lines to print (default 10)")
    p.set_defaults(func=_cli_main)
    return p


def _cli_main(args) -> int:
    import sys

    try:
        files = expand_paths(args.paths, glob=args.glob)
        result = parse_nccl_logs(files, strict=args.strict)
    except NcclLogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.summary(max_issues=args.max_issues))
    if not result.events:
        print(f"error: no COLL lines found in {len(files)} file(s); was NCCL_DEBUG=INFO with "
              "NCCL_DEBUG_SUBSYS including COLL set?", file=sys.stderr)
        return 3
    out = write_parquet(result.events, args.out)
    print(f"wrote {len(result.events)} events to {out}")
    return 0
