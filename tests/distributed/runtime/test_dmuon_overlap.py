"""Forward prefetch and Z3's backward re-broadcast prefetch, from the interposer's
ordered events on 4 gloo ranks, 3 transformer blocks: block j+1's first broadcast is issued
before block j's forward returns, and (Z3) block j-1's last re-broadcast before block j's
first grad arrives.
``prefetch_depth=0`` is the control: there the same checks fail."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.runtime import overlap_tasks as T

pytestmark = pytest.mark.distributed

TIMEOUT_S = 90


def _forward_prefetched(r) -> bool:
    return all(r["first_fwd"][j + 1] < r["returned"][j] for j in range(len(r["returned"]) - 1))


def _backward_prefetched(r) -> bool:
    return all(r["last_rb"][j - 1] < r["first_grad"][j] for j in range(1, len(r["first_grad"])))


@pytest.mark.parametrize("mode", ["z3", "hsdp-z2"])
def test_next_bucket_broadcast_is_in_flight_while_a_module_computes(pool4, mode):
    for r in pool4.run_with_timeout(TIMEOUT_S, T.broadcast_positions, mode, 1):
        assert _forward_prefetched(r), r
        if mode == "z3":
            assert _backward_prefetched(r), r


def test_without_prefetch_each_broadcast_waits_for_its_module(pool4):
    for r in pool4.run_with_timeout(TIMEOUT_S, T.broadcast_positions, "z3", 0):
        assert not _forward_prefetched(r) and not _backward_prefetched(r), r


@pytest.mark.parametrize("mode", ["z3", "hsdp-z2"])
def test_no_reduce_is_waited_on_before_the_next_one_is_issued(pool4, mode):
    """Each reduce flies at least until the next is issued (a unit's reduces overlap the
    next unit's backward); a unit's reduces are waited when the next unit's
    are issued, not all at the end, so non-holders free their grad buffers early."""
    for log in pool4.run_with_timeout(TIMEOUT_S, T.reduce_issue_and_wait_order, mode):
        issues = [k for kind, k in log if kind == "issue"]
        waits = [k for kind, k in log if kind == "wait"]
        assert len(issues) > 1 and sorted(waits) == issues, log  # each waited once
        for k in issues[:-1]:
            assert log.index(("wait", k)) > log.index(("issue", k + 1)), log
        assert log.index(("wait", issues[0])) < log.index(("issue", issues[-1])), log  # early


@pytest.mark.parametrize("mode", ["z3", pytest.param("hsdp-z3", marks=pytest.mark.slow)])
def test_prefetch_depth_changes_no_bits(pool4, mode):
    ref = pool4.run_with_timeout(TIMEOUT_S, T.train_with_depth, mode, 0)
    for depth in (1, 3):
        got = pool4.run_with_timeout(TIMEOUT_S, T.train_with_depth, mode, depth)
        for a, b in zip(ref, got):
            assert a.keys() == b.keys() and a
            assert all(torch.equal(a[n], b[n]) for n in a), (mode, depth)


@pytest.mark.parametrize("mode", ["z3", "hsdp-z2"])
def test_grads_live_in_one_flat_buffer_per_bucket(pool4, mode):
    """Backward: a bucket's grads are views of one persistent flat buffer (no
    torch.cat per step); no_sync micro-batches accumulate into it in place; owners read the
    reduced average there; non-holders free it at a known point (after the reduce wait)."""
    for r in pool4.run_with_timeout(TIMEOUT_S, T.grad_buffer_layout, mode):
        assert r["accumulated_in_buffer"] and all(r["accumulated_in_buffer"]), r
        assert r["owner_grad_in_buffer"] and all(r["owner_grad_in_buffer"]), r
        assert r["non_holder_freed"] and all(r["non_holder_freed"]), r


@pytest.mark.parametrize("mode", ["z3", "hsdp-z3"])
def test_z3_keeps_only_the_last_unit_between_forward_and_backward(pool4, mode):
    """Protocol step 2: after a forward with grad enabled a non-holder holds the last unit
    (the backward needs it first) and nothing else; after backward, and after a forward
    under no_grad (no backward follows), it holds nothing."""
    results = pool4.run_with_timeout(TIMEOUT_S, T.copies_after_forward, mode)
    assert any("blocks.2" in r["forward"] for r in results)  # some rank does not hold it
    for r in results:
        assert r["last"] == "blocks.2" and r["forward"], r
        for block, copies in r["forward"].items():
            assert set(copies) == ({"VALID"} if block == r["last"] else {"FREED"}), r
        for when in ("backward", "no_grad"):
            assert {c for copies in r[when].values() for c in copies} == {"FREED"}, (when, r)
