"""The harness's NS bound and the baseline comparison, on hand-made inputs (no processes)."""

from __future__ import annotations

import copy
import json

import pytest

from verify.report.baseline import apply_baseline, causes, figures, make_baseline, read_baseline, write_baseline
from verify.traffic.ns_bound import ns_bound, ns_cost


def test_ns_cost_counts_the_iteration_by_hand():
    # 2x3: m=2, n=3; prologue 3*6+1 = 19; per step 2*4*3 + (2*8 + 3*4) + (2*4*3 + 3*6) = 94
    assert ns_cost(2, 3, steps=1) == 19 + 94 and ns_cost(3, 2, steps=2) == 19 + 2 * 94


def test_ns_bound_is_graham_and_counts_cheapest_first():
    b = ns_bound([(4, 4)] * 3 + [(8, 8)], world_size=2)
    small, big = ns_cost(4, 4), ns_cost(8, 8)
    assert b.cost_bound == pytest.approx((3 * small + big) / 2 + big / 2)
    assert b.count_bound == 3  # the 3 small fit; all 4 (T) exceed T/2 + big/2
    with pytest.raises(ValueError, match="world_size"):
        ns_bound([(4, 4)], 0)


def _report(calls=8.0) -> dict:
    run = {"mode": "dmuon-z2", "pass": True, "calls_measured_per_step": calls,
           "phases": {"forward": {"collectives_measured": calls / 2, "measured_avg_elems": 10.0}},
           "bytes": {"measured_avg_bytes": {"forward": {"float32": 40.0}}},
           "wire": {"busiest_rank": 0, "max_recv_elems": 10.0},
           "ns_balance": {"calls_per_rank": [4.0, 4.0]}, "units": 1, "timing": {"step_ms": 100.0},
           "checks": [{"check": "collectives", "pass": True, "detail": ""}]}
    return {"pass": True, "world_size": 2, "backend": "gloo", "model": "tinygpt",
            "torch_version": "2.13.0", "config": {"modes": ["dmuon-z2"], "coalesce": "auto",
                                                  "out_dir": "a"},
            "runs": [run], "failures": []}


def test_baseline_equal_passes_and_reports_step_time_only():
    base = make_baseline(_report())
    run = _report()
    run["runs"][0]["timing"]["step_ms"] = 900.0  # slower, outside the band: reported, not gated
    apply_baseline(run, base, "b.json", explicit=False)
    assert run["pass"] and run["baseline"]["compared"]
    assert run["baseline"]["step_time"][0]["within_noise_band"] is False


def test_baseline_difference_fails_naming_the_figure():
    base = make_baseline(_report())
    run = _report(calls=12.0)
    apply_baseline(run, base, "b.json", explicit=False)
    assert not run["pass"]
    assert "calls_per_step: 12 vs baseline 8" in run["failures"][0]["detail"]


def _figures(mode_calls: dict, units=1, dtype="float32", elems=10.0, ns=(4.0, 4.0)) -> dict:
    run = {"calls_measured_per_step": sum(mode_calls.values()),
           "phases": {ph: {"collectives_measured": c, "measured_avg_elems": elems}
                      for ph, c in mode_calls.items()},
           "bytes": {"measured_avg_bytes": {ph: {dtype: 4 * elems} for ph in mode_calls}},
           "ns_balance": {"calls_per_rank": list(ns)}, "units": units}
    return figures(run)


def test_baseline_names_the_cause_in_the_protocols_words():
    base = _figures({"forward": 4.0, "backward": 4.0})
    # Z3 broadcasting its kept unit again in backward; Z2 freeing its copies between steps
    assert "a unit is broadcast again in backward" in causes(
        "dmuon-z3", _figures({"forward": 4.0, "backward": 5.0}), base)[0]
    assert "copies freed between steps" in causes(
        "dmuon-z2", _figures({"forward": 6.0, "backward": 4.0}), base)[0]
    assert "added to or removed from step()" in causes(
        "dmuon-z2", _figures({"forward": 4.0, "backward": 4.0, "optimizer": 1.0}), base)[0]
    assert "coalescing target" in " ".join(causes("dmuon-z2", _figures({"forward": 4.0, "backward": 4.0}, units=2), base))
    assert "another dtype on the wire" in " ".join(
        causes("dmuon-z2", _figures({"forward": 4.0, "backward": 4.0}, dtype="bfloat16"), base))
    assert "other sizes" in " ".join(causes("dmuon-z2", _figures({"forward": 4.0, "backward": 4.0}, elems=12.0), base))
    assert "ownership plan" in " ".join(causes("dmuon-z2", _figures({"forward": 4.0, "backward": 4.0}, ns=(8.0, 0.0)), base))
    assert causes("dmuon-z2", base, base) == []
    # the words reach the baseline check's detail, after the figures
    report = _report(calls=12.0)
    apply_baseline(report, make_baseline(_report()), "b.json", explicit=False)
    assert "copies freed between steps" in report["failures"][0]["detail"]


