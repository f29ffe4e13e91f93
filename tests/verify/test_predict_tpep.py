"""The TP × EP kind's prediction (verify/traffic/tpep.py) without processes, at W = 4 on the
mesh ``("dp_shard", "ep", "tp")`` = (1, 2, 2): per-rank counts and the W-average bytes against
hand-computed numbers, the closed form of docs/traffic-model.md, "TP × EP", against the summed
prediction, the token all_to_all's EP groups, layout.json round trip and errors; each check
with a control (a planted error it must catch). The measured side is the end-to-end run
``python -m verify.run.launch --nproc 4 --tp 2 --ep 2`` (docs/verify.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dmuon.ownership.plan import ParamSpec
from tracer.events import group_id_from_ranks
from verify.traffic import tpep as tpep_mod
from verify.traffic.layouts import layout_from_dict
from verify.traffic.tpep import TPEPRunLayout, tpep_closed_form, tpep_skip_reason

X = 8  # experts per stack
TOKENS = 64  # one data-parallel slice's tokens (activation numel = TOKENS · features)


def _specs() -> tuple[ParamSpec, ...]:
    out = [ParamSpec("embed.weight", (64, 32), "float32", "embed")]
    for i in range(2):
        b = f"layers.{i}"
        out += [ParamSpec(f"{b}.attn.q.weight", (32, 32), "float32", f"{b}.attn.q"),
                ParamSpec(f"{b}.attn.o.weight", (32, 32), "float32", f"{b}.attn.o"),
                ParamSpec(f"{b}.norm.weight", (32,), "float32", f"{b}.norm"),
                ParamSpec(f"{b}.mlp.router", (X, 32), "float32", f"{b}.mlp"),
                ParamSpec(f"{b}.mlp.gate_up_proj", (X, 32, 32), "float32", f"{b}.mlp"),
                ParamSpec(f"{b}.mlp.down_proj", (X, 32, 16), "float32", f"{b}.mlp")]
    return tuple(out)


def _layout(mode: str = "dmuon-z2", **kw) -> TPEPRunLayout:
    specs = _specs()
    muon = tuple(p.name for p in specs if len(p.shape) >= 2 and not p.name.startswith("embed"))
    base = dict(
        mode=mode, replicate_size=1, shard_size=1, params=specs, muon_names=muon, fsdp_modules=("",),
        reshard_after_forward=mode.endswith("z3"), dmuon_rest="wrapper", dmuon_reduce_by_gather=True,
        tp_size=2, ep_size=2,
        tp_dims=tuple((f"layers.{i}.attn.{m}.weight", d) for i in range(2) for m, d in (("q", 0), ("o", 1))),
        tp_activations=tuple((f"layers.{i}.attn.{m}", s, TOKENS * 32, "float32")
                             for i in range(2) for m, s in (("q", "colwise"), ("o", "rowwise"))),
        expert_names=tuple(p.name for p in specs if len(p.shape) == 3),
        ep_layers=tuple((f"layers.{i}.mlp", X, 32, "float32") for i in range(2)))
    base.update(kw)
    return TPEPRunLayout(**base)


# Hand-computed at (1, 2, 2), per block: q, o (32 x 32) TP-sharded -> 512 + 512 local elements,
# router (8 x 32) 256 dense, stacks (8, 32, 32) + (8, 32, 16) -> (4, ·, ·) local 4096 + 2048.
P_TP = 4 * 1024
P_D_LOC = 2 * (512 + 512 + 256)  # 2560: a TP column's dense elements
P_X_LOC = 2 * (4096 + 2048)  # 12288: one rank's local stacks
REST_SHARD = (64 * 32 + 2 * 32) // 2  # FSDP2's root unit: embed + 2 norms over N·E = 2 ranks


def _hand_checks(layout: TPEPRunLayout, calls) -> None:
    """Rank 0's calls and the W-average at (1, 2, 2) against the numbers above."""
    dense_g, expert_g, tp_g = (group_id_from_ranks(r) for r in ([0, 2], [0], [0, 1]))
    mine = [c for c in calls if c.rank == 0]

    def total(phase, op, gid):
        return sum(c.count for c in mine if (c.phase, c.op, c.group_id) == (phase, op, gid))

    # step 1: every dense bucket of TP column 0 over ranks {0, 2}, every local stack alone
    assert total("forward", "broadcast", dense_g) == P_D_LOC
    assert total("forward", "broadcast", expert_g) == P_X_LOC
    # step 4 on gloo: gathers of the grads plus one usage element per param (6 dense, 4 stacks)
    assert total("backward", "gather", dense_g) == P_D_LOC + 6
    assert total("backward", "gather", expert_g) == P_X_LOC + 4
    # Z3: layers.0 (not the kept last block) broadcast again in backward
    z3 = layout.reshard_after_forward
    assert total("backward", "broadcast", dense_g) == (1280 if z3 else 0)
    assert total("backward", "broadcast", expert_g) == (6144 if z3 else 0)
    # FSDP2's root unit on the TP column (auto reshard: no backward all_gather)
    assert total("forward", "all_gather", dense_g) == REST_SHARD
    assert total("backward", "reduce_scatter", dense_g) == REST_SHARD
    assert total("backward", "all_gather", dense_g) == 0
    # DTensor: q's input grad in backward, o's output in forward, per layer
    assert sorted((c.module, c.count) for c in mine if c.phase == "tp" and c.group_id == tp_g) == [
        (f"layers.{i}.attn.{m}", TOKENS * 32) for i in range(2) for m in ("o", "q")]
    # step 6: each TP matrix's local shards gathered once in its owner's TP group, on both members
    assert sum(c.count for c in calls if c.op == "gather" and c.phase == "optimizer") == P_TP
    assert sum(c.count for c in calls if c.op == "scatter" and c.phase == "optimizer") == P_TP
    # W-average of the dedicated elements: forward 1/2·P_D,loc, backward the same (+ Z3's
    # 1/2 · layers.0's 1280), optimizer 2(T-1)/(T·W)·P_TP = 1024
    w = layout.world_size
    avg = {ph: sum(c.dedicated_avg_elems() for c in calls if c.phase == ph) / w
           for ph in ("forward", "backward", "optimizer")}
    assert avg == pytest.approx({"forward": 1280, "backward": 1280 + (640 if z3 else 0), "optimizer": 1024})


