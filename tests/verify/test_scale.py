"""verify.traffic.scale: the aggregated step equals the sum over verify.traffic.predict's exact call list."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import pytest

from dmuon.ownership.plan import specs_from_named_parameters
from dmuon.ownership.select import select_params
from verify.traffic.predict import RunLayout, predict_step
from verify.workload.presets import build_preset
from verify.traffic.scale import SCALE_MODES, ZERO1, CostModel, Tally, step_traffic, split_ns_s
from verify.traffic.formulas import MODES, avg_elems


def ded_max_elems(agg) -> float:
    """The busiest rank's dedicated elements per step (``StepTraffic`` keeps bytes only)."""
    return agg._max("ded_avg_elems")


def total_avg_elems(agg) -> float:
    """W-average elements per rank-step over all params."""
    return agg._avg("avg_elems")


def ded_avg_by_phase(agg) -> dict[str, float]:
    """W-average dedicated elements per rank-step, by phase."""
    out = defaultdict(float, agg.common.ded_by_phase)
    for t in agg.extra.values():
        for ph, v in t.ded_by_phase.items():
            out[ph] += v * agg.replicate_size / agg.world_size
    return dict(out)

#: Sums of a few hundred floats in another order: equal up to round-off.
REL = 1e-12


def _layout(mode: str, r: int, n: int, model_name: str = "llama-tiny") -> RunLayout:
    model = build_preset(model_name)
    muon = tuple(name for name, _, _ in select_params(model, None, None))
    blocks = tuple(f"layers.{i}" for i in range(len(model.layers)))
    per_linear = tuple(sorted({m.rpartition(".")[0] for m in muon})) if mode.startswith("naive") else ()
    return RunLayout(
        mode=mode, replicate_size=r, shard_size=n,
        params=tuple(specs_from_named_parameters(model.named_parameters())), muon_names=muon,
        fsdp_modules=() if "ddp" in mode or mode == ZERO1 else per_linear + blocks + ("",),
        reshard_after_forward=mode.endswith("z3") or mode == "naive-hsdp",
        ddp_bucket_cap_bytes=1 << 20,
    )


def _from_exact_list(layout: RunLayout) -> dict:
    calls = predict_step(layout)
    w = layout.world_size
    ded_rank, calls_rank, phase = defaultdict(float), Counter(), defaultdict(float)
    total = 0.0
    for e in calls:
        elems = avg_elems(e.op, e.count, e.group_size)
        ded = elems * e.dedicated_count / e.count
        ded_rank[e.rank] += ded
        calls_rank[e.rank] += 1
        phase[e.phase] += ded / w
        total += elems
    return dict(
        ded_avg=sum(ded_rank.values()) / w, ded_max=max(ded_rank.values()), total_avg=total / w,
        calls_avg=len(calls) / w, calls_max=max(calls_rank.values()), phases=dict(phase),
    )


MESHES = {mode: [(1, 3), (1, 4)] for mode in MODES if "hsdp" not in mode}
MESHES.update({mode: [(2, 3), (3, 2), (4, 2)] for mode in MODES if "hsdp" in mode})


@pytest.mark.parametrize("mode, mesh", [(m, mesh) for m in MODES for mesh in MESHES[m]])
def test_aggregate_equals_sum_over_exact_call_list(mode, mesh):
    layout = _layout(mode, *mesh)
    exact = _from_exact_list(layout)
    agg = step_traffic(layout)
    assert agg.ded_avg_elems == pytest.approx(exact["ded_avg"], rel=REL)
    assert ded_max_elems(agg) == pytest.approx(exact["ded_max"], rel=REL)
    assert total_avg_elems(agg) == pytest.approx(exact["total_avg"], rel=REL)
    assert agg.calls_avg == pytest.approx(exact["calls_avg"], rel=REL)
    assert agg.calls_max == exact["calls_max"]
    got = ded_avg_by_phase(agg)
    assert set(got) == set(exact["phases"])
    for ph, v in exact["phases"].items():
        assert got[ph] == pytest.approx(v, rel=REL, abs=1e-9)


@pytest.mark.parametrize("mode", [m for m in SCALE_MODES if "hsdp" not in m])
def test_closed_form_holds_without_padding(mode):
    # N = 2 divides every Muon dim of llama-tiny on dim 0 (even sizes), so no FSDP2 padding.
    layout = _layout("dmuon-z2" if mode == ZERO1 else mode, 1, 2)
    agg = step_traffic(layout, mode=mode)
    assert agg.ded_avg_elems == pytest.approx(agg.closed_form_elems(), rel=REL)


