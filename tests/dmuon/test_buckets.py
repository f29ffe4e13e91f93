"""The runtime's bucket layout (``dmuon/ownership/buckets.py``) against the rule as documented, and
against the predictor's independent implementation (``verify/traffic/predict.py``) on TinyGPT at
several caps and world sizes: the same buckets, and each block a contiguous index range."""

import pytest

from dmuon.ownership.buckets import block_of, bucket_layout
from tests.builders import tinygpt_layout
from verify.traffic.predict import dmuon_block, dmuon_buckets


@pytest.mark.parametrize("module", ["", "head", "blocks.3", "blocks.3.attn.qkv",
                                    "layers.0.experts.5.w1", "a.b", "x.10.y.2"])
def test_block_rule_agrees_with_the_predictor(module):
    assert block_of(module) == dmuon_block(module)


@pytest.mark.parametrize("mode,world", [("dmuon-z3", 3), ("dmuon-hsdp-z2", 4), ("dmuon-ddp", 4)])
@pytest.mark.parametrize("cap_bytes", [1, 20_000, 25 * 1024 * 1024])
def test_runtime_layout_equals_the_predicted_one(mode, world, cap_bytes):
    layout = tinygpt_layout(mode, world)
    specs, plan = layout.muon_specs(), layout.plan()
    runtime = bucket_layout(specs, plan, cap_bytes)
    predicted = dmuon_buckets(specs, plan, cap_bytes)
    assert [(b.module, b.owner, b.dtype, b.names, b.numel) for b in runtime] == \
        [(b.module, b.owner, b.dtype, b.names, b.numel) for b in predicted]
    blocks = [b.module for b in runtime]
    for block in set(blocks):  # contiguous: the drivers' index ranges rely on it
        idx = [i for i, m in enumerate(blocks) if m == block]
        assert idx == list(range(idx[0], idx[-1] + 1)), (block, idx)
    for b in runtime:
        assert len(b.names) == 1 or b.numel * 4 <= cap_bytes