@pytest.mark.parametrize("mode", ["dmuon-z2", "dmuon-z3"])
def test_prediction_matches_hand_counts_at_w4(mode):
    layout = _layout(mode)
    _hand_checks(layout, layout.predict_calls())


def test_control_unsharded_attention_fails_the_hand_counts():
    """Control: the attention predicted whole (as the EP kind would: no TP dims) moves 2·1024
    more elements per layer in the dense broadcasts."""
    layout = _layout("dmuon-z2")
    planted = dataclasses.replace(layout, tp_dims=())
    with pytest.raises(AssertionError):
        _hand_checks(layout, planted.predict_calls())


def test_control_tp_major_ranks_fail_the_hand_counts(monkeypatch):
    """Control: TP columns numbered as contiguous ranks (world rank t·N·E + c instead of
    c·T + t) put the dense calls on the wrong groups."""
    layout = _layout("dmuon-z2")
    original = tpep_mod.ep_part_calls

    def tp_major(kept, dense, expert, e_size, to_world=None):
        calls = original(kept, dense, expert, e_size, to_world=lambda c: c)
        t = to_world(0)
        return [dataclasses.replace(c, rank=c.rank + 2 * t) for c in calls]

    monkeypatch.setattr(tpep_mod, "ep_part_calls", tp_major)
    with pytest.raises(AssertionError):
        _hand_checks(layout, layout.predict_calls())


def _form_matches(layout: TPEPRunLayout, calls) -> None:
    form = tpep_closed_form(layout)
    w = layout.world_size
    for ph in {c.phase for c in calls} | set(form.phases):
        got = sum(c.dedicated_avg_elems() for c in calls if c.phase == ph) / w
        assert got == pytest.approx(form.at(ph, layout.p_m()), rel=1e-12, abs=1e-9), ph


@pytest.mark.parametrize("mode", ["dmuon-z2", "dmuon-z3"])
@pytest.mark.parametrize("n", [1, 2])
def test_closed_form_equals_summed_prediction(mode, n):
    """Phase by phase at W = 4 (and at W = 8, dp_shard = 2): the predicted dedicated W-average
    equals the closed form; its totals are the documented W = 4 numbers."""
    layout = _layout(mode, shard_size=n)
    _form_matches(layout, layout.predict_calls())
    # by hand: W = 4, Z2 2·2560/2 + 4096/4 (Z3 + 1280/2); W = 8 (N = 2), Z2
    # 3/2·2560 + 12288 + 4096/8, Z3 9/4·2560 − 3/4·1280 + 3/2·12288 − 1/2·6144 + 4096/8
    hand = {(1, False): 3584, (1, True): 4224, (2, False): 16640, (2, True): 20672}
    assert tpep_closed_form(layout).total_at(layout.p_m()) == hand[(n, mode.endswith("z3"))]
    assert layout.closed_form_check().p_m == 29184


