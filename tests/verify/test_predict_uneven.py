"""Uneven aligned groups on gloo (docs/traffic-model.md, "Aligned groups"): the predictor's
rule and calls, written out by hand for TinyGPT (owner shares 7, 7, 5, 5 d² at W = 4) and a
4-layer TinyGPT (two units, the last kept by Z3), flat and HSDP 2 x 2, Z2 and Z3; their
W-average equals the closed form (the proof that the closed forms need no change), and the
busiest rank of the wire model, exactly."""

from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction

import pytest

from dmuon.ownership.plan import specs_from_named_parameters
from tests.builders import dedicated_w_average, predicted_events, tinygpt_layout
from verify.compare import compare_run
from verify.modes.build import muon_names
from verify.traffic.formulas import closed_form
from verify.traffic.predict import (
    NO_LIMIT,
    RunLayout,
    dmuon_coalesce_bytes,
    dmuon_reduce_by_gather,
    dmuon_uneven_aligned,
    kept_elems,
    layout_buckets,
    predict_step,
)
from verify.traffic.wire import dedicated_traffic
from verify.workload.model import GPTConfig, TinyGPT

D2 = 64 * 64  # TinyGPT's d_model = 64: matrices are multiples of d²
GLOO = dict(dmuon_coalesce_bytes=dmuon_coalesce_bytes("auto", "gloo"),
            dmuon_reduce_by_gather=dmuon_reduce_by_gather("gloo"),
            dmuon_uneven_aligned=dmuon_uneven_aligned("gloo"))


def _tinygpt(mode: str) -> RunLayout:
    """TinyGPT (2 layers) at W = 4 on gloo, as `make verify-traffic` builds it."""
    return tinygpt_layout(mode, 4, **GLOO)


def _four_layers(mode: str) -> RunLayout:
    """TinyGPT with 4 layers at W = 4 on gloo, a unit target of two blocks: two units, each
    one uneven aligned group (owner shares 8, 8, 4, 4 and 4, 4, 8, 8 d²); nothing wraps the
    model (rest="replicate"), so every DMuon call is easy to pick out."""
    model = TinyGPT(GPTConfig(d_model=64, n_heads=4, n_layers=4))
    hsdp = "hsdp" in mode
    return RunLayout(mode=mode, replicate_size=2 if hsdp else 1, shard_size=2 if hsdp else 4,
                     params=tuple(specs_from_named_parameters(model.named_parameters())),
                     muon_names=muon_names(model), reshard_after_forward=mode.endswith("z3"),
                     dmuon_rest="replicate", **{**GLOO, "dmuon_coalesce_bytes": 2 * 12 * D2 * 4})


def _dedicated(layout: RunLayout) -> list[tuple]:
    """(rank, phase, op, group, count, in, out, self) of the DMuon calls, sorted."""
    return sorted((e.rank, e.phase, e.op, e.group_id, e.count, e.in_elems, e.out_elems, e.self_elems)
                  for e in predict_step(layout) if e.dedicated_count)


# ------------------------------------------------------------------------------ the rule
def test_backend_tables_and_layout_flag():
    assert dmuon_uneven_aligned("gloo") and not dmuon_uneven_aligned("nccl")
    layout = _tinygpt("dmuon-z2")
    assert RunLayout.from_dict(layout.to_dict()) == layout
    old = {k: v for k, v in layout.to_dict().items() if k != "dmuon_uneven_aligned"}
    assert RunLayout.from_dict(old).dmuon_uneven_aligned is False  # reports before the flag
    # reports of the aligned-group size limit: no limit loads, a finite one is refused
    assert RunLayout.from_dict({**old, "dmuon_aligned_max_bytes": NO_LIMIT}) == RunLayout.from_dict(old)
    with pytest.raises(ValueError, match="dmuon_aligned_max_bytes=65536, a limit"):
        RunLayout.from_dict({**old, "dmuon_aligned_max_bytes": 65536})
    with pytest.raises(ValueError, match="dmuon_uneven_aligned=True with dmuon_reduce_by_gather=False"):
        dataclasses.replace(layout, dmuon_reduce_by_gather=False)