def test_hsdp_busiest_rank_carries_the_replicate_calls():
    layout = _layout("dmuon-hsdp-z2", 4, 2)
    agg = step_traffic(layout)
    assert set(agg.extra) <= {0, 1} and agg.extra
    assert ded_max_elems(agg) > agg.ded_avg_elems
    # the W-average is one global all-reduce of P_M: 2(W-1)/W (the docs/spec.md §2 correction)
    assert agg.ded_avg_elems == pytest.approx(2 * 7 / 8 * agg.p_m, rel=REL)


def test_zero1_counts_and_memory():
    layout = _layout("zero1-muon", 1, 4)
    agg = step_traffic(layout)
    m = len(layout.muon_names)
    plan, totals = layout.plan(), [0] * 4
    for p in layout.muon_specs():
        totals[plan.owner[p.name]] += p.numel
    assert agg.ns_calls == m  # one NS per matrix, on its owner
    assert agg.p_m_pad == 4 * max(totals)
    assert agg.momentum_bytes_max == max(totals) * 4  # float32
    phases = ded_avg_by_phase(agg)
    assert phases.get("backward", 0.0) == 0.0  # DDP all-reduces only the other params
    assert phases["optimizer"] == pytest.approx(2 * 3 / 4 * agg.p_m_pad, rel=REL)


@pytest.mark.parametrize("mode, mesh", [("dmuon-z3", (1, 4)), ("dmuon-hsdp-z3", (2, 3))])
def test_z3_call_count_drops_the_kept_units_rebroadcasts(mode, mesh):
    """Z3 re-broadcasts every bucket in backward but those of the kept unit (the last layer,
    docs/protocol.md step 2): Z3 issues Z2's calls plus one per other bucket."""
    from verify.traffic.predict import kept_unit, layout_buckets

    # rest="replicate": the same rest all_reduce under Z2 and Z3 (FSDP2 would re-gather under Z3)
    z3 = dataclasses.replace(_layout(mode, *mesh), fsdp_modules=(), dmuon_rest="replicate")
    z2 = dataclasses.replace(z3, mode=mode.replace("z3", "z2"), reshard_after_forward=False)
    buckets = layout_buckets(z3)
    kept = kept_unit(z3, buckets)
    assert kept == f"layers.{len(build_preset('llama-tiny').layers) - 1}"
    rebroadcasts = sum(b.module != kept for b in buckets)  # not aligned: one call per bucket
    assert not any(b.aligned for b in buckets) and 0 < rebroadcasts < len(buckets)
    agg3, agg2 = step_traffic(z3), step_traffic(z2)
    assert agg3.common.calls - agg2.common.calls == rebroadcasts
    assert agg3.common.by_axis["shard"][0] - agg2.common.by_axis["shard"][0] == rebroadcasts
    # and their elements: (N-1)/N·(P_M - P_M^L) more in backward
    a = (mesh[1] - 1) / mesh[1]
    kept_numel = sum(b.numel for b in buckets if b.module == kept)
    assert agg3.p_m_kept == kept_numel
    extra = ded_avg_by_phase(agg3)["backward"] - ded_avg_by_phase(agg2)["backward"]
    assert extra == pytest.approx(a * (z3.p_m() - kept_numel), rel=REL)


def test_memory_per_rank_z2_keeps_a_full_copy_z3_does_not():
    z2 = step_traffic(_layout("dmuon-z2", 1, 4))
    z3 = step_traffic(_layout("dmuon-z3", 1, 4))
    full = sum(p.nbytes for p in _layout("dmuon-z2", 1, 4).muon_specs())
    assert z2.param_bytes_max == full
    assert full / 4 <= z3.param_bytes_max < full / 2


def test_cost_model_locality_and_errors():
    cm = CostModel()
    assert cm.on_one_node("shard", 128, 8) and not cm.on_one_node("replicate", 128, 8)
    assert not cm.on_one_node("shard", 1, 16) and cm.on_one_node("replicate", 2, 4)
    assert not cm.on_one_node("shard", 3, 6)  # rows 6..11 straddle nodes 0 and 1
    t = Tally()
    t.add("forward", "broadcast", "shard", 8, 1000, 2, 1000)
    expect = 10e-6 + 7 / 8 * 1000 * 2 / 360e9
    assert cm.comm_s(t, 1, 8) == pytest.approx(expect)
    with pytest.raises(ValueError, match="intra_gbps"):
        CostModel(intra_gbps=0)
    with pytest.raises(ValueError, match="mode='x'"):
        step_traffic(_layout("dmuon-z2", 1, 2), mode="x")