def test_control_closed_form_catches_a_missing_tp_step(monkeypatch):
    """Control: a prediction without step 6's gather / scatter falls short of the form's
    2(T-1)/(T·W)·P_TP in phase optimizer."""
    layout = _layout("dmuon-z3")
    monkeypatch.setattr(tpep_mod, "tp_step_calls", lambda *a: [])
    with pytest.raises(AssertionError, match="optimizer"):
        _form_matches(layout, layout.predict_calls())


def test_ns_calls_and_report_fields():
    """NS per step: 4 TP matrices once, 2 routers and 2·2·8 experts once per TP column."""
    layout = _layout()
    assert layout.ns_calls_per_step() == 4 + 2 * 2 + 2 * (2 * 2 * X)
    assert layout.report_fields() == {"tp_size": 2, "ep_size": 2}
    assert layout.dmuon_view() is None and layout.ns_plan() is None


def test_token_all_to_all_on_the_ep_groups_of_each_tp_column():
    """The EP groups are (s, *, t): {0, 2} and {1, 3}. Rank 2 (EP index 1 of group {0, 2})
    sends its assignments to experts 0-3 to rank 0 and receives rank 0's to experts 4-7."""
    layout = _layout()
    assert layout.ep_groups() == [[0, 2], [1, 3]]
    counts = ((1, 0, 0, 0, 2, 0, 0, 0), (1, 0, 0, 0, 2, 0, 0, 0), (0, 3, 0, 0, 0, 0, 0, 5),
              (0, 3, 0, 0, 0, 0, 0, 5))
    layout = dataclasses.replace(layout, ep_routing=(("layers.0.mlp", counts), ("layers.1.mlp", counts)))
    calls = [c for c in layout.window_calls(steps=1) if c.rank == 2 and c.module == "layers.0.mlp"]
    gid = group_id_from_ranks([0, 2])
    assert {c.group_id for c in calls} == {gid}
    rows = [c for c in calls if c.dtype == "float32"]
    # dispatch: sends 3 rows to rank 0, keeps 5; receives 2 from rank 0: in 8·32, out 7·32
    assert sorted((c.in_elems, c.out_elems, c.self_elems) for c in rows) == sorted(
        [(8 * 32, 7 * 32, 5 * 32)] * 2 + [(7 * 32, 8 * 32, 5 * 32)] * 2)
    control = dataclasses.replace(layout, ep_size=2)  # the EP kind's groups: consecutive ranks
    from verify.traffic.ep import EPRunLayout
    consecutive = EPRunLayout.ep_groups(control)
    assert consecutive != layout.ep_groups()  # the control: {0, 1}, {2, 3} would be TP groups


def test_layout_json_round_trip_and_errors():
    layout = _layout("dmuon-z3", ep_routing=(("layers.0.mlp", ((1,) * X,) * 4),))
    d = json.loads(json.dumps(layout.to_dict()))
    assert d["kind"] == "tpep"
    assert layout_from_dict(d) == layout
    # control: the comparison sees every field (one changed field differs)
    assert TPEPRunLayout.from_dict(dict(d, tp_size=4)) != layout
    assert TPEPRunLayout.from_dict(dict(d, ep_routing=[])) != layout
    with pytest.raises(ValueError, match="missing"):
        TPEPRunLayout.from_dict({k: v for k, v in d.items() if k != "ep_size"})
    with pytest.raises(ValueError, match="kind"):
        TPEPRunLayout.from_dict(dict(d, kind="ep"))


@pytest.mark.parametrize("kw, match", [
    (dict(mode="dmuon-hsdp-z2"), "mode"),
    (dict(replicate_size=2), "replicate_size"),
    (dict(tp_size=1), "tp_size"),
    (dict(ep_size=3), "expert stack"),
    (dict(dmuon_rest="replicate", fsdp_modules=()), "wrapper"),
    (dict(tp_dims=(("layers.0.mlp.gate_up_proj", 0),)), "TP param"),
])
def test_invalid_layouts_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        _layout(**kw)


def test_skip_reason():
    assert tpep_skip_reason("dmuon-z2", 4, 2, 2) is None
    assert tpep_skip_reason("dmuon-z3", 8, 2, 2) is None
    assert "no TP x EP variant" in tpep_skip_reason("ddp-muon", 4, 2, 2)
    assert "E·T | W" in tpep_skip_reason("dmuon-z2", 6, 2, 2)
