"""DMuon on an HSDP mesh, flat or hierarchical (``dedicate_params(hierarchy=...)``;
docs/traffic-model.md, "HSDP: flat or hierarchical"), on the harness side only, no processes:
a flat 2 x 2 run's DMuon calls are the 1-D W = 4 run's, FSDP2's calls for the rest stay on
the 2 x 2 mesh; ``"auto"`` goes flat only on gloo and only for one unit; the closed form of a
flat run is the 1-D form at N = W, per phase and exactly (rationals)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction

import pytest

from dmuon.ownership.plan import ParamSpec, plan_ownership, specs_from_named_parameters
from tests.builders import dedicated_w_average, llama_specs, predicted_events, tinygpt_layout
from verify.compare import compare_run
from verify.modes.build import muon_names
from verify.traffic.formulas import closed_form
from verify.traffic.predict import (
    RunLayout,
    dmuon_coalesce_bytes,
    dmuon_flattens,
    dmuon_hierarchy,
    dmuon_reduce_by_gather,
    dmuon_uneven_aligned,
    dmuon_units,
    kept_elems,
    layout_buckets,
    predict_step,
    run_closed_form,
)
from verify.workload.model import GPTConfig, TinyGPT

D2 = 64 * 64


def _backend(backend: str, coalesce: str = "auto") -> dict:
    """The RunLayout fields ``verify.modes.build.build`` derives from the backend."""
    return dict(dmuon_coalesce_bytes=dmuon_coalesce_bytes(coalesce, backend),
                dmuon_reduce_by_gather=dmuon_reduce_by_gather(backend),
                dmuon_uneven_aligned=dmuon_uneven_aligned(backend),
                dmuon_auto_flat=dmuon_flattens(backend))


def _tinygpt(mode: str, backend: str = "gloo", coalesce: str = "auto", **extra) -> RunLayout:
    """TinyGPT (2 layers) at W = 4, HSDP on 2 x 2, as ``make verify-traffic`` builds it."""
    return tinygpt_layout(mode, 4, **{**_backend(backend, coalesce), **extra})


def _four_layers(mode: str, **extra) -> RunLayout:
    """TinyGPT with 4 layers at W = 4 on gloo, two units of two blocks (P_M^L = P_M / 2),
    nothing wrapped (rest="replicate")."""
    model = TinyGPT(GPTConfig(d_model=64, n_heads=4, n_layers=4))
    hsdp = "hsdp" in mode
    return RunLayout(mode=mode, replicate_size=2 if hsdp else 1, shard_size=2 if hsdp else 4,
                     params=tuple(specs_from_named_parameters(model.named_parameters())),
                     muon_names=muon_names(model), reshard_after_forward=mode.endswith("z3"),
                     dmuon_rest="replicate",
                     **{**_backend("gloo"), "dmuon_coalesce_bytes": 2 * 12 * D2 * 4, **extra})


def _one_d(layout: RunLayout) -> RunLayout:
    """The same job as a 1-D DMuon run over all W ranks (dmuon-hsdp-zK -> dmuon-zK)."""
    return dataclasses.replace(layout, mode=layout.mode.replace("hsdp-", ""), replicate_size=1,
                               shard_size=layout.world_size)


def _calls(layout: RunLayout, dedicated: bool) -> Counter:
    """The predicted calls of one step, DMuon's (those with a Muon payload) or the others."""
    return Counter((e.key(), e.module, e.dedicated_count) for e in predict_step(layout)
                   if bool(e.dedicated_count) == dedicated)


# ----------------------------------------------------------------------------- the rule
def test_backend_table_and_layout_fields():
    assert dmuon_flattens("gloo") and not dmuon_flattens("nccl") and not dmuon_flattens("mpi")
    layout = _tinygpt("dmuon-hsdp-z2", dmuon_hierarchy="flat")
    assert RunLayout.from_dict(layout.to_dict()) == layout
    old = {k: v for k, v in layout.to_dict().items() if k not in ("dmuon_hierarchy", "dmuon_auto_flat")}
    # a layout written before the knob ran hierarchical, whatever its backend
    assert dmuon_hierarchy(RunLayout.from_dict(old)) == "hierarchical"
    with pytest.raises(ValueError, match="Invalid dmuon_hierarchy='ring'"):
        dataclasses.replace(layout, dmuon_hierarchy="ring")


