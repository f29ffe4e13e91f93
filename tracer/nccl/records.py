"""NCCL_DEBUG=INFO physical lines -> records (the per-line layer of :mod:`tracer.nccl.log`).

Records: :class:`CollRecord` (one complete COLL line), :class:`InitRecord` (INIT / DESTROY),
:class:`TorchCommRecord` (PyTorch's ``created ncclComm_`` line) and :class:`ParseIssue`.
Formats: :mod:`tracer.nccl.formats`. No cross-line state beyond one wrapped COLL line
(:class:`LineParser`); :func:`iter_nccl_records` is the public per-line generator, and the
columnar reader (:mod:`tracer.nccl.table`) sends every line its fast path cannot take through
the same :class:`LineParser`, so both give the same records.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from tracer.events import DTYPE_BYTES, impossible_reason
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
    """Line counts of one parse (physical lines; a wrapped COLL line counts once as coll).

    ``stripped``: characters removed before parsing, by kind: ``"ANSI escape"`` sequences
    (anywhere in a line), and ``"BOM"``, ``"CR"``, ``"NUL"`` before a line's text or before a
    record's prefix (:data:`tracer.nccl.formats.LEAD_JUNK`)."""

    lines: int = 0
    coll_lines: int = 0
    init_lines: int = 0
    torch_lines: int = 0
    continuation_lines: int = 0
    plain_lines: int = 0
    unattributed: int = 0  # COLL records without their host:pid:tid [dev] NCCL INFO prefix
    ignored: Counter = field(default_factory=Counter)  # NCCL lines not parsed, by kind
    stripped: Counter = field(default_factory=Counter)  # characters removed, by kind


_NO_PREFIX = (None, None, None, None, None)
#: Prefix texts longer than this are parsed but not cached (the cache stays small).
_PREFIX_CACHE_TEXT_MAX = 256
#: Longest text of one record kept for joining with the next line (a wrapped COLL line):
#: NCCL's COLL message is a few hundred characters; a longer unfinished one is an issue.
MAX_RECORD = 1 << 16
#: Longest pointer (``comm``) text: ``0x`` and 16 hex digits, or ``(nil)``, with room to spare.
MAX_POINTER = 64
#: Issues listed per physical line; the rest of a line's issues are one issue saying how many.
MAX_LINE_ISSUES = 20


def issue(file: str, line_no: int, reason: str, text: str, at: int | None = None) -> ParseIssue:
    """A :class:`ParseIssue` whose text is an excerpt of ``text`` (around ``at`` when
    given, see :func:`tracer.nccl.formats.excerpt`)."""
    return ParseIssue(file, line_no, reason, fmt.excerpt(text, at))


def parse_prefix(text: str) -> tuple:
    """``(t_start_ns, host, pid, tid, cuda_dev)`` of the text before ``NCCL INFO`` (linear
    time in ``len(text)``, see :func:`tracer.nccl.formats.read_prefix`); ``t_start_ns`` is
    ``None`` when the timestamp cannot be read (:func:`read_prefix_text` says why)."""
    return read_prefix_text(text)[0]


