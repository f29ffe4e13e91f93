"""``make verify-traffic``: start the harness under torchrun on whatever this machine has.

- ≥ 2 visible GPUs: one process per GPU, NCCL, with ``NCCL_DEBUG=INFO``,
  ``NCCL_DEBUG_SUBSYS=INIT,COLL`` and one ``NCCL_DEBUG_FILE`` per process
  (``<out>/nccl/nccl.%h.%p.log``; NCCL expands only %h and %p).
- otherwise the embedded default: ``--nproc`` (default 4) local CPU processes on gloo.
- ``--backend nccl`` forces NCCL (one process per GPU, ``--nproc`` at most the GPU count, 1
  allowed: ``make gpu-check`` runs W = 1 on one GPU); ``--backend gloo`` forces CPU processes.

Traces and reports go to ``traces/<run-id>/`` (or ``--out-dir``). The exit code: 0 every check
passed, 1 a check failed (verify.run.main's verdict: its last line names which, by mode) or a
worker failed (torchrun's status is printed), 2 bad input, 3 ``--backend nccl`` without a GPU.
It is also written to ``<out>/exit_code`` and printed on stderr (``verify.run.ci``: ``make``
turns every failure into 2, ``bin/dmuon-ci verify-traffic`` returns the code itself); 5 where
the output could not be written (the disk is full: ``verify.run.ci.EXIT_OUTPUT``).

The launcher always ends and takes its process tree with it (:func:`supervise`): once the run's
verdict is written it gives torchrun :data:`VERDICT_GRACE_S` seconds to end (a rank that hung
keeps torchrun waiting after its peers exit), then stops torchrun and every worker; SIGTERM,
SIGINT or SIGHUP to the launcher stop the tree the same way, and on Linux torchrun gets SIGTERM
when the launcher dies by any means (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tracer.fr.parse import flight_recorder_env
from verify.run.ci import EXIT_OUTPUT, read_code, record_exit, reserve_exit
from verify.run.nodes import NODE_FILE, report_elsewhere
from verify.run.main import EXIT_MISMATCH, EXIT_NO_HARDWARE, EXIT_USAGE, VERDICT_FILE, parse_args
from verify.modes.workloads import workload_of
from verify.run.runner import RunConfig
from verify.workload.data import global_batch_size
from verify.workload.usermodel import resolve

DEFAULT_CPU_PROCS = 4
PROG = "verify-traffic"


def rendezvous_args(nnodes: int, endpoint: str | None, rdzv_id: str) -> list[str]:
    """torchrun's rendezvous flags: ``--standalone`` on one node, else c10d rendezvous at
    ``endpoint`` (``HOST:PORT`` every node reaches; the node whose address it names hosts the
    store) under the job id ``rdzv_id`` (a pure function, tested).

    Raises:
        ValueError: ``nnodes`` < 1, or > 1 without an ``endpoint`` of the form ``HOST:PORT``.
    """
    if nnodes < 1:
        raise ValueError(f"Invalid --nnodes {nnodes}. Must be >= 1.")
    if nnodes == 1 and endpoint is None:
        return ["--standalone"]
    host, _, port = (endpoint or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Invalid --rdzv-endpoint {endpoint!r}. Must be HOST:PORT (the address "
                         "of one node, reachable from every node; a free port) with --nnodes > 1.")
    return ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", rdzv_id]


def launch_command(nproc: int, out_dir: Path, extra: list[str],
                   rendezvous: list[str] = ("--standalone",)) -> list[str]:
    """The torchrun command line (a pure function, tested); ``rendezvous``:
    :func:`rendezvous_args`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={nproc}",
        "-m",
        "verify.run.main",
        "--out-dir",
        str(out_dir),
        *extra,
    ]


def launch_env(use_nccl: bool, out_dir: Path) -> dict[str, str]:
    """Environment for the workers: NCCL logging on NCCL runs; never DETAIL debug (it adds
    hidden fingerprint collectives)."""
    env = dict(os.environ)
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(flight_recorder_env())
    if use_nccl:
        (out_dir / "nccl").mkdir(parents=True, exist_ok=True)
        env.update(
            NCCL_DEBUG="INFO",
            NCCL_DEBUG_SUBSYS="INIT,COLL",
            NCCL_DEBUG_FILE=str(out_dir / "nccl" / "nccl.%h.%p.log"),
        )
    return env


