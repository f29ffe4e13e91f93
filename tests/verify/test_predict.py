"""The predictor without processes: its independence from the runtime, its closed forms at any
world size (padded for the naive baselines), mixed precision, and the comparison's verdicts."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from tests.builders import dedicated_w_average, predicted_events, tinygpt_layout
from verify.compare import compare_run
from verify.modes.build import muon_names
from verify.traffic.predict import RunLayout, dmuon_block, dmuon_buckets, ns_calls_per_step, predict_step
from verify.traffic.formulas import avg_elems, closed_form, padded_numel

from dmuon.ownership.plan import ParamSpec, specs_from_named_parameters

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- independence
_ALLOWED_DMUON = {"dmuon.ownership.plan"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ("verify." * (node.level > 0)) + (node.module or "")
            names.add(base.rstrip("."))
            names.update(f"{base}.{a.name}".lstrip(".") for a in node.names if node.module is None)
    return names


@pytest.mark.parametrize("predictor", ["verify.traffic.predict", "verify.traffic.tp", "verify.traffic.pp", "verify.traffic.cp",
                                       "verify.traffic.layouts"])
def test_predictor_imports_only_the_planner_from_dmuon(predictor):
    # The predictor (and the TP one) and every harness module it reaches (transitively) may
    # take the planner's output from dmuon and nothing else: no bucketing, hooks or
    # collectives of the runtime.
    seen, todo, dmuon_imports = set(), [predictor], set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for name in _imports(REPO / (mod.replace(".", "/") + ".py")):
            if name == "dmuon" or name.startswith("dmuon."):
                dmuon_imports.add(name)
            elif name.startswith(("verify.", "tracer.")) and (REPO / (name.replace(".", "/") + ".py")).is_file():
                todo.append(name)
    assert {"verify.traffic.predict", "verify.traffic.formulas", "tracer.events"} <= seen
    assert dmuon_imports == _ALLOWED_DMUON, dmuon_imports


def test_predictor_never_calls_the_runtime():
    # In a fresh interpreter, break every runtime module but the planner (and the NS cost
    # model it uses) after building the layout: the prediction is unchanged, so it cannot
    # reach the runtime's bucketing, hooks or collectives by any path.
    code = """
import sys, dmuon, dmuon.ownership.plan
import tests.builders as t
layout = t.tinygpt_layout("dmuon-hsdp-z3", 4)
ref = t.predict_step(layout)
for name, mod in list(sys.modules.items()):
    if name.startswith("dmuon.") and name not in ("dmuon.ownership.plan", "dmuon.optim.muon_math"):
        for attr in [a for a in vars(mod) if not a.startswith("__")]:
            setattr(mod, attr, None)
assert sys.modules["dmuon.ownership.buckets"].bucket_layout is None
assert t.predict_step(layout) == ref
print("ok", len(ref))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok ")


def test_buckets_follow_the_documented_rule():
    layout = tinygpt_layout("dmuon-z3", 3)
    plan = layout.plan()
    buckets = dmuon_buckets(layout.muon_specs(), plan)
    # under the default cap: one bucket per (block, owner, dtype); every Muon param once
    keys = [(b.module, b.owner, b.dtype) for b in buckets]
    assert len(keys) == len(set(keys))
    names = [n for b in buckets for n in b.names]
    assert sorted(names) == sorted(layout.muon_names)
    for b in buckets:
        assert {plan.owner[n] for n in b.names} == {b.owner}
        assert {dmuon_block(s.module) for s in layout.muon_specs() if s.name in b.names} == {b.module}
        assert b.numel == sum(s.numel for s in layout.muon_specs() if s.name in b.names)
    # a block's matrices share buckets: fewer buckets than modules with a Muon param
    assert len(buckets) < len({s.module for s in layout.muon_specs()})