def test_tinygpt_is_one_uneven_aligned_group_on_gloo_and_per_owner_calls_on_nccl():
    buckets = layout_buckets(_tinygpt("dmuon-z2"))
    assert [(b.owner, b.numel // D2, len(b.names), b.aligned) for b in sorted(buckets, key=lambda b: b.owner)] == \
        [(0, 7, 2, True), (1, 7, 2, True), (2, 5, 2, True), (3, 5, 2, True)]
    assert {b.module for b in buckets} == {"blocks.0"}  # one unit of both blocks
    # NCCL: equal groups only; the shares differ, so the unit splits into its blocks again
    # (joined it would need as many calls) and every bucket has its own broadcast / reduce
    nccl = tinygpt_layout("dmuon-z2", 4, dmuon_coalesce_bytes=dmuon_coalesce_bytes("auto", "nccl"))
    assert not any(b.aligned for b in layout_buckets(nccl))
    assert {e.op for e in predict_step(nccl) if e.dedicated_count} == {"broadcast", "reduce"}


# ------------------------------------------------------------------ exact call lists
@pytest.mark.parametrize("mode", ["dmuon-z2", "dmuon-z3"])
def test_tinygpt_flat_calls(mode):
    """H_s = c_s (R = 1): 7, 7, 5, 5 d². Forward: this rank's bucket to every peer, every
    bucket back; reduce: every peer's part (grads + 2 usage elements) out, this rank's part
    from every peer. Z3 keeps the one unit: no backward all_to_all of the params."""
    held = [7 * D2, 7 * D2, 5 * D2, 5 * D2]
    want = []
    for s, h in enumerate(held):
        want.append((s, "forward", "all_to_all", "0,1,2,3", None, 4 * h, 24 * D2, h))
        want.append((s, "backward", "all_to_all", "0,1,2,3", None, 24 * D2 + 8, 4 * (h + 2), h + 2))
    assert _dedicated(_tinygpt(mode)) == sorted(want)


@pytest.mark.parametrize("mode", ["dmuon-hsdp-z2", "dmuon-hsdp-z3"])
def test_tinygpt_hsdp_calls(mode):
    """2 x 2: shard index s holds owners s and 2 + s, 7 + 5 = 12 d² each: the shard channels
    are even (an all_gather; the reduce an all_to_all of equal chunks, as before). The
    replicate groups {0, 2} and {1, 3} hold 7 and 5 d²: uneven all_to_alls."""
    c = [7 * D2, 7 * D2, 5 * D2, 5 * D2]  # by world rank = owner g = r * 2 + s
    want = []
    for rank in range(4):
        r, s = divmod(rank, 2)
        shard, column = ("0,1", "2,3")[r], ("0,2", "1,3")[s]
        pair = [c[s], c[2 + s]]
        want += [
            (rank, "forward", "all_gather", shard, 12 * D2, None, None, None),
            (rank, "backward", "all_to_all", shard, 12 * D2 + 4, 24 * D2 + 8, 24 * D2 + 8, 12 * D2 + 4),
            (rank, "backward", "all_to_all", column, None, sum(pair) + 4, 2 * (c[rank] + 2), c[rank] + 2),
            (rank, "replicate", "all_to_all", column, None, 2 * c[rank], sum(pair), c[rank]),
        ]
    assert _dedicated(_tinygpt(mode)) == sorted(want)


def test_four_layers_z3_rebroadcasts_the_first_unit_and_keeps_the_last():
    layout = _four_layers("dmuon-z3")
    first, last = [8 * D2, 8 * D2, 4 * D2, 4 * D2], [4 * D2, 4 * D2, 8 * D2, 8 * D2]
    usage = {"blocks.0": [3, 3, 1, 1], "blocks.2": [1, 1, 3, 3]}
    want = []
    for unit, held in (("blocks.0", first), ("blocks.2", last)):
        q = [h + u for h, u in zip(held, usage[unit])]
        for s in range(4):
            gather = (s, "all_to_all", "0,1,2,3", None, 4 * held[s], 24 * D2, held[s])
            want.append((unit, "forward", *gather))
            if unit == "blocks.0":  # re-broadcast; blocks.2 is kept from forward into backward
                want.append((unit, "backward", *gather))
            want.append((unit, "backward", s, "all_to_all", "0,1,2,3", None, sum(q), 4 * q[s], q[s]))
    got = sorted((e.module, e.phase, e.rank, e.op, e.group_id, e.count, e.in_elems, e.out_elems,
                  e.self_elems) for e in predict_step(layout) if e.dedicated_count)  # no rest
    assert got == sorted(want)
    assert kept_elems(layout) == 24 * D2


def test_four_layers_hsdp_z3():
    """Both units' shard channels are even on 2 x 2 (12 d² per shard index); the replicate
    channels are not. Z3 re-gathers only the first unit in backward."""
    layout = _four_layers("dmuon-hsdp-z3")
    calls = Counter((e.module, e.phase, e.op, e.group_id, e.count, e.in_elems, e.out_elems)
                    for e in predict_step(layout) if e.rank == 0 and e.dedicated_count)
    assert calls == Counter({
        ("blocks.0", "forward", "all_gather", "0,1", 12 * D2, None, None): 1,
        ("blocks.0", "backward", "all_gather", "0,1", 12 * D2, None, None): 1,
        ("blocks.0", "backward", "all_to_all", "0,1", 12 * D2 + 4, 24 * D2 + 8, 24 * D2 + 8): 1,
        # rank 0 owns 8 d² (3 params) of blocks.0, rank 2 4 d² (1 param)
        ("blocks.0", "backward", "all_to_all", "0,2", None, 12 * D2 + 4, 2 * (8 * D2 + 3)): 1,
        ("blocks.0", "replicate", "all_to_all", "0,2", None, 16 * D2, 12 * D2): 1,
        ("blocks.2", "forward", "all_gather", "0,1", 12 * D2, None, None): 1,
        ("blocks.2", "backward", "all_to_all", "0,1", 12 * D2 + 4, 24 * D2 + 8, 24 * D2 + 8): 1,
        ("blocks.2", "backward", "all_to_all", "0,2", None, 12 * D2 + 4, 2 * (4 * D2 + 1)): 1,
        ("blocks.2", "replicate", "all_to_all", "0,2", None, 8 * D2, 12 * D2): 1,
    })


def test_every_uneven_call_is_consistent_across_its_members():
    """Per call (group, phase, unit): the members send as much as they receive in all, and
    each member's output is one chunk from every member (the repeated part or the reduce
    part)."""
    for layout in (_tinygpt("dmuon-hsdp-z2"), _four_layers("dmuon-z3"), _tinygpt("dmuon-z2")):
        calls: dict[tuple, list] = {}
        for e in predict_step(layout):
            if e.uneven:  # a reduce's own chunk holds usage elements, a gather's does not
                kind = "gather" if e.dedicated_count == e.self_elems else "reduce"
                calls.setdefault((e.group_id, e.phase, e.module, kind), []).append(e)
        assert calls
        for members in calls.values():
            assert len(members) == members[0].group_size
            assert sum(e.in_elems - e.self_elems for e in members) == \
                sum(e.out_elems - e.self_elems for e in members)
            assert sum(e.in_elems for e in members) == sum(e.out_elems for e in members)
            assert sum(e.dedicated_in_elems for e in members) == sum(e.dedicated_out_elems for e in members)


# --------------------------------------------------------------- closed forms, busiest rank
LAYOUTS = [(_tinygpt, m) for m in ("dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")] + \
    [(_four_layers, m) for m in ("dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")]


@pytest.mark.parametrize("build,mode", LAYOUTS)
def test_uneven_groups_move_the_closed_form_exactly(build, mode):
    """On the W-average an uneven group moves what per-owner broadcasts and reduces move:
    each element leaves its holder for N - 1 peers once per channel. Exact in rationals, per
    phase, and through compare_run on the prediction as the interposer records it."""
    layout = build(mode)
    form = closed_form(mode, layout.shard_size, layout.replicate_size)
    assert dedicated_w_average(layout) == Fraction(form.total_at(layout.p_m(), 0, kept_elems(layout))).limit_denominator(64)
    run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=len(layout.muon_names))
    assert run["pass"] and run["closed_form_matches"], run["phases"]
    for ph in run["phases"].values():
        assert ph["measured_avg_elems"] == pytest.approx(ph["closed_form_avg_elems"], rel=1e-12)
    assert any(e.uneven for e in predict_step(layout))


def test_busiest_rank_of_tinygpt_flat_z2():
    """Rank s sends 3·H_s and receives P_M - H_s in forward; in the reduce it sends P_M - H_s
    dedicated elements and receives 3·H_s: it receives P_M + 2·H_s. The owners of 7 d² are the
    busiest, 38 d²; the mean, 36 d² = 1.5·P_M, is the closed form."""
    layout = _tinygpt("dmuon-z2")
    wire = dedicated_traffic(layout, predicted_events(layout), steps=1)["wire"]
    assert [(e["rank"], e["sent_elems"], e["recv_elems"]) for e in wire["per_rank"]] == [
        (0, 38 * D2, 38 * D2), (1, 38 * D2, 38 * D2), (2, 34 * D2, 34 * D2), (3, 34 * D2, 34 * D2)]
    assert wire["busiest_rank"] == 0 and wire["max_recv_elems"] == 38 * D2
    assert wire["mean_recv_elems"] == 36 * D2 == 1.5 * layout.p_m()
    assert wire["max_recv_bytes"] == 4 * 38 * D2


def test_busiest_rank_of_tinygpt_hsdp_z2():
    """2 x 2: the shard channels are even (N - 1 = 1 chunk of 12 d² each way, forward and
    reduce); the replicate reduce brings the owner of 7 d² one more 7 d² chunk and its broadcast
    sends 7 d²; the owner of 5 d² gets 7 d² in the broadcast. Received: rank 0 12 + 12 + 7 + 5,
    rank 2 12 + 12 + 5 + 7 d²: all 36 d², the closed form 2(W-1)/W·P_M."""
    layout = _tinygpt("dmuon-hsdp-z2")
    wire = dedicated_traffic(layout, predicted_events(layout), steps=1)["wire"]
    assert [e["recv_elems"] for e in wire["per_rank"]] == [36 * D2] * 4
    assert [e["sent_elems"] for e in wire["per_rank"]] == [36 * D2] * 4
    assert wire["mean_recv_elems"] == 1.5 * layout.p_m()


@pytest.mark.parametrize("build,mode", LAYOUTS)
def test_aggregate_predictor_sums_uneven_groups_like_the_exact_list(build, mode):
    """verify.traffic.scale tallies an uneven group per shard index (a replicate call at its
    column's mean): its averages equal the exact list's; flat, its busiest rank too."""
    from verify.traffic.scale import step_traffic

    layout = build(mode)
    calls = predict_step(layout)
    w = layout.world_size
    per_rank: Counter = Counter()
    for e in calls:
        per_rank[e.rank] += e.dedicated_avg_elems()
    agg = step_traffic(layout)
    assert agg.ded_avg_elems == pytest.approx(sum(per_rank.values()) / w, rel=1e-12)
    assert agg._avg("avg_elems") == pytest.approx(sum(e.avg_elems() for e in calls) / w, rel=1e-12)
    assert agg.calls_avg == len(calls) / w
    if layout.replicate_size == 1:
        assert agg._max("ded_avg_elems") == pytest.approx(max(per_rank.values()), rel=1e-12)
