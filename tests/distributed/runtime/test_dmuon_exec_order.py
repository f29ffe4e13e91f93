"""Buckets in execution order: a model that runs its blocks in another order than it
registers them, W=2 gloo. After the first step the forward broadcasts follow the execution
order and prefetch the next block *in that order*; the traffic equals the prediction made
from the harness's own record of the order; the params are bit-identical to the same run
with model order. Ranks whose first forwards differ warn and keep model order."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.runtime import order_tasks as T
from verify.compare import compare_run
from verify.traffic.predict import dmuon_buckets

pytestmark = pytest.mark.distributed

TIMEOUT_S = 90
MODEL = tuple(f"blocks.{i}" for i in range(4))
EXECUTION = tuple(f"blocks.{i}" for i in T.RUN_ORDER)


def _blocks_in_forward_order(r) -> tuple[str, ...]:
    modules = [m for _, m in r["forward"]]
    runs = tuple(m for k, m in enumerate(modules) if k == 0 or modules[k - 1] != m)
    return runs  # one entry per run of consecutive broadcasts of one block


def _prefetched(r, order) -> bool:
    """Block j+1's first broadcast is issued before block j's forward returns."""
    first = {m: k for k, m in reversed(r["forward"])}
    return all(first[order[j + 1]] < r["returned"][order[j]] for j in range(len(order) - 1))


def _only_next_block_ahead(r, order) -> bool:
    """Before block j's forward returns, only blocks 0..j+1 (in ``order``) were broadcast
    (prefetch_depth=1 reaches at most one bucket into the next block)."""
    return all({m for k, m in r["forward"] if k < r["returned"][order[j]]} <= set(order[: j + 2])
               for j in range(len(order)))


@pytest.mark.parametrize("z3,hsdp", [(True, False), (False, False), (True, True)],
                         ids=["z3", "z2", "hsdp-z3"])
def test_buckets_follow_the_recorded_execution_order(request, z3, hsdp):
    pool = request.getfixturevalue("pool4" if hsdp else "pool2")
    got = pool.run_with_timeout(TIMEOUT_S, T.reordered_step, z3, False, hsdp)
    ref = pool.run_with_timeout(TIMEOUT_S, T.reordered_step, z3, True, hsdp)  # model order kept
    for r, q in zip(got, ref):
        assert r["before"] == MODEL and r["after"] == EXECUTION, r["after"]
        # the agreement: one all_gather of 32 bytes per rank over all W ranks, in step 1 only
        assert r["setup"] == q["setup"] == [("all_gather", 32, "uint8", len(got))], r["setup"]
        assert tuple(r["recorded"]) == EXECUTION
        assert _blocks_in_forward_order(r) == EXECUTION, r["forward"]
        assert _prefetched(r, EXECUTION), (r["forward"], r["returned"])
        assert _only_next_block_ahead(r, EXECUTION), (r["forward"], r["returned"])
        # the control, model order: the first block to run (blocks.2) waits for blocks 0, 1
        assert q["after"] == MODEL and _blocks_in_forward_order(q) == MODEL
        assert not _only_next_block_ahead(q, EXECUTION)
        assert r["params"].keys() == q["params"].keys()
        assert all(torch.equal(r["params"][n], q["params"][n]) for n in r["params"])
    layout = got[0]["layout"]
    assert layout.dmuon_block_order == EXECUTION
    predicted = [b.names for b in dmuon_buckets(layout.muon_specs(), layout.plan(),
                                                layout.dmuon_bucket_cap_bytes, layout.dmuon_block_order)]
    assert predicted == got[0]["bucket_names"]  # the runtime's index order, derived independently
    run = compare_run(layout, [e for r in got for e in r["events"]], steps=1,
                      ns_calls=sum(r["ns_calls"] for r in got))
    assert run["pass"], run


def test_ranks_that_record_different_orders_warn_and_keep_model_order(pool2):
    out = pool2.run_with_timeout(TIMEOUT_S, T.disagreeing_first_step, True)
    assert out[0]["warnings"] == out[1]["warnings"] and len(out[0]["warnings"]) == 1, out
    message = out[0]["warnings"][0]
    assert "ranks [0]" in message and "ranks [1]" in message and "model order" in message
    for r in out:
        assert r["order"] == MODEL
        assert all(torch.isfinite(p).all() for p in r["params"].values())
    assert all(torch.equal(out[0]["params"][n], out[1]["params"][n]) for n in out[0]["params"])
