"""Columnar reading of NCCL_DEBUG=INFO logs: blocks of lines, and the COLL fields of their
*fast* lines as numpy arrays (the hot path of :mod:`tracer.nccl.table`).

A :class:`LineBlock` is a run of physical lines as one UTF-8 buffer, each line ended by
``\\n``. Files are read in binary chunks cut after a line end (:func:`file_blocks`), with the
line ends Python's text mode would see (``\\r\\n`` and a lone ``\\r`` end a line),
decompressed when gzip (by the first bytes, any name); a line longer than :data:`LONG_LINE`
is a block of its own. In-memory ``(name, lines)`` inputs are packed :data:`BLOCK_LINES` lines
at a time (:func:`line_blocks`), one element one line. :func:`expand_paths` leaves out, and
names with their reason, files that are not logs (:func:`skip_reason`); reading that stops
part-way (a truncated gzip) raises :class:`InputReadError` after the lines before it.

:func:`fast_coll_fields` finds the fast lines of a block with one RE2 pass
(:data:`tracer.nccl.formats.FAST_COLL_LINE_RE2`), then cuts their fields at spaces with numpy
(such a line has a fixed field order) and converts numbers in bulk. Every other line is for
the general per-line path (:class:`tracer.nccl.records.LineParser`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from gzip import GzipFile as _GzipFile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracer.events import OPS, ROOTED_OPS
from tracer.inputs import GZIP_ERRORS, folder_entries, gzip_problem, is_gzip, not_regular
from tracer.nccl import formats as fmt

#: Bytes read per chunk of a file (a block is this plus the rest of its last line).
CHUNK_BYTES = 2 << 20
#: Lines per block of an in-memory ``(name, lines)`` input.
BLOCK_LINES = 1024

_NL, _SP, _LBRACKET, _DOT, _ZERO, _MINUS = 10, 32, ord("["), ord("."), ord("0"), ord("-")
#: Null in the int64 arrays of :class:`FastFields`.
NULL = np.iinfo(np.int64).min


@dataclass(slots=True)
class LineBlock:
    """Physical lines ``first_line_no ...`` of one input.

    ``data`` (bytes or bytearray): the lines as UTF-8, each ended by ``\\n`` (a line end
    inside an in-memory line is replaced by NUL here, so it is never a fast line);
    ``starts``: int64 (lines + 1,), line ``i`` is ``data[starts[i]:starts[i + 1] - 1]``;
    ``lines``: the original strings of an in-memory input (the general path reads those),
    else ``None``.
    """

    data: bytes | bytearray
    starts: np.ndarray
    first_line_no: int
    lines: list[str] | None = None

    def __len__(self) -> int:
        return len(self.starts) - 1

    def text(self, i: int) -> str:
        """Line ``i`` as the general path reads it (files: decoded with
        ``errors="surrogateescape"``, so an invalid byte reaches it as a lone surrogate and the
        line becomes an issue, see :func:`tracer.nccl.records.invalid_utf8_issue`)."""
        if self.lines is not None:
            return self.lines[i]
        view = memoryview(self.data)[self.starts[i]:self.starts[i + 1] - 1]
        if len(view) > fmt.LONG_LINE and np.frombuffer(view, np.uint8).max() >= 0x80:
            return fmt.ByteLine.from_bytes(view)  # one byte a character, see ByteLine
        return str(view, "utf-8", "surrogateescape")  # decoded in place: no copy


#: Bytes of a file's start (decompressed, for gzip) read to tell text from binary.
SNIFF_BYTES = 8192
#: Text that makes a file with NUL bytes in its first :data:`SNIFF_BYTES` an NCCL log still
#: (a crash can leave a zero-filled block in a log): it is read, NUL runs are foreign text.
NCCL_TEXT = (b"NCCL INFO", b": opCount")
#: What reading a file can raise (gzip: a truncated or damaged stream too).
READ_ERRORS = GZIP_ERRORS


class InputReadError(OSError):
    """Reading a file stopped before its end (a truncated or damaged gzip stream, an I/O
    error): ``line_no`` is the line where it stopped; the lines before it were read."""

    def __init__(self, path, line_no: int, reason: str):
        super().__init__(f"reading stopped at line {line_no}: {reason}")
        self.path, self.line_no, self.reason = str(path), line_no, reason


def open_input(path: str | Path):
    """``path`` opened for binary reading, decompressed when it is gzip (by its first bytes,
    whatever its name)."""
    return _GzipFile(path, "rb") if is_gzip(path) else open(path, "rb", buffering=0)


def skip_reason(path: Path) -> str | None:
    """Why ``path`` is not read as an NCCL log, or ``None`` when it is: not a regular file
    (:func:`tracer.inputs.not_regular`), unreadable, a gzip stream damaged at its start, or
    binary (a NUL byte in its first :data:`SNIFF_BYTES`, decompressed, and no
    :data:`NCCL_TEXT` there)."""
    reason = not_regular(path)
    if reason is not None:
        return reason
    try:
        f = open_input(path)
    except READ_ERRORS as exc:
        return f"cannot read ({gzip_problem(exc)})"
    with f:
        head, error = read_chunk(f, SNIFF_BYTES)
    if error is not None and not head:  # a damaged start: nothing to read at all
        return f"cannot read ({error})"
    nul = head.find(b"\0")
    if nul >= 0 and not any(t in head for t in NCCL_TEXT):
        where = "of its decompressed text " if isinstance(f, _GzipFile) else ""
        return (f"binary (a NUL byte at offset {nul:,d} {where}and no NCCL text in its first "
                f"{SNIFF_BYTES // 1024} KiB)")
    return None  # a stream damaged later is read up to the damage (file_blocks)


def read_chunk(f, size: int) -> tuple[bytes, str | None]:
    """Up to ``size`` bytes of ``f`` (fewer at its end), and why reading stopped early
    (``None``: it did not). A gzip stream is read a piece at a time (``read1``), so the
    text before a truncated or damaged part is returned, not lost with the error."""
    if not isinstance(f, _GzipFile):
        try:
            return f.read(size), None
        except READ_ERRORS as exc:
            return b"", gzip_problem(exc)
    pieces, n = [], 0
    while n < size:
        try:
            piece = f.read1(size - n)
        except READ_ERRORS as exc:
            return b"".join(pieces), gzip_problem(exc)
        if not piece:
            break
        pieces.append(piece)
        n += len(piece)
    return b"".join(pieces), None


def expand_paths(paths: Sequence[str | os.PathLike], *, glob: str | None = None,
                 skipped: list | None = None) -> list[Path]:
    """Files named by ``paths`` that are read as NCCL logs: files as given; directories
    recursively, every non-hidden entry (NCCL_DEBUG_FILE names have no fixed extension),
    filtered by ``glob`` (e.g. ``"*.log"``) if given, sorted by path. Gzip files (by their
    first bytes) are read decompressed.

    A file that cannot be read as a log (:func:`skip_reason`: binary such as Parquet or
    SQLite, unreadable, not a regular file) is left out and, when ``skipped`` is given,
    appended to it as ``(path, reason)``; otherwise a ``ValueError`` names it.

    Raises:
        ValueError: a path does not exist; a file is skipped and ``skipped`` is ``None``.
    """
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = folder_entries(p, recursive=True, glob=glob or "*")
        elif p.exists() or p.is_symlink():
            found = [p]
        else:
            raise ValueError(f"Invalid NCCL log path {str(p)!r}. Must be an existing file or "
                             "directory.")
        for q in found:
            reason = skip_reason(q)
            if reason is None:
                out.append(q)
            elif skipped is None:
                raise ValueError(f"Invalid NCCL log {str(q)!r}: {reason}. Must be a text "
                                 "file (or gzip of one).")
            else:
                skipped.append((str(q), reason))
    return out


def sources(paths, skipped: list | None = None) -> Iterator[tuple[str, Iterator[LineBlock]]]:
    """``(name, blocks)`` per input: a path, a sequence of paths (directories expanded by
    :func:`expand_paths`, which appends files it leaves out to ``skipped``), or ``(name,
    lines)`` pairs. A file's blocks raise :class:`InputReadError` where reading stops early,
    after the blocks of the lines before."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    for item in paths:
        if isinstance(item, tuple):
            name, lines = item
            yield name, line_blocks(lines)
            continue
        for path in expand_paths([item], skipped=skipped):
            yield str(path), file_blocks(path)


