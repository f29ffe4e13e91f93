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
turns every failure into 2, ``bin/dmuon-ci verify-traffic`` returns the code itself).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import subprocess
import sys
from pathlib import Path

import torch

from tracer.fr.parse import flight_recorder_env
from verify.run.ci import record_exit
from verify.run.nodes import NODE_FILE, report_elsewhere
from verify.run.main import EXIT_MISMATCH, EXIT_NO_HARDWARE, EXIT_USAGE, VERDICT_FILE, parse_args
from verify.run.runner import RunConfig
from verify.traffic.ep import ep_skip_reason
from verify.traffic.tp import tp_skip_reason
from verify.workload.data import global_batch_size
from verify.workload.usermodel import resolve, skip_reasons

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
        found.append(f"FAIL: {path.parent.name} raised on rank {rank}: {lines[-1] if lines else '?'}")
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
    (``verify.run.main.parse_args``: flags, ``--modes`` names, step counts), a mode set that
    cannot run at W = ``nproc``, a ``--tp`` T that does not divide W or with which no mode
    of the set can run (``verify.traffic.tp.tp_skip_reason``: the TP-capable modes), a
    ``--global-batch`` that W does not divide, and a ``--model`` that cannot be imported.
    Returns one line, or ``None``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_args([*extra, "--out-dir", str(out_dir)])
    except SystemExit:  # argparse's usage line, then "prog: error: ..."
        return err.getvalue().strip().splitlines()[-1].partition("error: ")[2] or err.getvalue().strip()
    modes = args.modes.split(",")
    at = f"at W={nproc}"
    if args.ep > 1:  # the workers' mesh is (W/E) x E (verify.run.ep_modes.ep_mesh)
        if nproc % args.ep:
            return (f"Invalid --ep {args.ep} at W={nproc} (--nproc). Must divide W, the mesh being "
                    f"(W/E) x E: give an --nproc that {args.ep} divides.")
        skipped = {m: why for m in modes if (why := ep_skip_reason(m, nproc, args.ep))}
        at = f"with --ep {args.ep} at W={nproc}"
    elif args.tp > 1:  # the workers' mesh is (W/T) x T (verify.run.tp_modes.tp_mesh)
        if nproc % args.tp:
            fits = [str(t) for t in range(2, nproc + 1) if nproc % t == 0]
            return (f"Invalid --tp {args.tp} at W={nproc} (--nproc). Must divide W, the mesh being "
                    f"(W/T) x T: give --tp {' or '.join(fits) or '1'}, or an --nproc that "
                    f"{args.tp} divides.")
        skipped = {m: why for m in modes if (why := tp_skip_reason(m, nproc, args.tp))}
        at = f"with --tp {args.tp} at W={nproc}"
    else:
        skipped = skip_reasons(modes, nproc)
    if len(skipped) == len(modes):
        return f"no mode of --modes {args.modes} can run {at}: {'; '.join(sorted(set(skipped.values())))}"
    try:
        global_batch_size(nproc, per_rank=RunConfig.batch_per_rank, global_batch=args.global_batch)
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
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_run_outputs(out_dir)  # only this run's errors and verdict are read below
    cpu_why = "" if args.backend == "gloo" else " (no ≥2 GPUs visible)"
    where = f"{nproc} GPU(s), NCCL" if use_nccl else f"{nproc} local CPU processes, gloo{cpu_why}"
    nodes = f" per node, {args.nnodes} nodes" if args.nnodes > 1 else ""
    print(f"verify-traffic: {where}{nodes}; output in {out_dir}/", flush=True)
    cmd = launch_command(nproc, out_dir, [*extra, "--backend", "nccl" if use_nccl else "gloo"],
                         rendezvous)
    code = subprocess.call(cmd, env=launch_env(use_nccl, out_dir))
    verdict = out_dir / VERDICT_FILE
    if code != 0:
        raised = rank_errors(out_dir)
        cause = f"; {raised}" if raised else ""
        if verdict.is_file():  # rank 0 reported the failure (verify.run.failstop)
            cause = f"; rank 0's report names it: {out_dir / 'report.md'}"
        print(f"verify-traffic: torchrun exited with {code} (a worker failed; see above){cause}",
              file=sys.stderr)
        return record_exit(out_dir, EXIT_MISMATCH, PROG)  # the run failed: 1, whatever torchrun's
    elsewhere = report_elsewhere(out_dir)
    if elsewhere:  # a node without rank 0: the verdict came through the store
        print(f"verify-traffic: {elsewhere}", flush=True)
    if not verdict.is_file():
        print(f"verify-traffic: no verdict in {verdict}; the run did not finish", file=sys.stderr)
        return record_exit(out_dir, EXIT_MISMATCH, PROG)
    return record_exit(out_dir, int(verdict.read_text()), PROG)


if __name__ == "__main__":
    sys.exit(main())
