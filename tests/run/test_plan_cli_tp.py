"""dmuon-plan --tp T (verify/plan/tp.py): the TP terms of docs/traffic-model.md, "Tensor
parallelism", and the NS balance of the plan over W = R·N·T ranks."""

from __future__ import annotations

import json

import pytest

from verify.plan.cli import main
from verify.plan.tp import tp_report, tp_sharded
from verify.workload.presets import build_preset
from verify.plan.cli import ModelLayout


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
    assert rows["dmuon-z3"]["ded_avg_elems"] == pytest.approx(3 * (n - 1) / n * tp["p_m"] / t + 2 * gather)
    assert rows["dmuon-z2"]["ns_calls"] == 15  # once per matrix across the whole mesh
    assert tp["ns_idle_ranks"] == 0


def test_tp_text_and_replicated_matrices(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2x2", "--tp", "3"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: mesh 2x2x3" in out and "dmuon-hsdp-z3" in out
    ml = ModelLayout(build_preset("llama-tiny"), "llama-tiny")
    rep = tp_report(ml.muon_specs, (2, 2), 3)
    rep_specs = [sp for sp in ml.muon_specs if tp_sharded(sp, 3) is None]
    assert rep["p_rep"] == sum(sp.numel for sp in rep_specs)
    # a replicated matrix is orthogonalized in each of the T columns
    assert rep["modes"][0]["ns_calls"] == rep["tp_matrices"] + 3 * len(rep_specs)


def test_tp_with_sweep_exits_2(capsys):
    assert main(["--model", "llama-tiny", "--sweep", "--tp", "2"]) == 2
    assert "Invalid --tp" in capsys.readouterr().err
    assert main(["--model", "llama-tiny", "--mesh", "2", "--tp", "0"]) == 2
