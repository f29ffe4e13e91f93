"""Process pools shared by the distributed tests (see ``harness.py``).

``pool2`` and ``pool4`` are created on first use and closed after the last test of this
package, not at the end of the session (the single-process tests that run after them need
neither their CPU nor their memory); tests share them because starting ranks costs seconds. A
task that fails or times out kills that pool's workers, and the pool starts fresh ones on the
next task, so one failing test does not break the others. Under ``make test`` (pytest-xdist,
two workers, one test file per worker at a time) each worker holds its own pools.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.distributed.harness import DistributedPool

#: Per-call timeout of the shared pools, seconds. Gloo on 2 cores finishes tasks in well under it.
POOL_TIMEOUT_S = 120


@pytest.fixture(scope="package")
def pool2() -> Iterator[DistributedPool]:
    """A 2-rank gloo :class:`DistributedPool`, shared by the tests of this package."""
    with DistributedPool(2, timeout_s=POOL_TIMEOUT_S) as pool:
        yield pool


@pytest.fixture(scope="package")
def pool4() -> Iterator[DistributedPool]:
    """A 4-rank gloo :class:`DistributedPool`, shared by the tests of this package."""
    with DistributedPool(4, timeout_s=POOL_TIMEOUT_S) as pool:
        yield pool


@pytest.fixture(scope="package", autouse=True)
def oracle_threads() -> Iterator[None]:
    """This process at the ranks' thread count (the pools' workers run at 1) while the tests of
    this package run: the single-process oracles they compute here then round as the ranks do
    (a CPU GEMM's blocking depends on its thread count, and Muon amplifies a rounding
    difference on a rank-deficient gradient). The pools fork from this process either way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
