"""dmuon-plan --pp S --microbatches M (verify/plan/pp.py): each stage planned on its own slice,
its dedicated elements per rank and step Z2 = Z3 = 2(N-1)/N·P_s whatever M (docs/traffic-model.md,
"Pipeline parallelism"), the stages' P_s summing to P_M, the P2P 2M·A·(S-1)/S; a 4-D layout
with --tp; bad input exits 2."""

from __future__ import annotations

import json

import pytest

from verify.plan.cli import UNITS, ModelLayout, main
from verify.plan.pp import stage_names
from verify.workload.presets import build_preset


def _pp(capsys, *args) -> dict:
    assert main(["--model", "llama-tiny", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["reports"][0]


@pytest.mark.parametrize("m", [1, 8])
def test_stage_figures_follow_the_closed_form_whatever_m(capsys, m):
    rep = _pp(capsys, "--mesh", "4", "--pp", "2", "--microbatches", str(m))
    pp, n = rep["pp"], 4
    assert pp["world_size"] == 8 and pp["mesh"] == {"pp": 2, "replicate": 1, "shard": 4, "tp": 1}
    assert sum(st["p_s"] for st in pp["stages"]) == rep["p_m"]
    for st in pp["stages"]:
        rows = {r["mode"]: r for r in st["modes"]}
        assert rows.keys() == {"dmuon-z2", "dmuon-z3"}
        for r in rows.values():  # Z3 keeps its copies for the step: Z2's figure
            assert r["ded_avg_elems"] == pytest.approx(2 * (n - 1) / n * st["p_s"])
            assert r["memory_busiest_bytes"] > 0
        assert st["z3_per_microbatch_elems"] == pytest.approx((2 * m + 1) * (n - 1) / n * st["p_s"])
        assert st["ns"]["max_over_mean"] >= 1
    p2p = pp["p2p"]
    d = build_preset("llama-tiny").config.d_model
    assert p2p["activation_elems"] == 4096 * d
    assert p2p["avg_recv_elems"] == pytest.approx(2 * m * 4096 * d / 2)
    # every key of the section has its unit in the JSON's header (by key or suffix)
    keys, todo = set(), [pp]
    while todo:
        obj = todo.pop()
        if isinstance(obj, dict):
            keys |= set(obj)
            todo += list(obj.values())
        elif isinstance(obj, list):
            todo += obj
    suffix = [u for u in UNITS if u.startswith("*")]
    assert sorted(k for k in keys - {"mode", "modes", "ns"}
                  if k not in UNITS and not any(k.endswith(u[1:]) for u in suffix)) == []


def test_four_d_layout_text(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2x2", "--tp", "2", "--pp", "2",
                 "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline parallel: mesh 2x2x2x2 (pp x dp_replicate x dp_shard x tp, W = 16), M = 4" in out
    assert "stage 0:" in out and "stage 1:" in out and "dmuon-hsdp-z3" in out
    assert "stage-to-stage send/recv" in out


def test_stages_split_blocks_contiguously():
    ml = ModelLayout(build_preset("llama-tiny"), "llama-tiny")
    names = stage_names(ml, 3)
    assert sorted(n for s in names for n in s) == sorted(p.name for p in ml.params)
    assert all(names)
    with pytest.raises(ValueError, match="Invalid --pp 99"):
        stage_names(ml, 99)


@pytest.mark.parametrize("args", [["--sweep", "--pp", "2"], ["--mesh", "2", "--pp", "2", "--ep", "2"],
                                  ["--mesh", "2", "--pp", "99"], ["--mesh", "2", "--pp", "0"]])
def test_bad_pp_input_exits_2(capsys, args):
    assert main(["--model", "llama-tiny", *args]) == 2
    assert "dmuon-plan:" in capsys.readouterr().err
