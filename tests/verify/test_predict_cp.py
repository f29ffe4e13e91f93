"""The CP kind's prediction (verify/traffic/cp.py) without processes: DMuon's dedicated calls on
the one shard group of all N·C ranks, its W-average equal to the 1-D closed form at N_eff = N·C
(docs/traffic-model.md, "Context parallelism"); the attention's K/V exchange in phase
``context`` on the CP groups with its own closed form 6(C-1)·Σ_l a_l; and the controls: DMuon
run with "cp" left undeclared (its calls on the dp_shard columns, the form at N) and a lost K/V
grad all_reduce each make the comparison fail. The measured side is
tests/distributed/phase_d/test_traffic_cp.py."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from dmuon.ownership.plan import specs_from_named_parameters
from examples.cp_attention import CPDecoder
from tracer.events import CollectiveEvent, group_id_from_ranks
from verify.compare import compare_run
from verify.modes.build import muon_names
from verify.traffic.cp import CONTEXT, CP_MODES, CPRunLayout, cp_skip_reason
from verify.traffic.layouts import layout_from_dict
from verify.traffic.predict import RunLayout, predict_step

#: One rank's part of K (or V) per layer: 2 rows × 64 positions / C × 64 features.
ROWS, SEQ, DIM = 2, 64, 64


def _layout(mode: str, n: int, c: int, layers: int = 2) -> CPRunLayout:
    model = CPDecoder(vocab=256, dim=DIM, layers=layers, heads=4, max_len=SEQ)
    specs = tuple(specs_from_named_parameters(model.named_parameters()))
    dmuon = mode.startswith("dmuon-")
    a = ROWS * (SEQ // c) * DIM
    return CPRunLayout(mode=mode, replicate_size=1, shard_size=n, params=specs,
                       muon_names=tuple(muon_names(model)), reshard_after_forward=mode.endswith("z3"),
                       dmuon_rest="replicate" if dmuon else "wrapper", dmuon_reduce_by_gather=True,
                       dmuon_uneven_aligned=True, cp_size=c,
                       cp_layers=tuple((f"blocks.{i}", a, "float32") for i in range(layers)))


def _events(calls, steps: int = 2) -> list[CollectiveEvent]:
    """``calls`` as a perfect interposer records them, ``steps`` times."""
    return [CollectiveEvent(source="interposer", op=e.op, rank=e.rank, group_id=e.group_id,
                            group_size=e.group_size, group_rank=e.group_id.split(",").index(str(e.rank)),
                            count=e.count, dtype=e.dtype, root=e.root, phase=e.phase,
                            in_elems=e.in_elems, out_elems=e.out_elems)
            for _ in range(steps) for e in calls]


def _run(layout: CPRunLayout, calls=None, steps: int = 2) -> dict:
    events = _events(layout.predict_calls() if calls is None else calls, steps)
    return compare_run(layout, events, steps=steps, ns_calls=layout.ns_calls_per_step() * steps)


MESHES = [(2, 2), (2, 4), (3, 2)]


@pytest.mark.parametrize("mode", CP_MODES)
@pytest.mark.parametrize("n, c", MESHES)
def test_dedicated_average_is_the_1d_form_at_n_eff(mode, n, c):
    """The prediction, recorded perfectly, passes; its dedicated W-average is the 1-D form at
    N_eff = N·C: 2(N_eff-1)/N_eff·P_M in ddp-muon and DMuon Z2 (split forward / backward in
    DMuon), plus Z3's backward re-broadcast of all but the kept unit."""
    layout = _layout(mode, n, c)
    run = _run(layout)
    assert run["pass"] and run["closed_form_matches"], (run["missing"][:3], run["unexpected"][:3])
    ne = n * c
    a = (ne - 1) / ne
    p_m = layout.p_m()
    phases = {ph: v["measured_avg_elems"] for ph, v in run["phases"].items() if v["measured_avg_elems"]}
    if mode == "ddp-muon":
        assert phases == pytest.approx({"backward": 2 * a * p_m})
    elif mode == "dmuon-z3":
        forward = a * p_m
        kept = layout.closed_form_check().p_m_kept
        assert 0 < kept < p_m
        assert phases == pytest.approx({"forward": forward, "backward": forward + a * (p_m - kept)})
    else:
        assert phases == pytest.approx({"forward": a * p_m, "backward": a * p_m})
    assert run["closed_form_avg_elems"] == pytest.approx(run["measured_avg_elems"], rel=1e-12)
    assert (run["cp_size"], run["n_eff"]) == (c, ne)