def _block(data: bytes | bytearray, first_line_no: int,
           lines: list[str] | None = None) -> LineBlock:
    view = np.frombuffer(data, np.uint8)
    piece = 1 << 20  # line ends found a MiB at a time: no mask as long as a long line
    nl = np.concatenate([np.flatnonzero(view[k:k + piece] == _NL) + k
                         for k in range(0, len(view), piece)] or [np.zeros(0, np.int64)])
    starts = np.empty(len(nl) + 1, np.int64)
    starts[0] = 0
    starts[1:] = nl + 1
    return LineBlock(data, starts, first_line_no, lines)


def _universal_newlines(data: bytes | bytearray) -> bytes | bytearray:
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return data


#: Lines longer than this many bytes are blocks of their own (no other line's columnar pass
#: looks at their bytes, see :func:`fast_coll_fields`); non-ASCII ones are read as
#: :class:`tracer.nccl.formats.ByteLine`.
LONG_LINE = fmt.LONG_LINE


def file_blocks(path: str | Path, chunk_bytes: int | None = None) -> Iterator[LineBlock]:
    """Blocks of the file at ``path`` (decompressed when gzip), in order, read
    ``chunk_bytes`` (default :data:`CHUNK_BYTES`) at a time; a line longer than
    :data:`LONG_LINE` is a block of its own. Memory: one chunk plus its longest line.

    Raises:
        InputReadError: reading stopped early (after the blocks of the lines before it, and
            the partial line it stopped in as a last block).
    """
    size = chunk_bytes or CHUNK_BYTES
    line_no = 1
    buf = bytearray()
    error = None
    try:
        f = open_input(path)
    except READ_ERRORS as exc:
        raise InputReadError(path, 1, gzip_problem(exc)) from None
    with f:
        while True:
            start = len(buf)
            chunk, error = read_chunk(f, size)
            buf += chunk
            if error is not None or not chunk:
                break
            del chunk
            # cut after the last line end; a final "\r" may be half of "\r\n": keep it
            cut = max(buf.rfind(b"\n", start), buf.rfind(b"\r", start, len(buf) - 1)) + 1
            if cut == 0:  # no line end yet: a line longer than a chunk, read on
                continue
            rest = buf[cut:]
            del buf[cut:]
            for block in _split_long(_universal_newlines(buf), line_no):
                line_no += len(block)
                yield block
            buf = rest
    if buf:
        data = _universal_newlines(buf)
        yield from _split_long(data if data.endswith(b"\n") else data + b"\n", line_no)
        line_no += data.count(b"\n") + (not data.endswith(b"\n"))
    if error is not None:
        raise InputReadError(path, max(line_no - 1, 1), error)