def read_prefix_text(text: str, cut: bool = False) -> tuple[tuple, tuple | None, dict]:
    """``(prefix, problem, stripped)`` of the text before ``NCCL INFO`` (only its last
    :data:`tracer.nccl.formats.PREFIX_WINDOW` characters are read; ``cut``: the caller
    already cut it so): ``prefix`` as :func:`parse_prefix`; ``problem`` ``(shown text,
    reason, fatal)`` when a timestamp is there but cannot be read (an impossible date, a
    format not read here: the record is kept, ``fatal`` false) or when the prefix runs past
    the window (a host or pid of thousands of characters: ``fatal``, the record is
    skipped), else ``None``; ``stripped``: the :data:`tracer.nccl.formats.LEAD_JUNK`
    characters removed first, by kind."""
    if len(text) > fmt.PREFIX_WINDOW:
        text, cut = text[-fmt.PREFIX_WINDOW:], True
    text, stripped = fmt.strip_before(text)
    ts, host, pid, tid, dev, start = fmt.read_prefix(text)
    problem = t_ns = None
    run_end = len(text[:start].rstrip(" \t"))  # the separator before [dev] is not a blank here
    if (cut and text[:1] != "[" and not _BLANK_RE.search(text, 0, run_end)
            and (start == 0 or text.find(":", 0, run_end) >= 0)):
        # one run of non-blank text from the window's start into the prefix (the host runs
        # past it), or holding a ':' (a pid or host cut by it): where the host starts, or
        # which number is the pid, cannot be told
        problem = (text[:fmt.EXCERPT_CHARS], f"the 'host:pid:tid [dev]' prefix runs past "
                   f"{fmt.PREFIX_WINDOW:,d} characters (a damaged or glued host or pid); "
                   "record skipped", True)
    elif ts:
        why = fmt.timestamp_problem(ts)
        if why is None:
            t_ns = fmt.timestamp_ns(ts)
        else:
            problem = (f"[{ts}]", why, False)
    else:
        bad = fmt.unknown_timestamp(text, start)
        if bad is not None:
            problem = (bad, "not a timestamp format read here (YYYY-mm-dd HH:MM:SS[.frac]"
                       "[zone], zone Z, UTC, +HH, +HHMM or +HH:MM)", False)
    dec = fmt.decimal
    prefix = (t_ns, host, dec(pid) if pid else None, dec(tid) if tid else None,
              dec(dev) if dev else None)
    return prefix, problem, stripped


_BLANK_RE = re.compile(r"\s")


def timestamp_issue(file: str, line_no: int, problem: tuple) -> ParseIssue:
    """The issue of a record whose prefix cannot be fully read (``problem`` from
    :func:`read_prefix_text`): an unreadable timestamp (the event is kept, ``t_start_ns``
    empty), or a prefix too long to read (the record is skipped)."""
    shown, why, fatal = problem
    if fatal:
        return issue(file, line_no, why, shown)
    return issue(file, line_no, f"unreadable timestamp ({why}); event kept with t_start_ns "
                 "empty", shown)


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
    shown = fmt.excerpt(line, col)
    return ParseIssue(file, line_no, f"invalid UTF-8 ({what} at column {col + 1}); line not "
                      "parsed", shown.encode("utf-8", "backslashreplace").decode())


_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def range_problem(rec) -> tuple[str, int, str] | None:
    """``(field, value, column type)`` of the first number of ``rec`` (a COLL, INIT or
    PyTorch record) that its event-schema column cannot hold, or ``None``."""
    if type(rec) is CollRecord:
        if (rec.count < 2**59 and (rec.nranks or 0) < 2**31 and (rec.pid or 0) < 2**62
                and -(2**31) <= (rec.cuda_dev or 0) < 2**31 and -(2**31) <= rec.root < 2**31):
            return None  # the usual case, decided without building the checks
        checks = [("count", rec.count, _I64), ("nranks", rec.nranks, _I32),
                  ("pid", rec.pid, _I64), ("cudaDev", rec.cuda_dev, _I32)]
        if rec.dtype is not None:
            checks.append(("count * dtype bytes", rec.count * DTYPE_BYTES[rec.dtype], _I64))
        if rec.op in fmt.ROOTED_OPS:
            checks.append(("root", rec.root, _I32))
    elif type(rec) is InitRecord:
        checks = [("rank", rec.rank, _I32), ("nranks", rec.nranks, _I32)]
    else:
        checks = [("Rank", rec.group_rank, _I32)]
    for name, value, (lo, hi) in checks:
        if value is not None and not lo <= value < hi:
            return name, value, "int32" if hi == _I32[1] else "int64"
    return None


