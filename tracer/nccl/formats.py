"""Line formats of NCCL_DEBUG=INFO logs (NCCL 2.4 to 2.30, RCCL) and PyTorch's comm lines.

Pure tables and regular expressions, no state; :mod:`tracer.nccl.log` uses them. Every
format here is taken from NCCL's ``INFO(...)`` calls at its release tags (``src/enqueue.cc``
for COLL lines, ``src/init.cc`` for INIT lines, ``src/debug.cc`` for the prefix) and from the
real excerpts under ``shared/fixtures/nccl/`` (see ``TRACE_FORMATS.md``).

Line anatomy::

    [2026-05-05 06:16:47] node-01:1896279:1896279 [0] NCCL INFO AllReduce: opCount 0 ...
    `-- timestamp (2.26+) `-- host:pid:tid     `-- cudaDev (CUDA device, not the rank)

Anything before the timestamp / host (Ray's ``(RayTrainWorker pid=…)``, mpirun's ``[0] ``,
another rank's unterminated line) is ignored: records are found by searching for
``NCCL INFO `` anywhere in a physical line, never anchored at column 0. Terminal colours
(:data:`ANSI_RE`) are removed from a line, and a BOM, CR or NUL before a prefix
(:data:`LEAD_JUNK`) separates it from the text before, before a line is read. A COLL message whose
prefix was lost is found by its ``<Op>: opCount`` (:func:`iter_coll_heads`).

Every pattern here runs in linear time on any line: searches start at a literal or a
bounded class, and the three whose plain ``search`` backtracks quadratically on long runs
(the prefix, the INIT line, the PyTorch comm line) are read by :func:`read_prefix`,
:func:`match_init_span` and a name class that stops at brackets. Fields are ASCII
(``re.ASCII``): NCCL prints ASCII digits, and numbers too long for ``int`` read as
:data:`OVERSIZED` (:func:`decimal`).
"""

from __future__ import annotations

import calendar
import codecs
import re
from collections.abc import Iterator

#: Marker that starts the message of every INFO line (``src/debug.cc``: ``"%s NCCL INFO "``).
INFO_MARK = "NCCL INFO "

#: NCCL COLL op name -> canonical op (tracer.events.OPS). ``AllToAll`` is RCCL's spelling;
#: ``AlltoAll``, ``Gather`` and ``Scatter`` are logged from NCCL 2.28 (``src/collectives.cc``).
NCCL_OP_NAMES: dict[str, str] = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "Send": "send",
    "Recv": "recv",
    "AlltoAll": "all_to_all",
    "AllToAll": "all_to_all",
    "Gather": "gather",
    "Scatter": "scatter",
}

#: COLL op names NCCL logs that have no canonical op in tracer.events.OPS (reported as issues).
UNSUPPORTED_OP_NAMES: frozenset[str] = frozenset({"AllToAllv", "AllToAllV"})

#: Ops whose ``root`` field means something (the root, or for send / recv the peer).
ROOTED_OPS: frozenset[str] = frozenset({"broadcast", "reduce", "gather", "scatter", "send",
                                        "recv"})

#: ncclDataType_t (``src/nccl.h.in``) -> torch dtype name. 10 and 11 exist from NCCL 2.24.
NCCL_DATATYPES: dict[int, str] = {
    0: "int8",
    1: "uint8",
    2: "int32",
    3: "uint32",
    4: "int64",
    5: "uint64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "bfloat16",
    10: "float8_e4m3fn",
    11: "float8_e5m2",
}

#: NCCL dtype enum by torch name (inverse of :data:`NCCL_DATATYPES`).
DATATYPE_NUMBERS: dict[str, int] = {v: k for k, v in NCCL_DATATYPES.items()}

#: COLL message (2.4 → 2.30; RCCL appends ``task %d globalrank %d`` after the stream, ignored):
#: ``%s: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op %d root %d comm %p
#: [nranks=%d] stream %p``. Groups: op, opCount, count, datatype, op, root, comm, nranks,
#: stream keyword. A line is *complete* when the ``stream`` keyword is present.
COLL_RE = re.compile(
    r"([A-Za-z]+): opCount ([0-9a-fA-F]+) sendbuff [^\s\x00]+ recvbuff [^\s\x00]+ count (\d+)"
    r" datatype (\d+) op (\d+) root (-?\d+) comm ([^\s\[\x00]+)"
    r"(?: \[nranks=(\d+)\])?( stream(?: (?:0x[0-9a-fA-F]+|\(nil\)))?)?", re.ASCII
)

