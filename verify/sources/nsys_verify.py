"""``make nsys-verify``: the verify-traffic workload under Nsight Systems, checked against the
interposer.

Steps (where ``nsys`` is on PATH and ``torch.cuda.device_count() >= 2``):

1. ``nsys profile -t cuda,nvtx -o <dir>/report --force-overwrite=true python -m verify.run.launch
   --out-dir <dir>``: the workload writes ``<dir>/report.json`` and interposer events
   ``<dir>/<mode>/events_rank<r>.parquet``; nsys writes ``<dir>/report.nsys-rep``.
2. ``nsys export --type sqlite --include-blobs=true --force-overwrite=true -o
   <dir>/report.sqlite <dir>/report.nsys-rep``.
3. :func:`tracer.nsys.parse.parse_nsys`; per mode, the NCCL ranges inside that mode's
   ``dmuon.window <mode>`` NVTX ranges (:func:`window_events`: the runner opens and closes them
   where the interposer's window opens and closes, so set-up, warm-up and the gathers between
   modes are left out), ranks assigned by pid (:func:`assign_ranks`; the interposer records
   each rank's pid), then :func:`tracer.crosscheck.crosscheck` ``(reference=interposer,
   other=nsys, source="nsys")``.

nsys events carry no communicator or size (the payload blob is not decoded, see
``tracer/nsys/payload.py``), so both sides are compared per rank in time order, without group
ids or sequence numbers, and by op only: the cross-check's ``size_unknown`` counts those
calls, and the printed verdict says that their sizes were not compared.

Exit codes: 0 pass; 1 cross-check failed; 3 prerequisites missing (no ``nsys`` on PATH, fewer
than 2 GPUs; the message names which); 4 a step failed (workload, export, parse, a mode without
its window, rank assignment: the message says which, with its exit status or error).
The code is also written to ``<out-dir>/exit_code`` and printed on stderr (``verify.run.ci``;
``bin/dmuon-ci nsys-verify`` returns it, where ``make`` can only say 2).

Not yet run on GPUs; ``tests/run/test_nsys_verify.py`` runs :func:`main` on exports built in the
real export's schema with ``nsys`` replaced by a stub.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from verify.run.ci import record_exit

EXIT_PASS, EXIT_FAIL, EXIT_PREREQUISITES, EXIT_STEP_FAILED = 0, 1, 3, 4
MIN_GPUS = 2


def missing_prerequisites(nsys_path: str | None, gpu_count: int) -> list[str]:
    """What this machine lacks for an nsys run, one sentence each (empty: all present)."""
    missing = []
    if nsys_path is None:
        missing.append("`nsys` is not on PATH (install Nsight Systems, or add its target-linux-x64 "
                       "folder to PATH)")
    if gpu_count < MIN_GPUS:
        missing.append(f"torch.cuda.device_count() = {gpu_count}, need >= {MIN_GPUS} GPUs for an "
                       "NCCL run")
    return missing


def profile_command(out_dir: Path, *, nsys: str = "nsys", python: str = sys.executable,
                    extra: Sequence[str] = ()) -> list[str]:
    """``nsys profile`` around the workload; the report lands in ``<out_dir>/report.nsys-rep``."""
    return [nsys, "profile", "-t", "cuda,nvtx", "-o", str(out_dir / "report"),
            "--force-overwrite=true", python, "-m", "verify.run.launch", "--out-dir", str(out_dir),
            *extra]


def export_command(report: Path, sqlite_out: Path, *, nsys: str = "nsys") -> list[str]:
    """``nsys export`` to SQLite with the payload blobs (``binaryData``) included."""
    return [nsys, "export", "--type", "sqlite", "--include-blobs=true", "--force-overwrite=true",
            "-o", str(sqlite_out), str(report)]


def load_reference(out_dir: Path) -> dict[str, list]:
    """Interposer events per mode: ``<out_dir>/<mode>/events_rank<r>.parquet``.

    Raises:
        ValueError: no such file.
    """
    from tracer.events import read_parquet

    files = sorted(out_dir.glob("*/events_rank*.parquet"))
    if not files:
        raise ValueError(f"Invalid workload output out_dir={str(out_dir)!r}: no "
                         "<mode>/events_rank<r>.parquet. Must be written by verify.run.launch.")
    by_mode: dict[str, list] = {}
    for f in files:
        by_mode.setdefault(f.parent.name, []).extend(read_parquet(f))
    return by_mode


def window_events(result, mode: str) -> list:
    """The nsys events of ``mode``'s measured window: issued by a process inside its
    ``dmuon.window <mode>`` NVTX range (:func:`dmuon.annotate.window`, opened and closed by the
    runner where the interposer's window opens and closes).

    Raises:
        ValueError: the export has no ``dmuon.window <mode>`` range (DMuon's NVTX switched off
            with ``DMUON_NVTX=0``, or ``-t nvtx`` missing from ``nsys profile``).
    """
    windows = [w for w in result.windows if w.name == mode]
    if not windows:
        found = sorted({w.name for w in result.windows})
        raise ValueError(f"Invalid nsys export for mode {mode!r}: no 'dmuon.window {mode}' NVTX "
                         f"range (windows found: {found}). Must profile with -t nvtx and DMuon's "
                         "NVTX on (unset DMUON_NVTX).")
    return [ev for ev in result.events if any(w.contains(ev) for w in windows)]


def _rank_by_pid(reference) -> dict[int, int]:
    """``{pid: rank}`` of the reference events that carry both (empty: none carries a pid)."""
    ranks_by_pid: dict[int, set[int]] = {}
    for e in reference:
        if e.pid is not None and e.rank is not None:
            ranks_by_pid.setdefault(e.pid, set()).add(e.rank)
    shared = {pid: sorted(r) for pid, r in ranks_by_pid.items() if len(r) > 1}
    if shared:
        raise ValueError(f"Invalid reference events: pid -> ranks {shared} (one pid, several "
                         "ranks). Must be one process per rank on one host: pass the reference "
                         "events of the host whose nsys report is checked.")
    return {pid: next(iter(r)) for pid, r in ranks_by_pid.items()}


def assign_ranks(nsys_events, reference):
    """nsys events with ``rank`` set from the process that issued them.

    By ``pid`` where the reference (interposer) events carry one (:mod:`tracer.interposer`
    records ``os.getpid()``): an nsys process is the rank whose reference events have its pid,
    exact on one node. Otherwise by CUDA device, taking rank = ``cuda_dev`` (torchrun's one
    process per GPU with device = local rank = rank on one node); events without a device keep
    ``rank=None``. Group ids and seqs are cleared (nsys does not know them) and events are
    ordered by (rank, t_start_ns) so that threads of one process merge into issue order.

    Args:
        nsys_events: :class:`~tracer.events.CollectiveEvent` of ``source="nsys"`` (``pid`` from
            the export's ``globalTid``).
        reference: the interposer's events of the same run, all ranks.

    Raises:
        ValueError: by pid, an nsys process whose pid no reference event has (the report and
            the reference come from different runs, or a process outside the workload's ranks
            issued NCCL calls); or one pid with events of two ranks in the reference (pids of
            several hosts: check one host's report against that host's ranks).
    """
    rank_by_pid = _rank_by_pid(reference)
    if rank_by_pid:
        unmatched: dict[int | None, list] = {}
        for ev in nsys_events:
            if ev.pid not in rank_by_pid:
                unmatched.setdefault(ev.pid, []).append(ev)
        if unmatched:
            known = dict(sorted(rank_by_pid.items()))
            found = "; ".join(f"pid={pid}: {len(evs)} NCCL ranges, first {evs[0].source_ref}"
                              for pid, evs in sorted(unmatched.items(), key=lambda kv: repr(kv[0])))
            raise ValueError(f"Invalid nsys events: process(es) matching no rank ({found}); the "
                             f"reference has pid -> rank {known}. Must come from the same run as "
                             "the reference events (profile the workload and read its "
                             "<mode>/events_rank<r>.parquet, as `make nsys-verify` does).")
    out = []
    for ev in nsys_events:
        rank = rank_by_pid[ev.pid] if rank_by_pid else ev.cuda_dev
        out.append(ev.replace(rank=rank, group_id=None, seq=None))
    return sorted(out, key=_rank_then_time)


def _rank_then_time(e) -> tuple:
    """Sort key: by rank (unknown last), then issue time (a stable sort keeps ties in order)."""
    return (e.rank is None, e.rank or 0, e.t_start_ns or 0)


def _reference_per_rank(reference):
    """Reference events keyed by rank only (nsys has no group ids), in issue order
    (``t_start_ns``: one clock per process; a stable sort keeps the issue order of a coalesced
    call's events, which share their times)."""
    ordered = sorted(reference, key=_rank_then_time)
    return [ev.replace(group_id=None, seq=None) for ev in ordered]


def check_modes(result, reference: dict[str, list]) -> dict[str, object]:
    """Per mode, :func:`tracer.crosscheck.crosscheck` of the nsys events in its window against
    the interposer's events of that mode (per rank, in time order, by op where nsys has no
    size).

    Raises:
        ValueError: a mode without a window, or a process matching no rank (see
            :func:`window_events`, :func:`assign_ranks`).
    """
    from tracer.crosscheck import crosscheck

    checks = {}
    for mode, events in reference.items():
        ranked = assign_ranks(window_events(result, mode), events)
        checks[mode] = crosscheck(_reference_per_rank(events), ranked, source="nsys",
                                  backend="nccl")
    return checks


def _run(cmd: list[str], what: str) -> int:
    print(f"nsys-verify: {what}: {' '.join(cmd)}", flush=True)
    try:
        return subprocess.call(cmd)
    except OSError as exc:
        print(f"nsys-verify: {what} could not start: {exc}", file=sys.stderr)
        return 127


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make nsys-verify", description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 pass, 1 cross-check failed, 3 prerequisites missing, 4 a step "
               "failed.")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="output folder (default traces/nsys-<UTC timestamp>)")
    parser.add_argument("--nsys", default=None, help="nsys executable (default: from PATH)")
    args, extra = parser.parse_known_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.out_dir or Path("traces") / f"nsys-{stamp}"
    # make turns every failure into 2: the code goes to <out_dir>/exit_code (verify.run.ci)
    return record_exit(out_dir, _verify(args.nsys or shutil.which("nsys"), out_dir, extra),
                       "nsys-verify")


def _verify(nsys: str | None, out_dir: Path, extra: list[str]) -> int:
    """Steps 1-3 of the module docstring; the exit code."""
    missing = missing_prerequisites(nsys, _gpu_count())
    if missing:
        print("nsys-verify: prerequisites missing, nothing run:\n  - " + "\n  - ".join(missing),
              file=sys.stderr)
        return EXIT_PREREQUISITES
    out_dir.mkdir(parents=True, exist_ok=True)
    rc = _run(profile_command(out_dir, nsys=nsys, extra=extra), "profile")
    if rc != 0:
        print(f"nsys-verify: workload under nsys failed with exit status {rc}", file=sys.stderr)
        return EXIT_STEP_FAILED
    sqlite_out = out_dir / "report.sqlite"
    rc = _run(export_command(out_dir / "report.nsys-rep", sqlite_out, nsys=nsys), "export")
    if rc != 0:
        print(f"nsys-verify: nsys export failed with exit status {rc}", file=sys.stderr)
        return EXIT_STEP_FAILED
    from tracer.nsys.parse import parse_nsys

    try:
        result = parse_nsys(sqlite_out)
        print(result.summary())
        checks = check_modes(result, load_reference(out_dir))
    except ValueError as exc:
        print(f"nsys-verify: {exc}", file=sys.stderr)
        return EXIT_STEP_FAILED
    compared = sum(c.events for c in checks.values())
    for mode, check in checks.items():
        print(f"== {mode}")
        print("\n".join(check.lines()))
    size_unknown = sum(c.size_unknown for c in checks.values())
    if size_unknown:
        print(f"nsys-verify: {size_unknown} calls compared without sizes (op, order and "
              f"count of calls only): {result.sizes_unavailable_reason}")
    print(f"nsys-verify: {len(result.events) - compared} NCCL ranges outside the measured "
          "windows (set-up, warm-up, gathers) not compared")
    passed = all(c.passed for c in checks.values())
    print(f"nsys-verify: {'PASS' if passed else 'FAIL'}")
    return EXIT_PASS if passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