def test_block_rule_and_cap():
    assert dmuon_block("blocks.3.attn.qkv") == "blocks.3"
    assert dmuon_block("layers.0.experts.5.w1") == "layers.0.experts.5"
    assert dmuon_block("head") == "head" and dmuon_block("") == ""
    layout = tinygpt_layout("dmuon-z3", 3)
    specs, plan = layout.muon_specs(), layout.plan()
    biggest = max(s.numel * 4 for s in specs)
    capped = dmuon_buckets(specs, plan, cap_bytes=biggest)
    one_each = dmuon_buckets(specs, plan, cap_bytes=1)  # every param alone
    assert len(one_each) == len(specs) and all(len(b.names) == 1 for b in one_each)
    assert all(b.numel * 4 <= biggest for b in capped)
    assert len(dmuon_buckets(specs, plan)) <= len(capped) <= len(one_each)
    with pytest.raises(ValueError, match="cap_bytes"):
        dmuon_buckets(specs, plan, cap_bytes=0)


# --------------------------------------------------------------------------- closed forms
#: Z3 keeps the last unit from its forward into the backward (docs/protocol.md step 2):
#: here blocks.1 (one unit per block without coalescing), half of TinyGPT's P_M since both
#: blocks hold the same matrices, so the backward re-broadcast loses (N-1)/N · P_M/2.
KEPT_SHARE = Fraction(1, 2)


@pytest.mark.parametrize("world,mode,ratio", [
    (3, "dmuon-ddp", Fraction(4, 3)), (3, "dmuon-z2", Fraction(4, 3)),
    (3, "dmuon-z3", Fraction(2) - Fraction(2, 3) * KEPT_SHARE), (3, "ddp-muon", Fraction(4, 3)),
    (4, "dmuon-hsdp-z2", Fraction(3, 2)), (4, "dmuon-hsdp-z3", Fraction(2) - Fraction(1, 2) * KEPT_SHARE),
    (6, "dmuon-hsdp-z3", Fraction(5, 3) + Fraction(2, 3) - Fraction(2, 3) * KEPT_SHARE),
])
def test_dmuon_prediction_equals_closed_form_at_any_world_size(world, mode, ratio):
    # W=3: the TinyGPT matrices (64, 64), (192, 64), (256, 64), (64, 256) are not all
    # divisible by 3, and DMuon's closed form holds exactly anyway (whole matrices move).
    layout = tinygpt_layout(mode, world)
    if layout.shard_size == 3:
        assert any(s.shape[0] % 3 for s in layout.muon_specs())
    assert dedicated_w_average(layout) == ratio * layout.p_m()
    run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=len(layout.muon_names) * (
        1 if layout.is_dmuon else world))
    assert run["closed_form_matches"] and run["pass"] and not run["closed_form_padded"]
    assert run["ratio_to_p_m"] == pytest.approx(float(ratio), rel=1e-12)


@pytest.mark.parametrize("mode,factor", [
    ("naive-fsdp2-z2", Fraction(3) * Fraction(2, 3)), ("naive-fsdp2-z3", Fraction(4) * Fraction(2, 3)),
])
def test_naive_baselines_gate_a_padded_closed_form(mode, factor):
    layout = tinygpt_layout(mode, 3)
    p_pad = sum(padded_numel(s.shape, 3) for s in layout.muon_specs())
    assert p_pad > layout.p_m()  # 64 rows pad to 66 at N=3
    assert dedicated_w_average(layout) == factor * p_pad
    run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=len(layout.muon_names) * 3)
    assert run["closed_form_padded"] and run["closed_form_p_m"] == p_pad
    assert run["closed_form"].endswith("at P_M^pad")
    assert run["closed_form_avg_elems"] == pytest.approx(float(factor * p_pad))
    assert run["pass"]
    # the unpadded formula would be off: the gate is the padded one, not a switched-off one
    assert run["measured_avg_elems"] != pytest.approx(float(factor) * layout.p_m())


