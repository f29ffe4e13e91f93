"""The EP kind's prediction (verify/traffic/ep.py) without processes: the dedicated W-average of
the predicted calls equals the closed form of docs/traffic-model.md, "Expert parallelism", on
six meshes and four modes; dense calls on the (R, N·E) groups, expert calls on the column
groups; Z3's kept unit is the merged order's last block for both kinds; the token all_to_all
from recorded routing; layout.json round trip and errors. The measured side is
tests/distributed/phase_d/test_traffic_ep.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dmuon.ownership.plan import ParamSpec
from verify.traffic.ep import EPRunLayout, ep_closed_form, ep_skip_reason, predict_activations
from verify.traffic.layouts import layout_from_dict

MODES = ("dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")
X = 8


def _specs(blocks: int = 2, dense_tail: bool = False) -> tuple[ParamSpec, ...]:
    out = [ParamSpec("embed.weight", (64, 32), "float32", "embed")]
    for i in range(blocks):
        b = f"layers.{i}"
        out += [ParamSpec(f"{b}.attn.q.weight", (32, 32), "float32", f"{b}.attn.q"),
                ParamSpec(f"{b}.attn.o.weight", (48, 32), "float32", f"{b}.attn.o"),
                ParamSpec(f"{b}.norm.weight", (32,), "float32", f"{b}.norm"),
                ParamSpec(f"{b}.mlp.router", (X, 32), "float32", f"{b}.mlp"),
                ParamSpec(f"{b}.mlp.gate_up_proj", (X, 32, 32), "float32", f"{b}.mlp"),
                ParamSpec(f"{b}.mlp.down_proj", (X, 32, 16), "float32", f"{b}.mlp")]
    if dense_tail:  # a last block without experts
        out.append(ParamSpec(f"layers.{blocks}.attn.q.weight", (32, 32), "float32", f"layers.{blocks}.attn.q"))
    return tuple(out)


def _layout(mode: str, mesh: tuple[int, int, int], specs=None, **kw) -> EPRunLayout:
    r, n, e = mesh
    specs = specs or _specs()
    muon = tuple(p.name for p in specs if len(p.shape) >= 2 and not p.name.startswith("embed"))
    experts = tuple(p.name for p in specs if len(p.shape) == 3)
    return EPRunLayout(mode=mode, replicate_size=r, shard_size=n, params=specs, muon_names=muon,
                       reshard_after_forward=mode.endswith("z3"), dmuon_rest="replicate", ep_size=e,
                       expert_names=experts, **kw)


MESHES = [(1, 2, 2), (1, 1, 4), (1, 1, 2), (1, 2, 4), (2, 1, 2), (2, 2, 2)]


@pytest.mark.parametrize("mode, mesh", [(m, x) for m in MODES for x in MESHES if ("hsdp" in m) == (x[0] > 1)])
@pytest.mark.parametrize("dense_tail", [False, True])
def test_predicted_dedicated_average_equals_the_closed_form(mode, mesh, dense_tail):
    """Phase by phase: the predicted calls' dedicated f(n)·S summed over ranks / W (the code
    path of verify/traffic/predict.py) equals the closed form (verify/traffic/formulas.py's
    forms at the two parts' meshes). With ``dense_tail`` the merged kept unit holds no expert:
    the plain rule alone would keep the expert part's own last block (no backward broadcast),
    so the Z3 prediction would fall short of the form by (N-1)/N·P_X^L."""
    layout = _layout(mode, mesh, _specs(dense_tail=dense_tail))
    w = layout.world_size
    form = ep_closed_form(layout)
    calls = layout.predict_calls()
    for ph in {c.phase for c in calls} | set(form.phases):
        got = sum(c.dedicated_avg_elems() for c in calls if c.phase == ph) / w
        assert got == pytest.approx(form.at(ph, layout.p_m()), rel=1e-12, abs=1e-9), ph


def test_at_2x2_z2_the_form_is_the_documented_example():
    """docs/traffic-model.md: EP 2 x DP 2 (N = E = 2) Z2 moves 1.5·P_D + P_X/2."""
    layout = _layout("dmuon-z2", (1, 2, 2))
    p_d = sum(p.numel for p in layout.dense_specs())
    p_x = sum(p.numel for p in layout.muon_specs() if p.name in layout.expert_names)
    assert ep_closed_form(layout).total_at(layout.p_m()) == pytest.approx(1.5 * p_d + p_x / 2, rel=1e-12)
    assert ep_closed_form(layout).text == "2(NE-1)/(NE)·P_D + 2(N-1)/N·P_X/E"


def test_dense_calls_on_the_whole_mesh_expert_calls_on_their_column():
    """Rank 0's forward broadcasts at (1, 2, 2): all P_D on the (R, N·E) group of the four
    ranks, all P_X/E on its column (world ranks s·E + 0)."""
    layout = _layout("dmuon-z2", (1, 2, 2))
    p_d = sum(p.numel for p in layout.dense_specs())
    p_x_local = sum(p.numel for p in layout.local_stacks())
    fwd = [c for c in layout.predict_calls() if c.phase == "forward"]
    by_group: dict[str, int] = {}
    for c in fwd:
        if c.rank == 0:
            by_group[c.group_id] = by_group.get(c.group_id, 0) + c.count
    assert by_group == {"0,1,2,3": p_d, "0,2": p_x_local}
    assert {c.group_id for c in fwd} == {"0,1,2,3", "0,2", "1,3"}


def test_z3_keeps_the_merged_last_unit_for_both_kinds():
    """The last block holds no expert: every expert bucket gets a backward broadcast (without
    the merged-order rule, the expert part's own last block, layers.1, got none)."""
    layout = _layout("dmuon-z3", (1, 2, 2), _specs(dense_tail=True))
    assert layout.kept_block() == "layers.2"
    column = {"0,2", "1,3"}
    back = {c.module for c in layout.predict_calls() if c.phase == "backward" and c.op == "broadcast"
            and c.group_id in column}
    assert back == {"layers.0", "layers.1"}
    kept = _layout("dmuon-z3", (1, 2, 2))  # both kinds in the last block: neither re-broadcast there
    back = {c.module for c in kept.predict_calls() if c.phase == "backward" and c.op == "broadcast"}
    assert back == {"layers.0"}


def test_token_all_to_all_from_the_recorded_routing():
    """W = E = 2, X = 4, D = 8: rank 0 routes (1, 2, 3, 0), rank 1 (0, 1, 1, 2) to the experts
    [0, 1 | 2, 3]; rank 0 sends (1+2)·8 rows-elements to itself and (3+0)·8 to rank 1, and
    receives rank 1's (0+1)·8 for its experts."""
    layout = _layout("dmuon-z2", (1, 1, 2), ep_layers=(("layers.0.mlp", 4, 8, "float32"),),
                     ep_routing=(("layers.0.mlp", ((1, 2, 3, 0), (0, 1, 1, 2))),))
    calls = [c for c in predict_activations(layout, steps=1) if c.rank == 0]
    shapes = sorted((c.dtype, c.in_elems, c.out_elems, c.self_elems, c.count) for c in calls)
    assert shapes == [("float32", 32, 48, 24, None), ("float32", 32, 48, 24, None),
                      ("float32", 48, 32, 24, None), ("float32", 48, 32, 24, None),
                      ("int64", 4, 4, 2, 2)]
    assert {(c.phase, c.op, c.group_id, c.dedicated_share()) for c in calls} == {
        ("activations", "all_to_all", "0,1", 0.0)}
    assert calls[1].avg_elems() == 48 - 24  # what it sends


def test_routing_of_another_window_is_refused():
    layout = _layout("dmuon-z2", (1, 1, 2), ep_layers=(("layers.0.mlp", 4, 8, "float32"),),
                     ep_routing=(("layers.0.mlp", ((1, 2, 3, 0), (0, 1, 1, 2))),))
    with pytest.raises(ValueError, match="Invalid ep_routing of 1 layer forwards for 2 steps"):
        layout.window_calls(2)
    bad = dataclasses.replace(layout, ep_routing=(("layers.0.mlp", ((1, 2, 3), (0, 1, 1))),))
    with pytest.raises(ValueError, match="must be W=2 rows of X=4"):
        bad.window_calls(1)


def test_layout_json_round_trip():
    layout = _layout("dmuon-hsdp-z3", (2, 1, 2), ep_layers=(("layers.0.mlp", X, 32, "float32"),),
                     ep_routing=(("layers.0.mlp", tuple((1,) * X for _ in range(4))),))
    again = layout_from_dict(layout.to_dict())
    assert type(again) is EPRunLayout and again == layout


@pytest.mark.parametrize("kw, match", [
    (dict(ep_size=1), "Invalid ep_size=1 for an EPRunLayout"),
    (dict(mode="dmuon-ddp"), "Invalid mode=.dmuon-ddp. for an EPRunLayout"),
    (dict(dmuon_hierarchy="flat"), "Invalid dmuon_hierarchy='flat' with ep_size > 1"),
    (dict(ep_size=3), "Invalid expert stack 'layers.0.mlp.gate_up_proj' of shape \\(8, 32, 32\\)"),
])
def test_invalid_layouts_name_the_fix(kw, match):
    base = _layout("dmuon-z2", (1, 2, 2))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    with pytest.raises(ValueError, match=match):
        EPRunLayout(**{**fields, **kw})


def test_skip_reasons():
    assert ep_skip_reason("dmuon-z2", 4, 2) is None
    assert ep_skip_reason("dmuon-hsdp-z3", 4, 2) is None  # (2, 1, 2)
    assert "2E | W" in ep_skip_reason("dmuon-hsdp-z2", 4, 4)
    assert "no expert-parallel variant" in ep_skip_reason("ddp-muon", 4, 2)


def test_the_predictor_imports_only_the_planner_of_dmuon():
    tree = ast.parse(Path(__file__).parents[2].joinpath("verify/traffic/ep.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in mods if m.split(".")[0] == "dmuon"} == {"dmuon.ownership.plan"}


def test_dmuon_verify_check_adds_the_window_calls_and_infers_the_window_steps():
    """``dmuon-verify check`` on an EP run's events: each step's calls times the steps plus the
    token all_to_alls once per window (they used to be counted as unexpected, and their number
    inflated the inferred steps). The routing holds 2 steps; a dropped all_to_all is missing."""
    from tracer.events import CollectiveEvent
    from verify.check import check_events

    route = ("layers.0.mlp", ((1, 2, 3, 0), (0, 1, 1, 2)))
    layout = _layout("dmuon-z2", (1, 1, 2), ep_layers=(("layers.0.mlp", 4, 8, "float32"),),
                     ep_routing=(route, route))
    calls = [*layout.predict_calls(), *layout.predict_calls(), *layout.window_calls(2)]
    events = [CollectiveEvent(source="interposer", op=e.op, rank=e.rank, group_id=e.group_id,
                              group_size=e.group_size, count=e.count, dtype=e.dtype, root=e.root,
                              in_elems=e.in_elems, out_elems=e.out_elems, phase=e.phase,
                              module=e.module, source_ref=f"r{e.rank}#{i}")
              for i, e in enumerate(calls)]
    result = check_events(events, layout)
    assert result["pass"] and result["steps"] == 2 and result["steps_by_rank"] == {0: 2, 1: 2}
    assert result["predicted"] == len(events)
    dropped = [ev for ev in events if ev is not next(e for e in events if e.phase == "activations")]
    result = check_events(dropped, layout, steps=2)
    assert not result["pass"] and [row["phase"] for row, n in result["missing"]] == ["activations"]
    with pytest.raises(ValueError, match="for 3 steps"):
        check_events(events, layout, steps=3)
