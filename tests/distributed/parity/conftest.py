"""Fixtures shared by the parity tests of this package."""

from __future__ import annotations

import pytest

from tests.distributed import noise_floor as NF
from tests.distributed.parity import dmuon_tasks as T

#: Steps of the TinyGPT parity runs: the second is the first that uses the momentum.
STEPS = 2


#: Per-call timeout of :func:`titan_pool4`'s tasks, seconds (importing torchtitan takes 10-20 s
#: per process on these machines).
TITAN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def titan_pool4():
    """4 gloo ranks of the requesting module's own, closed after its last test: the torchtitan
    tests' ranks, so torchtitan is imported into no pool the other tests share."""
    from tests.distributed.harness import DistributedPool
    with DistributedPool(4, timeout_s=TITAN_TIMEOUT_S) as pool:
        yield pool


@pytest.fixture(scope="package")
def tinygpt_oracle() -> dict:
    """The TinyGPT oracle (``dmuon_tasks.oracle_run``) over :data:`STEPS` steps with its
    per-step floors (``noise_floor.floored``, Frobenius): its nudged runs and itself fed the
    global batch as 2 and as 4 accumulated micro-batches (only the summation order changed)."""
    return NF.floored(lambda nudge: T.oracle_run(STEPS, nudge=nudge),
                      {f"{w} micro-batches": lambda w=w: T.oracle_run(STEPS, micro_batches=w)
                       for w in (2, 4)}, norm="fro")


def tinygpt_distances(ref: dict, results: list[dict], step: int) -> dict[str, float]:
    """Per param after step ``step`` (0-based) of ``T.train_dmuon(..., every_step=True)``'s
    ``results``: the Frobenius distance from ``ref`` (:func:`tinygpt_oracle`)."""
    got = T.merge_owned([{"params": r["steps"][step]} for r in results])
    return NF.distances(got, ref["steps"][step], ref["init"], norm="fro")


def assert_on_oracle(ref: dict, results: list[dict], what: str) -> None:
    """Every step of ``T.train_dmuon(..., every_step=True)``'s ``results`` within its bound."""
    for step, floor in enumerate(ref["floors"]):
        NF.assert_within(tinygpt_distances(ref, results, step), floor, f"{what}, step {step + 1}")