#: Fast path: a whole physical line that is one plain, complete COLL record with a
#: ``host:pid:tid [dev] `` prefix at column 0 (the shape of almost every line of a per-process
#: NCCL_DEBUG_FILE). Groups: the prefix ``host:pid:tid [dev] ``, then as :data:`COLL_RE` minus
#: the stream. Any line it does not match takes the general path, which yields the same record.
#: Numbers are bounded (19 digits) so that ``int`` never sees an oversized text here.
FAST_COLL_LINE_RE = re.compile(
    r"([^\s\[\]:\x00\x1b]{1,255}:\d{1,19}:\d{1,19} \[\d{1,19}\] )NCCL INFO ([A-Za-z]+): opCount "
    r"([0-9a-fA-F]{1,32}) sendbuff [^\s\x00\x1b]+ recvbuff [^\s\x00\x1b]+ count (\d{1,19}) "
    r"datatype (\d{1,19}) op (\d{1,19}) root (-?\d{1,19}) comm ([^\s\[\x00\x1b]+) "
    r"(?:\[nranks=(\d{1,19})\] )?"
    r"stream (?:0x[0-9a-fA-F]+|\(nil\))[ \t]*\r?\n?\Z", re.ASCII
)

#: RE2 pattern (``pyarrow.compute.match_substring_regex``) of a *fast* line of the columnar
#: reader (:mod:`tracer.nccl.columns`): one physical line, ended by ``\n``, that is exactly one
#: complete COLL record with a supported op and a known datatype, optionally the 2.26+
#: ``[YYYY-mm-dd HH:MM:SS[.frac]] `` timestamp, then ``host:pid:tid [dev] `` at column 0, single
#: spaces between fields, trailing blanks only. Every field is ASCII and space-free, so the
#: reader splits such a line at spaces; numbers are bounded so that they fit the event schema
#: (count < 10**16, so msg_bytes fits int64; root, nranks, cudaDev < 10**9; the comm pointer
#: at most 64 characters, as :data:`tracer.nccl.records.MAX_POINTER`); a fast line is
#: also at most :data:`FAST_LINE_MAX` bytes long. The general path reads any line it accepts
#: to the same record (tested); every other line takes it.
FAST_COLL_LINE_RE2 = (
    r"^(?:\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?\] )?"
    r"[A-Za-z0-9_.\-]+:[0-9]{1,18}:[0-9]+ \[[0-9]{1,9}\] NCCL INFO "
    r"(?:" + "|".join(sorted(NCCL_OP_NAMES, key=lambda k: (-len(k), k))) + r"): opCount "
    r"[0-9a-fA-F]+ sendbuff (?:0x[0-9a-fA-F]+|\(nil\)) recvbuff (?:0x[0-9a-fA-F]+|\(nil\)) "
    r"count [0-9]{1,16} datatype (?:"
    + "|".join(sorted(map(str, NCCL_DATATYPES), key=lambda k: (-len(k), k)))
    + r") op [0-9]+ root -?[0-9]{1,9} comm 0x[0-9a-fA-F]{1,62} (?:\[nranks=[0-9]{1,9}\] )?"
    r"stream (?:0x[0-9a-fA-F]+|\(nil\))[ \t]*\n$"
)
#: Longest fast line (bytes, its line end included): a longer line that
#: :data:`FAST_COLL_LINE_RE2` accepts (a host of hundreds of characters, thousands of
#: trailing blanks) takes the general path, so every field of a fast line is short.
FAST_LINE_MAX = 1024

#: :data:`NCCL_DATATYPES` keyed by the decimal text as logged.
NCCL_DATATYPES_BY_TEXT: dict[str, str] = {str(k): v for k, v in NCCL_DATATYPES.items()}

#: Start of any COLL message, complete or not: ``<Op>: opCount ``.
COLL_HEAD_RE = re.compile(r"([A-Za-z]+): opCount\b", re.ASCII)

#: The text after a COLL op name. Every ``: opCount`` not followed by a word character is the
#: head of a COLL record (NCCL prints it in COLL lines only): one with a prefix belongs to
#: the ``NCCL INFO`` marker before it; one whose ``host:pid:tid [dev] NCCL INFO `` prefix was
#: lost (interleaved stdout) is found by this text alone, see :func:`iter_coll_heads`.
OPCOUNT_MARK = ": opCount"

#: Letters that may end an op name right before :data:`OPCOUNT_MARK` (reading backwards at
#: most this many: longer runs hold text glued before the op name, which
#: :func:`lost_op_name` reads from its end).
_OP_RUN_MAX = 64
_OP_RUN_END_RE = re.compile(r"(?<![A-Za-z])[A-Za-z]+\Z")
_WORD_CHAR_RE = re.compile(r"\w", re.ASCII)
#: Characters read before an op name to tell a split name (``"All-Reduce"``) from glued text.
_GAP_MAX = 16
_LETTERS_END_RE = re.compile(r"[A-Za-z]+\Z")


