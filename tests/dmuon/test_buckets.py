"""The runtime's bucket layout (``dmuon/ownership/buckets.py``) against the rule as documented, and
against the predictor's independent implementation (``verify/traffic/predict.py``) on TinyGPT at
several caps and world sizes: the same buckets, and each block a contiguous index range."""

import pytest

from dmuon.ownership.buckets import (LINK_COSTS, LINK_POLICIES, block_of, bucket_layout, check_hierarchy,
                                     check_link, resolve_coalesce, resolve_hierarchy, unit_layout)
from dmuon.ownership.plan import ParamSpec, plan_ownership
from tests.builders import tinygpt_layout
from verify.traffic.predict import dmuon_block, dmuon_buckets, dmuon_coalesce_bytes


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


def _key(b):
    return (b.module, b.owner, b.dtype, b.names, b.numel, tuple(b.blocks), b.aligned)


@pytest.mark.parametrize("mode,world", [("dmuon-z3", 4), ("dmuon-hsdp-z2", 4), ("dmuon-ddp", 2)])
@pytest.mark.parametrize("target", [0, 20_000, 200_000, 2**63 - 1])
@pytest.mark.parametrize("uneven", [False, True])
def test_coalesced_layout_equals_the_predicted_one(mode, world, target, uneven):
    layout = tinygpt_layout(mode, world)
    specs, plan = layout.muon_specs(), layout.plan()
    runtime = bucket_layout(specs, plan, 25 * 1024 * 1024, target, uneven)
    predicted = dmuon_buckets(specs, plan, 25 * 1024 * 1024, coalesce_bytes=target,
                              uneven_aligned=uneven)
    assert sorted(map(_key, runtime)) == sorted(map(_key, predicted))  # aligned: (s, r) order
    units = [b.module for b in runtime]
    assert units == sorted(units, key=units.index)  # each unit one contiguous range


def _specs(shapes, dtype="float32"):
    """``blocks.i.fc`` Linear weights of the given shapes, in order."""
    return [ParamSpec(f"blocks.{i}.fc.weight", tuple(s), dtype, f"blocks.{i}.fc") for i, s in enumerate(shapes)]


def test_units_join_consecutive_blocks_up_to_the_target():
    specs = _specs([(64, 64)] * 5)  # 16 KiB each
    assert len(set(unit_layout(specs, 0).values())) == 5  # "block": one unit per block
    units = unit_layout(specs, 40_000)  # two blocks fit (32 KiB), three do not
    assert units["blocks.0"] == units["blocks.1"] == ("blocks.0", "blocks.1")
    assert units["blocks.4"] == ("blocks.4",)
    assert set(unit_layout(specs, resolve_coalesce("all", "gloo").target_bytes).values()) == {
        tuple(f"blocks.{i}" for i in range(5))}


