"""verify.nsys_verify: the prerequisites-missing path for real (no nsys, no GPU here), the
command lines as pure functions, rank assignment, and step failures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tracer.events import CollectiveEvent, write_parquet
from verify import nsys_verify as nv


def test_missing_prerequisites_for_real_here():
    if nv.shutil.which("nsys") and nv._gpu_count() >= 2:
        pytest.skip("this machine has nsys and >= 2 GPUs")
    proc = subprocess.run([sys.executable, "-m", "verify.nsys_verify"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == nv.EXIT_PREREQUISITES == 3
    assert "prerequisites missing, nothing run" in proc.stderr
    assert "Traceback" not in proc.stderr
    if not nv.shutil.which("nsys"):
        assert "`nsys` is not on PATH" in proc.stderr


def test_missing_prerequisites_pure():
    assert nv.missing_prerequisites("/usr/bin/nsys", 8) == []
    both = nv.missing_prerequisites(None, 1)
    assert len(both) == 2 and "torch.cuda.device_count() = 1, need >= 2" in both[1]
    assert nv.missing_prerequisites("/x/nsys", 0) == [
        "torch.cuda.device_count() = 0, need >= 2 GPUs for an NCCL run"]


def test_commands():
    out = Path("/runs/a")
    assert nv.profile_command(out, nsys="nsys", python="py", extra=["--steps", "3"]) == [
        "nsys", "profile", "-t", "cuda,nvtx", "-o", "/runs/a/report", "--force-overwrite=true",
        "py", "-m", "verify.launch", "--out-dir", "/runs/a", "--steps", "3"]
    assert nv.export_command(out / "report.nsys-rep", out / "report.sqlite", nsys="/opt/nsys") == [
        "/opt/nsys", "export", "--type", "sqlite", "--include-blobs=true",
        "--force-overwrite=true", "-o", "/runs/a/report.sqlite", "/runs/a/report.nsys-rep"]


def _ns(pid, dev, t, op="broadcast"):
    return CollectiveEvent(source="nsys", op=op, pid=pid, cuda_dev=dev, t_start_ns=t,
                           t_end_ns=t + 1, source_ref=f"r.sqlite#NVTX_EVENTS.{t}")


def test_assign_ranks_by_pid_then_device():
    ref = [CollectiveEvent(source="interposer", op="broadcast", rank=r, pid=p, group_id="0,1",
                           seq=0, source_ref="x") for r, p in ((0, 500), (1, 400))]
    nsys = [_ns(500, 1, 30), _ns(400, 0, 10), _ns(500, 1, 20)]
    by_pid = nv.assign_ranks(nsys, ref)
    assert [(e.rank, e.t_start_ns) for e in by_pid] == [(0, 20), (0, 30), (1, 10)]
    no_pid = [e.replace(pid=None) for e in ref]
    by_dev = nv.assign_ranks(nsys, no_pid)
    assert [(e.rank, e.t_start_ns) for e in by_dev] == [(0, 10), (1, 20), (1, 30)]
    assert all(e.group_id is None and e.seq is None for e in by_dev)


def test_load_reference(tmp_path):
    with pytest.raises(ValueError, match="no <mode>/events_rank<r>.parquet"):
        nv.load_reference(tmp_path)
    ev = CollectiveEvent(source="interposer", op="reduce", rank=1, count=4, dtype="float32",
                         source_ref="x")
    write_parquet([ev], tmp_path / "ddp" / "events_rank1.parquet")
    write_parquet([ev.replace(rank=0)], tmp_path / "z2" / "events_rank0.parquet")
    assert sorted(e.rank for e in nv.load_reference(tmp_path)) == [0, 1]


def test_failed_profile_step_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nv, "_gpu_count", lambda: 2)
    rc = nv.main(["--nsys", "false", "--out-dir", str(tmp_path)])
    assert rc == nv.EXIT_STEP_FAILED == 4
    assert "workload under nsys failed with exit status 1" in capsys.readouterr().err
    rc = nv.main(["--nsys", str(tmp_path / "no-such-nsys"), "--out-dir", str(tmp_path)])
    assert rc == nv.EXIT_STEP_FAILED
    assert "could not start" in capsys.readouterr().err
