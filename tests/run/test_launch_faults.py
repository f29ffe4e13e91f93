"""The launcher always ends, with a code that says why, and takes its process tree with it.

- a run whose verdict is written while torchrun keeps waiting on a hung rank: the launcher
  returns the verdict within ``VERDICT_GRACE_S`` and no process of the tree is left;
- SIGTERM to the launcher (a CI job cancelled): the tree is stopped, the launcher ends;
- a full disk: the code still reaches ``exit_code`` (reserved at start, rewritten in place),
  the report's failure to fit says so, and ``bin/dmuon-ci code`` reads 5;
- rank 0 dying: a surviving rank claims the report (the store's ``compare_set``);
- no matplotlib: every file but the PNGs, and a line saying why.

The first four use stand-in processes and an in-memory store (seconds); the end-to-end runs
under torchrun are marked slow.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.tools.session import UNBLOCKED, run_session
from verify.run import ci, failstop
from verify.run.launch import descendants, supervise

REPO = Path(__file__).resolve().parents[2]
FACTORIES = "tests.distributed.phase_d.failure_factories"

#: A stand-in torchrun: writes the verdict, starts a "worker" in a session of its own (as
#: torchrun does) that never ends, and then waits for it forever.
HUNG_TREE = textwrap.dedent("""
    import pathlib, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                              start_new_session=True)
    pathlib.Path(sys.argv[1], "worker.pid").write_text(str(worker.pid))
    pathlib.Path(sys.argv[1], "exit_code").write_text("1\\n")
    worker.wait()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by its new parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the process tree is read from /proc")
@pytest.mark.timeout(240)
def test_a_written_verdict_ends_the_launcher_and_its_hung_tree(tmp_path):
    started = time.monotonic()
    code, why = supervise([sys.executable, "-c", HUNG_TREE, str(tmp_path)], None, tmp_path,
                          verdict_grace_s=1.0, kill_grace_s=1.0)
    assert code == -1 and "a rank is hung" in why and "stopped torchrun and its workers" in why
    assert time.monotonic() - started < 600  # the worker alone would hold it for 3600 s
    worker = int((tmp_path / "worker.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the hung worker outlived the launcher"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the process tree is read from /proc")
@pytest.mark.timeout(240)
def test_sigterm_to_the_launcher_stops_its_tree(tmp_path):
    """A cancelled CI job sends SIGTERM to the launcher: it must not leave torchrun and the
    workers running (they had the machine's cores until their group timeout)."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from verify.run.launch import supervise
        out = Path({str(tmp_path)!r})
        code, why = supervise([sys.executable, "-c", {HUNG_TREE!r}, str(out)], None,
                              out / "elsewhere", verdict_grace_s=3600, kill_grace_s=1.0)
        print(why, flush=True)
    """)
    (tmp_path / "elsewhere").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", UNBLOCKED, sys.executable, "-c", script],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "worker.pid")
    worker = int((tmp_path / "worker.pid").read_text())
    assert _alive(worker)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "interrupted by SIGTERM; stopped torchrun and its workers" in out
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def test_descendants_lists_grandchildren_in_other_sessions(tmp_path):
    if not Path("/proc").is_dir():
        pytest.skip("the process tree is read from /proc")
    proc = subprocess.Popen([sys.executable, "-c", HUNG_TREE, str(tmp_path)])
    try:
        _wait_for(tmp_path / "worker.pid")
        assert int((tmp_path / "worker.pid").read_text()) in descendants(proc.pid)
    finally:
        from verify.run.launch import stop_tree

        stop_tree(proc, grace_s=1.0)


def test_reserved_exit_code_reads_as_not_ended_and_takes_a_code_in_place(tmp_path):
    ci.reserve_exit(tmp_path)
    assert ci.read_code(tmp_path) is None
    with pytest.raises(ValueError, match="its run has not ended"):
        ci.read_exit_code(tmp_path)
    inode = (tmp_path / "exit_code").stat().st_ino
    ci.write_code(tmp_path / "exit_code", 5)
    assert (tmp_path / "exit_code").read_text() == "5\n"
    assert (tmp_path / "exit_code").stat().st_ino == inode  # the same file: no new allocation
    assert ci.read_exit_code(tmp_path) == 5 and ci.MEANINGS[5] == "output not written"
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "report.json"))
    assert ci.is_disk_full(RuntimeError("wrapped")) is False
    try:
        raise RuntimeError("writing the report") from full
    except RuntimeError as exc:
        assert ci.is_disk_full(exc)
    text = ci.disk_full_text(tmp_path / "report.json", full)
    assert text.startswith(f"the disk is full: writing {tmp_path / 'report.json'} failed")
    assert "bytes free on the filesystem of" in text and "--out-dir on another filesystem" in text


def _small_tmpfs_available() -> str | None:
    if not shutil.which("unshare"):
        return "no unshare(1) here"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot mount a small tmpfs in a user namespace here: {probe.stderr.strip()}"
    return None