def _split_long(data: bytes | bytearray, first_line_no: int) -> Iterator[LineBlock]:
    """``data`` (whole lines) as one block, or, when a line is longer than
    :data:`LONG_LINE`, as blocks where each such line stands alone."""
    block = _block(data, first_line_no)
    if len(data) <= LONG_LINE:
        yield block
        return
    lengths = np.diff(block.starts)
    long = np.flatnonzero(lengths > LONG_LINE)
    if not len(long):
        yield block
        return
    view = memoryview(data)
    cuts = sorted({0, len(block), *long.tolist(), *(long + 1).tolist()})
    for a, b in zip(cuts, cuts[1:]):
        lo, hi = int(block.starts[a]), int(block.starts[b])
        yield LineBlock(view[lo:hi], block.starts[a:b + 1] - lo, first_line_no + a)


def line_blocks(lines: Iterable[str], block_lines: int | None = None) -> Iterator[LineBlock]:
    """Blocks of ``block_lines`` (default :data:`BLOCK_LINES`) lines of an in-memory stream;
    each element of ``lines`` is one physical line. Lone surrogates (``errors=
    "surrogateescape"`` text), which Arrow cannot hold, are replaced by U+FFFD in the block's
    buffer (so such a line is never fast); the general path reads the original strings."""
    it = iter(lines)
    line_no = 1
    while batch := list(itertools.islice(it, block_lines or BLOCK_LINES)):
        text = "".join(batch)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            data = text.encode("utf-8")
        if not (text.count("\n") == len(batch) and "\r" not in text
                and all(map(str.endswith, batch, itertools.repeat("\n")))):
            data = "".join(map(_one_line, batch)).encode("utf-8", "surrogatepass")
            data = data.decode("utf-8", "replace").encode("utf-8")
        yield _block(data, line_no, batch)
        line_no += len(batch)


