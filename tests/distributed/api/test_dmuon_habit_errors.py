"""Habits of FSDP2 / DDP scripts get an error (or warning) that names the fix.

What each test saw before its fix:

- fully_shard without ignored_params: Z2 "Pass model.parameters() ...", Z3 "... storage freed
  ... call dm.sync_params()"; neither named ignored_params.
- a rest param of another shape on one rank: dedicate_params agreed (the digest covered only the
  dedicated params), and FSDP2's first collective failed later (gloo EnforceNotMet, a dead rank):
  "no error" from dedicate_params.
- reentrant activation checkpointing over a block run twice: a raw ``AssertionError: ... grads:
  REDUCING -> LOCAL`` in backward (an AssertionError: the harness's RankError, not "ValueError").
- TP at N = T: the shard-axis DTensor counted as TP-only (mesh size 2 = TP size 2): one warning.
- a shared Linear: the warning said "params= cannot dedicate it" and then "Pass params= ... to
  dedicate them".
"""

import re

import pytest
import torch

from tests.distributed.api import habit_tasks as H

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_fully_shard_without_ignored_params_names_them(pool2, mode):
    for rank, msg in enumerate(pool2.run_with_timeout(TIMEOUT_S, H.fully_shard_without_ignored_params, mode)):
        assert msg.startswith("ValueError: "), (rank, msg)
        assert "ignored_params=set(dm)" in msg and "fully_shard(module, mesh=mesh, ignored_params=set(dm))" in msg, (
            rank, msg)


def test_rest_param_of_another_shape_fails_the_setup_agreement(pool2):
    for rank, msg in enumerate(pool2.run_with_timeout(TIMEOUT_S, H.rest_shape_differs)):
        assert msg.startswith("RuntimeError: DMuon setup"), (rank, msg)
        assert "differs across ranks (ranks [0]" in msg and "same parameter names, shapes and dtypes" in msg


@pytest.mark.parametrize("mode", ["ddp", "z2", "z3"])
def test_reentrant_checkpointing_over_a_shared_block_names_use_reentrant_false(pool2, mode):
    for rank, r in enumerate(pool2.run_with_timeout(TIMEOUT_S, H.reentrant_shared_block, mode, True)):
        assert r["error"].startswith("ValueError: DMuon: module 'blocks.0'"), (rank, r["error"])
        assert "Checkpoint it with use_reentrant=False" in r["error"], (rank, r["error"])


@pytest.mark.parametrize("mode", ["ddp", "z3"])
def test_non_reentrant_checkpointing_over_a_shared_block_works(pool2, mode):
    """The fix the error names: both uses' grads summed, reduced once, equal to one process."""
    ref = H.reentrant_oracle()
    results = pool2.run_with_timeout(TIMEOUT_S, H.reentrant_shared_block, mode, False)
    assert all(r["error"] == "no error" for r in results), results
    owned = {n: g for r in results for n, g in r["grads"].items()}
    assert owned.keys() == ref.keys()
    for n, g in owned.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-5, atol=1e-7)


def test_no_false_tp_warning_at_n_equal_t(pool4):
    for rank, counts in enumerate(pool4.run_with_timeout(TIMEOUT_S, H.tp_rest_warning)):
        assert counts == {"fsdp_shard": 0, "tp_only": 1, "plain": 1}, (rank, counts)


def test_shared_weight_warning_says_one_thing(pool2):
    for messages in pool2.run_with_timeout(TIMEOUT_S, H.shared_weight_warning):
        assert len(messages) == 1
        msg = messages[0]
        assert "blocks.0.mlp.fc1.weight" in msg and "cannot dedicate it (reuse a whole block" in msg, msg
        assert "Pass params= or predicate=" not in msg, msg


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_reentrant_checkpointing_over_two_forwards_names_use_reentrant_false(pool2, mode):
    """Two forwards, one backward: each block is used twice in one backward though no block
    runs twice in a forward. Before: ``AssertionError: DMuon bucket 1 ('blocks.0') grads:
    REDUCING -> LOCAL`` (the transition check, from a grad hook). Now every rank raises the
    same ValueError naming the block and the fix (Z2: from the late grad's hook; Z3: from
    the recompute, which finds the block's copy freed)."""
    results = pool2.run_with_timeout(TIMEOUT_S, H.reentrant_two_forwards, mode, True)
    for rank, r in enumerate(results):
        assert re.match(r"ValueError: DMuon: block 'blocks\.\d' \(unit 'blocks\.0'\) backpropagates "
                        "a second use in one backward", r["error"]), (rank, r["error"])
        assert "Checkpoint it with use_reentrant=False" in r["error"], (rank, r["error"])
    assert results[0]["error"] == results[1]["error"]


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_non_reentrant_checkpointing_over_two_forwards_works(pool2, mode):
    """The fix the error names: both forwards' grads summed, reduced once, equal to one process
    (the control: the same model and batches, only ``use_reentrant`` differs)."""
    results = pool2.run_with_timeout(TIMEOUT_S, H.reentrant_two_forwards, mode, False)
    assert all(r["error"] == "no error" for r in results), results
    ref = H.two_forwards_oracle()
    owned = {n: g for r in results for n, g in r["grads"].items()}
    assert owned.keys() == ref.keys()
    for n, g in owned.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-5, atol=1e-7)