def test_committed_baseline_is_the_file_written_from_the_same_run(tmp_path, monkeypatch):
    from verify.report import baseline as bl

    monkeypatch.setattr(bl, "BASELINES_DIR", tmp_path)
    monkeypatch.setattr(bl, "DEFAULT_BASELINE", tmp_path / "default.json")
    write_baseline(_report(), tmp_path / "default.json")
    block = _report()
    block["config"]["coalesce"] = "block"
    assert bl.committed_baseline(block) == tmp_path / "default.json"  # none written: skipped there
    write_baseline(block, tmp_path / "block.json")
    assert bl.committed_baseline(block) == tmp_path / "block.json"
    assert bl.committed_baseline(_report()) == tmp_path / "default.json"


def test_every_committed_baseline_is_of_another_run():
    """Two committed files with one key: the first would shadow the other."""
    from verify.report import baseline as bl

    keys = [json.dumps(read_baseline(p)["key"], sort_keys=True) for p in sorted(bl.BASELINES_DIR.glob("*.json"))]
    assert keys and len(set(keys)) == len(keys)


def test_every_committed_baseline_is_found_for_a_run_of_today_with_its_key():
    """A run of today's harness has every knob in its config, at its default where the file
    predates the knob (``ep``, ``pp``, ``microbatches``, ``cp``): the lookup must still find
    the file written from that run (it used to fall back to the default baseline, and the
    full profile's TP / EP / bf16 runs went uncompared)."""
    from verify.report import baseline as bl

    outer = ("world_size", "backend", "model", "torch")
    for path in sorted(bl.BASELINES_DIR.glob("*.json")):
        key = read_baseline(path)["key"]
        config = {**bl._PREDATED, **{k: (bl._PREDATED.get(k) if v is None else v)
                                     for k, v in key.items() if k not in outer}}
        report = {"world_size": key["world_size"], "backend": key["backend"], "model": key["model"],
                  "torch_version": key["torch"] + ".0", "config": config}
        assert bl.committed_baseline(report) == path, path.name


def test_baseline_of_another_run_skips_by_default_fails_when_explicit():
    base = make_baseline(_report())
    other = _report()
    other["config"]["coalesce"] = "block"
    skipped = apply_baseline(copy.deepcopy(other), base, "b.json", explicit=False)
    assert skipped["pass"] and "coalesce='block'" in skipped["baseline"]["reason"]
    failed = apply_baseline(other, base, "b.json", explicit=True)
    assert not failed["pass"] and "coalesce='block'" in failed["failures"][0]["detail"]


def test_baseline_file_round_trip_and_errors(tmp_path):
    path = write_baseline(_report(), tmp_path / "b.json")
    assert read_baseline(path)["modes"]["dmuon-z2"]["figures"]["units"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"baseline_version": 0}))
    with pytest.raises(ValueError, match="version-1"):
        read_baseline(bad)
    failing = _report()
    failing["pass"] = False
    with pytest.raises(ValueError, match="known-good"):
        write_baseline(failing, tmp_path / "c.json")


def test_a_knob_a_baseline_predates_matches_at_its_default_only():
    """A baseline written before ``--ep`` existed applies to a run at ``ep=1`` (without the
    default mapped to None the default run silently lost its baseline check), not at ep=2."""
    base = make_baseline(_report())
    for ep, compared in ((1, True), (2, False)):
        run = _report()
        run["config"]["ep"] = ep
        apply_baseline(run, base, "b.json", explicit=False)
        assert run["baseline"]["compared"] is compared, (ep, run["baseline"]["reason"])
