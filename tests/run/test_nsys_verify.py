"""verify.sources.nsys_verify: the prerequisites-missing path for real (no nsys, no GPU here), the
command lines as pure functions, rank assignment, step failures, and main() end to end on a
small export built with the real export's DDL (nsys itself replaced by a stub)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.nsys_builders import build_export, global_tid, nsys_ddl
from tracer.events import CollectiveEvent, write_parquet
from verify.sources import nsys_verify as nv


def test_missing_prerequisites_for_real_here():
    if nv.shutil.which("nsys") and nv._gpu_count() >= 2:
        pytest.skip("this machine has nsys and >= 2 GPUs")
    proc = subprocess.run([sys.executable, "-m", "verify.sources.nsys_verify"], cwd=REPO_ROOT,
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
        "py", "-m", "verify.run.launch", "--out-dir", "/runs/a", "--steps", "3"]
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


def _iref(rank, pid, op="broadcast", seq=0, t=0, count=8, root=None):
    return CollectiveEvent(source="interposer", op=op, rank=rank, pid=pid, group_id="0,1",
                           group_size=2, seq=seq, count=count, dtype="float32", root=root,
                           t_start_ns=t, t_end_ns=t + 1, source_ref=f"interposer:rank{rank}:#{seq}")


def test_assign_ranks_unmatched_process_is_a_clear_error():
    ref = [_iref(0, 500), _iref(1, 400)]
    nsys = [_ns(500, 0, 1), _ns(999, 1, 5), _ns(999, 1, 6), _ns(400, 1, 7)]
    with pytest.raises(ValueError) as err:
        nv.assign_ranks(nsys, ref)
    msg = str(err.value)
    assert "process(es) matching no rank (pid=999: 2 NCCL ranges, first r.sqlite#NVTX_EVENTS.5)" \
        in msg
    assert "pid -> rank {400: 1, 500: 0}" in msg and "Must come from the same run" in msg
    # Without pids in the reference the device fallback applies and nothing is rejected.
    assert [e.rank for e in nv.assign_ranks(nsys, [e.replace(pid=None) for e in ref])] == [
        0, 1, 1, 1]


def test_assign_ranks_rejects_one_pid_on_two_ranks():
    with pytest.raises(ValueError, match=r"pid -> ranks \{7: \[0, 1\]\}.*one host"):
        nv.assign_ranks([_ns(7, 0, 1)], [_iref(0, 7), _iref(1, 7)])


def test_reference_per_rank_is_in_time_order():
    later = [_iref(0, 5, "all_reduce", 0, t=900), _iref(1, 6, "all_reduce", 0, t=901)]
    earlier = [_iref(0, 5, "broadcast", 0, t=100), _iref(0, 5, "reduce", 1, t=100),
               _iref(1, 6, "broadcast", 0, t=101)]
    got = nv._reference_per_rank(later + earlier)
    assert [(e.rank, e.op) for e in got] == [(0, "broadcast"), (0, "reduce"), (0, "all_reduce"),
                                             (1, "broadcast"), (1, "all_reduce")]
    assert all(e.group_id is None and e.seq is None for e in got)


# --- main() end to end: interposer events + an nsys export of the same (stub) run ---------

PIDS = {0: 10, 1: 20}  # rank -> pid
NCCL_DOM, DMUON_DOM = 3, 4
#: The run: mode "z3" first, then mode "ddp" (the reverse of their name order).
RUN = [("z3", "broadcast", "ncclBroadcast", 0), ("z3", "reduce", "ncclReduce", 0),
       ("ddp", "all_reduce", "ncclAllReduce", None)]


def _write_run(out_dir: Path) -> None:
    files: dict[Path, list] = {}
    for rank, pid in PIDS.items():
        for i, (mode, op, _, root) in enumerate(RUN):
            ev = _iref(rank, pid, op, seq=i, t=1000 * i + rank, root=root)
            files.setdefault(out_dir / mode / f"events_rank{rank}.parquet", []).append(ev)
    for path, events in files.items():
        write_parquet(events, path)


@pytest.fixture
def stub_nsys(tmp_path, monkeypatch, shared_fixtures):
    """main() with nsys replaced: 'profile' writes the run's interposer events, 'export' an
    export built from ``nvtx`` rows (edit the list before calling main)."""
    ddl = nsys_ddl(shared_fixtures)
    nvtx = [(0, None, 75, dom, global_tid(pid, pid), i) for pid in PIDS.values()
            for dom, i in (("NCCL", NCCL_DOM), ("DMuon", DMUON_DOM))]
    for rank, pid in PIDS.items():
        # each mode's window (the runner's dmuon.window range) and a warm-up call before it
        nvtx += [(9_000, 25_000, 59, "dmuon.window z3", global_tid(pid, pid), DMUON_DOM),
                 (29_000, 35_000, 59, "dmuon.window ddp", global_tid(pid, pid), DMUON_DOM),
                 (5_000 + rank, 5_050, 59, "ncclBroadcast", global_tid(pid, pid), NCCL_DOM),
                 (27_000 + rank, 27_050, 59, "ncclAllReduce", global_tid(pid, pid), NCCL_DOM)]
    for i, (_, _, api, _) in enumerate(RUN):
        for rank, pid in PIDS.items():
            t = 10_000 * (i + 1) + rank
            nvtx.append((t, t + 50, 59, api, global_tid(pid, pid), NCCL_DOM))

    def run(cmd, what):
        if what == "profile":
            _write_run(tmp_path)
        else:
            build_export(tmp_path / "report.sqlite", ddl, nvtx=nvtx)
        return 0

    monkeypatch.setattr(nv, "_gpu_count", lambda: 2)
    monkeypatch.setattr(nv, "_run", run)
    return nvtx


def _main(tmp_path):
    return nv.main(["--nsys", "nsys-stub", "--out-dir", str(tmp_path)])


def test_main_passes_without_sizes(tmp_path, stub_nsys, capsys):
    assert _main(tmp_path) == nv.EXIT_PASS
    out = capsys.readouterr().out
    assert "== z3\nnsys: PASS events=4 matched=4 unmatched=0 skipped=0 outside_window=0 " \
           "size_unknown=4" in out
    assert "== ddp\nnsys: PASS events=2 matched=2" in out
    assert "nsys-verify: 6 calls compared without sizes" in out
    assert "nsys-verify: 4 NCCL ranges outside the measured windows" in out
    assert out.rstrip().endswith("nsys-verify: PASS")


def test_main_fails_on_a_missing_call(tmp_path, stub_nsys, capsys):
    del stub_nsys[-1]  # rank 1's last ncclAllReduce
    assert _main(tmp_path) == nv.EXIT_FAIL
    out = capsys.readouterr().out
    assert "rank 1 group None: missing in nsys: reference all_reduce count=8 float32" in out
    assert out.rstrip().endswith("nsys-verify: FAIL")


def test_main_stops_on_a_process_of_no_rank(tmp_path, stub_nsys, capsys):
    stub_nsys.append((0, None, 75, "NCCL", global_tid(30, 30), NCCL_DOM))
    stub_nsys.append((0, None, 75, "DMuon", global_tid(30, 30), DMUON_DOM))
    stub_nsys.append((9_000, 25_000, 59, "dmuon.window z3", global_tid(30, 30), DMUON_DOM))
    stub_nsys.append((9_005, 9_009, 59, "ncclAllReduce", global_tid(30, 30), NCCL_DOM))
    assert _main(tmp_path) == nv.EXIT_STEP_FAILED
    err = capsys.readouterr().err
    assert "process(es) matching no rank (pid=30: 1 NCCL ranges" in err


def test_main_stops_without_windows(tmp_path, stub_nsys, capsys):
    stub_nsys[:] = [row for row in stub_nsys if not str(row[3]).startswith("dmuon.window ddp")]
    assert _main(tmp_path) == nv.EXIT_STEP_FAILED
    err = capsys.readouterr().err
    assert "no 'dmuon.window ddp' NVTX range (windows found: ['z3'])" in err


def test_load_reference(tmp_path):
    with pytest.raises(ValueError, match="no <mode>/events_rank<r>.parquet"):
        nv.load_reference(tmp_path)
    ev = CollectiveEvent(source="interposer", op="reduce", rank=1, count=4, dtype="float32",
                         source_ref="x")
    write_parquet([ev], tmp_path / "ddp" / "events_rank1.parquet")
    write_parquet([ev.replace(rank=0)], tmp_path / "z2" / "events_rank0.parquet")
    by_mode = nv.load_reference(tmp_path)
    assert sorted(by_mode) == ["ddp", "z2"] and [e.rank for e in by_mode["ddp"]] == [1]


def test_failed_profile_step_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nv, "_gpu_count", lambda: 2)
    rc = nv.main(["--nsys", "false", "--out-dir", str(tmp_path)])
    assert rc == nv.EXIT_STEP_FAILED == 4
    assert "workload under nsys failed with exit status 1" in capsys.readouterr().err
    rc = nv.main(["--nsys", str(tmp_path / "no-such-nsys"), "--out-dir", str(tmp_path)])
    assert rc == nv.EXIT_STEP_FAILED
    assert "could not start" in capsys.readouterr().err