#: Where a field named by :func:`range_problem` is printed, to centre an excerpt on it.
_FIELD_WORDS = {"count": " count ", "count * dtype bytes": " count ", "nranks": "[nranks=",
                "root": " root ", "rank": " rank ", "Rank": " Rank ", "pid": ":",
                "cudaDev": "["}


def range_issue(rec, text: str, prefix: tuple | None = None) -> ParseIssue | None:
    """The issue of ``rec`` when a number does not fit its event-schema column
    (:func:`range_problem`), showing ``text`` (the record's message, or ``prefix`` as text
    for the prefix's pid and cudaDev) around that field; ``None`` when all fit."""
    bad = range_problem(rec)
    if bad is None:
        return None
    name, value, kind = bad
    shown = _prefix_shown(prefix) if name in ("pid", "cudaDev") and prefix else text
    at = shown.find(_FIELD_WORDS.get(name, name))
    return issue(rec.file, rec.line_no, f"{name} {fmt.show_int(value)} out of range (the "
                 f"event schema stores it as {kind}); record skipped", shown,
                 at if at >= 0 else None)


def _pointer_issue(file: str, line_no: int, what: str, value: str, text: str) -> ParseIssue:
    return issue(file, line_no, f"{what} field of {len(value):,d} characters (a pointer has "
                 f"at most {MAX_POINTER}); record skipped", text, text.find(value[:8]))