def iter_coll_heads(line: str, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, int]]:
    """``(op_start, colon)`` of every :data:`OPCOUNT_MARK` not followed by a word character
    in ``line[lo:hi]``, in order: ``colon`` is where the mark starts, ``op_start`` where the
    run of ASCII letters before it starts (at most :data:`_OP_RUN_MAX` letters back, never
    before ``lo`` or the previous head); ``op_start == colon`` when no such run ends there
    (``"All-Reduce : opCount"``, a run of more letters): a head whose op name cannot be read.
    Lazy and linear: ``str.find`` plus a bounded backward read per head."""
    hi = len(line) if hi is None else hi
    mark, n = OPCOUNT_MARK, len(OPCOUNT_MARK)
    floor = lo
    i = line.find(mark, lo, hi)
    while i >= 0:
        after = i + n
        if after >= len(line) or not _WORD_CHAR_RE.match(line, after):  # "\b" after opCount
            m = _OP_RUN_END_RE.search(line, max(floor, i - _OP_RUN_MAX), i)
            yield (i if m is None else m.start()), i
            floor = after
        i = line.find(mark, after, hi)


def op_token(line: str, colon: int, lo: int = 0) -> str:
    """The text before ``colon`` back to the previous blank (or ``lo``), at most
    :data:`_OP_RUN_MAX` characters: the op name as a reader sees it, for messages."""
    start = max(lo, colon - _OP_RUN_MAX)
    blank = max(line.rfind(" ", start, colon), line.rfind("\t", start, colon))
    return line[max(start, blank + 1):colon]


#: Op names a COLL line may carry (:data:`NCCL_OP_NAMES` and :data:`UNSUPPORTED_OP_NAMES`).
KNOWN_OP_NAMES: frozenset[str] = frozenset(NCCL_OP_NAMES) | UNSUPPORTED_OP_NAMES


def lost_op_name(run: str, before: str = "") -> tuple[str | None, list[str]]:
    """The op name of a COLL record that lost its prefix, from the letters before
    ``: opCount`` (``run``), which may carry text glued before the name (``"stepAllGather"``),
    and the text before them (``before``, a few characters).

    Returns ``(name, candidates)``: ``run`` itself when it is a known op name (or no known name
    ends it: an unknown op); else the one known name that ends it; ``(None, names)`` when
    several readings exist:

    - several known names end ``run`` (``"xAllReduce"``: ``AllReduce``, or ``Reduce`` after
      ``"xAll"``);
    - letters are glued to a name that ends a longer one (``"stepReduce"``, ``"AlReduce"``:
      ``Reduce``, or a mangled ``AllReduce``); glued to ``Send`` (``"doneSend"``) the name
      is read;
    - the name is split by characters that are not ASCII letters (``"All-Reduce"``, ``"All
      Reduce"``, ``"All\u200bReduce"``, ``"All5Reduce"``: ``Reduce``, or ``AllReduce``
      with something inside), or it ends a longer name and punctuation or other non-ASCII
      text (no blank, no digit) comes right before it (``"Al-Reduce"``). A blank or digits
      before it are foreign text (``"loss 2.5 Reduce"``, a pointer ``"0x7f00Reduce"``).
    """
    if run in KNOWN_OP_NAMES:
        names = [run]
    else:
        names = sorted((n for n in KNOWN_OP_NAMES if run.endswith(n)), key=len, reverse=True)
        if not names:
            return run, []
    if len(names) > 1:
        return None, names
    name = names[0]
    longer = sorted((n for n in KNOWN_OP_NAMES if len(n) > len(name) and n.endswith(name)),
                    key=len, reverse=True)
    if run != name and longer:  # letters glued to a name that ends a longer one
        return None, longer + names
    if before:
        k = len(before)
        while k and len(before) - k < _GAP_MAX and not _is_ascii_letter(before[k - 1]):
            k -= 1
        gap = before[k:]
        m = _LETTERS_END_RE.search(before, 0, k) if gap else None
        if m is not None:
            joined = m.group(0) + run
            split = [n for n in longer if joined.endswith(n)]
            if split:
                return None, split + names
            if longer and not _BLANK_OR_DIGIT_RE.search(gap):
                return None, longer + names
    return name, names


_BLANK_OR_DIGIT_RE = re.compile(r"[\s0-9]", re.ASCII)


def _is_ascii_letter(ch: str) -> bool:
    return "a" <= ch <= "z" or "A" <= ch <= "Z"