def _one_line(line: str) -> str:
    """``line`` as one ``\\n``-ended line: its own line end dropped as the general path drops
    it, any other CR / LF turned into NUL."""
    if line.endswith("\n"):
        line = line[:-2] if line.endswith("\r\n") else line[:-1]
    if "\n" in line or "\r" in line:
        line = line.replace("\n", "\0").replace("\r", "\0")
    return line + "\n"


@dataclass(slots=True)
class FastFields:
    """The COLL fields of the fast lines of one block (arrays of length rows).

    ``line``: int64 line index in the block; ``prefix``: int64 index into ``prefixes``
    (``"host:pid:tid [dev]"`` texts); ``op``: int64 index into :data:`tracer.events.OPS`;
    ``count``: int64 elements per rank; ``datatype``: int64 NCCL enum; ``root``: int64;
    ``comm``: int64 index into ``comms``; ``nranks``: int64, :data:`NULL` where the line has no
    ``[nranks=]``; ``t_ns``: int64 ns since the epoch (UTC) with ``t_valid`` (bool), or both
    ``None`` when no line of the block has a timestamp; ``t_bad``: the lines whose
    timestamp cannot be read (an impossible date: an issue, see
    :func:`tracer.nccl.formats.timestamp_problem`).
    """

    line: np.ndarray
    prefix: np.ndarray
    prefixes: list[str]
    op: np.ndarray
    count: np.ndarray
    datatype: np.ndarray
    root: np.ndarray
    comm: np.ndarray
    comms: list[str]
    nranks: np.ndarray
    t_ns: np.ndarray | None
    t_valid: np.ndarray | None
    t_bad: np.ndarray | None = None  # a timestamp is there but cannot be read

    def take(self, lo: int, hi: int) -> FastFields | None:
        """Rows ``lo:hi`` (views; ``None`` when empty)."""
        if hi <= lo:
            return None
        cut = (lambda a: None if a is None else a[lo:hi])
        return FastFields(self.line[lo:hi], self.prefix[lo:hi], self.prefixes, self.op[lo:hi],
                          self.count[lo:hi], self.datatype[lo:hi], self.root[lo:hi],
                          self.comm[lo:hi], self.comms, self.nranks[lo:hi], cut(self.t_ns),
                          cut(self.t_valid), cut(self.t_bad))