class LineParser:
    """The general path for one stream: any physical line -> its records, in order.

    State: one pending wrapped COLL line (joined with up to 3 following non-NCCL lines), a
    flag for a stream pointer expected on the next line, and a bounded prefix cache.
    Counts lines into ``stats`` (not ``stats.lines``: the caller counts physical lines).

    Before a line is read, ANSI escape sequences are removed from it and the BOM, CR and NUL
    characters at its start (:data:`tracer.nccl.formats.LEAD_JUNK`), counted in
    ``stats.stripped``; so are those characters in the text before each prefix.

    Records in a line start at *anchors*: each ``NCCL INFO `` marker (its message follows,
    its prefix precedes it), and each ``<Op>: opCount`` that its marker does not own (a COLL
    record whose prefix was lost: unattributed). A marker owns the first ``: opCount`` of
    its message (up to the next marker) unless an INIT line's end (``- Init COMPLETE``)
    comes before it: when its op name does not start the message (``All-Reduce``, ``All
    Reduce``, ``All\u200bReduce``) the record is an issue. A record's text ends at the next
    anchor. Every step is linear in the length of the line, and lazy: memory per line is
    the line and the records not yet consumed (issues past :data:`MAX_LINE_ISSUES` on one
    line are counted, not kept).
    """

    __slots__ = ("file", "stats", "cache", "pending", "expect_tail")

    def __init__(self, file: str, stats: ParseStats):
        self.file = file
        self.stats = stats
        self.cache: dict[str, tuple] = {}
        # [line_no, text, prefix, joins, unattributed, before, timestamp problem]
        self.pending: list | None = None
        self.expect_tail = False

    def interrupt(self) -> ParseIssue | None:
        """A complete single-line COLL record was taken by a fast path: it ends a pending
        wrapped line (an issue, returned) and any expected stream tail."""
        self.expect_tail = False
        if self.pending is None:
            return None
        issue_ = _incomplete(self.file, self.pending)
        self.pending = None
        return issue_

    def finish(self) -> ParseIssue | None:
        """End of the stream: a still pending wrapped line is an issue (returned)."""
        if self.pending is None:
            return None
        issue_ = _incomplete(self.file, self.pending, at_end=True)
        self.pending = None
        return issue_

    def _prefix(self, line: str, lo: int, at: int, latin: bool = False) -> tuple:
        """``(prefix, timestamp problem)`` of ``line[lo:at]``, the text before a marker
        (:func:`read_prefix_text`; its stripped characters counted). ``latin``: ``line``
        is a :class:`tracer.nccl.formats.ByteLine` (not cached: its texts are bytes)."""
        if latin or at - lo > _PREFIX_CACHE_TEXT_MAX:
            ptext = line[max(lo, at - fmt.PREFIX_WINDOW):at]
            bom = ptext.count(fmt.BOM_BYTES) if latin else 0
            prefix, problem, stripped = read_prefix_text(
                ptext.replace(fmt.BOM_BYTES, "") if bom else ptext, at - lo > fmt.PREFIX_WINDOW)
            if bom:
                self.stats.stripped["BOM"] += bom
        else:
            ptext = line[lo:at]
            cache = self.cache
            hit = cache.get(ptext)
            if hit is None:
                if len(cache) >= _PREFIX_CACHE_MAX:
                    cache.clear()
                hit = cache[ptext] = read_prefix_text(ptext)
            prefix, problem, stripped = hit
        if stripped:
            self.stats.stripped.update(stripped)
        return prefix, problem

    def iter_feed(self, line_no: int, line: str) -> Iterator[Record]:
        """Records of physical line ``line_no`` (``line`` with or without its line end), read
        as they are consumed. A line of more than
        :data:`tracer.nccl.formats.LONG_LINE` UTF-8 bytes holding non-ASCII characters is
        read as a :class:`tracer.nccl.formats.ByteLine` (whether it comes as one, from the
        file reader, or as text)."""
        latin = type(line) is fmt.ByteLine
        if not latin:
            if line.endswith("\n"):
                line = line[:-1]
                if line.endswith("\r"):
                    line = line[:-1]
            if len(line) * 4 > fmt.LONG_LINE and not line.isascii():
                try:
                    data = line.encode("utf-8", "surrogateescape")
                except UnicodeEncodeError:  # a lone surrogate no file holds: reported below
                    data = None
                if data is not None and len(data) > fmt.LONG_LINE:
                    line, latin = fmt.ByteLine.from_bytes(data), True
                del data
        if latin and line.invalid is not None:
            col, byte, shown = line.invalid
            yield from self._drop_pending()
            self.expect_tail = False
            yield ParseIssue(self.file, line_no, f"invalid UTF-8 (byte 0x{byte:02x} at column "
                             f"{col}); line not parsed",
                             shown.encode("utf-8", "backslashreplace").decode())
            return
        records = self._feed(line_no, line.text if latin else line, latin)
        del line  # the generator holds the only reference: a cleaned copy can replace it
        shown = hidden = 0
        for rec in records:
            if latin:
                rec = _unbyte(rec)
            if type(rec) is ParseIssue:
                shown += 1
                if shown > MAX_LINE_ISSUES:
                    hidden += 1
                    continue
            yield rec
        if hidden:
            yield ParseIssue(self.file, line_no, f"{hidden:,d} more issue(s) on this line, "
                             f"not listed (at most {MAX_LINE_ISSUES} per line)", "")

    def _feed(self, line_no: int, line: str, latin: bool) -> Iterator[Record]:
        st, file = self.stats, self.file
        if not latin and not line.isascii():
            bad = invalid_utf8_issue(file, line_no, line)
            if bad is not None:
                yield from self._drop_pending()
                self.expect_tail = False
                yield bad
                return
        if "\x1b" in line:
            pieces, n = fmt.ansi_pieces(line)
            if n:
                st.stripped["ANSI escape"] += n
                line = None  # the only reference (see iter_feed): freed before the join
                line = "".join(pieces)
            del pieces
        if line and (line[0] in fmt.LEAD_JUNK or latin and line.startswith(fmt.BOM_BYTES)):
            line = self._strip_lead(line, latin)
        heads = fmt.iter_coll_heads(line) if fmt.OPCOUNT_MARK in line else iter(())
        head = next(heads, None)
        pending = self.pending
        if pending is not None:
            # a continuation holds neither a prefix nor another record's "<Op>: opCount"
            if "NCCL" not in line and head is None and line.strip():
                yield from self._continue(pending, line)
                return
            yield from self._drop_pending()
        if head is None and "NCCL" not in line:
            if self.expect_tail and fmt.STREAM_TAIL_RE.match(line):
                st.continuation_lines += 1
            else:
                st.plain_lines += 1
            self.expect_tail = False
            return
        self.expect_tail = False
        anchors = _anchors(line, heads, head)
        anchor = next(anchors, None)
        if anchor is None:
            yield from _non_info_line(line, 0, len(line), file, line_no, st)
            return
        if not anchor[1] and line.find(fmt.INFO_MARK) < 0 and line.find("NCCL", 0, anchor[0]) >= 0:
            # e.g. a WARN line, then the record
            yield from _non_info_line(line, 0, anchor[0], file, line_no, st, count_plain=False)
        coll_match, head_match = fmt.COLL_RE.match, fmt.COLL_HEAD_RE.match
        n_mark = len(fmt.INFO_MARK)
        lo = 0
        while anchor is not None:
            at, is_mark, owned = anchor
            anchor = next(anchors, None)
            last = anchor is None
            end = len(line) if last else anchor[0]
            if is_mark:
                start = at + n_mark
                prefix, problem = self._prefix(line, lo, at, latin)
                before = ""
            else:
                start, prefix, problem = at, _NO_PREFIX, None
                before = line[max(lo, start - fmt._GAP_MAX - 8):start]
            if owned is not None and (owned[0] == owned[1] or is_mark and owned[0] != start):
                # "All-Reduce: opCount" after a marker, "All\u200bReduce", ": opCount" alone
                token = (line[start:owned[1]] if is_mark else
                         fmt.op_token(line, owned[1], lo))
                yield issue(file, line_no, f"COLL line whose op name "
                            f"{fmt.excerpt(token, None, 64)!r} is not an NCCL op name "
                            f"({_OP_LIST}); no event",
                            line[start:end] if is_mark else line[owned[1] - len(token):end])
                lo = start  # the next record's prefix may lie in this text
                continue
            m = coll_match(line, start, end)
            if m is not None and m.group(9) is not None:
                self._count(not is_mark)
                yield from _coll_records(m, file, line_no, prefix, not is_mark, before, problem)
                lo = m.end()
                self.expect_tail = last and m.group(9) == " stream"
            elif m is not None or not is_mark or head_match(line, start, end):
                colon = line.find(fmt.OPCOUNT_MARK, start, end)
                if line.find(" stream", start, end) >= 0 or end - start > MAX_RECORD:
                    yield _malformed(file, line_no, line, start, colon, end)
                elif last:
                    self.pending = [line_no, line[start:], prefix, 0, not is_mark, before,
                                    problem]
                else:
                    yield issue(file, line_no, "incomplete COLL line (another record starts "
                                "before its 'stream' field)", line[start:end])
                lo = start  # the next record's prefix may lie in this text
            else:
                lo = start
                yield from _other_info(line, start, end, file, line_no, prefix, st, problem)

    def _strip_lead(self, line: str, latin: bool) -> str:
        """``line`` without the BOM, CR and NUL characters at its start (counted)."""
        counts = self.stats.stripped
        i = 0
        while True:
            rest = line[i:].lstrip(fmt.LEAD_JUNK) if i else line.lstrip(fmt.LEAD_JUNK)
            cut = len(line) - len(rest)
            for ch in fmt.LEAD_JUNK:
                n = line.count(ch, i, cut)
                if n:
                    counts[fmt.JUNK_NAMES[ch]] += n
            i = cut
            if not (latin and line.startswith(fmt.BOM_BYTES, i)):
                return rest
            counts["BOM"] += 1
            i += len(fmt.BOM_BYTES)

    def _continue(self, pending: list, line: str) -> Iterator[Record]:
        """``line`` continues the pending wrapped COLL line."""
        st, file = self.stats, self.file
        pending[1] += line
        pending[3] += 1
        st.continuation_lines += 1
        text = pending[1]
        m = fmt.COLL_RE.match(text)
        if m is not None and m.group(9) is not None:
            self._count(pending[4])
            yield from _coll_records(m, file, pending[0], pending[2], pending[4], pending[5],
                                     pending[6])
            self.expect_tail = m.group(9) == " stream" and m.end() == len(text.rstrip())
            self.pending = None
        elif text.find(" stream") >= 0 or len(text) > MAX_RECORD:
            yield _malformed(file, pending[0], text, 0, text.find(fmt.OPCOUNT_MARK), len(text))
            self.pending = None
        elif pending[3] >= _MAX_JOINS:
            yield _incomplete(file, pending)
            self.pending = None

    def _count(self, unattributed: bool) -> None:
        if unattributed:
            self.stats.unattributed += 1
        else:
            self.stats.coll_lines += 1

    def _drop_pending(self) -> list[ParseIssue]:
        if self.pending is None:
            return []
        issue_ = _incomplete(self.file, self.pending)
        self.pending = None
        return [issue_]