#: INIT / DESTROY message, every version: optional init function name (2.21+), then
#: ``comm %p rank %d nranks %d cudaDev %d`` ... ``- Init START|COMPLETE`` or
#: ``- Destroy COMPLETE`` / ``- Abort COMPLETE``. The middle (nvmlDev, busId, commId,
#: parent, splitCount / childCount, color, key) is read by :data:`INIT_FIELD_RE`. This single
#: regex is the *definition* (kept for reference and tests); a backtracking search with it is
#: quadratic on a line repeating ``comm … cudaDev 0`` or ``nccl``, so lines are read by
#: :func:`match_init_span`, which returns the same groups in linear time.
INIT_RE = re.compile(
    r"(?:(nccl\w+) )?comm ([^\s\x00]+) rank (-?\d+) nranks (\d+) cudaDev (-?\d+)(.*?) ?- "
    r"(Init|Destroy|Abort) (START|COMPLETE)", re.ASCII
)
_INIT_HEAD_RE = re.compile(r"comm ([^\s\x00]+) rank (-?\d+) nranks (\d+) cudaDev (-?\d+)",
                           re.ASCII)
_INIT_END_RE = re.compile(r"- (Init|Destroy|Abort) (START|COMPLETE)")
_WORD_RUN_RE = re.compile(r"\w+", re.ASCII)


def match_init_span(text: str, pos: int = 0, endpos: int | None = None) -> tuple | None:
    """The groups of the leftmost :data:`INIT_RE` match in ``text[pos:endpos]`` (``None``: no
    match), in linear time and without copying it, with the middle (``rest``) as its bounds
    ``(start, end)`` in ``text`` (read its fields with :func:`init_fields`). Heads (``comm …
    cudaDev N``) and end markers (``- Init COMPLETE`` …) are found separately: the first head
    wins when an end marker follows it (no later head can have one otherwise), the lazy middle
    ending at the first marker after it (a space before the marker is not part of it), and the
    init function read from the word before the head."""
    endpos = len(text) if endpos is None else endpos
    nl = text.find("\n", pos, endpos)
    if nl >= 0:  # "." does not cross a line end: each piece on its own
        while True:
            groups = match_init_span(text, pos, endpos if nl < 0 else nl)
            if groups is not None or nl < 0:
                return groups
            pos = nl + 1
            nl = text.find("\n", pos, endpos)
    head = _INIT_HEAD_RE.search(text, pos, endpos)
    if head is None:
        return None
    stop = head.end()
    end = _INIT_END_RE.search(text, stop, endpos)
    if end is None:
        return None
    p = end.start()
    rest_end = p - 1 if p - 1 >= stop and text[p - 1] == " " else p
    return (_init_func(text, head.start(), pos), *head.groups(), stop, rest_end,
            *end.groups())


#: Characters read back from an INIT head for the init function's name.
_INIT_FUNC_MAX = 1024
_WORD_RUN_END_RE = re.compile(r"(?<!\w)\w+\Z", re.ASCII)


def _init_func(text: str, at: int, lo: int = 0) -> str | None:
    """``nccl\\w+`` ending right before ``" comm"`` at ``at`` (reading back at most
    :data:`_INIT_FUNC_MAX` characters, never before ``lo``): from the leftmost ``nccl`` of
    that word with at least one word character after it."""
    if at - lo < 2 or text[at - 1] != " ":
        return None
    m = _WORD_RUN_END_RE.search(text, max(lo, at - 1 - _INIT_FUNC_MAX), at - 1)
    if m is None:
        return None
    word = m.group(0)
    i = word.find("nccl")
    return word[i:] if 0 <= i < len(word) - 4 else None


#: Optional ``name value`` fields inside an INIT line.
INIT_FIELD_RE = re.compile(
    r"\b(commId|parent|splitCount|childCount|color|key|busId) ([^\s\x00]+)", re.ASCII)
_INIT_FIELD_AT_RE = re.compile(
    r"(commId|parent|splitCount|childCount|color|key|busId) ([^\s\x00]+)", re.ASCII)


def init_fields(text: str, start: int, end: int) -> dict[str, str]:
    """``dict(INIT_FIELD_RE.findall(text[start:end]))`` without copying the slice (``\\b``
    at ``start`` holds as at the start of the slice)."""
    m = _INIT_FIELD_AT_RE.match(text, start, end)
    out: dict[str, str] = {}
    pos = start
    if m is not None:
        out[m.group(1)] = m.group(2)
        pos = m.end()
    for m in INIT_FIELD_RE.finditer(text, pos, end):
        out[m.group(1)] = m.group(2)
    return out

#: Markers of messages that must parse as INIT / DESTROY lines (otherwise: an issue).
INIT_MARKERS = ("- Init START", "- Init COMPLETE", "Init START", "Init COMPLETE",
                "Destroy COMPLETE", "Abort COMPLETE")