@pytest.mark.parametrize("backend,coalesce,hierarchy,want", [
    ("gloo", "auto", "auto", "flat"),  # TinyGPT: one unit of both blocks
    ("gloo", "all", "auto", "flat"),
    ("gloo", "block", "auto", "hierarchical"),  # one unit per block: two units
    ("nccl", "auto", "auto", "hierarchical"),  # the backend's table says no
    ("gloo", "auto", "hierarchical", "hierarchical"),
    ("nccl", "block", "flat", "flat"),  # asked for: any backend, any units
])
def test_auto_is_flat_on_gloo_with_one_unit_only(backend, coalesce, hierarchy, want):
    layout = _tinygpt("dmuon-hsdp-z3", backend, coalesce, dmuon_hierarchy=hierarchy)
    assert dmuon_hierarchy(layout) == want
    assert ("replicate" in {e.phase for e in predict_step(layout)}) == (want == "hierarchical")


def test_auto_counts_the_final_units_not_the_candidate_ones():
    """Two blocks of one 64 x 64 matrix each fit one candidate unit on gloo, but their two
    owners' buckets (not one per owner: no aligned group) need two calls joined as apart, so
    the unit splits again ("a unit of several blocks stays only if it saves calls"): two
    final units, hierarchical although gloo's table allows flat."""
    params = tuple(ParamSpec(f"blocks.{i}.fc.weight", (64, 64), "float32", f"blocks.{i}.fc") for i in range(2))
    layout = RunLayout(mode="dmuon-hsdp-z2", replicate_size=2, shard_size=2, params=params,
                       muon_names=tuple(p.name for p in params), reshard_after_forward=False,
                       dmuon_rest="replicate", **_backend("gloo"))
    assert dmuon_units(layout.muon_specs(), layout.dmuon_coalesce_bytes) == [("blocks.0", "blocks.1")]
    assert [b.module for b in layout_buckets(layout)] == ["blocks.0", "blocks.1"]
    assert dmuon_hierarchy(layout) == "hierarchical"
    assert dmuon_hierarchy(dataclasses.replace(layout, dmuon_hierarchy="flat")) == "flat"


def test_the_knob_changes_nothing_off_a_2d_dmuon_mesh():
    for mode in ("dmuon-z2", "dmuon-z3", "dmuon-ddp", "naive-hsdp"):
        layout = _tinygpt(mode, dmuon_hierarchy="flat")
        assert dmuon_hierarchy(layout) is None
    with pytest.raises(ValueError, match="flat=True with mode='dmuon-z2'"):
        closed_form("dmuon-z2", 4, 1, flat=True)


def test_tp_is_hierarchical_and_refuses_flat():
    from verify.traffic.tp import TPRunLayout

    base = _tinygpt("dmuon-hsdp-z2")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(RunLayout)}
    tp = TPRunLayout(**fields, tp_size=2)
    assert dmuon_hierarchy(tp) == "hierarchical"
    assert dmuon_hierarchy(tp.column()) == "hierarchical"
    with pytest.raises(ValueError, match="dmuon_hierarchy='flat' with tp_size > 1"):
        dataclasses.replace(tp, dmuon_hierarchy="flat")