def test_an_aligned_group_is_one_bucket_per_owner_in_shard_then_replicate_order():
    specs = _specs([(32, 32)] * 8)
    plan = plan_ownership(specs, (2, 2))  # HSDP 2x2: g = r * 2 + s
    layout = bucket_layout(specs, plan, 25 * 1024 * 1024, 2**40)
    assert len(layout) == 4 and all(b.aligned for b in layout)
    assert [(b.owner % 2, b.owner // 2) for b in layout] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # coalesce="block" keeps one call per bucket even where a unit could be aligned
    assert not any(b.aligned for b in bucket_layout(specs, plan, 25 * 1024 * 1024, 0))
    # unequal sizes: per-owner buckets, not aligned, unless the backend reduces by gather
    # (an uneven group, moved by all_to_alls); still one bucket per owner, none split
    uneven = _specs([(32, 32)] * 3 + [(32, 64)])
    uneven_plan = plan_ownership(uneven, (1, 4))
    assert not any(b.aligned for b in bucket_layout(uneven, uneven_plan, 2**30, 2**40))
    by_gather = bucket_layout(uneven, uneven_plan, 2**30, 2**40, uneven=True)
    assert all(b.aligned for b in by_gather) and sorted(b.numel for b in by_gather) == [1024] * 3 + [2048]
    five = _specs([(32, 32)] * 5)  # an owner of two 4 KiB matrices: split by a 4 KiB cap, not aligned
    five_plan = plan_ownership(five, (1, 4))
    assert all(b.aligned for b in bucket_layout(five, five_plan, 2**30, 2**40, uneven=True))
    assert not any(b.aligned for b in bucket_layout(five, five_plan, 4096, 2**40, uneven=True))
    three = _specs([(32, 32)] * 3)  # an owner without a bucket: never aligned
    assert not any(b.aligned for b in bucket_layout(three, plan_ownership(three, (1, 4)), 2**30, 2**40,
                                                    uneven=True))


@pytest.mark.parametrize("bad", ["fast", -1, 1.5, True, None])
def test_coalesce_values_are_checked(bad):
    with pytest.raises(ValueError, match="Invalid coalesce="):
        resolve_coalesce(bad, "gloo")


def test_auto_target_is_the_documented_half_bandwidth_size():
    for backend, target in (("gloo", 2_000_000), ("nccl", 3_600_000)):
        got = resolve_coalesce("auto", backend)
        assert got.target_bytes == dmuon_coalesce_bytes("auto", backend) == target
    assert LINK_COSTS["nccl"].half_bytes == 3_600_000


@pytest.mark.parametrize("shapes,joined", [([(32, 32)] * 4, True), ([(32, 32)] * 3 + [(32, 64)], False)])
def test_a_unit_that_saves_no_call_splits_into_its_blocks(shapes, joined):
    """Four blocks owned by four ranks: joined they need four calls unless aligned, as many
    as alone, so they stay one unit each (their per-block overlap is kept); aligned (equal
    sizes) they need one. The predictor derives the same from the rule."""
    specs = _specs(shapes)  # 4 KiB each, or one of 8 KiB: not an even group
    plan = plan_ownership(specs, (1, 4))
    runtime = bucket_layout(specs, plan, 2**30, 2**40)
    predicted = dmuon_buckets(specs, plan, 2**30, coalesce_bytes=2**40)
    assert sorted(map(_key, runtime)) == sorted(map(_key, predicted))
    assert {len(b.blocks) for b in runtime} == ({4} if joined else {1})
    assert all(b.aligned for b in runtime) == joined


# ---------------------------------------------------------------- HSDP: flat or hierarchical
def _hsdp_layout(blocks: int, coalescing):
    """A stack of ``blocks`` 16x16 blocks on a 2 x 2 mesh, laid out under ``coalescing``."""
    specs = [ParamSpec(f"blocks.{i}.fc.weight", (16, 16), "float32", f"blocks.{i}.fc") for i in range(blocks)]
    plan = plan_ownership(specs, (2, 2))
    return bucket_layout(specs, plan, 1 << 20, coalescing.target_bytes, coalescing.reduce_by_gather)


@pytest.mark.parametrize(("hierarchy", "backend", "coalesce", "flat"), [
    ("auto", "gloo", "auto", True),       # one unit on gloo: flat
    ("auto", "gloo", "block", False),     # one unit per block: hierarchical
    ("auto", "nccl", "auto", False),      # NCCL never flattens by itself
    ("auto", "nccl", "all", False),
    ("flat", "nccl", "block", True),      # forced either way
    ("hierarchical", "gloo", "auto", False),
])
def test_resolve_hierarchy_follows_the_documented_rule(hierarchy, backend, coalesce, flat):
    coalescing = resolve_coalesce(coalesce, backend)
    assert resolve_hierarchy(hierarchy, coalescing, lambda: _hsdp_layout(4, coalescing)) is flat


def test_resolve_hierarchy_counts_units_after_the_saving_rule():
    """Blocks joined by the byte target but split again (a joined unit that saves no call) are
    several units: hierarchical under "auto"."""
    coalescing = resolve_coalesce(2 * 16 * 16 * 4, "gloo")  # two blocks fit the target
    layout = _hsdp_layout(4, coalescing)
    assert len({b.module for b in layout}) > 1
    assert resolve_hierarchy("auto", coalescing, lambda: layout) is False


@pytest.mark.parametrize("bad", ["2d", "", None, 1, "Flat"])
def test_check_hierarchy_rejects_other_values(bad):
    with pytest.raises(ValueError, match=r"Invalid hierarchy=.*Must be one of \('auto', 'hierarchical', 'flat'\)"):
        check_hierarchy(bad)


@pytest.mark.parametrize("bad", ["infiniband", "", None, 1, "NCCL"])
def test_check_link_rejects_other_values(bad):
    with pytest.raises(ValueError, match=r"Invalid link=.*Must be one of \('auto', 'nccl', 'gloo'\)"):
        check_link(bad)


def test_link_policies_are_auto_and_every_backend_entry():
    """dedicate_params(link=...) names an entry of LINK_COSTS: each must pass the check."""
    assert LINK_POLICIES == ("auto", *LINK_COSTS)
    for link in LINK_POLICIES:
        check_link(link)