#: Prefix before ``NCCL INFO``: optional ``[timestamp] ``, optional ``host:pid:tid ``,
#: optional ``[cudaDev] ``, anchored at the marker. Host is ``[^\s\[\]]`` characters; when
#: another rank's line ends without a newline right before it (interleaved output), the host
#: may carry that line's last characters (e.g. ``0x55f1ubuntu``): NCCL writes no separator.
#: This regex is the *definition* (its leftmost ``search`` match); :func:`read_prefix` gives
#: the same groups in linear time (a ``search`` visits every start of a long blob before the
#: marker, and with a lazy host that is quadratic).
PREFIX_RE = re.compile(
    r"(?:\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?: ?(?:Z|UTC|[+-]\d\d(?::?\d\d)?))?)\] )?"
    r"(?:([^\s\[\]]+?):(\d+):(\d+) ?)?(?:\[(-?\d+)\] ?)?\Z", re.ASCII
)
#: :data:`PREFIX_RE` read backwards from the marker (matched at the start of the reversed
#: text): ``[dev] ?``, then ``host:pid:tid ?`` (the greedy host run reaches where the leftmost
#: match's lazy host starts: the start of its run), then ``[timestamp] ``. Groups reversed.
_PREFIX_REV_RE = re.compile(
    r"(?: ?\](\d+-?)\[)?"
    r"(?: ?(\d+):(\d+):([^\s\[\]]+))?"
    r"(?: \]((?:(?:Z|CTU|(?:\d\d:?)?\d\d[+-]) ?)?"  # the zone, reversed
    r"(?:\d+[.,])?\d\d:\d\d:\d\d[ T]\d\d-\d\d-\d{4})\[)?", re.ASCII
)


#: Characters before a marker that :func:`read_prefix` reads: a timestamp, host, pid, tid and
#: device take far fewer; a longer glued host is cut here.
PREFIX_WINDOW = 4096


def read_prefix(text: str, lo: int = 0, hi: int | None = None,
                window: int = PREFIX_WINDOW) -> tuple:
    """The ``(timestamp, host, pid, tid, cuda_dev)`` texts (or ``None``) of :data:`PREFIX_RE`'s
    leftmost match in ``text[lo:hi]``, in linear time (one anchored match of the reversed
    text), reading at most its last ``window`` characters; then ``start``, where the match
    begins in ``text``."""
    hi = len(text) if hi is None else hi
    lo = max(lo, hi - window)
    rev = text[lo:hi][::-1]
    m = _PREFIX_REV_RE.match(rev)
    dev, tid, pid, host, ts = (g[::-1] if g is not None else None for g in m.groups())
    return ts, host, pid, tid, dev, hi - m.end()


#: PyTorch ProcessGroupNCCL (glog) line naming a comm pointer, for example
#: ``I0527 15:16:57.738664 58629 ProcessGroupNCCL.cpp:2183] [PG 0 (default_pg) Rank 5]
#: ProcessGroupNCCL created ncclComm_ 0x555b8d27b370 on CUDA device: <index>``.
#: Also the newer ``[PG ID 0 PG GUID 0(default_pg) Rank 0]`` prefix. The index is printed
#: as a raw character (``c10::DeviceIndex`` is an ``int8_t``), see :func:`decode_torch_device`.
#: The group name holds no parenthesis or bracket: each repetition stops at the next one, so
#: a search is linear on any line (a name with brackets makes the line an issue).
TORCH_COMM_RE = re.compile(
    r"\[PG (?:ID )?([^\s\]()\x00]+)(?: PG GUID ([^\s\]()\x00]+))? ?(?:\(([^()\[\]\x00]*)\))? "
    r"Rank (\d+)\] ProcessGroupNCCL created ncclComm_ ([^\s\x00]+) on CUDA device:", re.ASCII
)

#: glog prefix ``I0527 15:16:57.219332 58624 file.cpp:123]``: group 1 is the thread id.
GLOG_RE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +(\d+) ", re.ASCII)

#: A physical line that only carries the rest of a wrapped COLL line's stream pointer.
STREAM_TAIL_RE = re.compile(r"\s*(?:0x[0-9a-fA-F]+|\(nil\))\s*\Z")

#: Decimal texts longer than this many digits are not converted: no column of the event
#: schema holds more than 19, and Python refuses to convert more than 4300.
MAX_DIGITS = 40
#: What :func:`decimal` gives (with the text's sign) for a longer text: out of every range.
OVERSIZED = 10**MAX_DIGITS


def decimal(text: str) -> int:
    """``int`` of an ASCII decimal text (``-?[0-9]+``, as the patterns here capture it); a
    text of more than :data:`MAX_DIGITS` digits gives ``±OVERSIZED``."""
    if len(text) - text.startswith("-") > MAX_DIGITS:
        return -OVERSIZED if text.startswith("-") else OVERSIZED
    return int(text)