def test_closed_form_gates_a_predictor_that_drifts(monkeypatch):
    # A predictor that forgets one reduce, and a trace that lacks it too: the multisets agree,
    # the closed form of docs/spec.md §2 does not, and the run fails on it (in that phase and in
    # total).
    import verify.compare as compare

    layout = tinygpt_layout("dmuon-z2", 3)
    drop = next(e for e in predict_step(layout) if e.op == "reduce")
    key = (drop.op, drop.root, drop.count)
    drifted = [e for e in predict_step(layout) if (e.op, e.root, e.count) != key]
    monkeypatch.setattr(RunLayout, "predict_calls", lambda _layout: drifted)  # the dense kind's
    events = [ev for ev in predicted_events(layout) if (ev.op, ev.root, ev.count) != key]
    run = compare.compare_run(layout, events, steps=1, ns_calls=len(layout.muon_names))
    assert run["missing"] == [] and run["unexpected"] == []
    assert not run["closed_form_matches"] and not run["pass"]
    assert not run["phases"]["backward"]["closed_form_matches"]
    assert run["phases"]["forward"]["closed_form_matches"]


# --------------------------------------------------------------------------- mixed precision
def test_mixed_precision_dtypes_per_collective():
    layout = tinygpt_layout("dmuon-hsdp-z3", 4, mp_param_dtype="bfloat16", mp_reduce_dtype="float32")
    by = Counter((e.op, e.phase, e.group_size, e.dtype) for e in predict_step(layout)
                 if e.dedicated_count > 0 and e.op in ("broadcast", "reduce"))
    dtypes = {(op, phase): dt for (op, phase, _, dt) in by}
    assert dtypes[("broadcast", "forward")] == "bfloat16"
    assert dtypes[("broadcast", "backward")] == "bfloat16"
    assert dtypes[("reduce", "backward")] == "float32"
    assert dtypes[("broadcast", "replicate")] == "float32"  # the fp32 master copy
    fsdp = {(e.op, e.phase): e.dtype for e in predict_step(layout)
            if e.op in ("all_gather", "reduce_scatter", "all_reduce")}
    assert fsdp == {("all_gather", "forward"): "bfloat16", ("all_gather", "backward"): "bfloat16",
                    ("reduce_scatter", "backward"): "float32", ("all_reduce", "backward"): "float32"}


def test_mixed_precision_reduce_defaults_to_param_dtype_and_elements_do_not_change():
    plain = tinygpt_layout("dmuon-z2", 4)
    mp = tinygpt_layout("dmuon-z2", 4, mp_param_dtype="bfloat16")
    a, b = predict_step(plain), predict_step(mp)
    assert [(e.rank, e.phase, e.op, e.count) for e in a] == [(e.rank, e.phase, e.op, e.count) for e in b]
    assert {e.dtype for e in b if e.op in ("broadcast", "reduce", "all_gather", "reduce_scatter")} == {"bfloat16"}
    # bytes halve, elements do not
    elems = lambda es: sum(avg_elems(e.op, e.count, e.group_size) for e in es)
    assert elems(a) == elems(b)
    run = compare_run(mp, predicted_events(mp), steps=1, ns_calls=len(mp.muon_names))
    assert run["pass"]
    # measured in fp32 against a bf16 prediction: every call is missing / unexpected
    bad = compare_run(mp, predicted_events(plain), steps=1, ns_calls=len(mp.muon_names))
    assert not bad["pass"] and {m["dtype"] for m in bad["missing"]} == {"bfloat16"}


def test_mixed_precision_layout_round_trips_and_validates():
    layout = tinygpt_layout("naive-fsdp2-z2", 2, mp_param_dtype="bfloat16")
    assert RunLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match=r"Invalid mp_reduce_dtype='bf16'"):
        tinygpt_layout("dmuon-z2", 2, mp_reduce_dtype="bf16")
    # the naive step gathers the sharded grad, which FSDP2 keeps in the param's dtype
    step = {e.dtype for e in predict_step(layout) if e.phase == "optimizer"}
    assert step == {"float32"}


def test_closed_form_table_is_the_spec_at_n3():
    assert closed_form("dmuon-z3", 3).total == pytest.approx(2.0)
    assert closed_form("dmuon-z2", 3).total == pytest.approx(4 / 3)


