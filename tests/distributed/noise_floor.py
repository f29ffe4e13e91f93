"""Parity bounds from a noise floor that each parity test measures at run time.

DMuon's arithmetic differs from a single-process oracle's only in rounding: gradients summed
in another order, Newton–Schulz batched over an expert stack, GEMMs blocked for another thread
count. Muon turns such differences into large moves: Newton–Schulz runs in bfloat16 and maps
every singular direction of the momentum to about one, so one fp32 ulp in a gradient can flip
bf16 roundings and, on a rank-deficient gradient (a router, a thinly routed expert slice), set
the size of a direction that carries no signal; AdamW's ``sqrt(v)`` does the same to entries
whose gradient is rounding. Each step feeds the difference back through the forward, so it
grows with the steps, and how far depends on the CPU (ISA, GEMM blocking). A fixed tolerance
calibrated on one machine therefore fails on another. Measured on a 2-core AMD EPYC (AVX2):
the EP oracle (``ep/dmuon_ep_tasks.py``) against itself with one ulp nudged into its init
moves 0.7 %, 1.8 % and 10.8 % of its displacement after 1, 2 and 3 steps; the FSDP2-script
oracle 0.8 % after 1 step and 43 % after 3 (as far as removing the grad clip moves it).

So a parity test here:

1. runs the oracle and its :data:`NUDGES`, the same arithmetic rounded otherwise: every init
   value one ulp up (``ulp+``), one ulp down (``ulp-``), the oracle at :data:`OTHER_THREADS`
   threads (``threads``; a GEMM's blocking, and so its rounding, follows its thread count);
2. takes, at each step it compares, the floor: the largest distance of a nudged run from the
   oracle over the params compared (:func:`floors`), at least :data:`MIN_FLOOR`;
3. asserts that DMuon lands within ``FACTOR × floor`` of the oracle (:func:`assert_within`),
   and that a planted error lands beyond the same bound (:func:`assert_beyond`).

It compares few steps (one or two), where the floor stays at a few percent, so the planted
errors stay far above the bound. A distance is ``|got - want| / |want - init|`` per param, in
the max norm (largest entry) or the Frobenius norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

#: DMuon may sit this many times its noise floor from the oracle. The floor is one sample of
#: the rounding noise per nudge; DMuon's own distance is another sample of the same kind
#: (measured on the 2-core EPYC: 0 to 0.7 times the floor).
FACTOR = 4.0
#: The least floor (relative to the displacement): one bfloat16 ulp, the precision of
#: Newton–Schulz's output. Keeps the bound above zero where every nudged run rounds alike.
MIN_FLOOR = 2.0 ** -8
#: The least floor of a scalar compared relatively (a grad norm): eight fp32 ulps, a sum of
#: fp32 squares in another order.
MIN_SCALAR_FLOOR = 8 * 2.0 ** -23
#: The nudged runs of the oracle (module docstring).
NUDGES = ("ulp+", "ulp-", "threads")
#: ``torch.get_num_threads()`` in every rank of ``harness.py``'s pools, and of the oracle.
RANK_THREADS = 1
#: The oracle's thread count under the ``threads`` nudge.
OTHER_THREADS = 2


@contextmanager
def oracle_threads(nudge: str | None = None):
    """Run the block at the ranks' thread count, or at :data:`OTHER_THREADS` under the
    ``threads`` nudge (``None``: no nudge)."""
    _check(nudge)
    before = torch.get_num_threads()
    torch.set_num_threads(OTHER_THREADS if nudge == "threads" else RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def nudge_init_(model: torch.nn.Module, nudge: str | None) -> torch.nn.Module:
    """Under ``ulp+`` / ``ulp-``, move every param of ``model`` one ulp up / down in place
    (``torch.nextafter``); other nudges leave it. Returns ``model``."""
    _check(nudge)
    if nudge in ("ulp+", "ulp-"):
        to = math.inf if nudge == "ulp+" else -math.inf
        for p in model.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, to)))
    return model


def _check(nudge: str | None) -> None:
    if nudge is not None and nudge not in NUDGES:
        raise ValueError(f"Invalid nudge={nudge!r}. Must be None or one of {NUDGES}.")


def distance(got: torch.Tensor, want: torch.Tensor, init: torch.Tensor, norm: str = "max") -> float:
    """``|got - want| / |want - init|`` in the max norm (``norm="max"``) or the Frobenius norm
    (``"fro"``); the denominator at least 1e-12."""
    if got.shape != want.shape or want.shape != init.shape:
        raise ValueError(f"Invalid shapes got={tuple(got.shape)}, want={tuple(want.shape)}, "
                         f"init={tuple(init.shape)}. Must be equal.")
    if norm == "max":
        num, den = (got - want).abs().max(), (want - init).abs().max()
    elif norm == "fro":
        num, den = (got - want).norm(), (want - init).norm()
    else:
        raise ValueError(f"Invalid norm={norm!r}. Must be 'max' or 'fro'.")
    return (num / den.clamp_min(1e-12)).item()


def distances(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
              init: Mapping[str, torch.Tensor], names: Iterable[str] | None = None,
              part: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
              norm: str = "max") -> dict[str, float]:
    """Per param of ``names`` (default: every key of ``want``): :func:`distance` of ``got`` from
    ``want``, the displacement ``want - init``; each tensor first mapped by ``part(name, t)``
    (e.g. a router without what routing cannot see)."""
    part = part or (lambda name, t: t)
    return {n: distance(part(n, got[n]), part(n, want[n]), part(n, init[n]), norm)
            for n in (want if names is None else names)}


@dataclass(frozen=True)
class Floor:
    """The noise floor at one step: ``value``, the largest distance of a nudged oracle run from
    the oracle (``where``: which nudge and param), and ``least``, the floor below which it is
    not taken (:data:`MIN_FLOOR`, or :data:`MIN_SCALAR_FLOOR` for a scalar)."""

    value: float
    where: str
    least: float = MIN_FLOOR

    @property
    def bound(self) -> float:
        """``FACTOR × max(value, least)``: how far DMuon may land from the oracle."""
        return FACTOR * max(self.value, self.least)

    def __str__(self) -> str:
        return f"bound {self.bound:.3g} = {FACTOR:g} x floor {self.value:.3g} ({self.where})"


def floors(ref: Mapping, nudged: Mapping[str, Mapping], names: Iterable[str] | None = None,
           part: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
           norm: str = "max") -> list[Floor]:
    """The floor after each step of the oracle run ``ref`` against its nudged runs
    ``nudged`` (nudge -> run). A run is a dict with ``init`` (name -> tensor) and ``steps``
    (one name -> tensor dict per step, the params after that step); the params compared are
    ``names`` (default: every param of ``init``)."""
    names = list(ref["init"] if names is None else names)
    out = []
    for k, want in enumerate(ref["steps"]):
        worst = Floor(0.0, "bit-identical")
        for nudge, run in nudged.items():
            d = distances(run["steps"][k], want, ref["init"], names, part, norm)
            name = max(d, key=d.get)
            if d[name] > worst.value:
                worst = Floor(d[name], f"{nudge} on {name}")
        out.append(worst)
    return out


def floored(oracle: Callable[[str | None], dict], extra: Mapping[str, Callable[[], dict]] | None = None,
            names: Iterable[str] | None = None,
            part: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
            norm: str = "max") -> dict:
    """``oracle(None)``'s run with ``floors`` (:func:`floors`) from ``oracle(nudge)`` for each
    of :data:`NUDGES` and each run of ``extra`` (label -> a nudged run of the test's own, e.g.
    the batch as micro-batches); ``nudged``: those runs."""
    ref = oracle(None)
    nudged = {nudge: oracle(nudge) for nudge in NUDGES}
    nudged.update({label: run() for label, run in (extra or {}).items()})
    ref["floors"] = floors(ref, nudged, names, part, norm)
    ref["nudged"] = nudged
    return ref


def final_only(init: Mapping[str, torch.Tensor], final: Mapping[str, torch.Tensor]) -> dict:
    """A run that reports only its last step's params, as :func:`floors` reads runs."""
    return {"init": dict(init), "steps": [dict(final)], "final": dict(final)}


