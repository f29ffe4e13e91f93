"""NCCL_DEBUG=INFO physical lines -> records (the per-line layer of :mod:`tracer.nccl.log`).

Records: :class:`CollRecord` (one complete COLL line), :class:`InitRecord` (INIT / DESTROY),
:class:`TorchCommRecord` (PyTorch's ``created ncclComm_`` line) and :class:`ParseIssue`.
Formats: :mod:`tracer.nccl.formats`. No cross-line state beyond one wrapped COLL line
(:class:`LineParser`); :func:`iter_nccl_records` is the public per-line generator, and the
columnar reader (:mod:`tracer.nccl.table`) sends every line its fast path cannot take through
the same :class:`LineParser`, so both give the same records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from tracer.nccl import formats as fmt

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
    unknown ``datatype`` number; ``t_start_ns`` from a 2.26+ timestamp prefix, else ``None``.
    A number of more than :data:`tracer.nccl.formats.MAX_DIGITS` digits reads as
    ``±OVERSIZED`` (the event layer turns it into an issue). ``unattributed``: the record's
    ``host:pid:tid [dev] NCCL INFO`` prefix was lost (``host``, ``pid``, ``tid``,
    ``cuda_dev``, ``t_start_ns`` are ``None``; see :mod:`tracer.nccl.log`)."""

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
    unattributed: bool = False


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
    unattributed: int = 0  # COLL records without their host:pid:tid [dev] NCCL INFO prefix
    ignored: Counter = field(default_factory=Counter)  # NCCL lines not parsed, by kind


_NO_PREFIX = (None, None, None, None, None)
#: Prefix texts longer than this are parsed but not cached (the cache stays small).
_PREFIX_CACHE_TEXT_MAX = 256


def parse_prefix(text: str) -> tuple:
    """``(t_start_ns, host, pid, tid, cuda_dev)`` of the text before ``NCCL INFO`` (linear
    time in ``len(text)``, see :func:`tracer.nccl.formats.match_prefix`)."""
    ts, host, pid, tid, dev = fmt.match_prefix(text)
    try:
        t_ns = fmt.timestamp_ns(ts) if ts else None
    except ValueError:  # a bracketed date that is not a calendar date: not a timestamp
        t_ns = None
    dec = fmt.decimal
    return (t_ns, host, dec(pid) if pid else None, dec(tid) if tid else None,
            dec(dev) if dev else None)


def invalid_utf8_issue(file: str, line_no: int, line: str) -> ParseIssue | None:
    """An issue when ``line`` holds a lone surrogate: an invalid UTF-8 byte decoded with
    ``errors="surrogateescape"`` (how files are read) or one put there by the caller."""
    try:
        line.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        col = exc.start
    ch = ord(line[col])
    what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate U+{ch:04X}"
    return ParseIssue(file, line_no, f"invalid UTF-8 ({what} at column {col + 1}); line not "
                      "parsed", line.encode("utf-8", "backslashreplace").decode())


