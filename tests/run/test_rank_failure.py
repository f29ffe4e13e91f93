"""A rank that raises or dies, and two torchrun agents as two nodes.

Before ``verify.run.failstop`` a raise on rank 1 alone hung rank 0 to the 300 s group timeout
(the report then blamed rank 0's timeout and the next mode vanished), and a rank that died
left no report.json: both tests below fail on that code (no report within 60 s, no rank 1,
no ``not run``)."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.phase_d.failure_factories import PLANTED
from tests.tools.session import run_session, session

REPO = Path(__file__).resolve().parents[2]
FACTORIES = "tests.distributed.phase_d.failure_factories"


def _launch(out: Path, factory: str) -> subprocess.CompletedProcess:
    return run_session(
        [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", str(out),
         "--modes", "dmuon-ddp,dmuon-z2", "--steps-warmup", "2", "--steps-measured", "1",
         "--no-profiler", "--model", f"{FACTORIES}:{factory}"],
        cwd=REPO, text=True, timeout=240)


def _check_stopped_report(out: Path, failed_at: float, rank1_says: str) -> dict:
    report = json.loads((out / "report.json").read_text())
    # within 60 s of the failure (its traceback file, or rank 0's first sight of it)
    assert (out / "report.json").stat().st_mtime - failed_at < 60
    assert (out / "exit_code").read_text() == "1\n"
    failed = {f["mode"]: f["detail"] for f in report["failures"]}
    assert set(failed) == {"dmuon-ddp", "dmuon-z2"}
    assert rank1_says in failed["dmuon-ddp"]
    assert failed["dmuon-z2"].startswith("not run: the run stopped in dmuon-ddp")
    assert report["stopped"]["mode"] == "dmuon-ddp" and report["stopped"]["not_run"] == ["dmuon-z2"]
    assert "dmuon-z2" in (out / "junit.xml").read_text()
    return report


@pytest.mark.distributed
@pytest.mark.slow  # ~60 s: the raising rank waits failstop.SETTLE_S for its peers' statuses
@pytest.mark.timeout(300)
def test_a_raise_on_rank1_alone_is_reported_within_60s_naming_rank1(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, "raises_on_rank1")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed_at = (out / "dmuon-ddp" / "error_rank1.txt").stat().st_mtime
    report = _check_stopped_report(out, failed_at, f"rank 1 raised: RuntimeError: {PLANTED}")
    assert report["stopped"]["left_ranks"] == [1]  # it ended its process to free rank 0
    assert proc.stdout.strip().splitlines()[-1] == "FAIL: mode raised an error (dmuon-ddp, dmuon-z2)"


@pytest.mark.distributed
@pytest.mark.slow  # ~20 s of torchrun; the failure logic runs in make test on an in-memory store (test_nodes_failstop.py)
@pytest.mark.timeout(300)
def test_rank1_dying_without_exception_is_reported_within_60s(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, "exits_on_rank1")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed_at = (out / "dmuon-ddp" / "error_rank0.txt").stat().st_mtime  # rank 0 saw it die
    report = _check_stopped_report(out, failed_at, "rank 1 posted no status: its process ended "
                                                   "without a Python exception")
    assert report["stopped"]["missing_ranks"] == [1]
    assert "exitcode  : 7" in proc.stderr  # torchrun's summary names the code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_agents_as_two_nodes_collect_to_rank0_and_show_bytes_between_nodes(tmp_path):
    """W = 4 as 2 nodes x 2 processes, two torchrun agents on one machine with c10d rendezvous
    and separate output folders; HSDP 2 x 2 hierarchical, the replicate groups {0,2} {1,3}
    across the nodes. Rank 0's folder gets the other node's trace files and a report with
    per-node bytes; the other node's launcher returns the same verdict and says where it is."""
    port = _free_port()
    procs = {}
    with contextlib.ExitStack() as stack:  # a timeout or an error stops both trees
        for name in ("a", "b"):
            procs[name] = stack.enter_context(session(
                [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--nnodes", "2",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}",
                 "--out-dir", str(tmp_path / name), "--modes", "dmuon-hsdp-z2",
                 "--hierarchy", "hierarchical", "--steps-warmup", "2", "--steps-measured", "1"],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + 360
        logs = {n: p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                for n, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), logs
    (home,) = [n for n in procs if (tmp_path / n / "report.json").is_file()]
    (other,) = set(procs) - {home}
    report = json.loads((tmp_path / home / "report.json").read_text())
    assert report["pass"] and report["nodes"]["of_rank"] == [0, 0, 1, 1]
    assert report["nodes"]["collected"] == {**report["nodes"]["collected"], "ranks": [2, 3],
                                            "error": None}
    for r in (2, 3):  # the other node's files, now beside rank 0's
        for f in (f"events_rank{r}.parquet", f"profiler_rank{r}.json", f"fr_rank{r}.json"):
            assert (tmp_path / home / "dmuon-hsdp-z2" / f).is_file(), f
    nodes = report["runs"][0]["nodes"]
    assert set(nodes["spanning_groups"]) == {"0,2", "1,3"}  # the replicate axis only
    assert 0 < nodes["inter_node_share"] < 1
    assert [n["ranks"] for n in nodes["per_node"]] == [[0, 1], [2, 3]]
    assert "bytes between nodes" in (tmp_path / home / "report.md").read_text()
    assert (tmp_path / other / "exit_code").read_text() == "0\n"
    assert "rank 0 wrote the report on host" in logs[other]
