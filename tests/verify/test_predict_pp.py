"""The PP kind's prediction (verify/traffic/pp.py) without processes: each stage's calls on its
own N ranks, the dedicated W-average equal to docs/traffic-model.md's "Pipeline parallelism"
closed form Σ_s 2(N-1)/N·P_s / S in every PP mode (Z3 held for the step: Z2's calls), the
stage-to-stage send / recv in phase ``pipeline`` with its own closed form 2M·Σ_b A_b / S; and
the controls: an extra reduce per micro-batch (Z3 or a schedule reducing every backward) and a
lost activation recv each make the comparison fail, naming the call. The measured side is
tests/distributed/phase_d/test_traffic_pp.py."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from dmuon.ownership.plan import specs_from_named_parameters
from tracer.events import CollectiveEvent
from verify.compare import compare_run
from verify.modes.build import muon_names
from verify.traffic.layouts import layout_from_dict
from verify.traffic.pp import PIPELINE, PP_MODES, PPRunLayout, pp_skip_reason
from verify.workload.model import GPTConfig, TinyGPT


def _layout(mode: str, stages: int, n: int, layers: int = 4, microbatches: int = 4,
            activation: int = 4096) -> PPRunLayout:
    model = TinyGPT(GPTConfig(n_layers=layers))
    specs = tuple(specs_from_named_parameters(model.named_parameters()))
    per = layers // stages

    def stage_of(name: str) -> int:
        if name.startswith("blocks."):
            return int(name.split(".")[1]) // per
        return 0 if name.startswith(("tok_emb", "pos_emb")) else stages - 1

    names = tuple(tuple(p.name for p in specs if stage_of(p.name) == s) for s in range(stages))
    dmuon = mode.startswith("dmuon-")
    return PPRunLayout(mode=mode, replicate_size=1, shard_size=n, params=specs,
                       muon_names=muon_names(model), reshard_after_forward=mode.endswith("z3"),
                       dmuon_rest="replicate" if dmuon else "wrapper", dmuon_reduce_by_gather=True,
                       dmuon_uneven_aligned=True, dmuon_coalesce_bytes=1 << 20,
                       pp_size=stages, microbatches=microbatches, stage_names=names,
                       pp_activations=tuple((activation, "float32") for _ in range(stages - 1)))


def _events(calls, steps: int = 2) -> list[CollectiveEvent]:
    """``calls`` as a perfect interposer records them, ``steps`` times."""
    return [CollectiveEvent(source="interposer", op=e.op, rank=e.rank, group_id=e.group_id,
                            group_size=e.group_size, group_rank=e.group_id.split(",").index(str(e.rank)),
                            count=e.count, dtype=e.dtype, root=e.root, phase=e.phase,
                            in_elems=e.in_elems, out_elems=e.out_elems)
            for _ in range(steps) for e in calls]


def _run(layout: PPRunLayout, calls=None, steps: int = 2) -> dict:
    events = _events(layout.predict_calls() if calls is None else calls, steps)
    return compare_run(layout, events, steps=steps, ns_calls=layout.ns_calls_per_step() * steps)


MESHES = [(2, 2), (2, 3), (4, 2)]


@pytest.mark.parametrize("mode", PP_MODES)
@pytest.mark.parametrize("stages, n", MESHES)
def test_dedicated_average_equals_the_closed_form(mode, stages, n):
    """The prediction, recorded perfectly, passes; its dedicated W-average is
    2(N-1)/N·P_M/S = Σ_s 2(N-1)/N·P_s / S, split (N-1)/N·P_M/S per phase in DMuon, all in
    backward in ddp-muon; every stage's P_s counts."""
    layout = _layout(mode, stages, n)
    run = _run(layout)
    assert run["pass"] and run["closed_form_matches"], (run["missing"], run["unexpected"])
    a = (n - 1) / n
    p_s = layout.stage_p_m()
    assert sum(p_s) == layout.p_m() and all(p_s)
    expected = sum(2 * a * p * n for p in p_s) / (stages * n)
    assert run["measured_avg_elems"] == pytest.approx(expected, rel=1e-12)
    assert run["closed_form_avg_elems"] == pytest.approx(expected, rel=1e-12)
    phases = {ph: v["measured_avg_elems"] for ph, v in run["phases"].items() if v["measured_avg_elems"]}
    if mode == "ddp-muon":
        assert phases == pytest.approx({"backward": expected})
    else:
        assert phases == pytest.approx({"forward": expected / 2, "backward": expected / 2})
    assert run["pp_size"] == stages and run["stage_p_m"] == p_s


