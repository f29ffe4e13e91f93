"""Run a launcher (``verify.run.launch``, torchrun) from a test so that a timeout or a failed
assertion stops the whole process tree, not only the process the test started.

``subprocess.run(cmd, timeout=...)`` kills only its direct child on timeout (SIGKILL). For
``python -m verify.run.launch`` that is the launcher: the torchrun agent it started keeps
running, and so do the ranks, which torchrun starts in sessions of their own; they hold the
test machine's cores until they finish or reach their group timeout (``--timeout-s``, 300 s;
30 min for gloo subgroups created without one, e.g. a 2-D DeviceMesh's). Here the command
runs in a new session; stopping it sends SIGTERM to that session (the launcher, the torchrun
agent: the agent then stops its ranks, torchrun's own shutdown) and SIGKILL to what is left of
it after ``grace_s``. The command starts with no signal blocked: a blocked mask survives fork
and exec, and the test process may block SIGTERM (pytest's process in ``make test`` here had it
blocked, so the stand-in launchers of ``test_session.py`` never saw the stop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

#: Seconds a stopped session gets to exit after SIGTERM before SIGKILL (torchrun's agent waits
#: up to 30 s for its ranks before it kills them itself).
GRACE_S = 45.0
#: Run as ``python -c UNBLOCKED cmd...``: clear the signal mask, then exec ``cmd``.
UNBLOCKED = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, ()); "
             "os.execvp(sys.argv[1], sys.argv[1:])")


def stop_session(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to ``proc``'s session (``proc`` started with ``start_new_session=True``), then
    SIGKILL to whatever of it still runs after ``grace_s`` seconds; ``proc`` is reaped. A
    session that has ended already is left alone."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, else its zombie keeps the group alive
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def session(cmd: Sequence[str], grace_s: float = GRACE_S, **popen_kw) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(cmd, start_new_session=True, **popen_kw)`` with no signal blocked
    (:data:`UNBLOCKED`), stopped on leaving the block (:func:`stop_session`) whether the block
    ended normally or raised."""
    proc = subprocess.Popen([sys.executable, "-c", UNBLOCKED, *cmd], start_new_session=True,
                            **popen_kw)
    try:
        yield proc
    finally:
        stop_session(proc, grace_s)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def run_session(cmd: Sequence[str], timeout: float, grace_s: float = GRACE_S,
                **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, capture_output=True, **popen_kw)`` in a new
    session: on timeout the whole session is stopped (:func:`stop_session`) before
    ``subprocess.TimeoutExpired`` is raised.

    Returns:
        The ``CompletedProcess`` (``stdout``/``stderr`` as ``text=`` in ``popen_kw`` says).
    """
    with session(cmd, grace_s, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kw) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
