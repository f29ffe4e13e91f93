"""When a rank fails: say so to every rank through the TCPStore, stop, and report within seconds.

A rank that raises inside a mode's collectives leaves its peers blocked in the next collective
they share with it; on gloo nothing can unblock them but the end of its process (gloo's
``abort()`` does not return a blocked wait; tried on torch 2.13), and torchrun stops every
worker once one exits non-zero. So the harness settles each mode through the store that
torchrun's rendezvous already runs (``torch.distributed``'s default store: it lives in the
agent, not in a worker, and survives a worker's death):

1. every rank posts its status of the mode (``ok``, or its one-line error and traceback file)
   under ``status/<mode>/<rank>``;
2. a rank whose mode passed goes on to the gather of results (a collective);
3. a rank whose mode raised polls the store for up to :data:`SETTLE_S` seconds: when every
   rank posted a status of this mode, no rank is inside the mode's collectives, and the ranks
   gather as before (a mode that raised alike on every rank is one failed mode, the next modes
   still run). Otherwise a peer is blocked in a collective with this rank: the rank posts
   ``left/<rank>`` and **leaves** (its process ends, which breaks the blocked waits with
   "Connection closed by peer");
4. a rank that finds the run broken (a peer posted ``left``, torchrun sent SIGTERM because a
   worker died, or the gather itself failed) stops running modes; the reporting rank
   (:meth:`Board.claim_report`: rank 0, or the first surviving rank to claim it once rank 0
   has not within :data:`COLLECT_S`, so that rank 0's own death is reported too) waits up to
   :data:`COLLECT_S` for the others' statuses and writes the report: the failed mode with
   every rank's error (the first rank whose error is not a consequence, a broken connection
   or torchrun's SIGTERM, named first), the ranks that posted nothing (their process died:
   ``os._exit``, a signal, the OOM killer), and every mode not run.

SIGTERM: torchrun sends it to the surviving workers when one exits non-zero and kills them 30 s
later (``torch.distributed.elastic.multiprocessing.api``, ``_close(timeout=30)``). A thread of
:func:`watch_sigterm` waits for it (the signal is blocked in the other threads, so a main thread
blocked in a collective does not matter) and marks the run as broken; on NCCL it also aborts
the process groups, which returns the main thread's blocked waits (gloo's return by
themselves once the dead rank's sockets close). Rank 0 then has the rest of the 30 s to write.

Nothing here is used by ``dmuon/``; the harness's runtime protocol is unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

#: Seconds a rank whose mode raised waits for every rank's status of the mode before it
#: decides that a peer is blocked in a collective with it (step 3 of the module docstring).
SETTLE_S = 20.0
#: Seconds rank 0 waits for the other ranks' statuses once the run is broken.
COLLECT_S = 8.0
#: Poll period of the store (seconds).
POLL_S = 0.2
#: Texts of errors a rank gets because a peer left (gloo's TCP transport) or was stopped.
CONSEQUENCES = ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                "SIGTERM", "Terminated")
#: Key prefix of the harness's entries in the default store.
PREFIX = "dmuon-verify/"


@dataclass
class Broken:
    """Why the run stopped: the mode it stopped in and every rank's status of it."""

    mode: str
    statuses: dict[int, dict] = field(default_factory=dict)  # rank -> {"error", "file"} or {"ok"}
    left: dict[int, dict] = field(default_factory=dict)  # ranks that ended their process
    missing: list[int] = field(default_factory=list)  # ranks that posted nothing
    terminated: bool = False  # torchrun's SIGTERM arrived (a worker exited non-zero)


def is_consequence(error: str) -> bool:
    """Whether a rank's error is what a peer's failure does to it (a broken connection, the
    SIGTERM torchrun sends the survivors), not a cause."""
    return any(mark in error for mark in CONSEQUENCES)


