"""Keep Kineto's ``USDT ... profiler_start`` / ``profiler_stop`` lines off the user's terminal.

Every ``torch.profiler.profile`` start and stop makes Kineto (libkineto's
``SyncActivityProfilerHandler``, inside ``libtorch_cpu``) print a line such as
``USDT:2026-12-06 05:28:41 5653:5653 SyncActivityProfilerHandler.cpp:52] profiler_start`` on
the process's stderr (file descriptor 2, from C++: ``sys.stderr`` never sees it). Kineto logs it
at its ``USDT`` severity, which ranks above ``ERROR``: ``KINETO_LOG_LEVEL`` cannot hide it
without hiding Kineto's errors too. verify-traffic starts and stops a profiler per mode on every
rank, so a run printed ~80 of them.

:class:`QuietProfile` wraps a profiler's start and stop (nothing else) in
:func:`filtered_stderr`: file descriptor 2 goes to a temporary file for the call; afterwards
every line of it is written back to the real stderr except those matching
:data:`KINETO_MARKER`. Warnings and errors printed in that window (Kineto's, torch's, another
thread's) are kept, after the call instead of during it.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

#: A Kineto start / stop marker line (the only lines :func:`filtered_stderr` drops).
KINETO_MARKER = re.compile(rb"USDT:[^\n]*\] profiler_(?:start|stop)[ \t\r]*")


def drop_markers(data: bytes) -> bytes:
    """``data`` without its whole lines that are :data:`KINETO_MARKER` lines."""
    lines = data.splitlines(keepends=True)
    return b"".join(line for line in lines if not KINETO_MARKER.fullmatch(line.rstrip(b"\n")))


@contextmanager
def filtered_stderr() -> Iterator[None]:
    """File descriptor 2 into a temporary file for the block; then its lines, less Kineto's
    markers (:func:`drop_markers`), written to the real descriptor 2. Where descriptor 2 cannot
    be duplicated (closed), the block runs unfiltered."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            if sys.stderr is not None:
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = drop_markers(tmp.read())
            if kept:
                os.write(2, kept)


class QuietProfile:
    """A ``torch.profiler.profile`` (or any context manager) whose enter and exit run under
    :func:`filtered_stderr`; the profiled block itself prints as usual."""

    def __init__(self, profiler) -> None:
        self.profiler = profiler

    def __enter__(self):
        with filtered_stderr():
            return self.profiler.__enter__()

    def __exit__(self, *exc):
        with filtered_stderr():
            return self.profiler.__exit__(*exc)
