"""Fuzzing helpers shared by the parser fuzz tests: a per-input time limit and byte-level
mutations of real inputs (hypothesis strategies). Generic: nothing here knows a format.

- :func:`time_limit`: a hang becomes a failure naming the input, after ``seconds`` (SIGALRM
  in the main thread; Python code, ``re`` included, is interrupted there). It saves and
  re-arms any timer already set (pytest-timeout's signal method uses the same one).
- :func:`mutations`: a list of edits (bit flips, byte replacements with the bytes parsers
  trip on, deletions, duplications, token insertions, truncation) applied by :func:`apply`.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hypothesis import strategies as st


class InputTimeout(AssertionError):
    """One fuzz input ran past its time limit (a hang, or a super-linear path)."""


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with :class:`InputTimeout` naming ``what`` when the block runs longer than
    ``seconds`` (wall clock). Interrupts the block where SIGALRM can be used (main thread,
    POSIX); elsewhere it checks the time afterwards."""
    usable = (hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    start = time.monotonic()
    if not usable:
        yield
        if time.monotonic() - start > seconds:
            raise InputTimeout(f"{what} took more than {seconds} s")
        return
    old_handler = signal.getsignal(signal.SIGALRM)
    old_delay, old_interval = signal.getitimer(signal.ITIMER_REAL)
    limit = min(seconds, old_delay) if old_delay else seconds

    def on_alarm(signum, frame):
        raise InputTimeout(f"{what} took more than {limit} s (a hang or a super-linear path)")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:  # re-arm the outer timer with what it had left
            left = old_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), old_interval)


#: Bytes that parsers of text formats trip on: line ends, NUL, invalid UTF-8 lead and
#: continuation bytes, separators, brackets, sign and digits.
AWKWARD_BYTES = b"\n\r\x00\xff\x80\xc3 \t:[](){}-0912x\"',"


def mutations(tokens: Sequence[bytes] = (), max_edits: int = 8) -> st.SearchStrategy:
    """Edits for :func:`apply`. ``tokens``: format words worth inserting (markers, keywords).
    Positions are drawn as integers and reduced modulo the current length when applied."""
    pos = st.integers(0, 2**20)
    edit = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("set"), pos, st.binary(min_size=1, max_size=4)
                  | st.sampled_from([bytes([b]) for b in AWKWARD_BYTES])),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
        st.tuples(st.just("duplicate"), pos, st.integers(1, 256), pos),
        st.tuples(st.just("truncate"), pos),
    )
    if tokens:
        edit = edit | st.tuples(st.just("insert"), pos, st.sampled_from(list(tokens)))
    return st.lists(edit, min_size=1, max_size=max_edits)


def apply(data: bytes, edits: list[tuple]) -> bytes:
    """``data`` with ``edits`` (from :func:`mutations`) applied in order."""
    buf = bytearray(data)
    for kind, at, *args in edits:
        n = len(buf)
        i = at % (n + 1)
        if kind == "flip" and n:
            buf[i % n] ^= 1 << args[0]
        elif kind == "set":
            buf[i:i + len(args[0])] = args[0]
        elif kind == "delete":
            del buf[i:i + args[0]]
        elif kind == "duplicate":
            chunk = bytes(buf[i:i + args[0]])
            j = args[1] % (n + 1)
            buf[j:j] = chunk
        elif kind == "truncate":
            del buf[i:]
        elif kind == "insert":
            buf[i:i] = args[0]
    return bytes(buf)