def _strings(data, begs: np.ndarray, ends: np.ndarray) -> list[pa.Array]:
    """``data[begs[i, j]:ends[i, j]]`` as one Arrow string array per column ``j`` (no Python
    string per value: the spans become offsets of one array, every other value taken)."""
    rows, cols = begs.shape
    offsets = np.empty(2 * rows * cols + 1, np.int64)
    offsets[0:-1:2] = begs.ravel()
    offsets[1::2] = ends.ravel()
    offsets[-1] = offsets[-2]
    spans = pa.LargeStringArray.from_buffers(2 * rows * cols, pa.py_buffer(offsets),
                                             pa.py_buffer(data))
    idx = pa.array(np.arange(rows, dtype=np.int64) * (2 * cols))
    return [spans.take(pc.add(idx, 2 * j)) for j in range(cols)]


def _dict(arr: pa.Array) -> tuple[np.ndarray, list[str]]:
    """Codes (int64, by first appearance) and distinct values of a string array."""
    enc = arr.dictionary_encode()
    return (enc.indices.to_numpy(zero_copy_only=False).astype(np.int64),
            enc.dictionary.to_pylist())


_POW10 = 10 ** np.arange(19, dtype=np.int64)


def _words(data) -> np.ndarray:
    """``data`` as overlapping little-endian uint64: ``words[k]`` holds bytes ``k .. k+7``."""
    return np.ndarray((len(data) - 7,), "<u8", buffer=data, strides=(1,))


#: ``_HIGH_BYTES[k]``: a uint64 mask of its k high bytes (the last k of 8 little-endian bytes).
_HIGH_BYTES = np.array([~((1 << (8 * (8 - k))) - 1) & (2**64 - 1) for k in range(9)],
                       np.uint64)