#: ``--backend`` choices: ``auto`` = NCCL on >= 2 GPUs, else gloo.
BACKENDS = ("auto", "nccl", "gloo")


def resolve_backend(backend: str, gpus: int, nproc: int | None) -> tuple[bool, int]:
    """``(use_nccl, nproc)`` for ``--backend`` and ``--nproc`` on a machine with ``gpus`` GPUs.

    Raises:
        ValueError: an unknown backend, NCCL without a GPU or with more processes than GPUs,
            or ``nproc`` < 1 (< 2 for ``auto``, whose CPU default is a multi-process run).
    """
    if backend not in BACKENDS:
        raise ValueError(f"Invalid --backend={backend!r}. Must be one of {BACKENDS}.")
    if nproc is not None and nproc < 1:  # 0 used to mean the default
        raise ValueError(f"Invalid --nproc={nproc}. Must be >= 1, or left out for the default "
                         f"(the GPU count, else {DEFAULT_CPU_PROCS} CPU processes).")
    if backend == "nccl" or (backend == "auto" and gpus >= 2):
        n = nproc or gpus
        if gpus < 1 or not 1 <= n <= gpus:
            raise ValueError(f"Invalid --nproc={n} for --backend nccl with {gpus} visible GPUs. "
                             "Must be between 1 and the GPU count (one GPU per process).")
        return True, n
    n = nproc or DEFAULT_CPU_PROCS
    if n < (2 if backend == "auto" else 1):
        raise ValueError(f"Invalid --nproc={n}. Must be >= 2 (a distributed run), or pass "
                         "--backend gloo / nccl explicitly for a 1-process run.")
    return False, n


#: Texts of errors that a rank gets because a peer left a collective (gloo's TCP transport).
TRANSPORT_ERRORS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer")


#: Seconds torchrun may still run after the run's verdict is in ``<out>/exit_code`` (the report
#: is written) before the launcher stops it: the time a finished job needs to exit.
VERDICT_GRACE_S = 15.0
#: Seconds between SIGTERM and SIGKILL when the launcher stops torchrun and its workers.
KILL_GRACE_S = 5.0
#: Poll period of :func:`supervise` (seconds).
POLL_S = 0.2


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from ``/proc/<p>/stat``'s parent
    field; ``[]`` where ``/proc`` is absent. torchrun starts each worker in a session of its own,
    so a process-group signal does not reach them; this list does."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            fields = stat.read_text().rpartition(")")[2].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def stop_tree(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """Stop ``proc`` and every process under it: SIGTERM to all of them (torchrun then closes
    its workers too), SIGKILL to those still alive ``grace_s`` seconds later, then reap ``proc``."""
    tree = descendants(proc.pid)
    for pid in [proc.pid, *tree]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    for pid in [proc.pid, *tree, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The child's ``preexec_fn`` on Linux: SIGTERM when the launcher dies (``prctl(2)``
    ``PR_SET_PDEATHSIG``), so that not even a SIGKILL of the launcher leaves torchrun running."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class Interrupted(Exception):
    """The launcher received a signal that ends it (its number in ``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def supervise(cmd: list[str], env: dict[str, str] | None, out_dir: Path,
              verdict_grace_s: float = VERDICT_GRACE_S, kill_grace_s: float = KILL_GRACE_S) -> tuple[int, str]:
    """Run ``cmd`` (torchrun) to its end, or until the run's verdict has been in
    ``<out_dir>/exit_code`` for ``verdict_grace_s`` seconds, or until the launcher is told to
    stop (SIGTERM, SIGINT, SIGHUP); in the last two cases stop its whole tree (:func:`stop_tree`).

    Returns:
        ``(returncode, why)``: torchrun's exit status and ``""`` where it ended by itself, else
        ``-1`` and one line saying why it was stopped.
    """
    def on_signal(signum, frame):  # noqa: ARG001
        raise Interrupted(signum)

    linux = sys.platform.startswith("linux")
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if linux else None)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # where handlers may be set
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        verdict_at = None
        while proc.poll() is None:
            if verdict_at is None and read_code(out_dir) is not None:
                verdict_at = time.monotonic()
            if verdict_at is not None and time.monotonic() - verdict_at > verdict_grace_s:
                why = (f"the report's verdict was written {verdict_grace_s:.0f} s ago and torchrun "
                       "has not ended (a rank is hung or did not exit); stopped torchrun and its "
                       "workers")
                stop_tree(proc, kill_grace_s)
                return -1, why
            time.sleep(POLL_S)
        return proc.returncode, ""
    except Interrupted as exc:
        stop_tree(proc, kill_grace_s)
        return -1, f"interrupted by {signal.Signals(exc.signum).name}; stopped torchrun and its workers"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rank_errors(out_dir: Path) -> str:
    """What the ranks recorded before a worker died (``<mode>/error_rank<r>.txt``, written by
    ``verify.run.runner`` when a mode raises on a rank; :func:`main` removes an earlier run's
    first, :func:`clear_run_outputs`): ``"FAIL: <mode> raised on rank r:
    <exception line>"`` per file, or ``""``. A rank that raised alone leaves the others in a
    collective that can no longer pair up, so torchrun's failure is often a peer's abort."""
    found = []
    for path in sorted(out_dir.glob("*/error_rank*.txt")):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        rank = path.stem.removeprefix("error_rank")
        said = lines[-1] if lines else ("its error file is empty (the error could not be written: "
                                        "is the disk full?)")
        found.append(f"FAIL: {path.parent.name} raised on rank {rank}: {said}")
    # a peer's broken connection is a consequence: the ranks' own errors first
    found.sort(key=lambda text: any(mark in text for mark in TRANSPORT_ERRORS))
    return "; ".join(found)