def decimal_or_none(text: str | None) -> int | None:
    """:func:`decimal` of ``text`` when it is ``-?[0-9]+`` (ASCII digits), else ``None``."""
    if not text:
        return None
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()):
        return None
    return decimal(text)


def show_int(value: int) -> str:
    """``value`` for a message: :data:`OVERSIZED` reads as a number of too many digits."""
    if abs(value) >= OVERSIZED:
        return f"{'-' if value < 0 else ''}<more than {MAX_DIGITS} digits>"
    return str(value)


#: A timestamp's text as :data:`PREFIX_RE` captures it: date, clock, fraction, zone.
_TIMESTAMP_RE = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d+))?"
    r" ?(?:(Z|UTC)|([+-])(\d\d)(?::?(\d\d))?)?\Z", re.ASCII)


def timestamp_ns(text: str) -> int:
    """``YYYY-mm-dd HH:MM:SS[.frac][zone]`` (NCCL 2.26+ ``NCCL_DEBUG_TIMESTAMP_FORMAT``,
    default ``[%F %T] ``; ``T`` may separate date and clock, ``,`` may start the fraction) as
    integer ns since the Unix epoch, UTC. ``zone`` (optional, a space may precede it):
    ``Z``, ``UTC``, or an offset ``+HH``, ``+HHMM``, ``+HH:MM`` (or ``-``), subtracted to get
    UTC. Without a zone the wall clock is read as UTC (the log does not name its zone: use
    the value for ordering and differences).

    Raises:
        ValueError: ``text`` is not in that format, names an impossible date, clock or offset
            (month 13, February 30, 25:00, +24:00), or a time that int64 ns since the epoch
            cannot hold (before 1677-09-21 or after 2262-04-11). The message says which
            (:func:`timestamp_problem`).
    """
    m = _TIMESTAMP_RE.match(text)
    if m is None:
        raise ValueError(
            f"Invalid NCCL timestamp {text!r}. Must be 'YYYY-mm-dd HH:MM:SS[.frac][zone]' "
            "(zone Z, UTC, +HH, +HHMM or +HH:MM).")
    year, month, day, hour, minute, second = (int(x) for x in m.group(1, 2, 3, 4, 5, 6))
    frac, sign, zh, zm = m.group(7, 9, 10, 11)
    what = None
    if not 1 <= month <= 12:
        what = f"month {month:02d}"
    elif not 1 <= day <= calendar.monthrange(max(year, 1), month)[1]:
        what = f"day {day:02d} of {year:04d}-{month:02d}"
    elif hour > 23 or minute > 59 or second > 60:  # 60: a leap second
        what = f"clock {hour:02d}:{minute:02d}:{second:02d}"
    elif sign is not None and (int(zh) > 23 or int(zm or 0) > 59):
        what = f"offset {sign}{zh}:{zm or '00'}"
    if what is not None:
        raise ValueError(f"Invalid NCCL timestamp {text!r}: no {what} exists.")
    offset = 0
    if sign is not None:
        offset = (1 if sign == "+" else -1) * (int(zh) * 3600 + int(zm or 0) * 60)
    seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)) - offset
    frac_ns = int((frac + "000000000")[:9]) if frac else 0
    ns = seconds * 1_000_000_000 + frac_ns
    if not -(2**63) <= ns < 2**63:
        raise ValueError(f"Invalid NCCL timestamp {text!r}: outside 1677-09-21 .. 2262-04-11 "
                         "(int64 ns since the epoch).")
    return ns


def timestamp_problem(text: str) -> str | None:
    """Why :func:`timestamp_ns` cannot read ``text`` (its error message), or ``None``."""
    try:
        timestamp_ns(text)
    except ValueError as exc:
        return str(exc)
    return None


#: The bracketed text right before a prefix that names a time of day (``[05/05/26
#: 06:16:47]``, ``[06:16:47]``): a timestamp in a format :data:`PREFIX_RE` does not know.
_TIME_LIKE_RE = re.compile(r"\[([^\[\]]{0,64}?\d:\d\d[^\[\]]{0,64}?)\] ?\Z", re.ASCII)


def unknown_timestamp(text: str, end: int) -> str | None:
    """The bracketed time-like text (:data:`_TIME_LIKE_RE`) ending ``text[:end]``, or
    ``None`` (read from at most the last 160 characters)."""
    m = _TIME_LIKE_RE.search(text, max(0, end - 160), end)
    return None if m is None else m.group(0).rstrip(" ")


#: A PyTorch line's device index as ASCII digits, and as one raw byte (not 9-13: whitespace).
_TORCH_DEV_DIGITS_RE = re.compile(r"\s*([0-9]+)\s*\Z")
_TORCH_DEV_BYTE_RE = re.compile(r" ?([\x00-\x08\x0e-\x1f])[\r\n]*\Z")