def _unbyte(rec: Record) -> Record:
    """``rec`` read from a :class:`tracer.nccl.formats.ByteLine`, its texts decoded back."""
    back = fmt.from_byte_text
    kind = type(rec)
    if kind is ParseIssue:
        return rec._replace(reason=back(rec.reason), text=back(rec.text))
    if kind is CollRecord:
        return rec._replace(host=rec.host and back(rec.host), comm=back(rec.comm))
    if kind is InitRecord:
        return rec._replace(host=rec.host and back(rec.host), comm=back(rec.comm),
                            comm_id=rec.comm_id and back(rec.comm_id),
                            parent=rec.parent and back(rec.parent))
    return rec._replace(pg=back(rec.pg), pg_name=rec.pg_name and back(rec.pg_name),
                        comm=back(rec.comm))


def _anchors(line: str, heads: Iterator, head: tuple | None) -> Iterator[tuple]:
    """``(position, is_marker, owned head)`` of every anchor of ``line``, in order, lazily
    (:class:`LineParser`): each marker with the ``(op_start, colon)`` head it owns (or
    ``None``), and each head no marker owns (``position`` its op name's start)."""
    mark = fmt.INFO_MARK
    n = len(mark)
    p = line.find(mark)
    while True:
        if p >= 0 and (head is None or head[1] > p):
            s = p + n
            q = line.find(mark, s)
            owned = None
            if (head is not None and (q < 0 or head[1] < q)
                    and (head[0] == s or fmt._INIT_END_RE.search(line, s, head[0]) is None)):
                owned = head
                head = next(heads, None)
            yield p, True, owned
            p = q
        elif head is not None:
            yield head[0], False, head
            head = next(heads, None)
        else:
            return


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
                if op is not None and dtype is not None and len(comm) <= MAX_POINTER:
                    tail = tails.get(ptext)
                    if tail is None:
                        if len(tails) >= _PREFIX_CACHE_MAX:
                            tails.clear()
                        tail = tails[ptext] = parse_prefix(ptext)[1:] + (None, False)
                    rec = new(CollRecord, (
                        file, line_no, op, nccl_op, int(opc, 16), int(count), int(dt), dtype,
                        int(redop), int(root), comm, int(nranks) if nranks else None) + tail)
                    # else: the general path says which number is wrong or impossible
                    if range_problem(rec) is None and impossible_reason(
                            op, rec.nranks, rec.root if op in fmt.ROOTED_OPS else None) is None:
                        parser.expect_tail = False
                        st.coll_lines += 1
                        yield rec
                        continue
        yield from parser.iter_feed(line_no, line)
    issue_ = parser.finish()
    if issue_ is not None:
        yield issue_
    st.lines += line_no