@pytest.mark.parametrize("mode", ["dmuon-z3", "dmuon-hsdp-z3"])
def test_z3_closed_forms_lose_the_kept_units_rebroadcast(mode):
    # the kept unit's P_M^L is not re-broadcast: -(N-1)/N·P_M^L in backward, nowhere else
    # (docs/protocol.md step 3); P_M = 12, P_M^L = 3 at N = 3, R = 2
    form = closed_form(mode, 3, 2)
    a = 2 / 3
    for phase in ("forward", "backward", "replicate", "optimizer"):
        kept = -a * 3 if phase == "backward" else 0.0
        assert form.at(phase, 12, 0, 3) == pytest.approx(form.at(phase, 12) + kept)
    assert form.total_at(12, 0, 3) == pytest.approx(form.total * 12 - a * 3)
    assert form.terms_text(0, 3) == " − (N-1)/N·P_M^L" and form.terms_text() == ""
    assert form.terms_text(5, 3) == " + (N-1)/N·P_M^r − (N-1)/N·P_M^L"


@pytest.mark.parametrize("mode", ["dmuon-z2", "dmuon-hsdp-z2", "dmuon-ddp", "naive-fsdp2-z3", "naive-hsdp"])
def test_other_closed_forms_have_no_kept_term(mode):
    form = closed_form(mode, 3, 2)
    assert form.total_at(12, 0, 3) == pytest.approx(form.total * 12) and form.terms_text(0, 3) == ""


def _experts_layout(mode: str, world: int, **extra) -> RunLayout:
    """The layout the harness records for examples/experts.py (3-D stacks, routers)."""
    from dmuon.ownership.select import matrix_shapes
    from examples.experts import ExpertsMLP

    model = ExpertsMLP()
    targets = muon_names(model)
    specs = tuple(specs_from_named_parameters(model.named_parameters(), matrix_shapes(model, targets)))
    fsdp = () if "ddp" in mode or mode == "zero1-muon" else (
        ("inp", "layers.0", "layers.1", "") if mode.startswith("naive") else ("",))
    return RunLayout(mode=mode, replicate_size=1, shard_size=world, params=specs, muon_names=targets,
                     fsdp_modules=fsdp, reshard_after_forward=mode.endswith("z3"), **extra)


@pytest.mark.parametrize("mode", ["dmuon-z3", "naive-fsdp2-z2", "ddp-muon", "zero1-muon"])
def test_expert_stacks_count_matrices_and_keep_the_closed_form(mode):
    from verify.traffic.predict import ns_calls_per_step

    layout = _experts_layout(mode, 4)
    assert layout.p_m() == 19_920
    once = 1 + 2 * (1 + 5 + 5)  # inp, and per layer a router and two stacks of 5 slices
    assert ns_calls_per_step(layout) == (once if mode in ("dmuon-z3", "zero1-muon") else 4 * once)
    run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=ns_calls_per_step(layout))
    assert run["pass"] and run["closed_form_matches"] and run["p_m_reused"] == 0
    assert RunLayout.from_dict(layout.to_dict()) == layout  # ParamSpec.matrix round-trips


def _shared_layout(mode: str, calls: int) -> RunLayout:
    """examples/structures.py:shared_block at W=2 with blocks.0 run ``calls`` times."""
    from examples.structures import SharedBlockMLP

    model = SharedBlockMLP()
    targets = muon_names(model)
    units = {"dmuon-z3": ("",), "dmuon-z2": ("",),
             "naive-fsdp2-z3": ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down",
                                "inp", "blocks.0", "blocks.1", "")}
    units["naive-fsdp2-z2"] = units["naive-fsdp2-z3"]
    reused = (("blocks.0", calls), ("blocks.0.down", calls), ("blocks.0.up", calls)) if calls > 1 else ()
    return RunLayout(mode=mode, replicate_size=1, shard_size=2,
                     params=tuple(specs_from_named_parameters(model.named_parameters())),
                     muon_names=targets, fsdp_modules=units[mode],
                     reshard_after_forward=mode.endswith("z3"), module_calls=reused)


@pytest.mark.parametrize("mode,forward_again,backward_again", [
    ("dmuon-z3", 1, 0), ("dmuon-z2", 0, 0), ("naive-fsdp2-z3", 1, 1), ("naive-fsdp2-z2", 0, 1)])