def decode_torch_device(tail: str, pos: int = 0, endpos: int | None = None) -> int | None:
    """CUDA device index from the text after ``on CUDA device:`` in a PyTorch line
    (``tail[pos:endpos]``, read in place).

    PyTorch streams a ``c10::DeviceIndex`` (``int8_t``) into the log, so the index appears as
    a raw byte: ``"\\x03"`` is device 3. ASCII decimal digits are accepted too (below 2**31),
    with blanks around them. Bytes 0x09-0x0d (device 9-13) are whitespace and cannot be told
    from line ends; they and an empty or altered tail decode to ``None``.
    """
    endpos = len(tail) if endpos is None else endpos
    m = _TORCH_DEV_DIGITS_RE.match(tail, pos, endpos)
    if m is not None:
        number = decimal(m.group(1))
        return number if number < 2**31 else None
    m = _TORCH_DEV_BYTE_RE.match(tail, pos, endpos)
    return None if m is None else ord(m.group(1))


# ------------------------------------------------------------------ damaged and hostile text

#: ANSI escape sequences (terminal colours, cursor moves): CSI ``ESC [ … final``, OSC
#: ``ESC ] … BEL|ESC \\``, and the two-character cursor and keypad ones (``ESC 7``, ``ESC 8``,
#: ``ESC =``, ``ESC >``). Presentation, never part of a record: removed from a line before it
#: is parsed (counted in the parse's stats). ``ESC`` and a letter is not removed: it would
#: take the letter with it (``All\x1bReduce`` would read ``Alleduce``).
ANSI_RE = re.compile(r"\x1b(?:\[[0-?]{0,64}[ -/]{0,8}[@-~]|\][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)"
                     r"|[78=>])")
#: Characters of a long line cleaned at a time by :func:`ansi_pieces`.
_ANSI_WINDOW = 1 << 20
#: Longest ANSI escape sequence :data:`ANSI_RE` reads (an OSC title of 4096 characters).
_ANSI_LONGEST = 4200


def ansi_pieces(text: str) -> tuple[list[str], int]:
    """``text`` without its ANSI escape sequences, as pieces to join, and how many went.
    A long text is cleaned a window at a time (never cutting a sequence), so that no list of
    every match's pieces is built: the pieces are at most the text's size."""
    if len(text) <= _ANSI_WINDOW:
        clean, n = ANSI_RE.subn("", text)
        return [clean], n
    pieces, total, pos = [], 0, 0
    while pos < len(text):
        end = min(len(text), pos + _ANSI_WINDOW)
        if end < len(text):
            esc = text.rfind("\x1b", max(pos + 1, end - _ANSI_LONGEST), end)
            if esc > pos:
                end = esc
        clean, n = ANSI_RE.subn("", text[pos:end])
        pieces.append(clean)
        total += n
        pos = end
    return pieces, total


#: Characters removed from the start of a line (and before a prefix, see
#: :func:`strip_before`): a UTF-8 byte-order mark, carriage returns, NUL bytes (a crash can
#: leave a zero-filled block in a log file before the next line).
LEAD_JUNK = "\ufeff\r\0"
#: Names of the removed characters in the stats.
JUNK_NAMES = {"\ufeff": "BOM", "\r": "CR", "\0": "NUL"}


def strip_before(text: str) -> tuple[str, dict[str, int]]:
    """``text`` (the text before a prefix) with its :data:`LEAD_JUNK` characters made
    blanks, and how many of each there were: such a character separates the prefix from the
    text before it (a BOM where two files were joined, NUL bytes before a restarted process's
    line), so the host is not glued to that text."""
    counts = {JUNK_NAMES[c]: text.count(c) for c in LEAD_JUNK if c in text}
    if counts:
        for c in LEAD_JUNK:
            text = text.replace(c, " ")
    return text, counts


#: Longest :class:`tracer.nccl.records.ParseIssue` text: longer texts are cut to an excerpt.
EXCERPT_CHARS = 200