def _incomplete(file: str, pending: list, at_end: bool = False) -> ParseIssue:
    where = "at end of input" if at_end else f"after joining {pending[3]} following line(s)"
    return issue(file, pending[0], f"truncated or malformed COLL line {where} (no 'stream' "
                 "field; NCCL prints it last)", pending[1])


def _malformed(file: str, line_no: int, text: str, start: int, colon: int,
               end: int) -> ParseIssue:
    """The issue of a COLL record ``text[start:end]`` that holds its ``stream`` field (or is
    longer than any NCCL prints) but does not read: the first field out of NCCL's format,
    shown in an excerpt around it."""
    if end - start > MAX_RECORD and text.find(" stream", start, end) < 0:
        reason, at = f"longer than {MAX_RECORD:,d} characters, no 'stream' field", start
    else:
        reason, at = fmt.coll_problem(text, colon if colon >= 0 else start, end)
    lo, hi = max(start, at - fmt.EXCERPT_CHARS), min(end, at + fmt.EXCERPT_CHARS)
    return issue(file, line_no, f"malformed COLL line ({reason}); no event", text[lo:hi],
                 at - lo)


def _coll_records(m, file: str, line_no: int, prefix: tuple, unattributed: bool = False,
                  before: str = "", problem: tuple | None = None) -> Iterator[Record]:
    nccl_op, opc, count, dt, redop, root, comm, nranks, _ = m.groups()
    if unattributed:
        name, names = fmt.lost_op_name(nccl_op, before)
        if name is None:
            glued = nccl_op != names[-1]  # letters before the shortest reading
            how = (f"glued to the text before it ({nccl_op!r}: the op is "
                   f"{' or '.join(names)})" if glued else
                   f"split by or after characters that are not ASCII letters "
                   f"({(before + nccl_op)[-len(nccl_op) - 8:]!r}: the op is "
                   f"{' or '.join(names)})")
            yield issue(file, line_no, f"COLL line without its prefix whose op name is {how}; "
                        "no event", before + m.group(0), len(before))
            return
        nccl_op = name
    op = fmt.NCCL_OP_NAMES.get(nccl_op)
    if op is None:
        what = "unsupported op" if nccl_op in fmt.UNSUPPORTED_OP_NAMES else "unknown op"
        yield issue(file, line_no, f"{what} {nccl_op!r} (no canonical op in "
                    "tracer.events.OPS)", m.group(0))
        return
    if len(comm) > MAX_POINTER:
        yield _pointer_issue(file, line_no, "comm", comm, m.group(0))
        return
    if problem is not None and problem[2]:
        yield timestamp_issue(file, line_no, problem)
        return
    dec = fmt.decimal
    datatype = dec(dt)
    dtype = fmt.NCCL_DATATYPES.get(datatype)
    t_ns, host, pid, tid, dev = prefix
    rec = CollRecord(file, line_no, op, nccl_op, int(opc, 16) if len(opc) <= 32 else -1,
                     dec(count), datatype, dtype, dec(redop), dec(root), comm,
                     dec(nranks) if nranks else None, host, pid, tid, dev, t_ns, unattributed)
    bad = range_issue(rec, m.group(0), prefix)
    if bad is not None:
        yield bad
        return
    why = impossible_reason(op, rec.nranks, rec.root if op in fmt.ROOTED_OPS else None)
    if why is not None:  # [nranks=0], a root / peer not in the communicator: no event
        at = m.group(0).find("[nranks=" if rec.nranks == 0 else " root ")
        yield issue(file, line_no, f"impossible COLL line ({why}); no event", m.group(0),
                    at if at >= 0 else None)
        return
    if dtype is None:
        yield issue(file, line_no, f"unknown datatype {fmt.show_int(datatype)} (NCCL "
                    "enum 0-11); event kept with dtype=None", m.group(0), m.start(4) - m.start())
    if problem is not None:
        yield timestamp_issue(file, line_no, problem)
    yield rec