def test_a_module_run_twice_is_sent_again_as_the_rules_say(mode, forward_again, backward_again):
    from verify.traffic.predict import reused_elems

    once, twice = _shared_layout(mode, 1), _shared_layout(mode, 2)
    extra = Counter(e.key() for e in predict_step(twice)) - Counter(e.key() for e in predict_step(once))
    assert not Counter(e.key() for e in predict_step(once)) - Counter(e.key() for e in predict_step(twice))
    per_phase = Counter()
    for key, n in extra.items():
        per_phase[key[1]] += n
    # W=2 ranks x 2 calls: blocks.0's two matrices have different owners (two DMuon buckets),
    # and FSDP2 wraps each in its own unit
    want = Counter({"forward": 4 * forward_again, "backward": 4 * backward_again})
    assert per_phase == want - Counter(), per_phase
    # P_M^r: blocks.0's 2 x 50 x 70 elements (even, so no padding); the form's factor decides
    # whether a mode sends them again (dmuon-z2: 0)
    assert reused_elems(twice) == 7000 and reused_elems(once) == 0
    run = compare_run(twice, predicted_events(twice), steps=1, ns_calls=len(twice.muon_names) * (
        1 if mode.startswith("dmuon") else 2))
    assert run["pass"] and run["closed_form_matches"], run["phases"]
    assert RunLayout.from_dict(twice.to_dict()) == twice


def _rebroadcasts(layout: RunLayout) -> Counter:
    """Each rank's Z3 backward broadcasts / all_gathers of dedicated params, by unit."""
    return Counter((e.rank, e.module) for e in predict_step(layout)
                   if e.phase == "backward" and e.op in ("broadcast", "all_gather") and e.dedicated_count)


def test_z3_keeps_the_last_unit_and_rebroadcasts_every_other_once():
    """docs/protocol.md steps 2-3: the unit of the last bucket index (blocks.1 in
    TinyGPT's model order) stays valid from its forward into the backward; every other
    bucket is re-broadcast exactly once, as it was broadcast once in forward."""
    from verify.traffic.predict import kept_elems

    layout = tinygpt_layout("dmuon-z3", 4)
    forward = Counter((e.rank, e.module) for e in predict_step(layout)
                      if e.phase == "forward" and e.op == "broadcast" and e.dedicated_count)
    assert {m for _, m in forward} == {"blocks.0", "blocks.1"}
    assert _rebroadcasts(layout) == Counter({k: n for k, n in forward.items() if k[1] != "blocks.1"})
    block1 = sum(p.numel for p in layout.muon_specs() if dmuon_block(p.module) == "blocks.1")
    assert kept_elems(layout) == block1 == layout.p_m() // 2
    for other in ("dmuon-z2", "dmuon-ddp", "naive-fsdp2-z3"):  # nothing kept: Z2, or not DMuon
        assert kept_elems(tinygpt_layout(other, 4)) == 0
    # the closed form's P_M^L term: backward 2(N-1)/N·P_M - (N-1)/N·P_M^L
    run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=len(layout.muon_names))
    assert run["pass"] and run["p_m_kept"] == block1
    assert run["closed_form"] == "3(N-1)/N − (N-1)/N·P_M^L"
    assert run["phases"]["backward"]["closed_form_avg_elems"] == pytest.approx(0.75 * (2 * layout.p_m() - block1))


