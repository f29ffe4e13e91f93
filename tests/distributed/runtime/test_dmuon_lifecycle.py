"""DedicatedParams.close() and the context manager release everything DMuon attached, and
``.to()`` is followed where it happens."""

import pytest
import torch

from tests.distributed.runtime import lifecycle_tasks as T

pytestmark = pytest.mark.distributed

TIMEOUT_S = 90
CYCLES = 3


@pytest.mark.parametrize("kind,pool", [("flat", "pool2"), ("hsdp", "pool4")])
def test_build_close_cycles_leave_no_threads_or_fds(kind, pool, request):
    results = request.getfixturevalue(pool).run_with_timeout(
        TIMEOUT_S, T.build_close_cycles, kind, CYCLES)
    for rank, r in enumerate(results):
        assert all(a <= r["before"] for a in r["after"]), (rank, r)  # threads, fds
        assert r["closed"] <= r["before"], (rank, r)
        # an open DedicatedParams holds its groups' threads and sockets: the check sees them
        assert r["open"][0] > r["before"][0] and r["open"][1] > r["before"][1], (rank, r)


@pytest.mark.parametrize("mode", ["z3", "hsdp-z2"])
def test_close_syncs_detaches_and_refuses_later_use(pool4, mode):
    results = pool4.run_with_timeout(TIMEOUT_S, T.close_semantics, mode)
    owner = {}
    for r in results:
        owner.update(r["owned"])
    for rank, r in enumerate(results):
        assert r["swapped"] and r["classes_restored"], (rank, r["swapped"])
        assert r["hooks_left"] == [] and r["ddp_ignore"] is None, (rank, r["hooks_left"])
        assert r["closed"] and r["again_closed"]
        # close() synced: every rank holds the owners' post-step values
        assert r["values"].keys() == owner.keys()
        assert all(torch.equal(r["values"][n], owner[n]) for n in owner), rank
        for msg in r["errors"]:
            assert "after close()" in msg and "dmuon.dedicate_params" in msg, msg


def test_exception_in_with_block_closes_without_collectives(pool2):
    for r in pool2.run_with_timeout(TIMEOUT_S, T.exception_in_with):
        assert r["closed"] and r["hooks_left"] == [] and r["state"] == "CLOSED", r


def test_class_swap_keeps_names_pickling_and_composes_with_fully_shard(pool2):
    for r in pool2.run_with_timeout(TIMEOUT_S, T.class_swap_behaviour):
        assert r["name"] == "Linear" and r["isinstance"] and not r["exact"]
        assert r["repr_same"]
        assert r["deepcopy_exact"]
        assert r["rebound_now"] and r["dtypes"] == ["torch.float32", "torch.float64"]
        assert r["fsdp_mro"][1] == "FSDPModule" and r["fsdp_mro"][0] == "FSDP" + r["fsdp_mro"][2]
        assert r["fsdp_kept_after_close"] == r["fsdp_mro"][0]


def test_split_bucket_is_named_at_the_forward_and_hand_rebinding_is_adopted(pool2):
    for r in pool2.run_with_timeout(TIMEOUT_S, T.moved_block_alone):
        assert "Invalid dedicated params of unit" in r["error"], r
        assert "torch.float64" in r["error"] and "apply .to()" in r["error"], r
        assert r["adopted"] == "no error", r


def test_close_refuses_unreduced_grads_and_a_later_backward_names_close(pool2):
    for r in pool2.run_with_timeout(TIMEOUT_S, T.close_misuse):
        assert "close() with grads accumulated under dm.no_sync()" in r["unreduced"], r
        assert "a backward started after DedicatedParams.close()" in r["backward_after_close"], r
        assert r["closed"]


def test_a_handle_dropped_without_close_does_not_keep_the_model_alive(pool2):
    for r in pool2.run_with_timeout(TIMEOUT_S, T.dropped_without_close):
        assert r == {"model": True, "dm": True}, r


@pytest.mark.parametrize("kind,pool", [("flat", "pool2"), ("hsdp", "pool4")])
def test_dmuon_groups_take_the_default_groups_timeout(kind, pool, request):
    # without it a new gloo group waits 30 min, whatever init_process_group(timeout=) said, so a
    # rank that dropped a backward would hang the others past the user's limit
    for default_s, mine in request.getfixturevalue(pool).run_with_timeout(TIMEOUT_S, T.group_timeouts, kind):
        assert default_s < 1800 and mine and all(s == default_s for s in mine), (default_s, mine)