def clear_run_outputs(out_dir: Path) -> list[Path]:
    """Remove what an earlier run in ``out_dir`` left that the launcher reads after this one
    (``<mode>/error_rank<r>.txt``, :func:`rank_errors`; the verdict file), so that a reused
    folder (``--run-id``, ``make timeline-png``'s fixed ``--out-dir``) never reports another
    run's error or verdict. Returns the removed paths."""
    stale = [*out_dir.glob("*/error_rank*.txt"), out_dir / VERDICT_FILE, out_dir / NODE_FILE]
    removed = []
    for path in stale:
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed


def usage_problem(extra: list[str], out_dir: Path, nproc: int) -> str | None:
    """What the workers would refuse before training, checked once here: their arguments
    (``verify.run.main.parse_args``: flags, ``--modes`` names, step counts, parallel degrees
    that no workload runs together), a ``--global-batch`` that W does not divide, a W that
    cannot hold the workload's mesh or split its batch (``Workload.mesh_problem``,
    ``verify.modes.workload``), a mode set of which no mode can run there
    (``Workload.skip_reason``), and a ``--model`` that cannot be imported.
    Returns one line, or ``None``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_args([*extra, "--out-dir", str(out_dir)])
    except SystemExit:  # argparse's usage line, then "prog: error: ..."
        return err.getvalue().strip().splitlines()[-1].partition("error: ")[2] or err.getvalue().strip()
    modes = args.modes.split(",")
    workload = workload_of(args)  # parse_args has refused what no workload runs
    try:
        rows = global_batch_size(nproc, per_rank=RunConfig.batch_per_rank, global_batch=args.global_batch)
    except ValueError as exc:
        return str(exc)
    problem = workload.mesh_problem(nproc, args, global_batch=rows, seq_len=RunConfig.seq_len,
                                    where=" (--nproc)")
    if problem is not None:
        return problem
    skipped = workload.skip_reasons(modes, nproc, args)
    at = f"with {workload.flags(args)} at W={nproc}" if workload.axes else f"at W={nproc}"
    if len(skipped) == len(modes):
        return f"no mode of --modes {args.modes} can run {at}: {'; '.join(sorted(set(skipped.values())))}"
    try:
        resolve(args.model)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make verify-traffic", description=__doc__.split("\n\n")[0],
        epilog="Every other option (--modes, --model, --coalesce, --rest, --hierarchy, --tp, "
               "--ep, --qk-clip, --mixed-precision, ...) goes to each rank's python -m verify.run.main: see its "
               "--help; docs/verify.md.")
    parser.add_argument("--nproc", type=int, default=None, help=f"CPU processes when < 2 GPUs (default {DEFAULT_CPU_PROCS})")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto: NCCL on >= 2 GPUs, else gloo; nccl / gloo force one")
    parser.add_argument("--run-id", default=None, help="traces/<run-id>/ (default: UTC timestamp)")
    parser.add_argument("--out-dir", default=None, help="output folder (default: traces/<run-id>/)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes of the job; > 1: run this command on every node with the same "
                             "--rdzv-endpoint and --rdzv-id (docs/verify.md, 'More than one node')")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="c10d rendezvous address (one node's, reachable from all)")
    parser.add_argument("--rdzv-id", default="dmuon-verify", help="rendezvous job id (default: %(default)s)")
    args, extra = parser.parse_known_args(argv)
    run_id = args.run_id or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir) if args.out_dir else Path("traces") / run_id
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        use_nccl, nproc = resolve_backend(args.backend, gpus, args.nproc)
    except ValueError as exc:
        print(f"make verify-traffic: error: {exc}", file=sys.stderr)
        no_gpu = args.backend == "nccl" and gpus == 0  # missing hardware, not a usage error
        return record_exit(out_dir, EXIT_NO_HARDWARE if no_gpu else EXIT_USAGE, PROG)
    try:
        rendezvous = rendezvous_args(args.nnodes, args.rdzv_endpoint, args.rdzv_id)
    except ValueError as exc:
        print(f"make verify-traffic: error: {exc}", file=sys.stderr)
        return record_exit(out_dir, EXIT_USAGE, PROG)
    problem = usage_problem(extra, out_dir, nproc * args.nnodes)  # W over every node
    if problem:  # one line and exit 2 here, not the same error from every rank under torchrun
        print(f"make verify-traffic: error: {problem}", file=sys.stderr)
        return record_exit(out_dir, EXIT_USAGE, PROG)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        clear_run_outputs(out_dir)  # only this run's errors and verdict are read below
        reserve_exit(out_dir)  # rank 0's verdict and this launcher's code fit on a full disk
    except OSError as exc:
        print(f"make verify-traffic: error: cannot write the output folder {out_dir}: {exc}",
              file=sys.stderr)
        return record_exit(out_dir, EXIT_OUTPUT, PROG)
    cpu_why = "" if args.backend == "gloo" else " (no ≥2 GPUs visible)"
    where = f"{nproc} GPU(s), NCCL" if use_nccl else f"{nproc} local CPU processes, gloo{cpu_why}"
    nodes = f" per node, {args.nnodes} nodes" if args.nnodes > 1 else ""
    print(f"verify-traffic: {where}{nodes}; output in {out_dir}/", flush=True)
    cmd = launch_command(nproc, out_dir, [*extra, "--backend", "nccl" if use_nccl else "gloo"],
                         rendezvous)
    code, stopped = supervise(cmd, launch_env(use_nccl, out_dir), out_dir)
    verdict = read_code(out_dir)  # rank 0's (or the reporting rank's) verdict, or None
    if stopped:
        print(f"verify-traffic: {stopped}", file=sys.stderr, flush=True)
        if verdict is not None and not stopped.startswith("interrupted"):
            return record_exit(out_dir, verdict, PROG)
        return record_exit(out_dir, EXIT_MISMATCH, PROG)
    if code != 0:
        raised = rank_errors(out_dir)
        cause = f"; {raised}" if raised else ""
        if verdict is not None:  # a rank reported the failure (verify.run.failstop)
            cause = f"; the report names it: {out_dir / 'report.md'}"
        print(f"verify-traffic: torchrun exited with {code} (a worker failed; see above){cause}",
              file=sys.stderr)
        # the run failed: 1 whatever torchrun's, 5 where the report said the disk is full
        return record_exit(out_dir, EXIT_OUTPUT if verdict == EXIT_OUTPUT else EXIT_MISMATCH, PROG)
    elsewhere = report_elsewhere(out_dir)
    if elsewhere:  # a node without rank 0: the verdict came through the store
        print(f"verify-traffic: {elsewhere}", flush=True)
    if verdict is None:
        print(f"verify-traffic: no verdict in {out_dir / VERDICT_FILE}; the run did not finish",
              file=sys.stderr)
        return record_exit(out_dir, EXIT_MISMATCH, PROG)
    return record_exit(out_dir, verdict, PROG)


if __name__ == "__main__":
    sys.exit(main())