class LineParser:
    """The general path for one stream: any physical line -> its records, in order.

    State: one pending wrapped COLL line (joined with up to 3 following non-NCCL lines), a
    flag for a stream pointer expected on the next line, and a bounded prefix cache.
    Counts lines into ``stats`` (not ``stats.lines``: the caller counts physical lines).

    Records in a line start at *anchors*: each ``NCCL INFO `` marker (its message follows,
    its prefix precedes it), and each ``<Op>: opCount`` that does not follow a marker (a COLL
    record whose prefix was lost: unattributed). A record's text ends at the next anchor.
    Every step is linear in the length of the line.
    """

    __slots__ = ("file", "stats", "cache", "pending", "expect_tail")

    def __init__(self, file: str, stats: ParseStats):
        self.file = file
        self.stats = stats
        self.cache: dict[str, tuple] = {}
        self.pending: list | None = None  # [line_no, text, prefix tuple, joins, unattributed]
        self.expect_tail = False

    def interrupt(self) -> ParseIssue | None:
        """A complete single-line COLL record was taken by a fast path: it ends a pending
        wrapped line (an issue, returned) and any expected stream tail."""
        self.expect_tail = False
        if self.pending is None:
            return None
        issue = _incomplete(self.file, self.pending)
        self.pending = None
        return issue

    def finish(self) -> ParseIssue | None:
        """End of the stream: a still pending wrapped line is an issue (returned)."""
        if self.pending is None:
            return None
        issue = _incomplete(self.file, self.pending, at_end=True)
        self.pending = None
        return issue

    def _prefix(self, ptext: str) -> tuple:
        if len(ptext) > _PREFIX_CACHE_TEXT_MAX:
            return parse_prefix(ptext)
        cache = self.cache
        prefix = cache.get(ptext)
        if prefix is None:
            if len(cache) >= _PREFIX_CACHE_MAX:
                cache.clear()
            prefix = cache[ptext] = parse_prefix(ptext)
        return prefix

    def feed(self, line_no: int, line: str) -> list[Record]:
        """Records of physical line ``line_no`` (``line`` with or without its line end)."""
        out: list[Record] = []
        st, file = self.stats, self.file
        if line.endswith("\n"):
            line = line[:-1]
            if line.endswith("\r"):
                line = line[:-1]
        if not line.isascii():
            bad = invalid_utf8_issue(file, line_no, line)
            if bad is not None:
                out.extend(self._drop_pending())
                self.expect_tail = False
                out.append(bad)
                return out
        heads = fmt.coll_heads(line) if fmt.OPCOUNT_MARK in line else ()
        pending = self.pending
        if pending is not None:
            # a continuation holds neither a prefix nor another record's "<Op>: opCount"
            if "NCCL" not in line and not heads and line.strip():
                pending[1] += line
                pending[3] += 1
                st.continuation_lines += 1
                m = fmt.COLL_RE.match(pending[1])
                if m is not None and m.group(9) is not None:
                    self._count(pending[4])
                    out.extend(_coll_records(m, file, pending[0], pending[2], pending[4]))
                    self.expect_tail = (m.group(9) == " stream"
                                        and m.end() == len(pending[1].rstrip()))
                    self.pending = None
                elif pending[3] >= _MAX_JOINS:
                    out.append(_incomplete(file, pending))
                    self.pending = None
                return out
            out.extend(self._drop_pending())
        if "NCCL" not in line and not heads:
            if self.expect_tail and fmt.STREAM_TAIL_RE.match(line):
                st.continuation_lines += 1
            else:
                st.plain_lines += 1
            self.expect_tail = False
            return out
        self.expect_tail = False
        mark, n_mark = fmt.INFO_MARK, len(fmt.INFO_MARK)
        marks = []
        pos = line.find(mark)
        while pos >= 0:
            marks.append(pos)
            pos = line.find(mark, pos + n_mark)
        anchors = [(p, True) for p in marks]
        if heads:
            owned = {fmt.op_run_end(line, p + n_mark) for p in marks}
            lost = [(s, False) for s, colon in heads if colon not in owned]
            if lost:
                anchors = sorted(anchors + lost)
        if not anchors:
            out.extend(_non_info_line(line, file, line_no, st))
            return out
        if not marks and "NCCL" in line[:anchors[0][0]]:  # e.g. a WARN line, then the record
            out.extend(_non_info_line(line[:anchors[0][0]], file, line_no, st,
                                      count_plain=False))
        coll_match, head_match = fmt.COLL_RE.match, fmt.COLL_HEAD_RE.match
        lo = 0
        last = len(anchors) - 1
        for k, (at, is_mark) in enumerate(anchors):
            end = anchors[k + 1][0] if k < last else len(line)
            if is_mark:
                start = at + n_mark
                prefix = self._prefix(line[lo:at])
            else:
                start, prefix = at, _NO_PREFIX
            m = coll_match(line, start, end)
            if m is not None and m.group(9) is not None:
                self._count(not is_mark)
                out.extend(_coll_records(m, file, line_no, prefix, not is_mark))
                lo = m.end()
                self.expect_tail = k == last and m.group(9) == " stream"
            elif m is not None or not is_mark or head_match(line, start, end):
                if k == last:
                    self.pending = [line_no, line[start:], prefix, 0, not is_mark]
                else:
                    out.append(ParseIssue(file, line_no, "incomplete COLL line (another "
                                          "record starts before its 'stream' field)",
                                          line[start:end]))
                lo = end
            else:
                lo = start
                out.extend(_other_info(line[start:end], file, line_no, prefix, st))
        return out

    def _count(self, unattributed: bool) -> None:
        if unattributed:
            self.stats.unattributed += 1
        else:
            self.stats.coll_lines += 1

    def _drop_pending(self) -> list[ParseIssue]:
        if self.pending is None:
            return []
        issue = _incomplete(self.file, self.pending)
        self.pending = None
        return [issue]


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
    parser = LineParser(file, st)
    fast = fmt.FAST_COLL_LINE_RE.match
    new = tuple.__new__
    tails: dict[str, tuple] = {}  # prefix -> (host, pid, tid, cuda_dev, None, False)
    op_names, dtypes = fmt.NCCL_OP_NAMES, fmt.NCCL_DATATYPES_BY_TEXT
    line_no = 0
    for line_no, line in enumerate(lines, 1):
        if parser.pending is None and line.isascii():  # other lines: checked for UTF-8
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
                        tail = tails[ptext] = parse_prefix(ptext)[1:] + (None, False)
                    parser.expect_tail = False
                    st.coll_lines += 1
                    yield new(CollRecord, (
                        file, line_no, op, nccl_op, int(opc, 16), int(count), int(dt), dtype,
                        int(redop), int(root), comm, int(nranks) if nranks else None) + tail)
                    continue
        recs = parser.feed(line_no, line)
        if recs:
            yield from recs
    issue = parser.finish()
    if issue is not None:
        yield issue
    st.lines += line_no


