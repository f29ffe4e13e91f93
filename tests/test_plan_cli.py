"""dmuon-plan (verify.plan_cli): table, JSON, sweep and PNG on a small preset; errors."""

from __future__ import annotations

import json

import pytest

from verify.plan_cli import ModelLayout, main, parse_mesh, report
from verify.workload.presets import build_preset
from verify.traffic.scale import CostModel, step_traffic


def test_parse_mesh():
    assert parse_mesh("64") == (1, 64)
    assert parse_mesh("128x8") == (128, 8)
    assert parse_mesh("2X4") == (2, 4)
    for bad in ("0", "x8", "2x4x2", "-1", "eight"):
        with pytest.raises(ValueError, match="Invalid mesh"):
            parse_mesh(bad)


def test_json_report_matches_the_aggregate(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2x2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rep = doc["reports"][0]
    assert doc["cost_model"]["gpus_per_node"] == 8
    assert rep["mesh"] == [2, 2] and rep["muon_matrices"] == 15
    assert [m["mode"] for m in rep["modes"]] == ["naive-hsdp", "dmuon-hsdp-z2", "dmuon-hsdp-z3"]
    ml = ModelLayout(build_preset("llama-tiny"), "llama-tiny")
    for row in rep["modes"]:
        st = step_traffic(ml.layout(row["mode"], 2, 2))
        assert row["ded_avg_bytes"] == pytest.approx(st.ded_avg_bytes)
        assert row["calls_max"] == st.calls_max
        assert row["closed_form_elems"] == pytest.approx(st.closed_form_elems())
    z2 = rep["modes"][1]
    assert z2["ded_avg_elems"] == pytest.approx(2 * 3 / 4 * rep["p_m"])  # 2(W-1)/W
    assert z2["ns_calls"] == 15 and rep["modes"][0]["ns_calls"] == 15 * 4
    assert rep["ns"]["max_over_mean"] >= 1 and rep["ns"]["idle_owners"] == 0


def test_table_on_a_1d_mesh_lists_every_mode_and_the_defaults(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "4"]) == 0
    out = capsys.readouterr().out
    for mode in ("ddp-muon", "zero1-muon", "naive-fsdp2-z2", "naive-fsdp2-z3", "dmuon-ddp", "dmuon-z2", "dmuon-z3"):
        assert f"| {mode} " in out
    assert "8 GPUs/node" in out and "Z2 and DDP keep a full copy" in out


def test_idle_owners_and_split_estimate_when_W_exceeds_the_matrices():
    ml = ModelLayout(build_preset("llama-tiny"), "llama-tiny")
    rep = report(ml, (1, 64), CostModel())
    assert rep["ns"]["idle_owners"] == 64 - 15
    assert rep["ns"]["split_ns"]["team"] == 4  # 64 // 15
    # (230, 614) matrices: 5 all_reduce latencies cost more than the compute they save
    assert rep["ns"]["split_ns"]["critical_path_s"] > rep["ns"]["critical_path_s"]
    big = report(ModelLayout(build_preset("llama3-8b"), "llama3-8b"), (128, 8), CostModel())
    assert big["ns"]["idle_owners"] == 1024 - 160 and big["ns"]["split_ns"]["team"] == 6
    assert big["ns"]["split_ns"]["critical_path_s"] < big["ns"]["critical_path_s"] / 2


def test_sweep_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("verify.plan_cli.SWEEP_WORLDS", (8, 16))
    png = tmp_path / "sweep.png"
    assert main(["--model", "llama-tiny", "--sweep", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "1x8" in out and "1x16" in out and "2x8" in out and "naive-hsdp" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "nope"], "--mesh"),
        (["--model", "nope", "--mesh", "4"], "Must be a preset"),
        (["--model", "llama-tiny", "--mesh", "4x"], "Invalid mesh"),
        (["--model", "llama-tiny", "--mesh", "4", "--intra-gbps", "0"], "intra_gbps"),
        (["--model", "llama-tiny", "--mesh", "4", "--dtype", "float31"], "float31"),
    ],
)
def test_errors_exit_2_with_a_message(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err
