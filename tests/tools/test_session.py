"""tests/tools/session.py stops a launcher's whole tree (stand-in for torchrun: no ranks).

The stand-in is a parent that starts a child in a session of its own and stops it on SIGTERM,
as torchrun's agent does with its ranks. Stopping the parent the way ``subprocess.run``'s
timeout does (SIGKILL to the parent alone) leaves the child running, so
:func:`test_stopping_a_session_stops_the_grandchild_too` fails with ``proc.kill()`` in place of
``stop_session``; checked by hand with that substitution.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tools.session import run_session, session

PARENT = r"""
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
def stop(*_):
    child.terminate()
    child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_for(path: Path, limit_s: float = 60.0) -> int:
    deadline = time.monotonic() + limit_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"the stand-in wrote no pid to {path} in {limit_s} s"
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, limit_s: float = 30.0) -> bool:
    deadline = time.monotonic() + limit_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_stopping_a_session_stops_the_grandchild_too(tmp_path):
    pid_file = tmp_path / "child.pid"
    with session([sys.executable, "-c", PARENT, str(pid_file)]) as proc:
        child = _wait_for(pid_file)
        assert _running(child)
    assert proc.returncode is not None
    assert _gone(child), f"child {child} outlived its stopped session"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_block_that_raises_still_stops_the_tree(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError, match="planted"):
        with session([sys.executable, "-c", PARENT, str(pid_file)]):
            child = _wait_for(pid_file)
            raise AssertionError("planted")
    assert _gone(child)


def test_run_session_returns_the_output_and_raises_on_timeout():
    done = run_session([sys.executable, "-c", "print('hi')"], timeout=60, text=True)
    assert (done.returncode, done.stdout) == (0, "hi\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_session([sys.executable, "-c", "import time; time.sleep(600)"], timeout=0.5)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signal masks")
def test_a_blocked_sigterm_in_the_test_process_does_not_reach_the_launcher(tmp_path):
    """The mask is inherited across fork and exec: with SIGTERM blocked here (as ``make test``'s
    pytest process had it), the stand-in would ignore the stop and its child outlive it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        pid_file = tmp_path / "child.pid"
        with session([sys.executable, "-c", PARENT, str(pid_file)], grace_s=20) as proc:
            child = _wait_for(pid_file)
        assert proc.returncode == 0  # the stand-in's own SIGTERM handler ran
        assert _gone(child)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