def describe(broken: Broken, world: int) -> str:
    """One paragraph naming the failed rank(s) and their errors, causes first (report.json
    ``failures[].detail`` of the mode the run stopped in)."""
    errors = {r: s for r, s in broken.statuses.items() if "error" in s}
    causes = {r: s for r, s in errors.items() if not is_consequence(s["error"])}
    parts = []
    for r, s in sorted(causes.items()):
        parts.append(f"rank {r} raised: {s['error']} (traceback: {s.get('file', '?')})")
    for r in broken.missing:
        parts.append(f"rank {r} posted no status: its process ended without a Python exception "
                     "(os._exit, a signal, the OOM killer) or is still blocked; torchrun's "
                     "summary on its node has its exit code")
    if not parts:
        parts.append("no rank named a cause")
    follow = sorted(set(errors) - set(causes))
    text = f"the run stopped in {broken.mode}: " + "; ".join(parts)
    if follow:
        first = errors[follow[0]]["error"]
        first = first if len(first) <= 160 else first[:159] + "…"
        text += f"; then rank(s) {follow} failed as a consequence (e.g. {first})"
    if broken.terminated:
        text += "; torchrun stopped the workers (SIGTERM) after a worker exited"
    return text + f" [{world} ranks]"


class Board:
    """This rank's view of the run's failures, kept in the default store (module docstring).

    Args:
        store: a ``torch.distributed.Store`` every rank shares (default: the default group's).
        rank, world: this rank and W (default: the default group's).
    """

    def __init__(self, store=None, rank: int | None = None, world: int | None = None) -> None:
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        # one namespace per run_all call: the n-th call of every rank (a process that runs
        # several, as the tests' pools do, never reads an earlier call's statuses)
        run = dist.PrefixStore(PREFIX, base).add(f"calls/{self.rank}", 1)
        self.store = dist.PrefixStore(f"{PREFIX}{run}/", base)
        self.terminated = TERMINATED
        #: Where the run stopped (set by ``verify.run.runner.run_all``), or ``None``.
        self.stopped: Broken | None = None

    def run_broken(self) -> bool:
        """Whether torchrun sent SIGTERM or a rank left: no collective can be trusted."""
        return self.terminated.is_set() or bool(self.left())

    # ------------------------------------------------------------------ keys

    def _status_key(self, mode: str, rank: int) -> str:
        return f"status/{mode}/{rank}"

    def post(self, mode: str, mine: dict) -> None:
        """Post this rank's status of ``mode``: ``{"ok": True}`` or ``{"error", "file"}``."""
        status = {"error": mine["error"], "file": mine.get("file", "?")} if "error" in mine else {"ok": True}
        self.store.set(self._status_key(mode, self.rank), json.dumps(status))

    def leave(self, mode: str, mine: dict) -> None:
        """Say that this rank ends its process (its peers' blocked waits then fail)."""
        self.store.set(f"left/{self.rank}", json.dumps({"mode": mode, "error": mine.get("error", "")}))

    def _read(self, key: str) -> dict | None:
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key).decode())

    def statuses(self, mode: str) -> dict[int, dict]:
        """The statuses of ``mode`` posted so far, by rank."""
        out = {}
        for r in range(self.world):
            got = self._read(self._status_key(mode, r))
            if got is not None:
                out[r] = got
        return out

    def left(self) -> dict[int, dict]:
        """The ranks that posted ``left``, with the mode and error they left on."""
        return {r: got for r in range(self.world) if (got := self._read(f"left/{r}")) is not None}

    # ------------------------------------------------------------------ decisions

    def settle(self, mode: str, mine: dict, settle_s: float = SETTLE_S) -> Broken | None:
        """Post ``mine`` and decide whether the ranks can gather ``mode``'s results
        (``None``) or the run is broken (a :class:`Broken`; this rank has then posted
        ``left`` where its mode raised and a peer is blocked; step 3)."""
        self.post(mode, mine)
        if "error" not in mine:
            return self.broken(mode) if self.run_broken() else None
        deadline = time.monotonic() + settle_s
        while True:
            if self.run_broken():
                return self.broken(mode)
            if len(self.statuses(mode)) == self.world:
                return None
            if time.monotonic() >= deadline:
                self.leave(mode, mine)
                return self.broken(mode)
            time.sleep(POLL_S)

    def claim_report(self, wait_s: float = COLLECT_S) -> bool:
        """Whether this rank writes the report of the stopped run. Rank 0 claims it at once;
        another rank waits ``wait_s`` seconds for rank 0's claim (rank 0 died, or is blocked)
        and then claims it itself; the store's ``compare_set`` lets exactly one claim win."""
        if self.rank != 0:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.store.check(["reporter"]):
                    return False
                time.sleep(POLL_S)
        return self.store.compare_set("reporter", "", str(self.rank)).decode() == str(self.rank)

    def broken(self, mode: str, collect_s: float = 0.0) -> Broken:
        """What the store says about ``mode`` now; the reporting rank passes ``collect_s`` to
        wait for every rank's status first."""
        deadline = time.monotonic() + collect_s
        statuses = self.statuses(mode)
        while len(statuses) < self.world and time.monotonic() < deadline:
            time.sleep(POLL_S)
            statuses = self.statuses(mode)
        left = self.left()
        missing = [r for r in range(self.world) if r not in statuses]
        return Broken(mode, statuses, left, missing, self.terminated.is_set())