@pytest.mark.timeout(240)
def test_on_a_really_full_disk_the_reserved_code_still_fits(tmp_path):
    """A 64 KiB tmpfs filled to the last byte: a new file cannot be written, the reserved
    exit_code takes its code."""
    why = _small_tmpfs_available()
    if why:
        pytest.skip(why)
    script = textwrap.dedent("""
        import errno, sys
        from pathlib import Path
        from verify.run import ci
        out = Path(sys.argv[1])
        ci.reserve_exit(out)
        try:
            with open(out / "filler", "wb") as f:
                while True:
                    f.write(b"x" * 4096)
                    f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            (out / "report.json").write_text("{}" * 4096)
        except OSError as exc:
            assert ci.is_disk_full(exc)
            print("FULL:", ci.disk_full_text(out / "report.json", exc))
        ci.write_code(out / "exit_code", ci.EXIT_OUTPUT)
        print("CODE:", ci.read_exit_code(out))
    """)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         f'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -c "$3" "$1"', "sh", str(mnt),
         sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "FULL: the disk is full: writing" in proc.stdout and "CODE: 5" in proc.stdout


def test_a_survivor_claims_the_report_when_rank0_is_gone_and_only_one_claim_wins():
    store = dist.HashStore()
    boards = [failstop.Board(store, rank=r, world=3) for r in range(3)]
    claims = {}

    def claim(r):
        claims[r] = boards[r].claim_report(wait_s=0.5)

    threads = [threading.Thread(target=claim, args=(r,)) for r in (1, 2)]  # rank 0 is dead
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(claims.values()) == [False, True]  # exactly one survivor writes

    store = dist.HashStore()  # rank 0 alive: it claims at once, the others stand down
    boards = [failstop.Board(store, rank=r, world=3) for r in range(3)]
    assert boards[0].claim_report(wait_s=0.5) is True
    assert boards[1].claim_report(wait_s=0.5) is False


def _launch(out: Path, factory: str, *extra: str, env=None) -> subprocess.CompletedProcess:
    return run_session(
        [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", str(out),
         "--modes", "dmuon-ddp,dmuon-z2", "--steps-warmup", "2", "--steps-measured", "1",
         "--no-profiler", "--model", f"{FACTORIES}:{factory}", *extra],
        cwd=REPO, text=True, timeout=300, env=env)


@pytest.mark.distributed
@pytest.mark.slow  # ~40 s of torchrun
@pytest.mark.timeout(400)
def test_rank0_dying_is_reported_by_a_survivor_naming_rank0(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, "exits_on_rank0")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    failed = {f["mode"]: f["detail"] for f in report["failures"]}
    assert "rank 0 posted no status" in failed["dmuon-ddp"], failed
    assert report["stopped"]["missing_ranks"] == [0]
    assert failed["dmuon-z2"].startswith("not run: the run stopped in dmuon-ddp")
    assert (out / "exit_code").read_text() == "1\n"


@pytest.mark.distributed
@pytest.mark.slow  # ~70 s: the group timeout, the settle wait, the verdict grace
@pytest.mark.timeout(400)
def test_a_hung_rank_is_reported_and_the_launcher_ends_taking_it_along(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, "hangs_on_rank1", "--timeout-s", "15")  # rank 1 alone sleeps 10**6 s
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "a rank is hung or did not exit); stopped torchrun and its workers" in proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert not report["pass"] and report["stopped"]["mode"] == "dmuon-ddp"
    leftover = subprocess.run(["pgrep", "-f", f"--out-dir {out}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout


@pytest.mark.distributed
@pytest.mark.slow  # ~25 s of torchrun
@pytest.mark.timeout(400)
def test_without_matplotlib_every_file_but_the_pngs_is_written(tmp_path):
    hide = tmp_path / "hide"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text(
        "raise ImportError('No module named matplotlib (hidden by the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(REPO)])}
    out = tmp_path / "run"
    proc = run_session(
        [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", str(out),
         "--modes", "dmuon-z2", "--steps-warmup", "2", "--steps-measured", "1"],
        cwd=REPO, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "writing no PNG (traffic.png, memory.png, timelines); every other file is written" in proc.stderr
    for name in ("report.json", "report.md", "junit.xml", "dmuon-z2/timeline.json"):
        assert (out / name).is_file(), name
    assert not list(out.rglob("*.png"))
    assert "no traffic.png: matplotlib is not installed" in (out / "report.md").read_text()


@pytest.mark.distributed
@pytest.mark.slow  # ~30 s of torchrun
@pytest.mark.timeout(400)
def test_a_run_on_a_full_disk_says_so_and_exits_5(tmp_path):
    """verify-traffic with its output on a 256 KiB tmpfs: the run fills it. It used to end in a
    raw OSError traceback, "raised on rank N: ?" for every rank, and an empty exit_code that
    ``bin/dmuon-ci code`` read as 2."""
    why = _small_tmpfs_available()
    if why:
        pytest.skip(why)
    mnt, kept = tmp_path / "mnt", tmp_path / "kept"
    mnt.mkdir()
    run = [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", f"{mnt}/run",
           "--modes", "dmuon-ddp", "--steps-warmup", "1", "--steps-measured", "1"]
    # the mount lives as long as the namespace: keep a copy of what the run left
    shell = ('mount -t tmpfs -o size=256k tmpfs "$1" && shift && "$@"; code=$?; '
             f'cp -r "{mnt}/run" "{kept}"; exit $code')
    proc = run_session(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell,
                        "sh", str(mnt), *run], cwd=REPO, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == ci.EXIT_OUTPUT, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the disk is full: writing" in proc.stderr and "--out-dir on another filesystem" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (kept / "exit_code").read_text() == "5\n"
    assert ci.read_exit_code(kept) == 5
