"""The block-order rule (buckets in execution order, ``docs/protocol.md`` step 7) as a pure
function: the predictor's implementation (``verify/traffic/predict.py``) on hand-written cases, the
runtime's (``dmuon/runtime/order.py``) agreeing with it, and the predicted bucket list and layout
following it."""

from collections import Counter

import pytest

from dmuon.runtime.order import execution_block_order, order_digest
from tests.builders import tinygpt_layout
from verify.traffic.predict import RunLayout, dmuon_block_sequence, dmuon_buckets, predict_step

BLOCKS = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
ENC_DEC = ("decoder.layers.0", "decoder.layers.1", "encoder.layers.0", "encoder.layers.1")
MOE = ("layers.0", "layers.0.experts.0", "layers.0.experts.1", "layers.1", "head")

CASES = [
    # (model order, recorded, expected)
    (BLOCKS, BLOCKS, BLOCKS),  # runs as registered
    (BLOCKS, ("blocks.2", "blocks.0", "blocks.3", "blocks.1"),
     ("blocks.2", "blocks.0", "blocks.3", "blocks.1")),
    (BLOCKS, ("blocks.2", "blocks.2", "x", "blocks.0", "blocks.1"),  # repeats, non-blocks
     ("blocks.2", "blocks.0", "blocks.1", "blocks.3")),  # blocks that never ran: appended
    (BLOCKS, ("blocks.0", "blocks.3"), BLOCKS),  # a subsequence of model order: model order
    (BLOCKS, (), BLOCKS),
    (ENC_DEC, ("encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"),
     ("encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1")),
    # encoder and decoder interleaved: neither driver would be contiguous -> model order
    (ENC_DEC, ("encoder.layers.0", "decoder.layers.0", "encoder.layers.1", "decoder.layers.1"), ENC_DEC),
    # MoE: experts without tokens on this rank, the rest in model order
    (MOE, ("layers.0", "layers.0.experts.1", "layers.1", "head"), MOE),
    (MOE, ("layers.1", "layers.0", "layers.0.experts.1", "layers.0.experts.0", "head"),
     ("layers.1", "layers.0", "layers.0.experts.1", "layers.0.experts.0", "head")),
    # an expert run outside its layer's turn would split the driver layers.0 -> model order
    (MOE, ("layers.0", "layers.1", "layers.0.experts.0"), MOE),
    (("", "blocks.0", "blocks.1"), ("", "blocks.1", "blocks.0"), ("", "blocks.1", "blocks.0")),
]


@pytest.mark.parametrize("model,recorded,expected", CASES)
def test_predictor_rule(model, recorded, expected):
    assert dmuon_block_sequence(model, recorded) == expected
    assert execution_block_order(model, recorded) == expected  # the runtime's own code agrees


def test_digest_names_the_order():
    assert order_digest(BLOCKS) == order_digest(list(BLOCKS))
    assert order_digest(BLOCKS) != order_digest(BLOCKS[::-1]) and len(order_digest(())) == 64


def _is_rebroadcast(e) -> bool:
    return e.phase == "backward" and e.op in ("broadcast", "all_gather") and e.dedicated_count > 0


@pytest.mark.parametrize("mode", ["dmuon-hsdp-z2", "dmuon-hsdp-z3"])
def test_predicted_buckets_follow_the_order_which_picks_only_the_unit_z3_keeps(mode):
    layout = tinygpt_layout(mode, 4)
    order = ("blocks.1", "blocks.0")
    reordered = RunLayout.from_dict(
        {**layout.to_dict(), "dmuon_block_order": list(order)})
    assert reordered.dmuon_block_order == order
    specs, plan = layout.muon_specs(), layout.plan()
    model = dmuon_buckets(specs, plan, 20_000)
    got = dmuon_buckets(specs, plan, 20_000, order)
    blocks = [b.module for b in got]
    assert list(dict.fromkeys(blocks)) == list(order) + [m for m in dict.fromkeys(
        b.module for b in model) if m not in order]
    for block in set(blocks):  # model order within a block, each block contiguous
        assert [b for b in got if b.module == block] == [b for b in model if b.module == block]
        idx = [i for i, m in enumerate(blocks) if m == block]
        assert idx == list(range(idx[0], idx[-1] + 1))
    if mode.endswith("z2"):  # no unit is kept: the calls of a step, a multiset, ignore the order
        assert Counter(predict_step(reordered)) == Counter(predict_step(layout))
        return
    # Z3 keeps the unit of the last bucket index (docs/protocol.md step 2): blocks.1 in
    # model order, blocks.0 in the recorded order; the other block alone is re-broadcast in
    # backward, and nothing else depends on the order
    rest = [Counter(e for e in predict_step(x) if not _is_rebroadcast(e)) for x in (reordered, layout)]
    assert rest[0] == rest[1]
    for x, other_unit in ((layout, "blocks.0"), (reordered, "blocks.1")):
        again = [e for e in predict_step(x) if _is_rebroadcast(e)]
        assert {e.module for e in again} == {other_unit}
        # each rank's re-broadcasts move that block's Muon elements once
        per_rank = sum(p.numel for p in x.muon_specs() if p.module.startswith(other_unit + "."))
        assert all(sum(e.count for e in again if e.rank == rank) == per_rank for rank in range(4))


def test_recorder_counts_the_runs_of_blocks_and_watched_modules():
    """The harness's own count of weight sharing (``RunLayout.module_calls``): the first
    forward only, blocks and watched modules (FSDP2 units) alike."""
    import torch

    from examples.structures import SharedBlockMLP
    from verify.measure.block_order import BlockOrderRecorder

    model = SharedBlockMLP()
    rec = BlockOrderRecorder(model, ("inp", "blocks.0", "blocks.1"), watch=("blocks.0.up", "blocks.1", ""))
    model(torch.randn(2, 20))
    model(torch.randn(2, 20))  # after the first forward the hooks are gone
    assert rec.recorded == ["inp", "blocks.0", "blocks.1"]
    assert rec.calls == {"inp": 1, "blocks.0": 2, "blocks.1": 1, "blocks.0.up": 2}
