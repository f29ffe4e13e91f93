"""The workloads ``verify-traffic`` runs, and the one a run's parallel degrees select
(``verify.modes.workload``: what a workload is; docs/verify.md, "Workloads")."""

from __future__ import annotations

from verify.modes.cp import CPWorkload
from verify.modes.ep import EPWorkload
from verify.modes.pp import PPWorkload
from verify.modes.tp import TPWorkload
from verify.modes.tpep import TPEPWorkload
from verify.modes.workload import AXES, Workload


def workloads() -> tuple[Workload, ...]:
    """Every workload the harness runs: the dense one, then one per parallel layout."""
    return (Workload(), TPWorkload(), EPWorkload(), PPWorkload(), CPWorkload(), TPEPWorkload())


def workload_of(cfg) -> Workload:
    """The workload whose :attr:`Workload.axes` are the degrees above 1 in ``cfg`` (parsed
    args or a ``RunConfig``).

    Raises:
        ValueError: a degree below 1, or degrees above 1 that no workload runs together.
    """
    low = [f"--{a} {getattr(cfg, a)}" for a in AXES if getattr(cfg, a) < 1]
    if low:
        raise ValueError(f"Invalid {', '.join(low)}. Must be >= 1 (1: that axis is not parallel).")
    active = tuple(a for a in AXES if getattr(cfg, a) > 1)
    found = [w for w in workloads() if sorted(w.axes) == sorted(active)]
    if found:
        return found[0]
    runs = " | ".join(" ".join(f"--{a}" for a in w.axes) for w in workloads() if w.axes)
    raise ValueError(f"{' and '.join(f'--{a} {getattr(cfg, a)}' for a in active)} do not run "
                     f"together. The parallel degrees above 1 must be one workload's set: {runs} "
                     "(verify/modes/workload.py).")