@pytest.mark.parametrize("stages, n", MESHES)
def test_each_stage_moves_its_own_params_on_its_own_ranks(stages, n):
    """Every DMuon call stays inside one stage's slice (world ranks s·N .. s·N + N - 1); the
    P2P runs on the pipeline groups {s·N + j}; Z3 issues exactly Z2's calls."""
    z3 = _layout("dmuon-z3", stages, n).predict_calls()
    z2 = _layout("dmuon-z2", stages, n).predict_calls()
    assert Counter(c.key() for c in z3) == Counter(c.key() for c in z2)
    for c in z3:
        members = [int(r) for r in c.group_id.split(",")]
        if c.phase == PIPELINE:
            assert members == [s * n + c.rank % n for s in range(stages)] and c.op in ("send", "recv")
        else:
            assert {r // n for r in members} == {c.rank // n}, c


@pytest.mark.parametrize("stages, n, m", [(2, 2, 4), (4, 2, 1), (2, 3, 3)])
def test_p2p_per_boundary_and_micro_batch(stages, n, m):
    """Per boundary, data-parallel index and micro-batch: one send and one recv of the
    activation and of its grad, the peer's group rank as root; received elements per rank and
    step 2M·Σ_b A_b / S, the phase's all-element closed form; no dedicated share."""
    layout = _layout("dmuon-z2", stages, n, microbatches=m, activation=640)
    p2p = [c for c in layout.predict_calls() if c.phase == PIPELINE]
    assert len(p2p) == 4 * m * (stages - 1) * n
    for c in p2p:
        assert abs(c.root - c.rank // n) == 1 and c.count == 640 and c.dedicated_count == 0
    first = [c for c in p2p if c.rank // n == 0]
    assert Counter(c.op for c in first) == {"send": m * n, "recv": m * n}
    run = _run(layout)
    ph = run["phases"][PIPELINE]
    assert ph["all_closed_form_avg_elems"] == 2 * m * 640 * (stages - 1) / stages
    assert ph["all_measured_avg_elems"] == ph["all_closed_form_avg_elems"] and ph["measured_avg_elems"] == 0
    assert ph["pass"]


@pytest.mark.parametrize("mode", ["dmuon-z3", "ddp-muon"])
def test_control_an_extra_reduce_per_micro_batch_fails(mode):
    """Planted: rank 0 reduces its stage's grads in every micro-batch's backward (M - 1 more
    times, as Z3 freeing per micro-batch or a schedule outside no_sync would): the comparison
    names the extra backward calls, and the backward phase leaves its closed form."""
    layout = _layout(mode, 2, 2)
    calls = layout.predict_calls()
    reduces = [c for c in calls if c.rank == 0 and c.phase == "backward" and c.dedicated_count]
    assert reduces
    planted = calls + reduces * (layout.microbatches - 1)
    run = _run(layout, planted)
    assert not run["pass"]
    extra = [u for u in run["unexpected"] if u["rank"] == 0 and u["phase"] == "backward"]
    assert {u["op"] for u in extra} == {c.op for c in reduces}
    assert sum(u["n"] for u in extra) == 2 * len(reduces) * (layout.microbatches - 1)
    assert not run["phases"]["backward"]["closed_form_matches"]


def test_control_a_lost_activation_recv_fails_in_its_phase():
    """Planted: stage 1's rank 2 misses one micro-batch's activation recv: the comparison
    names it in phase pipeline and the phase's all-element closed form no longer holds."""
    layout = _layout("dmuon-z2", 2, 2)
    calls = layout.predict_calls()
    lost = next(c for c in calls if c.phase == PIPELINE and c.op == "recv" and c.rank == 2)
    calls.remove(lost)
    run = _run(layout, calls)
    assert not run["pass"]
    assert [(m["phase"], m["op"], m["rank"]) for m in run["missing"]] == [(PIPELINE, "recv", 2)]
    assert not run["phases"][PIPELINE]["closed_form_matches"]


def test_layout_round_trip_and_errors():
    layout = _layout("dmuon-z3", 2, 2)
    assert layout_from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="stage_names"):
        dataclasses.replace(layout, stage_names=layout.stage_names[:1] + ((),))
    with pytest.raises(ValueError, match="pp_activations"):
        dataclasses.replace(layout, pp_activations=())
    with pytest.raises(ValueError, match="mode"):
        dataclasses.replace(layout, mode="naive-fsdp2-z2")
    assert pp_skip_reason("naive-hsdp", 4, 2) and pp_skip_reason("dmuon-z2", 4, 4)
    assert pp_skip_reason("dmuon-z2", 4, 2) is None
