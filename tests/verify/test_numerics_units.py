"""The words and arithmetic of the numerics, owner-grad, memory and source checks, on figures
built by hand (the runs that produce them: tests/distributed/phase_d/test_gate_numerics.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tracer.crosscheck import FLIGHT_RECORDER_GLOO, profile_for
from tracer.events import CollectiveEvent
from verify.report.checks import factor_text, run_checks
from verify.measure import numerics
from verify.run.runner import _op_kinds


@pytest.mark.parametrize("ratio, words", [
    (2.0, "2.000× the mean: divided by N=2, not W=4"),
    (4.0, "4.000× the mean: divided by 1, not W=4"),
    (0.5, "0.500× the mean: divided by 8, not W=4"),
    (1.0000001, "1.000× the mean"),
    (1.37, "1.370× the mean"),
])
def test_factor_names_the_divisor(ratio, words):
    assert factor_text(ratio, 4, (2, 2)) == words


def test_loss_floor_is_the_running_max_and_findings_name_the_step():
    floor = numerics.loss_floor([5.0, 4.0, 3.0], [5.0, 4.001, 3.0002])
    assert floor[0] == pytest.approx(2 * numerics.FP32_EPS * 5.0)
    assert floor[1] == pytest.approx(1e-3, rel=1e-6) and floor[2] == floor[1]
    assert numerics.loss_findings([5.0, 4.0, 3.0], [5.0, 4.0, 3.0], floor) == []
    off = numerics.loss_findings([5.0, 4.0, 2.9], [5.0, 4.0, 3.0], floor)
    assert [o["step"] for o in off] == [2] and off[0]["diff"] == pytest.approx(0.1)


def test_muon_step_is_torch_muon_and_a_momentum_change_moves_it():
    torch.manual_seed(0)
    before, grad, mom = torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16)
    update, after = numerics.muon_step(before, grad, mom, None, 0.02)
    p = torch.nn.Parameter(before.clone())
    opt = torch.optim.Muon([p], lr=0.02)
    opt.state[p]["momentum_buffer"] = mom.clone()
    p.grad = grad.clone()
    opt.step()
    assert torch.equal(update, p.detach() - before)
    assert torch.equal(after, opt.state[p]["momentum_buffer"])
    restarted, _ = numerics.muon_step(before, grad, torch.zeros_like(mom), None, 0.02)
    assert numerics._rel(restarted, update) > 100 * numerics.MIN_UPDATE_REL


def _run(**numerics_fields) -> dict:
    """A DMuon runs[] entry with passing traffic figures and a numerics entry."""
    num = {"step": 6, "mesh": [2, 2], "world": 4, "safety": 8.0,
           "grads": [{"param": "w", "rel": 1e-8, "floor": 5e-7, "ratio": 1.0, "pass": True}],
           "clip_norm": {"measured": 2.0, "oracle": 2.0, "rel": 0.0, "floor": 5e-7, "pass": True},
           "updates": [{"param": "w", "kind": "muon", "rel": 0.0, "floor": 2.4e-4, "max_abs": 0.0,
                        "momentum_rel": 0.0, "momentum_floor": 5e-7, "pass": True}],
           "losses": {"reference": "ddp-muon", "floor": [1e-6, 1e-4], "safety": 8.0, "max_diff": 0.0,
                      "off": []}}
    num.update(numerics_fields)
    return {"mode": "dmuon-hsdp-z3", "missing": [], "unexpected": [], "phases": {},
            "closed_form": "x", "closed_form_matches": True, "measured_avg_elems": 1.0,
            "closed_form_avg_elems": 1.0, "ns_calls_per_step": 8, "ns_calls_expected": 8,
            "sources": {}, "numerics": num,
            "checkpoint": {"step": 6, "compared": 10, "differ": []}}


def _check(run: dict, name: str) -> dict:
    return next(c for c in run_checks(run) if c["check"] == name)


def test_numerics_checks_pass_and_each_fails_with_its_cause():
    run = _run()
    for name in ("numerics", "owner_grads", "checkpoint"):
        assert _check(run, name)["pass"], _check(run, name)
    bad = copy.deepcopy(run)
    bad["numerics"]["grads"][0].update(rel=1.0, ratio=2.0, **{"pass": False})
    bad["numerics"]["clip_norm"].update(measured=4.0, rel=1.0, **{"pass": False})
    detail = _check(bad, "owner_grads")["detail"]
    assert not _check(bad, "owner_grads")["pass"]
    assert detail.startswith("clip_grad_norm_ 4 vs the oracle's 2 (2.000×)")
    assert "grad of w at its owner: 2.000× the mean: divided by N=2, not W=4" in detail
    bad = copy.deepcopy(run)
    bad["numerics"]["updates"][0].update(rel=0.4, max_abs=3e-3, **{"pass": False})
    assert "step 6 update of w (muon) off the oracle's by 40.00% of its norm" in _check(bad, "numerics")["detail"]
    bad = copy.deepcopy(run)
    bad["numerics"]["losses"]["off"] = [{"step": 1, "loss": 4.0, "reference": 4.1, "diff": 0.1, "tol": 8e-4}]
    assert "loss at step 1: 4.000000 vs ddp-muon 4.100000" in _check(bad, "numerics")["detail"]
    bad = copy.deepcopy(run)
    bad["checkpoint"]["differ"] = [{"rank": 1, "names": ["w", "w:momentum"]}]
    assert "rank 1: w, w:momentum" in _check(bad, "checkpoint")["detail"]


def _memory_run(measured: dict, z3: bool = False) -> dict:
    bound = {"peak_bytes": 400, "between_bytes": 400 if not z3 else 100, "grads_bytes": 500,
             "window_units": 1, "floor_peak_bytes": 400 if not z3 else 250, "floor_grads_bytes": 120,
             "between_exact": True}
    run = _run()
    run["memory"] = {"z3": z3, "prefetch_depth": 1,
                     "ranks": [{"rank": 1, "bound": bound, "measured": measured}]}
    return run


def test_memory_is_two_sided_where_the_plan_is_exact():
    exact = {"forward": 400, "backward": 400, "between": 400, "grads": 300}
    assert _check(_memory_run(exact), "memory")["pass"]
    freed = _check(_memory_run({**exact, "between": 200}), "memory")
    assert not freed["pass"] and "between steps 0.00 MB < the plan's exact 0.00 MB (Z2: every copy " \
                                "resident): freed what it should keep" in freed["detail"]
    zero = _check(_memory_run({"forward": 0, "backward": 0, "between": 0, "grads": 0}), "memory")
    assert "rank 1 meter reads 0 B forward where the plan holds" in zero["detail"]
    z3 = {"forward": 300, "backward": 260, "between": 100, "grads": 200}
    assert _check(_memory_run(z3, z3=True), "memory")["pass"]
    low = _check(_memory_run({**z3, "forward": 200}, z3=True), "memory")
    assert "forward 0.00 MB < the least the plan needs" in low["detail"]


def _ev(op: str) -> CollectiveEvent:
    return CollectiveEvent(source="flight_recorder", rank=0, seq=0, op=op, group_id="0", group_size=2,
                           count=4, dtype="float32", msg_bytes=16, root=None, phase=None,
                           module=None, t_start_ns=0, t_end_ns=None)


def test_a_source_without_an_op_kind_fails_naming_it():
    src = {"events": 2, "matched": 2, "unmatched": 0, "pass": True, "mismatches": []}
    _op_kinds(src, [_ev("all_gather"), _ev("all_reduce")], {"all_gather": 2, "reduce_scatter": 2},
              FLIGHT_RECORDER_GLOO)  # gloo's FR writes a reduce_scatter as an all_reduce
    assert src["pass"] and src["ops_missing"] == []
    _op_kinds(src, [_ev("all_gather")], {"all_gather": 2, "broadcast": 4},
              profile_for("profiler", "gloo"))
    assert not src["pass"] and src["ops_missing"] == ["broadcast"]
    run = _run()
    run["sources"] = {"profiler": src}
    assert "recorded no broadcast where the prediction has them" in _check(run, "source:profiler")["detail"]


def test_no_numerics_flag_and_the_baseline_ignores_it():
    from verify.report.baseline import baseline_key
    from verify.run.main import parse_args

    assert parse_args(["--out-dir", "x", "--no-numerics"]).no_numerics
    assert not parse_args(["--out-dir", "x"]).no_numerics
    report = {"world_size": 4, "backend": "gloo", "model": "tinygpt", "torch_version": "2.13.0",
              "config": {"modes": ["dmuon-z2"], "numerics": True}}
    assert baseline_key(report) == baseline_key({**report, "config": {"modes": ["dmuon-z2"], "numerics": False}})


def test_numerics_applies_to_whole_matrices_in_fp32_only():
    from verify.run.runner import RunConfig

    assert numerics.applies(RunConfig(), "dmuon-z2") is None
    assert numerics.applies(RunConfig(), "ddp-muon") == "not a DMuon mode"
    for config in (RunConfig(tp=2), RunConfig(ep=2), RunConfig(mixed_precision="bf16"),
                   RunConfig(qk_clip_tau=0.05), RunConfig(model="pkg.mod:factory")):
        assert numerics.applies(config, "dmuon-z2"), config
