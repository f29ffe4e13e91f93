"""The TP predictor (verify/traffic/tp.py) without processes: its independence from the
runtime, its closed forms at other (N, T) than the measured 2 x 2, and the protocol's call
counts (one gather and one scatter per NS rank of each owner's TP group)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction

import pytest

from dmuon.ownership.plan import specs_from_named_parameters
from verify.modes.build import muon_names
from verify.traffic.formulas import avg_elems
from verify.traffic.tp import TP_MODES, TPRunLayout, predict_tp_step, tp_closed_form, tp_ns_calls_per_step
from verify.workload.model import GPTConfig, TinyGPT


def tp_layout(mode: str, n: int, t: int) -> TPRunLayout:
    """TinyGPT (d=64, 2 layers) as ``verify.modes.tp`` lays it out: MLPs tensor parallel."""
    model = TinyGPT(GPTConfig(d_model=64, n_heads=4, n_layers=2))
    specs = tuple(specs_from_named_parameters(model.named_parameters()))
    targets = muon_names(model)
    dims = tuple((f"blocks.{i}.mlp.{m}.weight", d) for i in range(2) for m, d in (("fc1", 0), ("fc2", 1)))
    acts = tuple((f"blocks.{i}.mlp.{m}", s, 2 * 64 * 64, "float32") for i in range(2)
                 for m, s in (("fc1", "colwise"), ("fc2", "rowwise")))
    if mode.startswith("naive-"):
        fsdp = (*sorted({x.rpartition(".")[0] for x in targets}, key=[s.module for s in specs].index), "")
    else:
        fsdp = ("",)
    return TPRunLayout(mode=mode, replicate_size=1, shard_size=n, params=specs, muon_names=targets,
                       fsdp_modules=fsdp, reshard_after_forward=mode.endswith("z3"), tp_size=t,
                       tp_dims=dims, tp_activations=acts)


def _by_phase(layout: TPRunLayout) -> dict[str, Fraction]:
    """Exact W-average of the dedicated share of the predicted calls, per phase."""
    w = layout.world_size
    by_phase: dict[str, Fraction] = Counter()
    for e in predict_tp_step(layout):
        assert 0 <= e.rank < w
        share = Fraction(e.dedicated_count, e.count) if e.count else 0
        by_phase[e.phase] += Fraction(avg_elems(e.op, e.count, e.group_size)) * share / w
    return by_phase


@pytest.mark.parametrize("mode, r, n, t", [
    *((m, 1, n, t) for m in TP_MODES for n, t in ((2, 2), (4, 2), (2, 4), (1, 4))),
    *((m, 2, n, t) for m in ("dmuon-hsdp-z2", "dmuon-hsdp-z3") for n, t in ((2, 2), (1, 2), (2, 4))),
])
def test_tp_prediction_equals_the_closed_form(mode, r, n, t):
    layout = dataclasses.replace(tp_layout(mode, n, t), replicate_size=r)
    by_phase, form, p_m = _by_phase(layout), tp_closed_form(layout), layout.p_m()
    assert set(by_phase) <= {"forward", "backward", "optimizer", "replicate", "tp"}
    for phase in ("forward", "backward", "optimizer", "replicate", "tp"):
        assert float(by_phase[phase]) == pytest.approx(form.at(phase, p_m), rel=1e-12, abs=1e-9), phase
    assert (by_phase["replicate"] > 0) == (r > 1)
    if r == 1:
        assert tp_ns_calls_per_step(layout) == (4 + t * 4 if mode.startswith("dmuon-") else n * t * 8)


def test_tp_step_one_gather_and_scatter_per_ns_rank_of_each_owner():
    layout = tp_layout("dmuon-z3", 2, 2)
    calls = predict_tp_step(layout)
    owner, ns = layout._dp_owner(), layout.ns_rank()
    for rank in range(layout.world_size):
        roots = {ns[n] for n in ns if owner[n] == rank // layout.tp_size}
        mine = Counter(e.op for e in calls if e.rank == rank and e.phase == "optimizer")
        assert mine == {"gather": len(roots), "scatter": len(roots)} if roots else not mine, rank
    # DTensor's calls: per rank, per block, one forward and one backward all_reduce
    assert Counter(e.op for e in calls if e.phase == "tp") == {"all_reduce": 4 * 2 * 2}


@pytest.mark.parametrize("mode", ["dmuon-z3", "dmuon-hsdp-z3"])
def test_tp_z3_keeps_the_last_units_local_shards(mode):
    """Each TP column runs the plain protocol on local shards, so Z3 keeps the last unit
    (blocks.1, one unit per block here) from forward into backward: backward loses
    (N-1)/N·P_loc^L, blocks.1's local elements (its MLP matrices divided by T)."""
    n, t = 2, 2
    layout = dataclasses.replace(tp_layout(mode, n, t), replicate_size=2 if "hsdp" in mode else 1)
    tp = layout.tp_names()
    block1 = [p for p in layout.muon_specs() if p.name.startswith("blocks.1.")]
    p_loc_kept = sum(p.numel // t if p.name in tp else p.numel for p in block1)
    z2 = dataclasses.replace(layout, mode=mode.replace("z3", "z2"), reshard_after_forward=False)
    p_loc = sum(p.numel // t if p.name in tp else p.numel for p in layout.muon_specs())
    # Z3 - Z2 in backward: the re-broadcast of every local shard but the kept unit's
    want = Fraction(n - 1, n) * (p_loc - p_loc_kept)
    assert _by_phase(layout)["backward"] - _by_phase(z2)["backward"] == want
    assert "− (N-1)/N·P_loc^L" in tp_closed_form(layout).text
