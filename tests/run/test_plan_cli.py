"""dmuon-plan (verify.plan.cli, verify.plan.args): table, JSON, sweep and PNG on a small preset;
every bad input exits 2 with one line on stderr, odd meshes warn, models with nothing to
dedicate get an empty plan. Fuzzing of the arguments: tests/run/test_fuzz_plan_cli.py."""

from __future__ import annotations

import json
import os

import pytest

from verify.plan.args import LARGE_WORLD_SIZE, MAX_WORLD_SIZE, mesh_warnings
from verify.plan.cli import UNITS, ModelLayout, main, parse_mesh, report
from verify.workload.presets import build_preset
from verify.traffic.scale import CostModel, step_traffic


def test_parse_mesh():
    assert parse_mesh("64") == (1, 64)
    assert parse_mesh("128x8") == (128, 8)
    assert parse_mesh("2X4") == (2, 4)
    assert parse_mesh(f"{MAX_WORLD_SIZE // 8}x8") == (MAX_WORLD_SIZE // 8, 8)
    for bad in ("0", "x8", "2x4x2", "-1", "eight", "4x", "²", "1_000", "+4", "4.0", "",
                f"{MAX_WORLD_SIZE + 1}", "2x" + "9" * 30):
        with pytest.raises(ValueError, match="Invalid mesh"):
            parse_mesh(bad)


def test_json_report_matches_the_aggregate(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2x2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rep = doc["reports"][0]
    assert doc["cost_model"]["gpus_per_node"] == 8
    assert rep["mesh"] == {"replicate": 2, "shard": 2} and rep["muon_matrices"] == 15
    assert [m["mode"] for m in rep["modes"]] == ["naive-hsdp", "dmuon-hsdp-z2", "dmuon-hsdp-z3"]
    ml = ModelLayout(build_preset("llama-tiny"), "llama-tiny")
    for row in rep["modes"]:
        st = step_traffic(ml.layout(row["mode"], 2, 2, row["coalesce_bytes"] or 0))
        per_block = step_traffic(ml.layout(row["mode"], 2, 2))
        assert row["ded_avg_bytes"] == pytest.approx(st.ded_avg_bytes)
        # coalescing moves the same elements, but for the unit Z3 keeps from forward into
        # backward (the last, larger when coalesced), not re-broadcast: (N-1)/N·P_M^L at N = 2
        kept_more = st.p_m_kept - per_block.p_m_kept
        assert kept_more >= 0 and (kept_more > 0) == (row["mode"] == "dmuon-hsdp-z3")
        assert per_block.ded_avg_elems - st.ded_avg_elems == pytest.approx(0.5 * kept_more)
        assert row["calls_max"] == st.calls_max and row["calls_max_per_block"] == per_block.calls_max
        if row["mode"].startswith("dmuon"):  # llama-tiny's blocks are far below 3.6 MB
            assert row["coalesce_bytes"] == 3_600_000 and row["calls_max"] < row["calls_max_per_block"]
        assert row["closed_form_elems"] == pytest.approx(st.closed_form_elems())
    z2 = rep["modes"][1]
    assert z2["ded_avg_elems"] == pytest.approx(2 * 3 / 4 * rep["p_m"])  # 2(W-1)/W
    assert z2["ns_calls"] == 15 and rep["modes"][0]["ns_calls"] == 15 * 4
    assert rep["ns"]["max_over_mean"] >= 1 and rep["ns"]["idle_owners"] == 0


def _keys(obj) -> set[str]:
    """Every key of a JSON document, recursively."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


def _unit_of(key: str) -> str | None:
    if key in UNITS:
        return UNITS[key]
    return next((u for pattern, u in UNITS.items()
                 if pattern.startswith("*") and key.endswith(pattern[1:])), None)


@pytest.mark.parametrize("dtype, size", [("bf16", 2), ("float32", 4), ("fp64", 8)])
def test_json_is_self_describing(capsys, dtype, size):
    assert main(["--model", "llama-tiny", "--mesh", "4", "--json", "--dtype", dtype]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc)[:2] == ["schema_version", "model"] and doc["schema_version"] == 2
    canonical = {"bf16": "bfloat16", "float32": "float32", "fp64": "float64"}[dtype]
    assert doc["dtype"] == canonical and doc["element_bytes"] == size
    assert list(doc["param_dtypes"]) == [canonical] and doc["warnings"] == []
    rep = doc["reports"][0]
    assert rep["mesh"] == {"replicate": 1, "shard": 4} and rep["world_size"] == 4
    z2 = next(m for m in rep["modes"] if m["mode"] == "dmuon-z2")
    assert z2["ded_avg_bytes"] == pytest.approx(z2["ded_avg_elems"] * size, rel=1e-3)
    # every figure's unit is in the header (by key or suffix); names and texts need none
    unitless = {"schema_version", "model", "dtype", "units", "warnings", "cost_model", "reports",
                "modes", "mode", "closed_form", "ns", "largest_matrix", "name", "split_ns"}
    unitless |= set(doc["param_dtypes"])  # dtype names: the unit is param_dtypes'
    assert sorted(k for k in _keys(doc) - unitless if _unit_of(k) is None) == []


def test_dtype_model_reports_the_models_dtype(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "2", "--json", "--dtype", "model"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dtype"] == "float32" and doc["element_bytes"] == 4


def test_table_on_a_1d_mesh_lists_every_mode_and_the_defaults(capsys):
    assert main(["--model", "llama-tiny", "--mesh", "4"]) == 0
    captured = capsys.readouterr()
    for mode in ("ddp-muon", "zero1-muon", "naive-fsdp2-z2", "naive-fsdp2-z3", "dmuon-ddp", "dmuon-z2", "dmuon-z3"):
        assert f"| {mode} " in captured.out
    assert "8 GPUs/node" in captured.out and "Z2 and DDP keep a full copy" in captured.out
    assert "docs/spec.md §2" in captured.out and "SPEC" not in captured.out
    assert captured.err == ""  # an aligned mesh: no warning


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
    monkeypatch.setattr("verify.plan.cli.SWEEP_WORLDS", (8, 16))
    png = tmp_path / "sweep.data"  # any name: always a PNG
    assert main(["--model", "llama-tiny", "--sweep", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "1x8" in out and "1x16" in out and "2x8" in out and "naive-hsdp" in out
    assert "1x32" not in out  # the patched sweep, not the default one
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bad(argv, capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("dmuon-plan: ") and "Traceback" not in err, err
    return err


MODEL = ["--model", "llama-tiny"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "nope"], ["--mesh"]),
        (["--model", "nope", "--mesh", "4"], ["Must be a preset"]),
        ([*MODEL, "--mesh", "4x"], ["Invalid mesh"]),
        ([*MODEL, "--mesh", "0"], ["Invalid mesh", "positive integers"]),
        ([*MODEL, "--mesh", "2x4x2"], ["Invalid mesh"]),
        ([*MODEL, "--mesh", "100000000x100000000"], ["Must be at most 1,048,576"]),
        ([*MODEL, "--mesh", "4", "--sweep"], ["not allowed with argument --mesh"]),
        ([*MODEL, "--mesh", "4", "--intra-gbps", "0"], ["--intra-gbps", "> 0"]),
        ([*MODEL, "--mesh", "4", "--tflops", "nan"], ["--tflops", "finite"]),
        ([*MODEL, "--mesh", "4", "--inter-alpha-us", "-1"], ["--inter-alpha-us", ">= 0"]),
        ([*MODEL, "--mesh", "4", "--gpus-per-node", "0"], ["--gpus-per-node"]),
        ([*MODEL, "--mesh", "4", "--dtype", "float31"], ["float31", "bfloat16, float16, float32"]),
        ([*MODEL, "--mesh", "4", "--dtype", "int3"], ["'int3'", "model, bfloat16"]),
        ([*MODEL, "--mesh", "4", "--bogus"], ["unrecognized arguments: --bogus"]),
        ([], ["--model"]),
        (["--model", "tests.plan_factories:raises", "--mesh", "4"],
         ["tests.plan_factories:raises", "RuntimeError: no weights on this machine"]),
        (["--model", "tests.plan_factories:not_a_module", "--mesh", "4"], ["not an nn.Module"]),
        (["--model", "tests.plan_factories:complex_linear", "--mesh", "4", "--dtype", "model"],
         ["complex64"]),
        (["--model", "tests.no_such_module:f", "--mesh", "4"], ["no_such_module"]),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, words, capsys):
    err = _bad(argv, capsys)
    for w in words:
        assert w in err, err


def test_unwritable_png_names_the_path_and_the_os_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("verify.plan.cli.SWEEP_WORLDS", (8,))
    missing = tmp_path / "no" / "such" / "dir" / "w.png"
    err = _bad([*MODEL, "--sweep", "--png", str(missing)], capsys)
    assert str(missing) in err and "No such file or directory" in err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        err = _bad([*MODEL, "--mesh", "8", "--png", str(locked / "w.png")], capsys)
        assert "Permission denied" in err
    err = _bad([*MODEL, "--mesh", "8", "--png", str(tmp_path)], capsys)  # a directory
    assert str(tmp_path) in err


@pytest.mark.parametrize("factory", ["relu"])
def test_nothing_to_dedicate_is_an_empty_plan(factory, capsys):
    spec = f"tests.plan_factories:{factory}"
    assert main(["--model", spec, "--mesh", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "nothing to dedicate" in out and spec in out
    assert main(["--model", spec, "--mesh", "2x4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (rep,) = doc["reports"]
    assert rep["modes"] == [] and rep["ns"] is None and rep["p_m"] == 0
    assert rep["muon_matrices"] == 0 and "nothing to dedicate" in rep["note"]


@pytest.mark.parametrize("factory, matrices, params", [("conv_only", 2, 2), ("experts_3d", 4, 1)])
def test_conv_and_expert_stack_models_are_planned(factory, matrices, params, capsys):
    """Convs (one flattened matrix) and 3-D expert stacks (E matrices) are Muon targets by
    default (docs/selection.md), so these models get a plan, not "nothing to dedicate"."""
    assert main(["--model", f"tests.plan_factories:{factory}", "--mesh", "2", "--json"]) == 0
    (rep,) = json.loads(capsys.readouterr().out)["reports"]
    assert rep["muon_matrices"] == matrices and rep["muon_params"] == params and rep["modes"]


def test_nothing_to_dedicate_sweep_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("verify.plan.cli.SWEEP_WORLDS", (8, 16))
    png = tmp_path / "w.png"
    assert main(["--model", "tests.plan_factories:relu", "--sweep", "--png", str(png)]) == 0
    assert "nothing to dedicate" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mesh, warned", [
    ("1", ["W = 1 has no collectives"]),
    ("3x5", ["shard size 5 is neither a divisor nor a multiple of 8", "straddle nodes"]),
    ("12", ["last node is partly used"]),
    ("4x1", ["shard size 1"]),
    (f"{LARGE_WORLD_SIZE // 8 * 2}x8", ["one flat network tier"]),
])
def test_odd_meshes_warn_and_still_plan(mesh, warned, capsys):
    assert main([*MODEL, "--mesh", mesh, "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == len(json.loads(captured.out)["warnings"]) >= 1
    assert all(line.startswith("dmuon-plan: warning: ") for line in lines)
    for w in warned:
        assert w in captured.err


def test_aligned_meshes_do_not_warn():
    for mesh in ((1, 2), (1, 8), (1, 64), (16, 8), (2, 4), (4, 16), (1, LARGE_WORLD_SIZE)):
        assert mesh_warnings(mesh, 8) == [], mesh
    assert mesh_warnings((3, 6), 6) == [] and mesh_warnings((1, 12), 6) == []


def test_help_exits_0_and_documents_exit_codes_and_bounds(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and "1,048,576" in out and "docs/spec.md §2" in out
    assert "docs/traffic-model.md" in out  # never cut at its hyphen
    assert "bf16" in out and "--dtype" in out


def test_warnings_count_the_tp_ranks(capsys):
    """--mesh 1 --tp 2 warned 'W = 1 has no collectives; every traffic … figure is 0' above a
    TP section with W = 2 and 0.5·P_M of traffic: the warnings take W = R·N·T."""
    assert mesh_warnings((1, 1), 8, {"tp": 2}) == []
    assert mesh_warnings((1, 1), 8) != []
    assert main([*MODEL, "--mesh", "1", "--tp", "2"]) == 0
    captured = capsys.readouterr()
    assert "W = 1" not in captured.err and "W = 2" in captured.out
    (big,) = mesh_warnings((1, LARGE_WORLD_SIZE), 8, {"tp": 2})
    assert "--tp 2" in big and f"W = {2 * LARGE_WORLD_SIZE:,}" in big


def test_tp_world_above_the_bound_exits_2(capsys):
    """--tp multiplies W: R·N·T above MAX_WORLD_SIZE is refused as one line (a per-rank list
    of W entries would otherwise be built)."""
    assert main([*MODEL, "--mesh", "1024", "--tp", "1025"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Invalid --tp 1025 on mesh 1x1024" in err[0] and f"{MAX_WORLD_SIZE:,}" in err[0]


def test_a_factory_in_the_current_directory_resolves_from_a_console_script(tmp_path, monkeypatch):
    """``dmuon-plan`` (a console script) has no current directory on ``sys.path`` as ``python -m``
    has: ``--model mymodels:build`` from the directory holding mymodels.py used to say
    "No module named 'mymodels'"."""
    import sys

    import torch

    from verify.workload.presets import resolve_model

    (tmp_path / "mymodels_cwd.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(4, 4)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert isinstance(resolve_model("mymodels_cwd:build")(), torch.nn.Linear)