@pytest.mark.parametrize("n, c", MESHES)
def test_dmuon_on_one_group_of_all_ranks_kv_on_the_cp_groups(n, c):
    """Every DMuon call runs on the world group (the shard group spans dp_shard × cp); every
    K/V call on the CP group {d·C + k} of its rank; the calls equal the plain 1-D prediction at
    W = N·C plus the exchange."""
    layout = _layout("dmuon-z3", n, c)
    calls = layout.predict_calls()
    world = group_id_from_ranks(range(n * c))
    for e in calls:
        if e.phase == CONTEXT:
            assert e.group_id == group_id_from_ranks([e.rank // c * c + k for k in range(c)]), e
            assert e.dedicated_count == 0
        else:
            assert e.group_id == world, e
    flat = dataclasses.replace(layout.dense_view())
    assert flat.shard_size == n * c and type(flat) is RunLayout
    assert Counter(e.key() for e in calls if e.phase != CONTEXT) == Counter(e.key() for e in predict_step(flat))


@pytest.mark.parametrize("n, c", MESHES)
def test_kv_exchange_per_layer_and_its_closed_form(n, c):
    """Per rank, layer and step: all_gathers of K and V (a elements sent each) and their
    grads' all_reduces (C·a each); received elements 6(C-1)·Σ_l a_l, the phase's all-element
    closed form; no dedicated share."""
    layout = _layout("dmuon-z2", n, c)
    a = ROWS * (SEQ // c) * DIM
    kv = [e for e in layout.predict_calls() if e.phase == CONTEXT]
    assert Counter((e.op, e.count) for e in kv if e.rank == 0) == {("all_gather", a): 4, ("all_reduce", c * a): 4}
    assert len(kv) == 8 * n * c
    run = _run(layout)
    ph = run["phases"][CONTEXT]
    assert ph["all_closed_form_avg_elems"] == 6 * (c - 1) * 2 * a
    assert ph["all_measured_avg_elems"] == pytest.approx(ph["all_closed_form_avg_elems"], rel=1e-12)
    assert ph["measured_avg_elems"] == 0 and ph["pass"]


def _undeclared(layout: CPRunLayout) -> list:
    """DMuon's calls as a run with "cp" left undeclared issues them: the 1-D prediction at N on
    each dp_shard column {d·C + k} over d."""
    n, c = layout.shard_size, layout.cp_size
    base = {f.name: getattr(layout, f.name) for f in dataclasses.fields(RunLayout)}
    col = predict_step(RunLayout(**base))
    out = []
    for k in range(c):
        for e in col:
            ranks = [int(r) * c + k for r in e.group_id.split(",")]
            out.append(dataclasses.replace(e, rank=e.rank * c + k, group_id=group_id_from_ranks(ranks)))
    return out


@pytest.mark.parametrize("mode", ["dmuon-z2", "dmuon-z3"])
def test_control_cp_left_undeclared_fails(mode):
    """Planted: DMuon's calls on the dp_shard columns at N (cp undeclared): the comparison names
    the missing world-group calls and the unexpected column calls, and the dedicated phases
    leave the 1-D form at N_eff (they carry the form at N)."""
    layout = _layout(mode, 2, 2)
    calls = [e for e in layout.predict_calls() if e.phase == CONTEXT] + _undeclared(layout)
    run = _run(layout, calls)
    assert not run["pass"] and run["missing"] and run["unexpected"]
    assert {u["group_id"] for u in run["unexpected"]} == {"0,2", "1,3"}
    assert {m["group_id"] for m in run["missing"]} == {"0,1,2,3"}
    assert not run["closed_form_matches"]
    assert not run["phases"]["forward"]["closed_form_matches"]


def test_control_a_lost_kv_grad_all_reduce_fails_in_its_phase():
    """Planted: rank 3 misses one layer's V-grad all_reduce: the comparison names it in phase
    context and the phase's all-element closed form no longer holds."""
    layout = _layout("dmuon-z3", 2, 2)
    calls = layout.predict_calls()
    lost = next(e for e in calls if e.phase == CONTEXT and e.op == "all_reduce" and e.rank == 3)
    calls.remove(lost)
    run = _run(layout, calls)
    assert not run["pass"]
    assert [(m["phase"], m["op"], m["rank"]) for m in run["missing"]] == [(CONTEXT, "all_reduce", 3)]
    assert not run["phases"][CONTEXT]["closed_form_matches"]


def test_layout_round_trip_and_errors():
    layout = _layout("dmuon-z3", 2, 2)
    assert layout_from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="cp_size"):
        dataclasses.replace(layout, cp_size=1)
    with pytest.raises(ValueError, match="cp_layers"):
        dataclasses.replace(layout, cp_layers=())
    with pytest.raises(ValueError, match="mode"):
        dataclasses.replace(layout, mode="naive-fsdp2-z2")
    with pytest.raises(ValueError, match="dmuon_rest"):
        dataclasses.replace(layout, dmuon_rest="wrapper")
    assert cp_skip_reason("naive-hsdp", 4, 2) and cp_skip_reason("dmuon-z2", 4, 4)
    assert cp_skip_reason("dmuon-z2", 4, 2) is None