def _eight_digits(x: np.ndarray) -> np.ndarray:
    """Values of 8 ASCII digits (or NUL bytes, read as 0) packed in uint64s, first digit in
    the low byte: the low nibbles, then digit pairs, quads and all eight, one multiply each
    (Lemire, "Fast numeric string to int", 2018). uint64 arithmetic wraps by design."""
    x = (x & np.uint64(0x0F0F0F0F0F0F0F0F)) * np.uint64(10 * 2**8 + 1) >> np.uint64(8)
    x = (x & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(100 * 2**16 + 1) >> np.uint64(16)
    return (x & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(10000 * 2**32 + 1) >> np.uint64(32)


def _uints(words: np.ndarray, begs: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """int64 values of the ASCII decimal digits ``data[begs[i]:ends[i]]`` (:func:`_words` of
    ``data``; 1 to 16 digits, checked by the fast pattern, with at least 16 bytes of the block
    before ``ends``). The 16 bytes before ``ends`` are read as two words, the bytes before
    ``begs`` masked off."""
    width = ends - begs
    value = _eight_digits(words[ends - 8] & _HIGH_BYTES[np.minimum(width, 8)])
    if width.max(initial=0) > 8:  # the digits before the last 8
        high = words[ends - 16] & _HIGH_BYTES[np.clip(width - 8, 0, 8)]
        value += _eight_digits(high) * np.uint64(10**8)
    return value.astype(np.int64)


def _op_lookup() -> tuple[int, np.ndarray]:
    """NCCL op names (without ``:``) told apart by (length, one character): the character
    position and a table (length * 256 + byte) -> index into :data:`tracer.events.OPS`."""
    names = list(fmt.NCCL_OP_NAMES)
    for pos in range(min(map(len, names))):
        keys = {len(n) * 256 + ord(n[pos]): OPS.index(fmt.NCCL_OP_NAMES[n]) for n in names}
        if len(keys) == len(names):
            table = np.full((max(map(len, names)) + 1) * 256, -1, np.int64)
            table[list(keys)] = list(keys.values())
            return pos, table
    raise AssertionError(f"NCCL op names {names} need a longer key")  # pragma: no cover


_OP_POS, _OP_TABLE = _op_lookup()

# Token j of a fast line (0 = "host:pid:tid") ends at the (base + j)-th space of the block:
# 1 "[dev]", 20 comm; 4 "<Op>:", 12 count, 14 datatype, 18 root, 21 "[nranks=N]" or "stream".
_TOKENS = np.array([1, 20, 4, 12, 14, 18, 21])


#: Indices into OPS of the ops whose root is checked against the group size.
_ROOTED = np.array(sorted(OPS.index(o) for o in ROOTED_OPS))


def fast_coll_fields(block: LineBlock) -> FastFields | None:
    """Fields of the block's fast lines, or ``None`` when it has none."""
    data, starts = block.data, block.starts
    lines = pa.LargeStringArray.from_buffers(len(block), pa.py_buffer(starts),
                                             pa.py_buffer(data))
    ok = pc.match_substring_regex(lines, fmt.FAST_COLL_LINE_RE2)
    line = np.flatnonzero(ok.to_numpy(zero_copy_only=False))
    if not len(line):
        return None
    short = starts[line + 1] - starts[line] <= fmt.FAST_LINE_MAX
    if not short.all():
        line = line[short]
        if not len(line):
            return None
    buf = np.frombuffer(data, np.uint8)
    st = starts[line]
    spaces = np.flatnonzero(buf == _SP)
    first = np.searchsorted(spaces, st)  # the first space of each fast line
    has_ts = buf[st] == _LBRACKET  # "[date time] " holds two spaces
    base = first + 2 * has_ts
    ends = spaces[base[:, None] + _TOKENS]
    begs = spaces[base[:, None] + _TOKENS - 1] + 1
    begs[:, 0] = np.where(has_ts, spaces[first + 1] + 1, st)  # prefix: host ... "[dev]"
    (prefix_idx, prefixes), (comm_idx, comms) = map(_dict, _strings(data, begs[:, :2],
                                                                    ends[:, :2]))
    op_len = ends[:, 2] - begs[:, 2] - 1  # "<Op>:"
    op = _OP_TABLE[op_len * 256 + buf[begs[:, 2] + _OP_POS]]
    neg = buf[begs[:, 5]] == _MINUS
    words = _words(data)
    root = _uints(words, begs[:, 5] + neg, ends[:, 5])
    has_n = buf[begs[:, 6]] == _LBRACKET  # "[nranks=" N "]", else "stream"
    nranks = np.full(len(line), NULL)
    nranks[has_n] = _uints(words, begs[has_n, 6] + 8, ends[has_n, 6] - 1)
    root = np.where(neg, -root, root)
    # impossible calls (tracer.events.impossible_reason) take the general path, which names them
    known, rooted = nranks != NULL, np.isin(op, _ROOTED)
    fine = ~((known & (nranks < 1)) | (rooted & ((root < 0) | (known & (root >= nranks)))))
    if not fine.all():
        line, st, has_ts, begs, ends, first = (a[fine] for a in (line, st, has_ts, begs, ends, first))
        prefix_idx, comm_idx, op, root, nranks = (a[fine] for a in (prefix_idx, comm_idx, op, root, nranks))
        if not len(line):
            return None
    t_ns = t_valid = t_bad = None
    if has_ts.any():
        t_ns, t_valid = _timestamps(data, words, buf, st, spaces[first + 1], has_ts)
        t_bad = has_ts & ~t_valid
    return FastFields(line, prefix_idx, prefixes, op, _uints(words, begs[:, 3], ends[:, 3]),
                      _uints(words, begs[:, 4], ends[:, 4]), root,
                      comm_idx, comms, nranks, t_ns, t_valid, t_bad)


def source_refs(file: str, line_no: np.ndarray) -> pa.Array:
    """``f"{file}:{line_no[i]}"`` for every ``line_no`` (int64) as an Arrow string array
    (unencodable characters of ``file`` as ``?``). The numbers are printed by Arrow; when they
    all have as many digits (most blocks), the strings are laid out with one numpy copy."""
    head = f"{file}:".encode("utf-8", "replace")
    digits = pc.cast(pa.array(line_no, pa.int64()), pa.string())
    width = np.diff(np.frombuffer(digits.buffers()[1], np.int32, count=len(digits) + 1))
    if not len(width) or width.min() != width.max():
        return pc.binary_join_element_wise(pa.scalar(head.decode("utf-8")), digits, "")
    rows, size = len(width), len(head) + int(width[0])
    padded = np.empty((rows, size), np.uint8)
    padded[:, :len(head)] = np.frombuffer(head, np.uint8)
    padded[:, len(head):] = np.frombuffer(digits.buffers()[2], np.uint8,
                                          count=rows * int(width[0])).reshape(rows, -1)
    offsets = np.arange(rows + 1, dtype=np.int32) * size
    return pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(padded))


def _seconds(data, words: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Codes and distinct texts of ``YYYY-mm-dd HH:MM:SS`` at ``s + 1``. A log's seconds
    change rarely from line to line: runs of equal text are found comparing 8 bytes at a
    time (``words``: :func:`_words` of ``data``), and each run's text is read once."""
    new = np.ones(len(s), bool)
    new[1:] = False
    for at in (1, 9, 12):  # three 8-byte words cover bytes s+1 .. s+19
        word = words[s + at]
        new[1:] |= word[1:] != word[:-1]
    starts = np.flatnonzero(new)
    if len(starts) * 8 > len(s):  # not sorted by time: hash every row
        (secs,) = _strings(data, (s + 1)[:, None], (s + 20)[:, None])
        return _dict(secs)
    texts: dict[str, int] = {}
    run_code = [texts.setdefault(bytes(data[a + 1:a + 20]).decode("ascii"), len(texts))
                for a in s[starts].tolist()]
    return np.array(run_code, np.int64)[np.cumsum(new) - 1], list(texts)


def _timestamps(data, words: np.ndarray, buf: np.ndarray, st: np.ndarray, close: np.ndarray,
                has_ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ns since the epoch of ``[YYYY-mm-dd HH:MM:SS[.frac]] `` at ``st`` (``close``: the
    space after ``]``), exactly :func:`tracer.nccl.formats.timestamp_ns` of its text: the
    whole seconds once per distinct value, the fraction (its first 9 digits) in bulk."""
    t_ns = np.zeros(len(st), np.int64)
    valid = np.zeros(len(st), bool)
    i = np.flatnonzero(has_ts)
    s = st[i]
    sec_idx, sec_texts = _seconds(data, words, s)
    sec_ns = np.zeros(len(sec_texts), np.int64)
    sec_ok = np.zeros(len(sec_texts), bool)
    sec_edge = np.zeros(len(sec_texts), bool)  # within 1 s of the int64 end: row by row
    for k, text in enumerate(sec_texts):
        try:
            ns = fmt.timestamp_ns(text)
        except ValueError:
            continue
        sec_ok[k], sec_edge[k] = ns < 2**63 - 10**9, ns >= 2**63 - 10**9
        sec_ns[k] = ns if sec_ok[k] else 0
    frac_beg = s + 21  # after "[YYYY-mm-dd HH:MM:SS."
    frac_end = np.where(buf[s + 20] == _DOT, np.minimum(close[i] - 1, frac_beg + 9), frac_beg)
    frac_ns = _uints(words, frac_beg, frac_end) * _POW10[9 - (frac_end - frac_beg)]
    ok = sec_ok[sec_idx]
    t_ns[i] = np.where(ok, sec_ns[sec_idx] + frac_ns, 0)
    valid[i] = ok
    for j in np.flatnonzero(sec_edge[sec_idx]).tolist():
        text = bytes(data[s[j] + 1:close[i[j]] - 1]).decode("ascii")
        try:
            t_ns[i[j]], valid[i[j]] = fmt.timestamp_ns(text), True
        except ValueError:
            pass
    return t_ns, valid
