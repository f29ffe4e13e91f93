"""Coalescing (``dedicate_params(coalesce=...)``, docs/traffic-model.md "Coalescing"): a stack of
8 equal blocks at W=4 becomes one aligned group under ``coalesce="all"``, moved by one
all_gather / reduce_scatter per channel, and trains like ``coalesce="block"`` (one broadcast
and one reduce per bucket) in every mode; 5 blocks form an uneven group (owner shares 2, 1, 1,
1), moved on gloo by one all_to_all per channel, with the same result."""

import pytest

from tests.distributed.parity import coalesce_tasks as T

pytestmark = pytest.mark.distributed


# per step, aligned ("all"): one call per channel; "block": one per bucket (8 matrices). Z3
# re-broadcasts every unit but the last (docs/protocol.md step 2): none of the one
# "all" unit, 7 of the 8 blocks
EXPECTED_ALL = {
    "ddp": {("all_gather", "forward"): 1, ("reduce_scatter", "backward"): 1},
    "z3": {("all_gather", "forward"): 1, ("reduce_scatter", "backward"): 1},
    "hsdp-z2": {("all_gather", "forward"): 1, ("reduce_scatter", "backward"): 2, ("all_gather", "replicate"): 1},
}
EXPECTED_BLOCK = {
    "ddp": {("broadcast", "forward"): 8, ("reduce", "backward"): 8},
    "z3": {("broadcast", "forward"): 8, ("broadcast", "backward"): 7, ("reduce", "backward"): 8},
    "hsdp-z2": {("broadcast", "forward"): 8, ("reduce", "backward"): 8 + 4, ("broadcast", "replicate"): 4},
}


#: gloo's reductions (``buckets.LinkCost.reduce_by_gather``): reduce -> gather, reduce_scatter
#: -> all_to_all, the same counts
BY_GATHER = {"reduce": "gather", "reduce_scatter": "all_to_all"}


def _expected(table: dict, by_gather: bool) -> dict:
    return {(BY_GATHER.get(op, op) if by_gather else op, phase): k for (op, phase), k in table.items()}


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b)


@pytest.mark.parametrize("by_gather", [True, False], ids=["gloo-gather", "nccl-ops"])
@pytest.mark.parametrize("mode", ["ddp", "z3", "hsdp-z2"])
def test_aligned_group_trains_like_per_bucket_calls(pool4, mode, by_gather):
    coalesced = pool4.run(T.train, mode, "all", by_gather=by_gather)
    per_block = pool4.run(T.train, mode, "block", by_gather=by_gather)
    assert all(coalesced[0]["aligned"]) and not any(per_block[0]["aligned"])
    assert coalesced[0]["ops"] == _expected(EXPECTED_ALL[mode], by_gather)
    assert per_block[0]["ops"] == _expected(EXPECTED_BLOCK[mode], by_gather)
    assert coalesced[0]["coalescing"]["reduce_by_gather"] is by_gather
    for run in (coalesced, per_block):  # dm.coalescing() reports the calls the interposer saw
        by_phase = {ph: sum(k for (op, p), k in run[0]["ops"].items() if p == ph)
                    for ph in ("forward", "backward", "replicate")}
        assert run[0]["coalescing"]["calls_per_step"] == by_phase
    units = coalesced[0]["coalescing"]["units"]
    assert len(units) == 1 and units[0]["aligned"] and units[0]["bytes"] == T.BLOCKS * T.D * T.D * 4
    peak = coalesced[0]["coalescing"]["z3_peak_bytes"]  # Z3: the 6 of 8 matrices rank 0 does not hold
    assert peak == (6 * T.D * T.D * 4 if mode == "z3" else 0)
    # a reduce_scatter's chunks are summed in the same rank order as the reduces it replaces
    # (gloo's own, and DMuon's sum_rows_ by gather): the two layouts are bit-identical
    # (measured in every mode, fp32 and bf16)
    for a, b in zip(coalesced, per_block):  # every rank holds the same values after sync
        assert _max_rel(a["params"], b["params"]) == 0.0
    assert _max_rel(coalesced[0]["params"], coalesced[3]["params"]) == 0.0