def test_z3_keeps_an_aligned_unit_and_drops_its_backward_all_gather():
    """examples/structures.py:equal_blocks at W=2: units of two
    blocks, each one aligned group (one all_gather per forward); only the first unit's group
    is all_gathered again in backward, the last one is kept."""
    from examples.structures import EqualBlocks

    model = EqualBlocks()
    # 2 blocks x (50x70 + 70x50) fp32 = 56,000 bytes: the coalesce target of a two-block unit
    layout = RunLayout(mode="dmuon-z3", replicate_size=1, shard_size=2,
                       params=tuple(specs_from_named_parameters(model.named_parameters())),
                       muon_names=muon_names(model), fsdp_modules=("",),
                       dmuon_coalesce_bytes=56_000)
    gathers = Counter((e.rank, e.phase, e.module) for e in predict_step(layout)
                      if e.op == "all_gather" and e.dedicated_count)  # not FSDP2's root
    assert gathers == Counter({(r, "forward", u): 1 for r in (0, 1) for u in ("blocks.0", "blocks.2")}
                              | {(r, "backward", "blocks.0"): 1 for r in (0, 1)})
    run = compare_run(layout, predicted_events(layout), steps=1, ns_calls=len(layout.muon_names))
    assert run["pass"] and run["p_m_kept"] == layout.p_m() // 2


@pytest.mark.parametrize("reused,forward_again", [("blocks.0", 1), ("blocks.1", 0)])
def test_a_reused_last_unit_is_not_sent_again(reused, forward_again):
    """shared_block with ``reused`` run twice per forward under Z3: blocks.0 is freed after
    its first run and broadcast again; blocks.1, the last unit, stays valid (no call), so it
    counts in P_M^L and not in P_M^r."""
    from verify.traffic.predict import kept_elems, reused_elems

    once = _shared_layout("dmuon-z3", 1)
    twice = dataclasses.replace(once, module_calls=((reused, 2),))
    extra = Counter(e.key() for e in predict_step(twice)) - Counter(e.key() for e in predict_step(once))
    # W=2 ranks x one call per bucket of the block (its two matrices have different owners)
    assert sum(extra.values()) == 4 * forward_again and {k[1] for k in extra} <= {"forward"}
    block = sum(p.numel for p in twice.muon_specs() if dmuon_block(p.module) == reused)
    assert reused_elems(twice) == forward_again * block
    assert kept_elems(twice) == kept_elems(once) == 2 * 50 * 70  # blocks.1
    run = compare_run(twice, predicted_events(twice), steps=1, ns_calls=len(twice.muon_names))
    assert run["pass"] and run["closed_form_matches"], run["phases"]


def test_ddp_buffer_broadcasts_group_by_dtype_and_bucket():
    from verify.traffic.rules import ddp_buffer_broadcasts

    buffers = [("float32", 4), ("int64", 1), ("float32", 4), ("float32", 10)]
    assert ddp_buffer_broadcasts(buffers) == [("float32", 18), ("int64", 1)]
    # a group closes once it reaches the bucket (c10d's take_tensors): 16 + 16 bytes >= 32,
    # then 40 >= 32; the open int64 group comes last
    assert ddp_buffer_broadcasts(buffers, bucket_bytes=32) == [("float32", 8), ("float32", 10),
                                                               ("int64", 1)]
    layout = tinygpt_layout("dmuon-ddp", 2, ddp_buffers=(("float32", 8),))
    calls = [e for e in predict_step(layout) if e.phase == "forward" and e.op == "broadcast"
             and e.group_size == 2 and e.dedicated_count == 0]
    assert [(e.rank, e.count, e.root) for e in calls] == [(0, 8, 0), (1, 8, 0)]
    assert RunLayout.from_dict(layout.to_dict()) == layout


def test_frozen_params_leave_ddp_buckets_and_fsdp_reductions():
    """``RunLayout.frozen_names``: DDP's all_reduce and FSDP2's reduce_scatter / replicate
    all_reduce skip a frozen param; FSDP2's all_gather still moves it."""
    from verify.traffic.rules import ddp_calls, fsdp_calls

    params = (ParamSpec("inp.weight", (50, 20), "float32", "inp"),
              ParamSpec("fc.weight", (50, 50), "float32", "fc"))
    base = dict(replicate_size=2, shard_size=2, params=params, muon_names=(), fsdp_modules=("",))
    trained = RunLayout(mode="ddp-muon", **base)
    frozen = dataclasses.replace(trained, frozen_names=("inp.weight",))
    assert [c.count for c in ddp_calls(trained, set())] == [3500]
    assert [c.count for c in ddp_calls(frozen, set())] == [2500]
    ops = lambda layout: {(c.op, c.count) for c in fsdp_calls(layout, set())}  # noqa: E731
    assert ops(trained) == {("all_gather", 1750), ("reduce_scatter", 1750), ("all_reduce", 1750)}
    assert ops(frozen) == {("all_gather", 1750), ("reduce_scatter", 1250), ("all_reduce", 1250)}
    assert RunLayout.from_dict(frozen.to_dict()).frozen_names == ("inp.weight",)


