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
``NCCL INFO `` anywhere in a physical line, never anchored at column 0. A COLL message whose
prefix was lost is found by its ``<Op>: opCount`` (:func:`coll_heads`).

Every pattern here runs in linear time on any line: searches start at a literal or a
bounded class, and the three whose plain ``search`` backtracks quadratically on long runs
(the prefix, the INIT line, the PyTorch comm line) are read by :func:`match_prefix`,
:func:`match_init` and a name class that stops at brackets. Fields are ASCII
(``re.ASCII``): NCCL prints ASCII digits, and numbers too long for ``int`` read as
:data:`OVERSIZED` (:func:`decimal`).
"""

from __future__ import annotations

import bisect
import calendar
import re

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
    r"([A-Za-z]+): opCount ([0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ count (\d+)"
    r" datatype (\d+) op (\d+) root (-?\d+) comm ([^\s\[]+)"
    r"(?: \[nranks=(\d+)\])?( stream(?: (?:0x[0-9a-fA-F]+|\(nil\)))?)?", re.ASCII
)

#: Fast path: a whole physical line that is one plain, complete COLL record with a
#: ``host:pid:tid [dev] `` prefix at column 0 (the shape of almost every line of a per-process
#: NCCL_DEBUG_FILE). Groups: the prefix ``host:pid:tid [dev] ``, then as :data:`COLL_RE` minus
#: the stream. Any line it does not match takes the general path, which yields the same record.
#: Numbers are bounded (19 digits) so that ``int`` never sees an oversized text here.
FAST_COLL_LINE_RE = re.compile(
    r"([^\s\[\]:]+:\d{1,19}:\d{1,19} \[\d{1,19}\] )NCCL INFO ([A-Za-z]+): opCount "
    r"([0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ count (\d{1,19}) datatype (\d{1,19}) "
    r"op (\d{1,19}) root (-?\d{1,19}) comm ([^\s\[]+) (?:\[nranks=(\d{1,19})\] )?"
    r"stream (?:0x[0-9a-fA-F]+|\(nil\))[ \t]*\r?\n?\Z", re.ASCII
)

#: RE2 pattern (``pyarrow.compute.match_substring_regex``) of a *fast* line of the columnar
#: reader (:mod:`tracer.nccl.columns`): one physical line, ended by ``\n``, that is exactly one
#: complete COLL record with a supported op and a known datatype, optionally the 2.26+
#: ``[YYYY-mm-dd HH:MM:SS[.frac]] `` timestamp, then ``host:pid:tid [dev] `` at column 0, single
#: spaces between fields, trailing blanks only. Every field is ASCII and space-free, so the
#: reader splits such a line at spaces; numbers are bounded so that they fit the event schema
#: (count < 10**16, so msg_bytes fits int64; root, nranks, cudaDev < 10**9). The general
#: path reads any line it accepts to the same record (tested); every other line takes it.
FAST_COLL_LINE_RE2 = (
    r"^(?:\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?\] )?"
    r"[A-Za-z0-9_.\-]+:[0-9]{1,18}:[0-9]+ \[[0-9]{1,9}\] NCCL INFO "
    r"(?:" + "|".join(sorted(NCCL_OP_NAMES, key=lambda k: (-len(k), k))) + r"): opCount "
    r"[0-9a-fA-F]+ sendbuff (?:0x[0-9a-fA-F]+|\(nil\)) recvbuff (?:0x[0-9a-fA-F]+|\(nil\)) "
    r"count [0-9]{1,16} datatype (?:"
    + "|".join(sorted(map(str, NCCL_DATATYPES), key=lambda k: (-len(k), k)))
    + r") op [0-9]+ root -?[0-9]{1,9} comm 0x[0-9a-fA-F]+ (?:\[nranks=[0-9]{1,9}\] )?"
    r"stream (?:0x[0-9a-fA-F]+|\(nil\))[ \t]*\n$"
)

#: :data:`NCCL_DATATYPES` keyed by the decimal text as logged.
NCCL_DATATYPES_BY_TEXT: dict[str, str] = {str(k): v for k, v in NCCL_DATATYPES.items()}

#: Start of any COLL message, complete or not: ``<Op>: opCount ``.
COLL_HEAD_RE = re.compile(r"([A-Za-z]+): opCount\b", re.ASCII)

#: The text after a COLL op name. A COLL record whose ``host:pid:tid [dev] NCCL INFO `` prefix
#: was lost (interleaved stdout) is found by this text, see :func:`coll_heads`.
OPCOUNT_MARK = ": opCount"

#: Letters that may end an op name right before :data:`OPCOUNT_MARK` (reading backwards at
#: most this many: longer runs hold text glued before the op name, which
#: :func:`lost_op_name` reads from its end).
_OP_RUN_MAX = 64
_OP_RUN_END_RE = re.compile(r"(?<![A-Za-z])[A-Za-z]+\Z")
_OP_RUN_RE = re.compile(r"[A-Za-z]+")
_WORD_CHAR_RE = re.compile(r"\w", re.ASCII)


def coll_heads(line: str, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
    """``(op_start, colon)`` of every ``<letters>: opCount`` (:data:`COLL_HEAD_RE`) in
    ``line[lo:hi]``, in order: ``colon`` is where :data:`OPCOUNT_MARK` starts, ``op_start``
    where the run of ASCII letters before it starts (at most :data:`_OP_RUN_MAX` letters back,
    never before ``lo`` or the previous head). Linear time: ``str.find`` plus a bounded
    backward read per head."""
    hi = len(line) if hi is None else hi
    out: list[tuple[int, int]] = []
    mark, n = OPCOUNT_MARK, len(OPCOUNT_MARK)
    floor = lo
    i = line.find(mark, lo, hi)
    while i >= 0:
        after = i + n
        if after >= len(line) or not _WORD_CHAR_RE.match(line, after):  # "\b" after opCount
            m = _OP_RUN_END_RE.search(line, max(floor, i - _OP_RUN_MAX), i)
            if m is not None:
                out.append((m.start(), i))
                floor = after
        i = line.find(mark, after, hi)
    return out


def op_run_end(line: str, start: int) -> int:
    """End of the run of ASCII letters at ``start`` (``start`` itself when there is none)."""
    m = _OP_RUN_RE.match(line, start)
    return start if m is None else m.end()


#: Op names a COLL line may carry (:data:`NCCL_OP_NAMES` and :data:`UNSUPPORTED_OP_NAMES`).
KNOWN_OP_NAMES: frozenset[str] = frozenset(NCCL_OP_NAMES) | UNSUPPORTED_OP_NAMES


def lost_op_name(run: str) -> tuple[str | None, list[str]]:
    """The op name of a COLL record that lost its prefix, from the letters before
    ``: opCount`` (``run``), which may carry text glued before the name (``"stepAllGather"``).

    Returns ``(name, candidates)``: ``run`` itself when it is a known op name (or no known name
    ends it: an unknown op); else the one known name that ends it; ``(None, names)`` when
    several do (``"xAllReduce"`` may be ``AllReduce`` or ``Reduce`` after ``"xAll"``).
    """
    if run in KNOWN_OP_NAMES:
        return run, [run]
    names = sorted((n for n in KNOWN_OP_NAMES if run.endswith(n)), key=len, reverse=True)
    if not names:
        return run, []
    return (names[0], names) if len(names) == 1 else (None, names)


#: INIT / DESTROY message, every version: optional init function name (2.21+), then
#: ``comm %p rank %d nranks %d cudaDev %d`` ... ``- Init START|COMPLETE`` or
#: ``- Destroy COMPLETE`` / ``- Abort COMPLETE``. The middle (nvmlDev, busId, commId,
#: parent, splitCount / childCount, color, key) is read by :data:`INIT_FIELD_RE`. This single
#: regex is the *definition* (kept for reference and tests); a backtracking search with it is
#: quadratic on a line repeating ``comm … cudaDev 0`` or ``nccl``, so lines are read by
#: :func:`match_init`, which returns the same groups in linear time.
INIT_RE = re.compile(
    r"(?:(nccl\w+) )?comm (\S+) rank (-?\d+) nranks (\d+) cudaDev (-?\d+)(.*?) ?- "
    r"(Init|Destroy|Abort) (START|COMPLETE)", re.ASCII
)
_INIT_HEAD_RE = re.compile(r"comm (\S+) rank (-?\d+) nranks (\d+) cudaDev (-?\d+)", re.ASCII)
_INIT_END_RE = re.compile(r"- (Init|Destroy|Abort) (START|COMPLETE)")
_WORD_RUN_RE = re.compile(r"\w+", re.ASCII)


def match_init(body: str) -> tuple | None:
    """Groups of the leftmost :data:`INIT_RE` match in ``body`` (``None``: no match), in
    linear time: heads (``comm … cudaDev N``) and end markers (``- Init COMPLETE`` …) are
    found separately; the first head followed by an end marker wins, with the lazy middle
    ending at the first marker after it (a space before the marker is not part of it), and
    the init function read from the word before the head."""
    if "\n" in body:  # "." does not cross a line end: each piece on its own
        for piece in body.split("\n"):
            groups = match_init(piece)
            if groups is not None:
                return groups
        return None
    ends = [m.start() for m in _INIT_END_RE.finditer(body)]
    if not ends:
        return None
    for head in _INIT_HEAD_RE.finditer(body):
        stop = head.end()
        if stop > ends[-1]:
            return None
        p = ends[bisect.bisect_left(ends, stop)]
        end = _INIT_END_RE.match(body, p)
        rest = body[stop:p - 1] if p - 1 >= stop and body[p - 1] == " " else body[stop:p]
        return (_init_func(body, head.start()), *head.groups(), rest, *end.groups())
    return None


def _init_func(body: str, at: int) -> str | None:
    """``nccl\\w+`` ending right before ``" comm"`` at ``at``: from the leftmost ``nccl`` of
    that word with at least one word character after it."""
    if at < 2 or body[at - 1] != " ":
        return None
    m = _WORD_RUN_RE.match(body[at - 2::-1])  # the word before, read backwards
    if m is None:
        return None
    word = body[at - 1 - m.end():at - 1]
    i = word.find("nccl")
    return word[i:] if 0 <= i < len(word) - 4 else None


#: Optional ``name value`` fields inside an INIT line.
INIT_FIELD_RE = re.compile(r"\b(commId|parent|splitCount|childCount|color|key|busId) (\S+)",
                           re.ASCII)

#: Markers of messages that must parse as INIT / DESTROY lines (otherwise: an issue).
INIT_MARKERS = ("- Init START", "- Init COMPLETE", "Init START", "Init COMPLETE",
                "Destroy COMPLETE", "Abort COMPLETE")

#: Prefix before ``NCCL INFO``: optional ``[timestamp] ``, optional ``host:pid:tid ``,
#: optional ``[cudaDev] ``, anchored at the marker. Host is ``[^\s\[\]]`` characters; when
#: another rank's line ends without a newline right before it (interleaved output), the host
#: may carry that line's last characters (e.g. ``0x55f1ubuntu``): NCCL writes no separator.
#: This regex is the *definition* (its leftmost ``search`` match); :func:`match_prefix` gives
#: the same groups in linear time (a ``search`` visits every start of a long blob before the
#: marker, and with a lazy host that is quadratic).
PREFIX_RE = re.compile(
    r"(?:\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)\] )?"
    r"(?:([^\s\[\]]+?):(\d+):(\d+) ?)?(?:\[(-?\d+)\] ?)?\Z", re.ASCII
)
#: :data:`PREFIX_RE` read backwards from the marker (matched at the start of the reversed
#: text): ``[dev] ?``, then ``host:pid:tid ?`` (the greedy host run reaches where the leftmost
#: match's lazy host starts: the start of its run), then ``[timestamp] ``. Groups reversed.
_PREFIX_REV_RE = re.compile(
    r"(?: ?\](\d+-?)\[)?"
    r"(?: ?(\d+):(\d+):([^\s\[\]]+))?"
    r"(?: \]((?:\d+[.,])?\d\d:\d\d:\d\d[ T]\d\d-\d\d-\d{4})\[)?", re.ASCII
)


def match_prefix(text: str) -> tuple:
    """``(timestamp, host, pid, tid, cuda_dev)`` texts (or ``None``) of :data:`PREFIX_RE`'s
    leftmost match in ``text``, in linear time: one anchored match of the reversed text."""
    dev, tid, pid, host, ts = _PREFIX_REV_RE.match(text[::-1]).groups()
    rev = (lambda g: g[::-1] if g is not None else None)
    return rev(ts), rev(host), rev(pid), rev(tid), rev(dev)


#: PyTorch ProcessGroupNCCL (glog) line naming a comm pointer, for example
#: ``I0527 15:16:57.738664 58629 ProcessGroupNCCL.cpp:2183] [PG 0 (default_pg) Rank 5]
#: ProcessGroupNCCL created ncclComm_ 0x555b8d27b370 on CUDA device: <index>``.
#: Also the newer ``[PG ID 0 PG GUID 0(default_pg) Rank 0]`` prefix. The index is printed
#: as a raw character (``c10::DeviceIndex`` is an ``int8_t``), see :func:`decode_torch_device`.
#: The group name holds no parenthesis or bracket: each repetition stops at the next one, so
#: a search is linear on any line (a name with brackets makes the line an issue).
TORCH_COMM_RE = re.compile(
    r"\[PG (?:ID )?([^\s\]()]+)(?: PG GUID ([^\s\]()]+))? ?(?:\(([^()\[\]]*)\))? Rank (\d+)\]"
    r" ProcessGroupNCCL created ncclComm_ (\S+) on CUDA device:", re.ASCII
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


def timestamp_ns(text: str) -> int:
    """``YYYY-mm-dd HH:MM:SS[.frac]`` (NCCL 2.26+ ``NCCL_DEBUG_TIMESTAMP_FORMAT`` default
    ``[%F %T] ``) as integer ns since the Unix epoch, reading the wall clock as UTC (the log
    does not name its zone: use the value for ordering and differences).

    Raises:
        ValueError: ``text`` is not in that format, or not a time that int64 ns since the
            epoch can hold (1677-09-21 to 2262-04-11).
    """
    date, _, clock = text.replace("T", " ").partition(" ")
    try:
        year, month, day = (int(x) for x in date.split("-"))
        hms, _, frac = clock.replace(",", ".").partition(".")
        hour, minute, second = (int(x) for x in hms.split(":"))
    except ValueError as exc:
        raise ValueError(
            f"Invalid NCCL timestamp {text=}. Must be 'YYYY-mm-dd HH:MM:SS[.frac]'."
        ) from exc
    seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    frac_ns = int((frac + "000000000")[:9]) if frac else 0
    ns = seconds * 1_000_000_000 + frac_ns
    if not -(2**63) <= ns < 2**63:
        raise ValueError(f"Invalid NCCL timestamp {text=}. Must lie between 1677-09-21 and "
                         "2262-04-11 (int64 ns since the epoch).")
    return ns


def decode_torch_device(tail: str) -> int | None:
    """CUDA device index from the text after ``on CUDA device:`` in a PyTorch line.

    PyTorch streams a ``c10::DeviceIndex`` (``int8_t``) into the log, so the index appears as
    a raw byte: ``"\\x03"`` is device 3. ASCII decimal digits are accepted too (below 2**31).
    Bytes 0x09-0x0d (device 9-13) are whitespace and cannot be told from line ends; they and
    an empty or altered tail decode to ``None``.
    """
    text = tail[1:] if tail.startswith(" ") else tail
    text = text.rstrip("\r\n")
    digits = text.strip()
    if digits.isascii() and digits.isdigit():
        number = decimal(digits)
        return number if number < 2**31 else None
    if len(text) == 1 and (ord(text) < 9 or 14 <= ord(text) < 32):
        return ord(text)
    return None