def test_aligned_group_under_hsdp_z3_and_bf16(pool4):
    coalesced = pool4.run(T.train, "hsdp-z3", "all", 3, True)
    per_block = pool4.run(T.train, "hsdp-z3", "block", 3, True)
    assert coalesced[0]["ops"] == {("all_gather", "forward"): 1, ("all_to_all", "backward"): 2,
                                   ("all_gather", "replicate"): 1}  # the one unit is the last
    for a, b in zip(coalesced, per_block):  # bf16 compute copies, fp32 masters: bit-identical too
        assert _max_rel(a["params"], b["params"]) == 0.0


# 5 blocks at W=4: owner shares of 2, 1, 1, 1 matrices (HSDP 2x2: shard parts 3 and 2, replicate
# parts 2 and 1 or 1 and 1). gloo (reduce_by_gather) moves the uneven group by all_to_alls,
# one per channel; without reduce_by_gather (NCCL's ops) it cannot be aligned
EXPECTED_UNEVEN = {
    "ddp": {("all_to_all", "forward"): 1, ("all_to_all", "backward"): 1},
    "z3": {("all_to_all", "forward"): 1, ("all_to_all", "backward"): 1},
    "hsdp-z2": {("all_to_all", "forward"): 1, ("all_to_all", "backward"): 2, ("all_to_all", "replicate"): 1},
}


@pytest.mark.parametrize("mode", ["ddp", "z3", "hsdp-z2"])
def test_uneven_group_moves_by_all_to_all_and_trains_like_per_bucket_calls(pool4, mode):
    coalesced = pool4.run(T.train, mode, "all", blocks=5)
    per_block = pool4.run(T.train, mode, "block", blocks=5)
    assert all(coalesced[0]["aligned"]) and not any(per_block[0]["aligned"])
    assert coalesced[0]["ops"] == EXPECTED_UNEVEN[mode]
    by_phase = {ph: sum(k for (op, p), k in coalesced[0]["ops"].items() if p == ph)
                for ph in ("forward", "backward", "replicate")}
    assert coalesced[0]["coalescing"]["calls_per_step"] == by_phase
    for a, b in zip(coalesced, per_block):  # the members' rows are summed in the gathers' order
        assert _max_rel(a["params"], b["params"]) == 0.0
    assert _max_rel(coalesced[0]["params"], coalesced[3]["params"]) == 0.0


def test_uneven_group_under_hsdp_z3_bf16_and_without_reduce_by_gather(pool4):
    coalesced = pool4.run(T.train, "hsdp-z3", "all", 3, True, blocks=5)
    per_block = pool4.run(T.train, "hsdp-z3", "block", 3, True, blocks=5)
    assert coalesced[0]["ops"] == EXPECTED_UNEVEN["hsdp-z2"]  # the one unit is the last: kept
    for a, b in zip(coalesced, per_block):
        assert _max_rel(a["params"], b["params"]) == 0.0
    nccl_ops = pool4.run(T.train, "ddp", "all", by_gather=False, blocks=5)
    assert not any(nccl_ops[0]["aligned"])  # reduce_scatter / all_gather need equal parts


def test_moving_some_blocks_of_an_aligned_group_is_named_before_any_call(pool4):
    # the group's buckets would travel in one all_to_all in two dtypes (gloo aborts on the size
    # mismatch; equal-size dtypes would be read as the other): every rank raises at the forward
    errors = pool4.run(T.cast_one_block, False)
    assert all("Invalid dedicated params of unit 'blocks.0.0'" in e and "torch.float64" in e
               and "coalesce='block'" in e for e in errors), errors
    assert pool4.run(T.cast_one_block, True) == [""] * 4  # the whole unit moved: fine
