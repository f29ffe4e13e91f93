"""The NCCL_DEBUG log as a trace source of ``verify-traffic`` (NCCL runs only).

Capture (``verify.run.launch``): ``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS=INIT,COLL`` and one
``NCCL_DEBUG_FILE=<out>/nccl/nccl.%h.%p.log`` per process. One log spans the whole process
lifetime (every mode, warm-up steps, set-up collectives), so each rank marks the measured window
of a mode in its *own* log by the number of complete lines the file holds when the window opens
and when it closes (:class:`LogCursor`). That split is exact because NCCL prints a COLL line
when the call is enqueued, on the calling thread, and flushes the file after every line
(``src/debug.cc``, ``ncclDebugLog``: ``fflush(ncclDebugFile)``); the window opens and closes at
step boundaries, where the interposer's window opens and closes too.

Per mode:

1. every rank parses its own log (:func:`rank_window`, :func:`tracer.nccl.log.parse_nccl_logs`)
   and keeps the events whose line lies inside its window, plus its communicators (INIT lines);
   only that goes to rank 0, so the logs need not be on a shared file system;
2. rank 0 maps each communicator identity (commId, or ``parent/split/color``) to the sorted
   world ranks of the processes that hold it (:func:`comm_members`), and relabels every event
   with the rank list as ``group_id``, the convention of the interposer and of the prediction;
3. :func:`nccl_source_report` turns the interposer's calls into the lines NCCL logs for them
   (:func:`tracer.nccl.expect.expected_nccl_log`: bool as uint8, complex as real, barrier as a
   one-float AllReduce, single send / recv on their pair's communicator, gather / scatter and
   all_to_all as Send / Recv where torch lowers them so, for the NCCL version in use), then
   cross-checks the events one to one against those, per
   rank and communicator (:func:`tracer.crosscheck.crosscheck`), and against the theory (the
   prediction's multiset, :func:`verify.check.check_events`, keyed by rank, op, count, dtype,
   group size, root and group; a log has no phases).

Communicators whose identity is process-local (NCCL < 2.16 INIT lines carry no commId and no
PyTorch ``created ncclComm_`` line was logged) cannot be matched across processes; their events
keep the ``local:`` group id and fail the cross-check with that reason named.

Not yet run on GPUs: the plumbing is tested with logs rendered from real interposer events by
the test tool ``tests/tools/nccl_render.py`` (``tests/distributed/phase_d/test_nccl_source.py``),
and the lowering rules with log lines written in NCCL's format, independently of the
interposer (``tests/nccl/test_nccl_expect.py``).
"""

from __future__ import annotations

import glob
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tracer.backends import uses_nccl
from tracer.crosscheck import crosscheck
from tracer.events import CollectiveEvent, group_id_from_ranks
from tracer.nccl.expect import Lowering, expected_nccl_log
from tracer.nccl.log import parse_nccl_logs

from verify.check import check_events
from verify.traffic.predict import RunLayout

#: Environment variable naming the per-process log (NCCL expands ``%h`` host and ``%p`` pid).
LOG_ENV = "NCCL_DEBUG_FILE"


def own_log_path(pattern: str | None = None, pid: int | None = None) -> Path | None:
    """This process's NCCL log: ``pattern`` (default ``$NCCL_DEBUG_FILE``) with ``%p`` set to
    ``pid`` (default this process) and ``%h`` matched by glob (NCCL's host name form is its own).

    Returns ``None`` when no pattern is set or no file matches yet (NCCL opens the file at its
    first call).

    Raises:
        ValueError: more than one file matches (two hosts share the folder and a pid).
    """
    pattern = pattern if pattern is not None else os.environ.get(LOG_ENV)
    if not pattern:
        return None
    pid = os.getpid() if pid is None else pid
    found = sorted(glob.glob(glob.escape(pattern).replace("%h", "*").replace("%p", str(pid))))
    if len(found) > 1:
        raise ValueError(f"Invalid {LOG_ENV}={pattern!r}: {len(found)} files match pid {pid} "
                         f"({found[:3]}). Must name one file per process (use %h and %p).")
    return Path(found[0]) if found else None


