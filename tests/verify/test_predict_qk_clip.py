"""The traffic predictor's QK-clip call: one MAX all_reduce of 4 bytes a
head per rank and step over all W ranks, its own phase ``qk_clip``, no Muon payload (what
DMuon + ``QKClip`` on TinyGPT issues is checked against it in
``tests/distributed/parity/test_dmuon_qk_clip.py``).

Fails without the feature: ``RunLayout`` had no ``qk_clip_heads`` and the predictor no
``qk_clip`` phase; the measured side had no QK-clip to issue the call."""

import pytest

from dmuon.ownership.plan import ParamSpec
from tracer.events import group_id_from_ranks
from verify.traffic.predict import RunLayout, predict_step, qk_clip_calls


def _layout(mode="dmuon-z2", world=2, heads=0):
    specs = (ParamSpec("blocks.0.attn.qkv.weight", (96, 32), "float32", "blocks.0.attn"),
             ParamSpec("blocks.0.ln.weight", (32,), "float32", "blocks.0.ln"))
    return RunLayout(mode=mode, replicate_size=1, shard_size=world, params=specs,
                     muon_names=("blocks.0.attn.qkv.weight",), fsdp_modules=("",),
                     qk_clip_heads=heads)


def test_one_all_reduce_per_rank_in_its_own_phase():
    plain, clipped = predict_step(_layout()), predict_step(_layout(heads=8))
    extra = [e for e in clipped if e not in plain]
    assert [e for e in clipped if e.phase != "qk_clip"] == plain
    assert len(extra) == 2 and {e.rank for e in extra} == {0, 1}
    for e in extra:
        assert (e.phase, e.op, e.group_id, e.group_size, e.count, e.dtype, e.root) == (
            "qk_clip", "all_reduce", group_id_from_ranks([0, 1]), 2, 8, "float32", None)
        assert e.dedicated_count == 0 and e.avg_elems() == pytest.approx(2 * (2 - 1) / 2 * 8)
    assert RunLayout.from_dict(_layout(heads=8).to_dict()).qk_clip_heads == 8


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_bad_head_counts_are_refused(bad):
    with pytest.raises(ValueError, match="qk_clip_heads"):
        _layout(heads=bad)


def test_no_qk_clip_outside_dmuon():
    with pytest.raises(ValueError, match="DMuon modes"):
        _layout(mode="naive-fsdp2-z2", heads=4)



def _clipped(clips, mode="dmuon-z2"):
    specs = (ParamSpec("blocks.0.attn.qkv.weight", (96, 32), "float32", "blocks.0.attn"),
             ParamSpec("blocks.0.ln.weight", (32,), "float32", "blocks.0.ln"))
    return RunLayout(mode=mode, replicate_size=1, shard_size=2, params=specs,
                     muon_names=("blocks.0.attn.qkv.weight",), fsdp_modules=("",), grad_clips=clips)


def test_dmuons_clip_is_one_fp32_all_reduce_per_call_in_the_optimizer_phase():
    plain, clipped = predict_step(_clipped(0)), predict_step(_clipped(2))
    extra = [e for e in clipped if e.phase == "optimizer"]
    assert [e for e in clipped if e.phase != "optimizer"] == plain
    assert len(extra) == 4 and sorted(e.rank for e in extra) == [0, 0, 1, 1]
    for e in extra:
        assert (e.op, e.group_id, e.group_size, e.count, e.dtype, e.dedicated_count) == (
            "all_reduce", group_id_from_ranks([0, 1]), 2, 1, "float32", 0)
    assert RunLayout.from_dict(_clipped(2).to_dict()).grad_clips == 2
    with pytest.raises(ValueError, match="grad_clips"):
        _clipped(-1)
    with pytest.raises(ValueError, match="DMuon modes"):
        _clipped(1, mode="naive-fsdp2-z2")