# --------------------------------------------------------------------------- rest="replicate"
def _replicated(layout: RunLayout, **extra) -> RunLayout:
    """``layout`` as ``verify.modes.build.build`` records it under ``rest="replicate"``."""
    return dataclasses.replace(layout, fsdp_modules=(), ddp_buffers=(), dmuon_rest="replicate", **extra)


@pytest.mark.parametrize("mode, world", [("dmuon-z2", 4), ("dmuon-z3", 3), ("dmuon-ddp", 2),
                                         ("dmuon-hsdp-z2", 4), ("dmuon-hsdp-z3", 6)])
def test_replicated_rest_is_one_world_all_reduce_and_no_wrapper_call(mode, world):
    """dmuon/runtime/rest.py's docstring: per step one all_reduce of the trainable rest over
    all W ranks in backward (grads + one usage element per param); no DDP or FSDP2 call; the
    dedicated calls and so the closed form unchanged."""
    wrapped = tinygpt_layout(mode, world)
    layout = _replicated(wrapped)
    calls = predict_step(layout)
    rest = [p for p in layout.params if p.name not in layout.muon_names]
    world_gid = ",".join(map(str, range(world)))
    extra = [e for e in calls if e.dedicated_count == 0]
    assert [(e.rank, e.phase, e.op, e.group_id, e.group_size, e.count, e.dtype, e.root, e.module)
            for e in extra] == [(r, "backward", "all_reduce", world_gid, world,
                                 sum(p.numel for p in rest) + len(rest), "float32", None, None)
                                for r in range(world)]
    # DMuon's own calls (the only ones with a Muon share: the wrappers ignore the dedicated
    # params) are those of the wrapped layout
    assert Counter(e.key() for e in calls if e.dedicated_count > 0) == \
        Counter(e.key() for e in predict_step(wrapped) if e.dedicated_count > 0)
    assert dedicated_w_average(layout) == dedicated_w_average(wrapped)  # the closed forms concern P_M only
    run = compare_run(layout, predicted_events(layout, 2), steps=2, ns_calls=2 * ns_calls_per_step(layout))
    assert run["pass"] and run["closed_form_matches"]


def test_replicated_rest_groups_by_dtype_keeps_own_dtype_and_skips_frozen():
    """One all_reduce per dtype in model order of first appearance, in the params' own dtype
    under mixed precision; frozen params leave it; a dtype with only frozen params has none."""
    params = (ParamSpec("emb.weight", (10, 8), "float32", "emb"),
              ParamSpec("blocks.0.fc.weight", (8, 8), "float32", "blocks.0.fc"),
              ParamSpec("blocks.0.norm.weight", (8,), "bfloat16", "blocks.0.norm"),
              ParamSpec("blocks.0.fc.bias", (8,), "float32", "blocks.0.fc"),
              ParamSpec("blocks.0.gate", (4,), "float16", "blocks.0"),
              ParamSpec("head.bias", (3,), "bfloat16", "head"))
    layout = RunLayout(mode="dmuon-z3", replicate_size=1, shard_size=2, params=params,
                       muon_names=("blocks.0.fc.weight",), mp_param_dtype="bfloat16",
                       frozen_names=("emb.weight", "blocks.0.gate"), dmuon_rest="replicate")
    rest = [(e.op, e.count, e.dtype) for e in predict_step(layout) if e.rank == 0 and e.dedicated_count == 0]
    # bf16 first (emb is frozen), then fp32 (the bias); float16 holds only the frozen gate
    assert rest == [("all_reduce", 8 + 3 + 2, "bfloat16"), ("all_reduce", 8 + 1, "float32")]
    unfrozen = dataclasses.replace(layout, frozen_names=())
    rest = [(e.count, e.dtype) for e in predict_step(unfrozen) if e.rank == 0 and e.dedicated_count == 0]
    assert rest == [(80 + 8 + 2, "float32"), (8 + 3 + 2, "bfloat16"), (4 + 1, "float16")]
    # the dedicated broadcasts follow mp_param_dtype as before; only the rest keeps its own
    assert {e.dtype for e in predict_step(layout) if e.dedicated_count > 0} == {"bfloat16"}
    assert RunLayout.from_dict(layout.to_dict()) == layout