def test_the_planner_ignores_the_mesh_shape():
    """Flat reads owner g of the plan as world rank g; the predictor plans the (1, W) view:
    the same owners as the (R, N) plan."""
    tiny = _tinygpt("dmuon-hsdp-z2").muon_specs()
    for specs, world in ((tiny, 4), (llama_specs(), 8), (llama_specs(), 16)):
        flat = plan_ownership(specs, (1, world)).owner
        assert all(plan_ownership(specs, (r, world // r)).owner == flat for r in (2, world // 2))


# ------------------------------------------------------------------------ the calls
@pytest.mark.parametrize("mode", ["dmuon-hsdp-z2", "dmuon-hsdp-z3"])
@pytest.mark.parametrize("rest", ["wrapper", "replicate"])
def test_flat_2x2_moves_dmuon_params_like_1d_w4(mode, rest):
    """DMuon's calls of the flat 2 x 2 run are the 1-D W = 4 run's, call for call (TinyGPT on
    gloo: one uneven all_to_all per channel over 0,1,2,3); the other calls (FSDP2's on the 2 x 2
    mesh, or DMuon's all_reduce of the replicated rest over the world) are the hierarchical
    run's."""
    flat = _tinygpt(mode)
    if rest == "replicate":  # nothing wraps the model
        flat = dataclasses.replace(flat, fsdp_modules=(), dmuon_rest="replicate")
    hierarchical = dataclasses.replace(flat, dmuon_hierarchy="hierarchical")
    assert dmuon_hierarchy(flat) == "flat"
    assert _calls(flat, True) == _calls(_one_d(flat), True)
    assert _calls(flat, True) != _calls(hierarchical, True)
    assert {k[3] for k, _, _ in _calls(flat, True)} == {"0,1,2,3"}
    assert _calls(flat, False) == _calls(hierarchical, False)
    if rest == "wrapper":  # FSDP2 still shards the rest on the 2 x 2 mesh
        assert {k[3] for k, _, _ in _calls(flat, False)} >= {"0,1", "2,3", "0,2", "1,3"}


def test_flat_asked_for_with_two_units_is_the_1d_rule_too():
    """hierarchy="flat" with two units (not what "auto" picks): Z3 re-gathers the first unit
    over all W and keeps the last, as on a 1-D mesh."""
    flat = _four_layers("dmuon-hsdp-z3", dmuon_hierarchy="flat")
    assert dmuon_hierarchy(dataclasses.replace(flat, dmuon_hierarchy="auto")) == "hierarchical"
    assert predict_step(flat) == predict_step(_one_d(flat))  # nothing wrapped: every call
    assert kept_elems(flat) == flat.p_m() // 2


# ------------------------------------------------------------------ the closed forms
FLAT = [(_tinygpt, "dmuon-hsdp-z2", {}), (_tinygpt, "dmuon-hsdp-z3", {}),
        (_four_layers, "dmuon-hsdp-z2", {"dmuon_hierarchy": "flat"}),
        (_four_layers, "dmuon-hsdp-z3", {"dmuon_hierarchy": "flat"})]


@pytest.mark.parametrize("build,mode,extra", FLAT)
def test_flat_closed_form_is_the_predicted_w_average_per_phase(build, mode, extra):
    """Per phase, in rationals: forward (W-1)/W·P_M, backward (W-1)/W·P_M (reduce) plus under
    Z3 (W-1)/W·(P_M - P_M^L) (re-gather), no replicate phase; and compare_run passes the
    prediction as measured against it."""
    layout = build(mode, **extra)
    assert dmuon_hierarchy(layout) == "flat"
    form = run_closed_form(layout)
    assert form == closed_form(mode, 2, 2, flat=True)
    p_m, kept = layout.p_m(), kept_elems(layout)
    w = Fraction(3, 4)  # (W-1)/W at W = 4
    want = {"forward": w * p_m, "backward": w * p_m + (w * (p_m - kept) if mode.endswith("z3") else 0)}
    for phase in ("forward", "backward", "replicate"):
        got = dedicated_w_average(layout, phase)
        assert got == want.get(phase, 0)
        assert Fraction(form.at(phase, p_m, 0, kept)).limit_denominator(64) == got
    run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=len(layout.muon_names))
    assert run["pass"] and run["closed_form_matches"], run["phases"]
    assert run["hierarchy"] == "flat" and "replicate" not in run["phases"]
    assert run["seed_avg_elems"] is None  # the seed's reading concerns the replicate terms


def test_flat_and_hierarchical_agree_in_total_only_where_documented():
    """Z2: equal totals 2(W-1)/W, different phases. Z3: equal totals when one unit
    (P_M^L = P_M, TinyGPT under "auto"), not with two units."""
    z2, z3 = (closed_form(m, 2, 2, flat=True) for m in ("dmuon-hsdp-z2", "dmuon-hsdp-z3"))
    h2, h3 = closed_form("dmuon-hsdp-z2", 2, 2), closed_form("dmuon-hsdp-z3", 2, 2)
    assert (z2.text, z3.text, z3.kept_text) == ("2(W-1)/W", "3(W-1)/W", " − (W-1)/W·P_M^L")
    assert z2.total == pytest.approx(h2.total) and z2.phases != h2.phases
    assert z3.total_at(1, 0, 1) == pytest.approx(h3.total_at(1, 0, 1))  # P_M^L = P_M
    assert z3.total_at(1, 0, 0.5) != pytest.approx(h3.total_at(1, 0, 0.5))
    # compare_run of a flat run checked against the hierarchical form would fail
    layout = _four_layers("dmuon-hsdp-z3", dmuon_hierarchy="flat")
    assert dedicated_w_average(layout) != Fraction(h3.total_at(layout.p_m(), 0, kept_elems(layout)))


def test_hierarchical_runs_report_it_and_1d_runs_do_not():
    for layout, want in ((_tinygpt("dmuon-hsdp-z2", "nccl"), "hierarchical"), (_tinygpt("dmuon-z2"), None)):
        run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=len(layout.muon_names))
        assert run["pass"] and run.get("hierarchy") == want


def test_the_aggregate_predictor_refuses_flat():
    from verify.traffic.scale import step_traffic

    with pytest.raises(ValueError, match="moving its dedicated params flat"):
        step_traffic(_tinygpt("dmuon-hsdp-z2"))
    step_traffic(_tinygpt("dmuon-hsdp-z2", dmuon_hierarchy="hierarchical"))
