"""Per-bucket states (dmuon/runtime/state.py): sequences the old loose flags got wrong."""

import pytest
import torch

from tests.distributed.runtime import state_tasks as T

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_mixed_precision_sync_forward_sync_agrees_on_every_rank(pool2, mode):
    results = pool2.run_with_timeout(TIMEOUT_S, T.sync_forward_sync, mode)
    assert results[0]["values"].keys() == results[1]["values"].keys()
    for n, v in results[0]["values"].items():
        assert torch.equal(v, results[1]["values"][n]), n


def test_failed_forward_between_micro_batches_keeps_accumulated_grads(pool2):
    clean = pool2.run_with_timeout(TIMEOUT_S, T.accumulate_with_failed_forward, False)
    failed = pool2.run_with_timeout(TIMEOUT_S, T.accumulate_with_failed_forward, True)
    for a, b in zip(clean, failed):
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[n], b[n]) for n in a)
