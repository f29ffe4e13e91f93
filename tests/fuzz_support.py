"""Shared pieces of the fuzz tests (test_fuzz_*.py): byte-level mutations of real fixtures, a
per-input time limit, and the two profiles (a few seconds in ``make test``, a long one under
``@pytest.mark.slow`` for ``make test-all``)."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: ``make test``: reproducible (derandomized), no example database, bounded example counts.
FAST = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
#: ``make test-all``: random, many more examples.
SLOW = dict(deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fast(max_examples: int):
    return settings(max_examples=max_examples, **FAST)


def slow(max_examples: int):
    return settings(max_examples=max_examples, **SLOW)


class InputTimeout(Exception):
    """One fuzz input took longer than its limit: a hang (or a quadratic blow-up)."""


@contextmanager
def time_limit(seconds: float):
    """Raise :class:`InputTimeout` in this (main) thread once the process has spent
    ``seconds`` of CPU time (user + system, ``ITIMER_PROF``) inside the block. CPU time, not
    wall time, so a loaded machine does not fail an input; a hang that sleeps instead of
    spinning is left to pytest-timeout's per-test limit."""
    def on_alarm(signum, frame):
        raise InputTimeout(f"input not handled within {seconds} CPU-s")

    previous = signal.signal(signal.SIGPROF, on_alarm)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


#: One edit of a byte string: (kind, position as a fraction of the length, payload).
EDITS = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]),
    st.floats(0, 1, allow_nan=False),
    st.binary(min_size=1, max_size=16),
)


def mutate(raw: bytes, edits) -> bytes:
    """Apply ``edits`` (from :data:`EDITS`) to ``raw`` in order."""
    data = bytearray(raw)
    for kind, where, payload in edits:
        i = min(int(where * len(data)), max(len(data) - 1, 0))
        if kind == "flip" and data:
            data[i] ^= payload[0] or 1
        elif kind == "set":
            data[i:i + len(payload)] = payload
        elif kind == "insert":
            data[i:i] = payload
        elif kind == "delete":
            del data[i:i + len(payload)]
        elif kind == "truncate":
            del data[i:]
        elif kind == "duplicate":
            data[i:i] = data[i:i + 64 * len(payload)]
    return bytes(data)