def test_replicated_rest_layout_validates_and_old_layouts_load_as_wrapper():
    layout = tinygpt_layout("dmuon-z2", 2)
    d = layout.to_dict()
    del d["dmuon_rest"]  # a layout.json written before the field
    assert RunLayout.from_dict(d).dmuon_rest == "wrapper"
    with pytest.raises(ValueError, match="dmuon_rest='copy'"):
        dataclasses.replace(layout, fsdp_modules=(), dmuon_rest="copy")
    with pytest.raises(ValueError, match="nothing wrapped"):  # FSDP2 groups left in
        dataclasses.replace(layout, dmuon_rest="replicate")
    with pytest.raises(ValueError, match="nothing wrapped"):  # not a DMuon mode
        RunLayout(mode="ddp-muon", replicate_size=1, shard_size=2, params=layout.params,
                  muon_names=layout.muon_names, dmuon_rest="replicate")


def test_verify_traffic_rest_flag():
    from verify.run.main import parse_args

    assert parse_args(["--out-dir", "x"]).rest == "wrapper"
    assert parse_args(["--out-dir", "x", "--rest", "replicate"]).rest == "replicate"
    with pytest.raises(SystemExit):  # DMuon does not replicate a TP model's rest
        parse_args(["--out-dir", "x", "--rest", "replicate", "--tp", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--out-dir", "x", "--rest", "ddp"])


@pytest.mark.parametrize("mode,coalesce", [("dmuon-hsdp-z2", 0), ("dmuon-z3", 56_000)])
def test_gloo_reduces_by_gather_with_the_counts_and_traffic_of_reduce(mode, coalesce):
    """docs/protocol.md step 4 on gloo: every reduce (shard and replicate axis) is a
    gather to the same root and every aligned reduce_scatter an all_to_all, with the same
    counts; the W-average traffic, hence the closed form, is unchanged."""
    from examples.structures import EqualBlocks

    model = EqualBlocks()
    layout = RunLayout(mode=mode, replicate_size=2 if "hsdp" in mode else 1, shard_size=2,
                       params=tuple(specs_from_named_parameters(model.named_parameters())),
                       muon_names=muon_names(model), fsdp_modules=("",),
                       reshard_after_forward=mode.endswith("z3"),
                       dmuon_coalesce_bytes=coalesce)
    gloo = dataclasses.replace(layout, dmuon_reduce_by_gather=True)
    renamed = {"reduce": "gather", "reduce_scatter": "all_to_all"}
    plain = [e for e in predict_step(layout) if e.dedicated_count]
    gathered = [e for e in predict_step(gloo) if e.dedicated_count]
    assert {e.op for e in plain} & set(renamed)  # the layout has reductions to rename
    # the same calls and counts (an even all_to_all also carries its totals, n x count each)
    bare = dict(in_elems=None, out_elems=None, self_elems=None, dedicated_in_elems=None,
                dedicated_out_elems=None)
    assert [dataclasses.replace(e, **bare) for e in gathered] == \
        [dataclasses.replace(e, op=renamed.get(e.op, e.op)) for e in plain]
    assert all((e.in_elems, e.out_elems, e.self_elems) == (e.group_size * e.count,) * 2 + (e.count,)
               for e in gathered if e.op == "all_to_all")
    assert dedicated_w_average(gloo) == dedicated_w_average(layout)
    run = compare_run(gloo, predicted_events(gloo), steps=1, ns_calls=len(layout.muon_names))
    assert run["pass"] and run["closed_form_matches"]