def _prefix_shown(prefix: tuple) -> str:
    """The prefix's host:pid:tid [dev] as text, to show a number of it that is out of range."""
    _, host, pid, tid, dev = prefix
    num = (lambda v: "" if v is None else fmt.show_int(v))
    return f"{host}:{num(pid)}:{num(tid)} [{num(dev)}]"


def _other_info(line: str, start: int, end: int, file: str, line_no: int, prefix: tuple,
                st: ParseStats, problem: tuple | None = None):
    if _INIT_MARK_RE.search(line, start, end) is not None:
        groups = fmt.match_init_span(line, start, end)
        if groups is None:
            yield issue(file, line_no, "unreadable INIT/DESTROY line (expected 'comm %p "
                        "rank %d nranks %d cudaDev %d ... - Init COMPLETE')", line[start:end])
            return
        func, comm, rank, nranks, dev, a, b, what, state = groups
        if len(comm) > MAX_POINTER:
            yield _pointer_issue(file, line_no, "comm", comm, line[start:end])
            return
        if problem is not None and problem[2]:
            yield timestamp_issue(file, line_no, problem)
            return
        f = fmt.init_fields(line, a, b)
        split = f.get("splitCount", f.get("childCount"))
        _, host, pid, tid, _ = prefix
        dec = fmt.decimal
        rec = InitRecord(
            file, line_no, state if what == "Init" else "DESTROY", func, comm, dec(rank),
            dec(nranks), dec(dev), f.get("commId"), f.get("parent"),
            fmt.decimal_or_none(split), _int_or_none(f.get("color")),
            _int_or_none(f.get("key")), host, pid, tid)
        bad = range_issue(rec, line[start:min(end, start + MAX_RECORD)])
        if bad is not None:
            yield bad
            return
        st.init_lines += 1
        yield rec
        return
    if _OPCOUNT_ANY_RE.search(line, start, end) is not None:  # "AllReduce:opCount", "opcount"
        yield issue(file, line_no, "malformed COLL line (its 'opCount' is not written "
                    "'<Op>: opCount' as NCCL prints it); no event", line[start:end])
        return
    st.ignored["INFO (other subsystems)"] += 1


