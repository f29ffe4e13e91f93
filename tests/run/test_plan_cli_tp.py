"""dmuon-plan --tp T (verify/plan/tp.py): the TP terms of docs/traffic-model.md, "Tensor
parallelism", and the NS balance of the plan over W = R·N·T ranks."""

from __future__ import annotations

import json

import pytest

from verify.plan.cli import main
from verify.plan.tp import tp_layout, tp_report, tp_sharded
from verify.workload.presets import build_preset
from verify.plan.cli import ModelLayout, coalesce_target
from verify.traffic.scale import CostModel
from verify.traffic.tp import tp_closed_form


def test_tp_terms_follow_the_closed_forms(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2", "--tp", "2", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)["reports"][0]["tp"]
    n, t, w = 2, 2, 4
    assert tp["mesh"] == {"replicate": 1, "shard": 2, "tp": 2} and tp["world_size"] == w
    assert tp["p_tp"] + tp["p_rep"] == tp["p_m"] and tp["p_rep"] == 0  # every llama-tiny matrix shards
    rows = {m["mode"]: m for m in tp["modes"]}
    assert rows.keys() == {"dmuon-z2", "dmuon-z3"}
    gather = (t - 1) / (t * w) * tp["p_m"]
    assert rows["dmuon-z2"]["ded_avg_elems"] == pytest.approx(2 * (n - 1) / n * tp["p_m"] / t + 2 * gather)
    # Z3 keeps its last unit (P_loc^L) from forward into backward; llama-tiny's local shards
    # are one unit under the coalesce target, so P_loc^L = P_loc and Z3 moves Z2's traffic
    kept = rows["dmuon-z3"]["p_loc_kept_elems"]
    assert kept == tp["p_loc"] and rows["dmuon-z2"]["p_loc_kept_elems"] == 0
    assert rows["dmuon-z3"]["ded_avg_elems"] == pytest.approx(
        3 * (n - 1) / n * tp["p_m"] / t - (n - 1) / n * kept + 2 * gather)
    assert rows["dmuon-z3"]["ded_avg_elems"] == pytest.approx(rows["dmuon-z2"]["ded_avg_elems"])
    assert rows["dmuon-z2"]["ns_calls"] == 15  # once per matrix across the whole mesh
    assert tp["ns_idle_ranks"] == 0


def test_tp_text_and_replicated_matrices(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2x2", "--tp", "3"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: mesh 2x2x3" in out and "dmuon-hsdp-z3" in out
    ml = ModelLayout(build_preset("llama-tiny"), "llama-tiny")
    rep = tp_report(ml, (2, 2), 3, coalesce_bytes=coalesce_target(CostModel()))
    rep_specs = [sp for sp in ml.muon_specs if tp_sharded(sp, 3) is None]
    assert rep["p_rep"] == sum(sp.numel for sp in rep_specs)
    # a replicated matrix is orthogonalized in each of the T columns
    assert rep["modes"][0]["ns_calls"] == rep["tp_matrices"] + 3 * len(rep_specs)


def test_tp_with_sweep_exits_2(capsys):
    assert main(["--model", "llama-tiny", "--sweep", "--tp", "2"]) == 2
    assert "Invalid --tp" in capsys.readouterr().err
    assert main(["--model", "llama-tiny", "--mesh", "2", "--tp", "0"]) == 2


def test_tp_z3_rows_agree_with_the_table_and_the_predictors_closed_form(capsys):
    """The tester's case: --mesh 3 --tp 2 printed Z3 = 1.1667·P_M against Z2's 0.8333 while
    the table above showed Z3 = Z2 (Z3 keeps the one unit); the TP rows now take the kept
    unit's −(N-1)/N·P_loc^L as verify.traffic.tp.tp_closed_form does."""
    assert main(["--model", "llama-tiny", "--mesh", "3", "--tp", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["reports"][0]
    table = {m["mode"]: m["ded_avg_elems"] for m in rep["modes"]}
    rows = {m["mode"]: m for m in rep["tp"]["modes"]}
    assert table["dmuon-z3"] == pytest.approx(table["dmuon-z2"])
    assert rows["dmuon-z3"]["ded_avg_elems"] == pytest.approx(rows["dmuon-z2"]["ded_avg_elems"])
    assert rows["dmuon-z3"]["ded_avg_elems"] / rep["p_m"] == pytest.approx(5 / 6)
    assert main(["--model", "llama-tiny", "--mesh", "3", "--tp", "2"]) == 0
    assert "P_loc^L" in capsys.readouterr().out


@pytest.mark.parametrize("mesh, t, coalesce", [((1, 3), 2, None), ((1, 4), 2, 0), ((2, 2), 2, 0),
                                                ((2, 2), 2, None), ((2, 2), 3, 0)])
def test_tp_rows_equal_tp_closed_form(mesh, t, coalesce):
    """Every TP row is verify.traffic.tp.tp_closed_form of the same layout at P_M, per block
    (coalesce 0: P_loc^L is the last block's, Z3 > Z2) and coalesced."""
    ml = ModelLayout(build_preset("llama-tiny"), "llama-tiny")
    target = coalesce_target(CostModel()) if coalesce is None else coalesce
    rep = tp_report(ml, mesh, t, coalesce_bytes=target)
    for row in rep["modes"]:
        layout = tp_layout(ml.layout(row["mode"], *mesh, target), t)
        assert row["ded_avg_elems"] == pytest.approx(tp_closed_form(layout).total * rep["p_m"]), row["mode"]
        if row["mode"].endswith("z3"):
            assert 0 < row["p_loc_kept_elems"] <= rep["p_loc"]
            assert (row["p_loc_kept_elems"] < rep["p_loc"]) == (target == 0)
