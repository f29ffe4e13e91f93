"""Kineto's ``USDT ... profiler_start / profiler_stop`` lines stay off the terminal, other
stderr output does not (tracer/kineto_log.py).

Kineto prints from C++ onto file descriptor 2, so each case runs in a fresh Python process
and reads that process's real stderr. The bare profiler is run first in the same process:
where this torch build prints no marker at all, the test skips (it could not fail).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tracer.kineto_log import KINETO_MARKER, drop_markers

REPO = Path(__file__).resolve().parents[2]
MARKER = b"] profiler_start"


#: One process (torch starts slowly): the bare profiler, then QuietProfile three times with a
#: line of our own inside, then verify-traffic's measured window
#: (verify.run.runner._MeasuredWindow) on a 1-rank gloo group; sections split by "=== ".
_SCRIPT = """
    import os, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from tracer.kineto_log import QuietProfile
    from verify.run.runner import _MeasuredWindow

    def mark(name):
        sys.stderr.flush()
        os.write(2, b"=== " + name + b"\\n")

    def step():
        (torch.ones(8) * 2).sum()

    with profile(activities=[ProfilerActivity.CPU]):
        step()
    mark(b"quiet")
    for _ in range(3):
        with QuietProfile(profile(activities=[ProfilerActivity.CPU])) as prof:
            step()
            os.write(2, b"inside the profiled block\\n")
        assert prof.key_averages(), "the wrapped profiler recorded nothing"
    mark(b"window")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Linear(4, 4)
    window = _MeasuredWindow("m", Path(sys.argv[1]), "cpu", model)
    window.open()
    t = model(torch.ones(2, 4)).sum()
    t.backward()
    dist.all_reduce(t.detach())
    window.close()
    dist.destroy_process_group()
    print("done")
"""


@pytest.fixture(scope="module")
def stderr_sections(tmp_path_factory) -> dict[str, bytes]:
    """KINETO_LOG_LEVEL=3 makes Kineto print its STAGE lines beside the markers: those (like
    any warning or error) must survive."""
    out = tmp_path_factory.mktemp("window")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT), str(out)], cwd=REPO,
                          capture_output=True, timeout=180,
                          env={**os.environ, "KINETO_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout == b"done\n"  # nothing else on stdout
    bare, rest = proc.stderr.split(b"=== quiet\n")
    quiet, window = rest.split(b"=== window\n")
    if MARKER not in bare:
        pytest.skip("this torch build's Kineto prints no profiler_start marker")
    assert (out / "profiler_rank0.json").is_file()  # the window's trace was still written
    return {"bare": bare, "quiet": quiet, "window": window}


def test_quiet_profile_drops_markers_and_keeps_every_other_line(stderr_sections):
    bare, quiet = stderr_sections["bare"], stderr_sections["quiet"]
    assert b"USDT" not in quiet and b"profiler_st" not in quiet
    assert quiet.count(b"inside the profiled block") == 3
    stages = [line for line in bare.splitlines() if line.startswith(b"STAGE:")]
    assert stages and quiet.count(b"STAGE:") == 3 * len(stages)  # Kineto's own lines kept


def test_a_mode_window_prints_no_marker(stderr_sections):
    """Fails without QuietProfile in _MeasuredWindow.open (checked by reverting it)."""
    window = stderr_sections["window"]
    assert MARKER not in window and b"profiler_stop" not in window
    assert b"STAGE:" in window  # the window's profiler ran, its other lines kept


@pytest.mark.parametrize("text, kept", [
    (b"USDT:2026-12-06 05:28:41 5653:5653 SyncActivityProfilerHandler.cpp:52] profiler_start\n", b""),
    (b"USDT:2026-12-06 05:28:41 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop\r\n", b""),
    (b"ERROR:2026-12-06 05:28:41 1:1 Foo.cpp:1] profiler_start failed\n",
     b"ERROR:2026-12-06 05:28:41 1:1 Foo.cpp:1] profiler_start failed\n"),
    (b"USDT: other marker\nWARNING: x\n", b"USDT: other marker\nWARNING: x\n"),
    (b"a\nUSDT:t 1:1 S.cpp:52] profiler_start\nb", b"a\nb"),
])
def test_only_whole_marker_lines_are_dropped(text, kept):
    assert drop_markers(text) == kept
    assert KINETO_MARKER.pattern.startswith(b"USDT:")
