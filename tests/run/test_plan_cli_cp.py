"""dmuon-plan --cp C [--tp T] (verify/plan/cp.py): cp declared a shard dim, DMuon's dedicated
figures are those of the mesh R x N·C (N_eff = N·C, docs/traffic-model.md, "Context
parallelism"), not of R x N (the control: they differ); the K/V exchange 6(C-1)·L·a; the 4-D
layout's text; bad input exits 2."""

from __future__ import annotations

import json

import pytest

from verify.plan.cli import UNITS, main
from verify.workload.presets import build_preset


def _report(capsys, *args) -> dict:
    assert main(["--model", "llama-tiny", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["reports"][0]


def _rows(rep: dict) -> dict:
    return {r["mode"]: r["ded_avg_elems"] for r in rep["modes"]}


@pytest.mark.parametrize("mesh, c", [("4", 2), ("2x2", 4)])
def test_dedicated_figures_are_the_mesh_at_n_eff(capsys, mesh, c):
    rep = _report(capsys, "--mesh", mesh, "--cp", str(c))
    r, n = (1, int(mesh)) if "x" not in mesh else map(int, mesh.split("x"))
    flat = _report(capsys, "--mesh", f"{r}x{n * c}" if r > 1 else str(n * c))
    assert _rows(rep) == _rows(flat)  # DMuon's traffic at N_eff = N·C
    assert rep["cp"]["n_eff"] == n * c and rep["cp"]["world_size"] == r * n * c
    if r == 1:
        ne, p_m = n * c, rep["p_m"]
        assert _rows(rep)["dmuon-z2"] == pytest.approx(2 * (ne - 1) / ne * p_m)
    # the control: the mesh without cp (N, not N·C) prices other figures
    without = _report(capsys, "--mesh", mesh)
    assert all(_rows(without)[m] < v for m, v in _rows(rep).items() if m.startswith("dmuon"))


def test_kv_exchange_and_units(capsys):
    rep = _report(capsys, "--mesh", "2x2", "--cp", "2", "--tp", "2", "--cp-tokens", "1024")
    cfg = build_preset("llama-tiny").config
    width = cfg.n_kv_heads * cfg.resolved_head_dim
    cp = rep["cp"]
    assert (cp["kv_width"], cp["layers"], cp["tp"]) == (width, cfg.n_layers, 2)
    assert cp["kv_elems"] == pytest.approx(6 * (2 - 1) * cfg.n_layers * 1024 * width / 2)
    assert cp["kv_bytes"] == pytest.approx(cp["kv_elems"] * 2)  # bfloat16
    assert rep["tp"]  # the TP section runs on (R, N·C)
    suffix = [u[1:] for u in UNITS if u.startswith("*")]
    assert sorted(k for k in cp if k not in UNITS and not any(k.endswith(s) for s in suffix)) == []


def test_four_d_layout_text(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2x2", "--cp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh 2x4 (W = 8)" in out and "tensor parallel: mesh 2x4x2" in out
    assert "N_eff = N·C = 4 ranks" in out and "W = R·N·C·T = 16" in out
    assert "K/V exchange (attention's, not DMuon's)" in out


@pytest.mark.parametrize("args", [["--sweep", "--cp", "2"], ["--mesh", "2", "--cp", "2", "--ep", "2"],
                                  ["--mesh", "2", "--cp", "2", "--pp", "2"], ["--mesh", "2", "--cp", "0"],
                                  ["--mesh", "1024x1024", "--cp", "2"]])
def test_bad_cp_input_exits_2(capsys, args):
    assert main(["--model", "llama-tiny", *args]) == 2
    err = capsys.readouterr().err
    assert "dmuon-plan:" in err and len(err.strip().splitlines()) == 1