def capture_active(backend: str) -> bool:
    """Whether this process writes COLL lines to a per-process NCCL log (a backend string
    that uses NCCL, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``: :func:`tracer.backends.uses_nccl`;
    ``NCCL_DEBUG=INFO``, ``COLL`` in ``NCCL_DEBUG_SUBSYS`` or no subsystem filter, a file)."""
    subsys = os.environ.get("NCCL_DEBUG_SUBSYS", "INIT")
    wanted = {s.strip().upper() for s in subsys.split(",")}
    return (uses_nccl(backend) and os.environ.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE")
            and bool(os.environ.get(LOG_ENV)) and bool(wanted & {"COLL", "ALL"}))


class LogCursor:
    """Counts the complete lines of a growing file, reading only what was appended.

    Args:
        path: the log file (it may not exist yet: it then counts 0 lines).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._offset = 0
        self._lines = 0

    def lines(self) -> int:
        """Complete lines (ending in ``\\n``) in the file now."""
        if not self.path.exists():
            return 0
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is counted once complete
        self._lines += data.count(b"\n", 0, end)
        self._offset += end
        return self._lines


@dataclass(frozen=True)
class LogWindow:
    """One rank's measured window in its own log: lines ``first_line < n <= last_line``
    (1-based line numbers as in ``source_ref``)."""

    rank: int
    pid: int
    file: str
    first_line: int
    last_line: int


class WindowMark:
    """Opens this rank's window in its own log when created; :meth:`close` closes it.

    Args:
        rank: this process's world rank.
        pattern: the log path pattern (default ``$NCCL_DEBUG_FILE``).
    """

    def __init__(self, rank: int, pattern: str | None = None) -> None:
        self.rank, self.pid = rank, os.getpid()
        self.pattern = pattern if pattern is not None else os.environ.get(LOG_ENV, "")
        self.path = own_log_path(self.pattern, self.pid)
        self._cursor = LogCursor(self.path) if self.path is not None else None
        self.first_line = self._cursor.lines() if self._cursor is not None else 0

    def close(self) -> dict:
        """:func:`rank_window` of the window from creation to now; without a log file, an
        empty window whose ``issues`` say why."""
        if self._cursor is None:
            return {"window": asdict(LogWindow(self.rank, self.pid, "", 0, 0)), "events": [],
                    "comms": [], "issues": [
                        f"rank {self.rank}: no NCCL log for pid {self.pid} matching "
                        f"{self.pattern!r} (NCCL_DEBUG_FILE must be set before the process "
                        "starts)"]}
        return rank_window(LogWindow(self.rank, self.pid, str(self.path), self.first_line,
                                     self._cursor.lines()))


def rank_window(window: LogWindow) -> dict:
    """Parse ``window.file`` and keep what rank 0 needs (runs on the rank that owns the log).

    Returns:
        ``{"window": dict, "events": [CollectiveEvent], "comms": [CommInfo as dict],
        "issues": [str]}``: events inside the window with ``rank`` set to the world rank,
        every communicator of the process, and unreadable lines inside the window.

    Raises:
        ValueError: the file does not exist.
    """
    result = parse_nccl_logs([window.file])

    def inside(ref: str) -> bool:
        return window.first_line < int(ref.rsplit(":", 1)[1]) <= window.last_line

    events = [ev.replace(rank=window.rank) for ev in result.events if inside(ev.source_ref)]
    issues = [str(i) for i in result.issues if window.first_line < i.line_no <= window.last_line]
    return {"window": asdict(window), "events": events,
            "comms": [asdict(c) for c in result.comms], "issues": issues}


def comm_members(per_rank: Sequence[Mapping]) -> dict[str, list[int]]:
    """Communicator identity -> sorted world ranks holding it, from every rank's INIT lines.

    Identities that are process-local (``local:``) are left out: they cannot be shared.
    """
    members: dict[str, set[int]] = defaultdict(set)
    for entry in per_rank:
        rank = entry["window"]["rank"]
        for c in entry["comms"]:
            if not c["group_id"].startswith("local:"):
                members[c["group_id"]].add(rank)
    return {gid: sorted(ranks) for gid, ranks in members.items()}


def relabel(per_rank: Sequence[Mapping]) -> tuple[list[CollectiveEvent], list[str]]:
    """Every rank's window events with ``group_id`` as the comma-joined world ranks.

    Returns:
        ``(events, problems)``; problems name communicators whose member count differs from
        their ``nranks`` (a log is missing) and events whose communicator is process-local.
    """
    members = comm_members(per_rank)
    nranks: dict[str, int] = {}
    for entry in per_rank:
        for c in entry["comms"]:
            if c["nranks"] is not None:
                nranks[c["group_id"]] = c["nranks"]
    problems = [f"communicator {gid}: INIT lines from ranks {ranks} but nranks={nranks[gid]} "
                "(a rank's log is missing)"
                for gid, ranks in sorted(members.items()) if gid in nranks and len(ranks) != nranks[gid]]
    events: list[CollectiveEvent] = []
    local = 0
    for entry in per_rank:
        for ev in entry["events"]:
            ranks = members.get(ev.group_id)
            if ranks is None:
                local += 1
                events.append(ev)
            else:
                events.append(ev.replace(group_id=group_id_from_ranks(ranks)))
    if local:
        problems.append(f"{local} event(s) on communicators without a shared identity (no "
                        "commId in the INIT line: NCCL < 2.16): group unknown")
    return events, problems


def runtime_nccl_version() -> tuple[int, int, int] | None:
    """``torch.cuda.nccl.version()`` of this process, ``None`` where torch has no NCCL."""
    try:
        import torch

        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build raises or lacks it: unknown
        return None
    return tuple(version) if isinstance(version, tuple) and len(version) == 3 else None


def nccl_source_report(per_rank: Sequence[Mapping], interposer: Sequence[CollectiveEvent],
                       layout: RunLayout, steps: int, *,
                       nccl_version: Sequence[int] | None = None,
                       lowering: Lowering | None = None) -> dict:
    """``report.json`` ``sources["nccl_log"]`` of one run.

    Args:
        per_rank: :func:`rank_window` of every rank (any order).
        interposer: every rank's interposer events of the same window.
        layout: the run's layout (for the prediction).
        steps: measured steps in the window.
        nccl_version: the NCCL that wrote the logs, ``(major, minor, patch)``; default
            :func:`runtime_nccl_version` (unknown: NCCL < 2.28 assumed).
        lowering: overrides what ``nccl_version`` implies (:class:`tracer.nccl.expect.Lowering`).

    Returns:
        ``{events, matched, unmatched, pass, mismatches, theory, issues}``: the cross-check
        against the interposer (per rank and communicator, in order) plus ``theory``
        (``{pass, missing, unexpected}`` against the prediction); ``pass`` needs both, every
        rank's log, and no unreadable line inside a window.
    """
    events, problems = relabel(per_rank)
    version = nccl_version if nccl_version is not None else runtime_nccl_version()
    expected = expected_nccl_log(interposer, lowering or Lowering.for_version(version))
    problems += expected.problems
    check = crosscheck(expected.events, events, source="nccl_log", backend="nccl")
    check.notes.append(f"{expected.lowered} interposer call(s) expected as other NCCL lines "
                       f"(tracer.nccl.expect, NCCL {version or 'unknown: < 2.28 assumed'})")
    theory = check_events(events, layout, steps)
    ranks = sorted(e["window"]["rank"] for e in per_rank)
    issues = [i for e in per_rank for i in e["issues"]]
    if ranks != list(range(layout.world_size)):
        problems.append(f"windows from ranks {ranks}; expected 0..{layout.world_size - 1}")
    missing = [f"{n} x {k}" for k, n in theory["missing"][:10]]
    unexpected = [f"{n} x {k}" for k, n in theory["unexpected"][:10]]
    return {
        **check.as_report(),
        "pass": check.passed and theory["pass"] and not problems and not issues,
        "mismatches": problems + [f"unreadable line: {i}" for i in issues[:10]]
        + [str(m) for m in check.mismatches[:20]]
        + [f"theory: missing {m}" for m in missing] + [f"theory: unexpected {u}" for u in unexpected],
        "theory": {"pass": theory["pass"], "key": theory["key"], "missing": missing,
                   "unexpected": unexpected},
        "issues": issues[:20],
        "windows": sorted((e["window"] for e in per_rank), key=lambda w: w["rank"]),
    }

