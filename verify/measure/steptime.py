"""Step time and exposed communication of the measured steps, from the training thread's clock.

*Exposed communication* is the time the training thread spends blocked while a step runs,
divided by the step's wall time. On the CPU harness (gloo) a step blocks only when it waits
for a collective: ``Work.wait()`` after a c10d call, DDP's reducer at the end of backward,
FSDP2's waits for its all-gathers and reduce-scatters, DMuon's waits for broadcasts and
reduces. The interposer's per-call times cannot give this figure on gloo: they cover the
*issue* of each call (tens of µs), and the waits happen afterwards, partly inside C++ (DDP's
reducer), where no Python seam sees them.

Blocked time comes from the Linux scheduler's per-thread accounting
(``/proc/thread-self/schedstat``: nanoseconds on a CPU, nanoseconds runnable but waiting in a
run queue, timeslices; kernel ``Documentation/scheduler/sched-stats.rst``)::

    blocked = wall - on_cpu - run_queue_wait

Subtracting the run-queue wait matters on an oversubscribed machine (4 ranks on 2 cores):
time a runnable thread waits for a core is not communication. Waiting inside a collective for a
slower (or descheduled) peer *is* counted: from this rank's view it is exposed communication,
which is how skew between ranks shows up. Caveat: other sleeps of the
training thread (joining intra-op worker threads when ``torch.get_num_threads() > 1``, page
faults on a swapping machine) count too; the harness runs one intra-op thread per rank where
cores are scarce. Where schedstat is missing (not Linux, or a kernel without
``CONFIG_SCHED_INFO``) the fraction is ``None`` with the reason.

On CUDA (NCCL) collectives run on streams and the CPU thread does not block on them, so this
figure would be meaningless: :func:`timing_report` returns ``None`` with that reason; use the
nsys timeline there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

SCHEDSTAT = Path("/proc/thread-self/schedstat")


@dataclass(frozen=True, slots=True)
class ThreadSample:
    """One reading of the calling thread's clocks, all in ns (``cpu_ns``/``runq_ns`` None when
    schedstat is unavailable)."""

    wall_ns: int
    cpu_ns: int | None
    runq_ns: int | None


def sample() -> ThreadSample:
    """Read the calling thread's wall clock (``time.perf_counter_ns``) and schedstat."""
    wall = time.perf_counter_ns()
    try:
        on_cpu, runq, _ = SCHEDSTAT.read_text().split()
        return ThreadSample(wall, int(on_cpu), int(runq))
    except (OSError, ValueError):
        return ThreadSample(wall, None, None)


@dataclass(frozen=True, slots=True)
class StepTime:
    """One measured step on one rank: wall time and blocked time (ns; blocked None where
    schedstat is unavailable)."""

    wall_ns: int
    blocked_ns: int | None

    @classmethod
    def between(cls, a: ThreadSample, b: ThreadSample) -> StepTime:
        wall = b.wall_ns - a.wall_ns
        if None in (a.cpu_ns, a.runq_ns, b.cpu_ns, b.runq_ns):
            return cls(wall, None)
        blocked = wall - (b.cpu_ns - a.cpu_ns) - (b.runq_ns - a.runq_ns)
        # schedstat and perf_counter are different clocks read a few µs apart: clamp to [0, wall]
        return cls(wall, min(max(blocked, 0), wall))


def timing_report(per_rank: list[list[StepTime]], device: str) -> dict:
    """The report's ``timing`` entry of one run.

    Args:
        per_rank: for each rank, its measured steps in order (same count on every rank).
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        ``{"step_ms", "step_ms_per_step", "exposed_comm_frac", "exposed_comm_frac_max",
        "exposed_comm_source", "exposed_comm_reason"}``: ``step_ms`` is the median over steps
        of the slowest rank's step; ``exposed_comm_frac`` the mean over ranks of
        Σ blocked / Σ wall over the measured steps (``_max`` the largest rank's);
        ``None`` fractions come with a reason.

    Raises:
        ValueError: no ranks, no steps, or ranks with different step counts.
    """
    counts = {len(steps) for steps in per_rank}
    if not per_rank or counts == {0} or len(counts) != 1:
        raise ValueError(f"Invalid per-rank step times with counts {sorted(counts)}. Must be "
                         "the same non-zero number of measured steps on every rank.")
    n_steps = counts.pop()
    slowest = [max(steps[i].wall_ns for steps in per_rank) / 1e6 for i in range(n_steps)]
    out = {"step_ms": median(slowest), "step_ms_per_step": slowest, "exposed_comm_frac": None,
           "exposed_comm_frac_max": None, "exposed_comm_source": "schedstat",
           "exposed_comm_reason": None}
    if device != "cpu":
        out["exposed_comm_reason"] = ("collectives run on CUDA streams: CPU blocking is not "
                                      "exposed communication; read it from the nsys timeline")
        return out
    if any(s.blocked_ns is None for steps in per_rank for s in steps):
        out["exposed_comm_reason"] = f"{SCHEDSTAT} unavailable (needs Linux with CONFIG_SCHED_INFO)"
        return out
    fracs = [sum(s.blocked_ns for s in steps) / max(sum(s.wall_ns for s in steps), 1)
             for steps in per_rank]
    out["exposed_comm_frac"] = sum(fracs) / len(fracs)
    out["exposed_comm_frac_max"] = max(fracs)
    return out