def excerpt(text: str, at: int | None = None, width: int = EXCERPT_CHARS) -> str:
    """``text`` when it has at most ``width`` characters; else a window of it, around ``at``
    (a position in ``text``, e.g. the field that failed) or from its start, with ``…`` and
    the number of characters cut on each cut side."""
    if len(text) <= width:
        return text
    if at is None:
        lo = 0
    else:
        lo = min(max(0, at - width // 3), len(text) - width)
    hi = lo + width
    head = f"…({lo:,d} chars) " if lo else ""
    tail = f" …({len(text) - hi:,d} more chars)" if hi < len(text) else ""
    return head + text[lo:hi] + tail


#: COLL record fields in NCCL's order (``src/enqueue.cc``): name, pattern of name + value,
#: and what the value must be.
_COLL_FIELDS = [
    ("opCount", r": opCount [0-9a-fA-F]+\b", "a hex number"),
    ("sendbuff", r" sendbuff \S+", "a pointer"),
    ("recvbuff", r" recvbuff \S+", "a pointer"),
    ("count", r" count \d+\b", "a decimal number"),
    ("datatype", r" datatype \d+\b", "a decimal number"),
    ("op", r" op \d+\b", "a decimal number"),
    ("root", r" root -?\d+\b", "a decimal number"),
    ("comm", r" comm [^\s\[]+", "a pointer"),
    ("[nranks=]", r"(?: \[nranks=\d+\])?", "a decimal number"),
    ("stream", r" stream\b", "last"),
]
_COLL_FIELD_RES = [(name, re.compile(pat, re.ASCII), want) for name, pat, want in _COLL_FIELDS]


def coll_problem(text: str, colon: int, end: int) -> tuple[str, int]:
    """Why the COLL record whose op name ends at ``colon`` in ``text`` (and which ends by
    ``end``) does not read as NCCL's format, and where: ``(reason, position)``. The fields
    are read in order; the first one missing or malformed is named."""
    pos = colon
    for name, pattern, want in _COLL_FIELD_RES:
        m = pattern.match(text, pos, end)
        if m is None:
            word = name.strip("[]=")
            got = text.find(" " + word + " ", pos, end) if name != "stream" else -1
            if got < 0 and name != "stream":
                got = text.find(word, pos, end)
            where = pos if got < 0 else got + (name != "stream")
            if got < 0:
                return f"field {name!r} missing where NCCL prints it", pos
            return f"field {name!r} is not followed by {want}", where
        pos = m.end()
    return "fields not in NCCL's format", colon


# ------------------------------------------------------------------ long lines

#: Lines of more UTF-8 bytes than this that hold non-ASCII characters are read as
#: :class:`ByteLine` (one character per byte), by the file reader and the per-line API alike.
LONG_LINE = 1 << 16
#: Bytes decoded at a time when a long line's UTF-8 is checked.
_PIECE = 1 << 18


class ByteLine:
    """A long line's UTF-8 bytes as Latin-1 text (``text``): one character per byte, so that
    Python holds it in one byte per byte (decoded as UTF-8, a line holding one character
    beyond U+FFFF takes four bytes per character, and the decoder briefly more). Every field
    the parser reads is ASCII and every pattern is ``re.ASCII``, so it reads such a line as
    it reads the decoded one; the texts it keeps (hosts, pointers, excerpts) are decoded back
    (:func:`from_byte_text`). Column and width of excerpts count bytes.

    ``invalid``: ``None``, or ``(column, byte, excerpt)`` of the line's first invalid
    UTF-8 byte (a character column, as for other lines)."""

    __slots__ = ("text", "invalid")

    def __init__(self, text: str, invalid: tuple | None = None):
        self.text, self.invalid = text, invalid

    @classmethod
    def from_bytes(cls, data) -> ByteLine:
        """The line of UTF-8 ``data`` (a bytes-like object), its UTF-8 checked a
        :data:`_PIECE` at a time."""
        view = memoryview(data)
        pos = chars = 0
        n = len(view)
        while pos < n:
            piece = view[pos:pos + _PIECE]
            final = pos + _PIECE >= n
            try:
                text, used = codecs.utf_8_decode(piece, "strict", final)
            except UnicodeDecodeError as exc:
                chars += len(codecs.utf_8_decode(piece[:exc.start], "strict", True)[0])
                at = pos + exc.start
                lo = max(0, at - EXCERPT_CHARS)
                while lo < at and 0x80 <= view[lo] < 0xC0:  # start on a character
                    lo += 1
                window = str(view[lo:at + EXCERPT_CHARS], "utf-8", "surrogateescape")
                j = len(str(view[lo:at], "utf-8", "surrogateescape"))
                return cls("", (chars + 1, view[at], excerpt(window, j)))
            chars += len(text)
            del text
            if not used and not final:  # pragma: no cover - a piece holds whole characters
                break
            pos += used
        return cls(str(view, "latin-1"))


def from_byte_text(text: str) -> str:
    """A text cut from a :class:`ByteLine`, decoded back (a character cut at its edge reads
    as U+FFFD). Characters beyond U+00FF in it were added by the parser (an excerpt's
    ``…``), not read from the line: they stay."""
    if text.isascii():
        return text
    return _HIGH_RUN_RE.sub(lambda m: m.group().encode("latin-1").decode("utf-8", "replace"),
                            text)


_HIGH_RUN_RE = re.compile("[\x80-\xff]+")


#: A UTF-8 byte-order mark as a :class:`ByteLine` holds it.
BOM_BYTES = "\xef\xbb\xbf"

