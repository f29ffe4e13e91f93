"""`make verify-traffic` end to end on 2 CPU processes (torchrun, gloo), and its pieces."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verify.run.launch import launch_command, launch_env


def test_launch_command_runs_verify_main_under_torchrun():
    cmd = launch_command(4, Path("traces/x"), ["--modes", "dmuon-z2"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=4" in cmd and cmd[-4:] == ["--out-dir", "traces/x", "--modes", "dmuon-z2"]


def test_launch_env_sets_nccl_logging_only_for_nccl(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    gloo = launch_env(False, tmp_path)
    assert "NCCL_DEBUG" not in gloo and "TORCH_DISTRIBUTED_DEBUG" not in gloo
    nccl = launch_env(True, tmp_path)
    assert nccl["NCCL_DEBUG_SUBSYS"] == "INIT,COLL"
    assert nccl["NCCL_DEBUG_FILE"].endswith("nccl.%h.%p.log")


@pytest.mark.distributed
def test_verify_traffic_end_to_end_two_processes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", "runs/e2e",
         "--modes", "dmuon-z3", "--steps-warmup", "2", "--steps-measured", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "runs/e2e/report.json").read_text())
    (run,) = report["runs"]
    assert report["pass"] and run["mode"] == "dmuon-z3" and run["ratio_to_p_m"] == 1.5  # 3(N-1)/N, N=2
    assert run["sources"]["flight_recorder"]["pass"]
    assert run["sources"]["profiler"]["pass"]  # torch.profiler: the third source on CPU
    assert run["sources"]["profiler"]["matched"] == run["sources"]["interposer"]["events"]
    assert "nccl_log" not in run["sources"]  # gloo: no NCCL log to read
    assert run["nvlink"]["available"] or run["nvlink"]["reason"]  # here: NVML missing, and why
    for name in ("report.md", "traffic.png", "dmuon-z3/timeline.json", "dmuon-z3/timeline.png",
                 "dmuon-z3/layout.json", "dmuon-z3/profiler_rank0.json", "dmuon-z3/profiler_rank1.json"):
        assert (tmp_path / "runs/e2e" / name).is_file(), name
    assert "PASS" in proc.stdout and (tmp_path / "runs/e2e/exit_code").read_text() == "0\n"