#: Set once torchrun's SIGTERM arrived (:func:`watch_sigterm`).
TERMINATED = threading.Event()


def watch_sigterm(nccl: bool = False, grace_s: float = 25.0) -> None:
    """Route SIGTERM to a daemon thread that sets :data:`TERMINATED` (and aborts the process
    groups on NCCL, whose blocked waits do not return when a peer dies), then ends the process
    after ``grace_s`` (torchrun kills at 30 s; rank 0 writes the report meanwhile).

    Call from the main thread before ``init_process_group``: the signal is blocked in this
    thread and so in every thread started after it (torch's included), and only the watcher
    takes it.

    Raises:
        RuntimeError: called from another thread than the main one.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("watch_sigterm() must be called from the main thread.")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        signal.sigwait({signal.SIGTERM})
        TERMINATED.set()
        print("verify-traffic: SIGTERM from torchrun (a worker exited); stopping",
              file=sys.stderr, flush=True)
        if nccl:
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as exc:  # noqa: BLE001 - said; the grace period still ends it
                print(f"verify-traffic: aborting the groups failed: {exc}", file=sys.stderr, flush=True)
        time.sleep(grace_s)
        exit_now(143)

    threading.Thread(target=wait, name="dmuon-verify-sigterm", daemon=True).start()


def stopped_failures(broken: Broken, not_run: list[str], world: int) -> list[dict]:
    """report.json ``failures`` of a stopped run: the mode it stopped in (:func:`describe`)
    and one entry per mode it did not reach, so that none disappears from the report."""
    return [{"mode": broken.mode, "check": "error", "detail": describe(broken, world)}] + [
        {"mode": m, "check": "error",
         "detail": f"not run: the run stopped in {broken.mode} (a rank failed; see that mode)"}
        for m in not_run]


def stopped_report(broken: Broken, not_run: list[str]) -> dict:
    """report.json ``stopped``: ``{"mode", "ranks": [{"rank", "status"}], "missing_ranks",
    "left_ranks", "terminated", "not_run"}`` (``status`` is ``"ok"`` or the rank's one-line
    error)."""
    return {
        "mode": broken.mode,
        "ranks": [{"rank": r, "status": s.get("error", "ok")} for r, s in sorted(broken.statuses.items())],
        "missing_ranks": list(broken.missing),
        "left_ranks": sorted(broken.left),
        "terminated": broken.terminated,
        "not_run": list(not_run),
    }


def exit_now(code: int = 0) -> None:
    """End this process without torch's teardown (a broken group's destructor may block):
    flush the streams, then ``os._exit``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