def scalar_floors(ref: list[float], nudged: Mapping[str, list[float]]) -> list[Floor]:
    """The relative floor of a per-step scalar (a grad norm): at each step the largest
    ``|nudged - ref| / |ref|`` over the nudges, at least :data:`MIN_SCALAR_FLOOR`."""
    out = []
    for k, want in enumerate(ref):
        worst = Floor(0.0, "bit-identical", MIN_SCALAR_FLOOR)
        for nudge, values in nudged.items():
            d = abs(values[k] - want) / max(abs(want), 1e-30)
            if d > worst.value:
                worst = Floor(d, nudge, MIN_SCALAR_FLOOR)
        out.append(worst)
    return out


def assert_within(dist: Mapping[str, float], floor: Floor, what: str = "") -> None:
    """Every distance of ``dist`` (name -> distance) at most ``floor.bound``; the message
    names the worst params, the bound and what the floor is."""
    worst = sorted(dist.items(), key=lambda kv: -kv[1])[:4]
    assert worst and worst[0][1] <= floor.bound, (
        f"{what}: DMuon lands off the oracle: {worst}; {floor}")


def assert_beyond(dist: Mapping[str, float], floor: Floor, what: str = "") -> None:
    """The control: every distance of ``dist`` above ``floor.bound`` (a planted error the
    comparison of :func:`assert_within` must see)."""
    least = sorted(dist.items(), key=lambda kv: kv[1])[:4]
    assert least and least[0][1] > floor.bound, (
        f"{what}: a planted error lands within the bound: {least}; {floor}")