_OP_LIST = ", ".join(fmt.NCCL_OP_NAMES)
_INIT_MARK_RE = re.compile("|".join(map(re.escape, fmt.INIT_MARKERS)))
_OPCOUNT_ANY_RE = re.compile(r"op\W{0,3}count", re.IGNORECASE)


def _int_or_none(text: str | None) -> int | None:
    """``color`` / ``key`` value: ``-?[0-9]+`` with trailing dashes dropped, else ``None``."""
    return None if text is None else fmt.decimal_or_none(text.rstrip("-"))


def _non_info_line(line: str, start: int, end: int, file: str, line_no: int, st: ParseStats,
                   count_plain: bool = True):
    if line.find("created ncclComm_", start, end) >= 0:
        m = fmt.TORCH_COMM_RE.search(line, start, end)
        if m is None:
            yield issue(file, line_no, "unreadable PyTorch 'created ncclComm_' line "
                        "(expected '[PG <id> (<name>) Rank <r>] ProcessGroupNCCL created "
                        "ncclComm_ 0x... on CUDA device: '))", line[start:end])
            return
        pg, _guid, name, rank, comm = m.groups()
        if len(comm) > MAX_POINTER:
            yield _pointer_issue(file, line_no, "ncclComm_", comm, line[m.start():m.end()])
            return
        g = fmt.GLOG_RE.search(line, start, m.start())
        rec = TorchCommRecord(file, line_no, pg, name, fmt.decimal(rank), comm,
                              fmt.decode_torch_device(line, m.end(), end),
                              fmt.decimal(g.group(1)) if g else None)
        bad = range_issue(rec, line[m.start():m.end()])
        if bad is not None:
            yield bad
            return
        st.torch_lines += 1
        yield rec
        return
    for level in ("WARN", "CALL", "TRACE", "ABORT"):
        if line.find(f"NCCL {level}", start, end) >= 0:
            st.ignored[level] += 1
            return
    if count_plain:
        st.plain_lines += 1
