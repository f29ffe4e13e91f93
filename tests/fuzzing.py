"""Fuzzing helpers shared by the parser fuzz tests (tests/test_fuzz_*.py): a per-input time
limit, byte-level mutations of real inputs (hypothesis strategies) and the two settings
profiles. Generic: nothing here knows a format.

- :func:`time_limit`: a hang becomes a failure naming the input, once the block has used
  ``seconds`` of CPU time (``ITIMER_PROF``/SIGPROF in the main thread; Python code, ``re``
  included, is interrupted there). It saves and re-arms an outer timer of the same kind
  (a nested :func:`time_limit`).
- :func:`mutations`: a list of edits (bit flips, byte replacements with the bytes parsers
  trip on, deletions, duplications, insertions of format tokens or random bytes,
  truncation), optionally some aimed near the start (headers), applied by :func:`apply`.
- :func:`fast` / :func:`slow`: settings for the ``make test`` variant (derandomized, a few
  seconds) and the ``@pytest.mark.slow`` one (``make test-all``, random, many more inputs).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
#: ``make test``: reproducible (derandomized), no example database, bounded example counts.
FAST = dict(deadline=None, derandomize=True, database=None, suppress_health_check=_HEALTH)
#: ``make test-all``: random, many more examples.
SLOW = dict(deadline=None, database=None, suppress_health_check=_HEALTH)


def fast(max_examples: int) -> settings:
    """Settings of a ``make test`` fuzz test: ``max_examples`` derandomized inputs."""
    return settings(max_examples=max_examples, **FAST)


def slow(max_examples: int) -> settings:
    """Settings of a ``@pytest.mark.slow`` fuzz test: ``max_examples`` random inputs."""
    return settings(max_examples=max_examples, **SLOW)


class InputTimeout(AssertionError):
    """One fuzz input ran past its time limit (a hang, or a super-linear path)."""


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with :class:`InputTimeout` naming ``what`` once the block has used ``seconds`` of
    CPU time (user + system of the process, ``ITIMER_PROF``).

    CPU time, not wall time: the tests share loaded machines, where a linear parse can take
    many times its idle wall time, and that must not fail an input; a super-linear path or a
    spinning loop still uses the CPU and is caught. (CPU time of all threads counts, so a
    multi-threaded writer reaches the limit sooner than the wall clock.) A hang that sleeps
    or blocks instead of spinning is left to pytest-timeout's per-test wall-clock limit
    (SIGALRM, ``ITIMER_REAL``: a different timer, untouched here).

    Interrupts the block where signals can be used (main thread, POSIX); elsewhere it checks
    the CPU time afterwards. An outer ``ITIMER_PROF`` timer (a nested :func:`time_limit`) is
    saved, bounds this one, and is re-armed afterwards with what it had left. If the code
    under test swallows the timeout or turns it into its own error (``except Exception``),
    the timeout is raised anyway once the block ends.
    """
    usable = (hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    start = time.process_time()
    message = f"{what} used more than {seconds} CPU-s (a hang or a super-linear path)"
    if not usable:
        yield
        if time.process_time() - start > seconds:
            raise InputTimeout(message)
        return
    old_handler = signal.getsignal(signal.SIGPROF)
    old_delay, old_interval = signal.getitimer(signal.ITIMER_PROF)
    outer_first = bool(old_delay) and old_delay < seconds
    fired, armed = False, True

    def on_timer(signum, frame):
        nonlocal fired
        if not armed:  # fired while leaving the block: too late to matter
            return
        fired = True
        if outer_first and callable(old_handler):
            old_handler(signum, frame)  # the outer limit ran out first: its error
        raise InputTimeout(message)

    signal.signal(signal.SIGPROF, on_timer)
    signal.setitimer(signal.ITIMER_PROF, min(seconds, old_delay) if old_delay else seconds)
    try:
        yield
    except InputTimeout:
        raise
    except BaseException as exc:
        if fired:  # converted by the code under test: still a timeout
            raise InputTimeout(message) from exc
        raise
    else:
        if fired:  # swallowed by the code under test
            raise InputTimeout(message)
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_PROF, 0)
        if old_handler is not None:  # None: not set from Python, nothing to restore
            signal.signal(signal.SIGPROF, old_handler)
        if old_delay:  # re-arm the outer timer with what it had left
            left = old_delay - (time.process_time() - start)
            signal.setitimer(signal.ITIMER_PROF, max(left, 1e-3), old_interval)


#: Bytes that parsers of text formats trip on: line ends, NUL, invalid UTF-8 lead and
#: continuation bytes, separators, brackets, sign and digits.
AWKWARD_BYTES = b"\n\r\x00\xff\x80\xc3 \t:[](){}-0912x\"',"


def mutations(tokens: Sequence[bytes] = (), max_edits: int = 8, *, min_edits: int = 1,
              near_start: float | None = None) -> st.SearchStrategy:
    """Lists of ``min_edits`` to ``max_edits`` edits for :func:`apply`.

    ``tokens``: format words worth inserting (markers, keywords); without them, insertions
    are of random bytes. Positions are drawn as integers and reduced modulo the current
    length when applied. ``near_start``: also draw in-place edits (bit flips, byte
    replacements) at a position within this fraction of the length from the start (a
    float position, see :func:`apply`), where binary formats keep their header and schema.
    """
    pos = st.integers(0, 2**20)
    replacement = (st.binary(min_size=1, max_size=4)
                   | st.sampled_from([bytes([b]) for b in AWKWARD_BYTES]))
    insertion = (st.sampled_from(list(tokens)) if tokens
                 else st.binary(min_size=1, max_size=16))
    edit = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("set"), pos, replacement),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
        st.tuples(st.just("duplicate"), pos, st.integers(1, 256), pos),
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("insert"), pos, insertion),
    )
    if near_start is not None:
        head = st.floats(0, near_start)
        edit = edit | st.tuples(st.just("flip"), head, st.integers(0, 7)) | st.tuples(
            st.just("set"), head, replacement | st.binary(min_size=1, max_size=8))
    return st.lists(edit, min_size=min_edits, max_size=max_edits)


def apply(data: bytes, edits: list[tuple]) -> bytes:
    """``data`` with ``edits`` (from :func:`mutations`) applied in order. A position is an
    integer, reduced modulo the current length + 1, or a float: a fraction of that length."""
    buf = bytearray(data)
    for kind, at, *args in edits:
        n = len(buf)
        i = min(int(at * n), n) if isinstance(at, float) else at % (n + 1)
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