def _incomplete(file: str, pending: list, at_end: bool = False) -> ParseIssue:
    where = "at end of input" if at_end else f"after joining {pending[3]} following line(s)"
    return ParseIssue(file, pending[0], f"truncated or malformed COLL line {where} (no "
                      "'stream' field; NCCL prints it last)", pending[1])


def _coll_records(m, file: str, line_no: int, prefix: tuple,
                  unattributed: bool = False) -> Iterator[Record]:
    nccl_op, opc, count, dt, redop, root, comm, nranks, _ = m.groups()
    if unattributed:
        name, names = fmt.lost_op_name(nccl_op)
        if name is None:
            yield ParseIssue(file, line_no, "COLL line without its prefix whose op name is "
                             f"glued to the text before it ({nccl_op!r}: the op is "
                             f"{' or '.join(names)}); no event", m.group(0))
            return
        nccl_op = name
    op = fmt.NCCL_OP_NAMES.get(nccl_op)
    if op is None:
        what = "unsupported op" if nccl_op in fmt.UNSUPPORTED_OP_NAMES else "unknown op"
        yield ParseIssue(file, line_no, f"{what} {nccl_op!r} (no canonical op in "
                         "tracer.events.OPS)", m.group(0))
        return
    dec = fmt.decimal
    datatype = dec(dt)
    dtype = fmt.NCCL_DATATYPES.get(datatype)
    if dtype is None:
        yield ParseIssue(file, line_no, f"unknown datatype {fmt.show_int(datatype)} (NCCL "
                         "enum 0-11); event kept with dtype=None", m.group(0))
    t_ns, host, pid, tid, dev = prefix
    yield CollRecord(file, line_no, op, nccl_op, int(opc, 16), dec(count), datatype, dtype,
                     dec(redop), dec(root), comm, dec(nranks) if nranks else None, host, pid,
                     tid, dev, t_ns, unattributed)


def _other_info(body: str, file: str, line_no: int, prefix: tuple, st: ParseStats):
    if any(marker in body for marker in fmt.INIT_MARKERS):
        groups = fmt.match_init(body)
        if groups is None:
            yield ParseIssue(file, line_no, "unreadable INIT/DESTROY line (expected 'comm %p "
                             "rank %d nranks %d cudaDev %d ... - Init COMPLETE')", body)
            return
        func, comm, rank, nranks, dev, rest, what, state = groups
        f = dict(fmt.INIT_FIELD_RE.findall(rest))
        split = f.get("splitCount", f.get("childCount"))
        st.init_lines += 1
        _, host, pid, tid, _ = prefix
        dec = fmt.decimal
        yield InitRecord(
            file, line_no, state if what == "Init" else "DESTROY", func, comm, dec(rank),
            dec(nranks), dec(dev), f.get("commId"), f.get("parent"),
            fmt.decimal_or_none(split), _int_or_none(f.get("color")),
            _int_or_none(f.get("key")), host, pid, tid)
        return
    st.ignored["INFO (other subsystems)"] += 1


def _int_or_none(text: str | None) -> int | None:
    """``color`` / ``key`` value: ``-?[0-9]+`` with trailing dashes dropped, else ``None``."""
    return None if text is None else fmt.decimal_or_none(text.rstrip("-"))


def _non_info_line(line: str, file: str, line_no: int, st: ParseStats,
                   count_plain: bool = True):
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
        yield TorchCommRecord(file, line_no, pg, name, fmt.decimal(rank), comm,
                              fmt.decode_torch_device(line[m.end():]),
                              fmt.decimal(g.group(1)) if g else None)
        return
    for level in ("WARN", "CALL", "TRACE", "ABORT"):
        if f"NCCL {level}" in line:
            st.ignored[level] += 1
            return
    if count_plain:
        st.plain_lines += 1