def test_split_ns_model():
    cm = CostModel()
    single = split_ns_s(14336, 4096, 1, cm)
    assert single == pytest.approx(5 * 2 * 4096**2 * (2 * 14336 + 4096) / 600e12)
    assert split_ns_s(14336, 4096, 8, cm) < single / 2
    # a square matrix gains less: A·A (m³) is not split
    assert split_ns_s(4096, 4096, 8, cm) / split_ns_s(4096, 4096, 1, cm) > 0.4


def test_plan_for_another_mesh_is_rejected():
    layout = _layout("dmuon-z2", 1, 2)
    with pytest.raises(ValueError, match="Must be planned on"):
        step_traffic(layout, plan=dataclasses.replace(layout, shard_size=3).plan())


def _structures_layout(mode: str, r: int, n: int, factory: str) -> RunLayout:
    """examples/experts.py (3-D stacks) or examples/structures.py:shared_block (blocks.0 run
    twice per forward), wrapped as the harness does."""
    import importlib

    from dmuon.ownership.select import matrix_shapes

    module, _, name = factory.partition(":")
    model = getattr(importlib.import_module(module), name)()[0]
    muon = tuple(m for m, _, _ in select_params(model, None, None))
    holders = tuple(dict.fromkeys(m.rpartition(".")[0] for m in muon))
    listed = "blocks" if hasattr(model, "blocks") else "layers"  # the blocks FSDP2 wraps
    blocks = tuple(b for b in (f"{listed}.{i}" for i in range(2)) if b not in holders)
    units = () if "ddp" in mode or mode == ZERO1 else (
        (holders if mode.startswith("naive") else ()) + blocks + ("",))
    calls = (("blocks.0", 2), ("blocks.0.down", 2), ("blocks.0.up", 2)) if "shared" in factory else ()
    return RunLayout(
        mode=mode, replicate_size=r, shard_size=n,
        params=tuple(specs_from_named_parameters(model.named_parameters(), matrix_shapes(model, muon))),
        muon_names=muon, fsdp_modules=units, module_calls=calls,
        reshard_after_forward=mode.endswith("z3") or mode == "naive-hsdp",
    )


@pytest.mark.parametrize("factory", ["examples.experts:factory", "examples.structures:shared_block"])
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_equals_exact_list_for_stacks_and_weight_sharing(mode, factory):
    r, n = (2, 3) if "hsdp" in mode else (1, 3)
    layout = _structures_layout(mode, r, n, factory)
    exact = _from_exact_list(layout)
    agg = step_traffic(layout)
    assert agg.ded_avg_elems == pytest.approx(exact["ded_avg"], rel=REL)
    assert agg.calls_max == exact["calls_max"]
    from verify.traffic.predict import ns_calls_per_step

    assert agg.ns_calls == ns_calls_per_step(layout)
    if mode.startswith("dmuon-"):  # DMuon moves whole params: the closed form holds at any N
        assert agg.ded_avg_elems == pytest.approx(agg.closed_form_elems(), rel=REL)


@pytest.mark.parametrize("mode, mesh", [("dmuon-z2", (1, 4)), ("dmuon-z3", (1, 3)), ("dmuon-hsdp-z3", (2, 3)),
                                        ("dmuon-ddp", (1, 4))])
def test_aggregate_equals_exact_list_with_replicated_rest(mode, mesh):
    # rest="replicate": the shared rule (rules.rest_calls) in both predictors, no wrapper calls
    layout = dataclasses.replace(_layout(mode, *mesh), fsdp_modules=(), dmuon_rest="replicate")
    exact, agg = _from_exact_list(layout), step_traffic(layout)
    assert total_avg_elems(agg) == pytest.approx(exact["total_avg"], rel=REL)
    assert agg.ded_avg_elems == pytest.approx(exact["ded_avg"], rel=REL)
    assert agg.calls_avg == pytest.approx(exact["calls_avg"], rel=REL)
    assert agg.calls_max == exact["calls_max"]
