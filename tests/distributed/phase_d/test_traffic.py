"""Measured collectives (interposer) equal the predicted list exactly, in every mode.

Each run trains TinyGPT for 2 warm-up + 2 measured steps on 4 (or 2) gloo ranks; the test
asserts the per-rank, per-phase multiset of (op, group, count, dtype, root) and the
W-averaged Muon-param traffic against the closed forms of docs/spec.md §2, and that
torch.profiler's record of the same steps matches the interposer one to one (a third source).
"""

import json
import math

import pytest

from tests.distributed.phase_d import traffic_tasks
from tracer.crosscheck import crosscheck
from tracer.profiler import profiler_source_events
from verify.compare import compare_run
from verify.traffic.formulas import MODES

pytestmark = pytest.mark.distributed

#: docs/spec.md §2 at N=4 (1-D) and N=2, R=2 (HSDP 2x2), as multiples of P_M. DMuon's Z3 forms
#: lose (N-1)/N·P_M^L in backward, the unit kept from forward into backward (the last one,
#: docs/protocol.md step 2); coalesce="auto" on gloo makes TinyGPT's 8 fp32 matrices
#: (393,216 bytes, under the 2 MB target) one unit, so P_M^L = P_M: dmuon-z3 3(N-1)/N - (N-1)/N
#: = 2(N-1)/N = 1.5 and dmuon-hsdp-z3 2(W-1)/W + (N-1)/N - (N-1)/N = 1.5, Z2's traffic.
Z3_KEPT_SHARE = 1.0
EXPECTED_RATIO_W4 = {
    "ddp-muon": 1.5, "dmuon-ddp": 1.5,
    # ZeRO-1-style: 2(N-1)/N at P_M^pad = W·C; TinyGPT's NS-balanced plan gives C = 28,672
    # (7/6 of P_M/W), so 1.5 · 7/6 = 1.75 of P_M
    "zero1-muon": 1.75, "naive-fsdp2-z2": 2.25, "naive-fsdp2-z3": 3.0,
    "dmuon-z2": 1.5, "dmuon-z3": 2.25 - 0.75 * Z3_KEPT_SHARE,
    "naive-hsdp": 2.5, "dmuon-hsdp-z2": 1.5, "dmuon-hsdp-z3": 2.0 - 0.5 * Z3_KEPT_SHARE,
}


def _compare(pool, mode, **config):
    results = pool.run(traffic_tasks.measure_mode, mode, **config)
    events = [ev for r in results for ev in r["events"]]
    run = compare_run(results[0]["layout"], events, steps=2, ns_calls=sum(r["ns_calls"] for r in results))
    return run, results


def _assert_profiler_matches(results):
    ref = [ev for r in results for ev in r["events"]]
    prof = [ev for r in results for ev in r["profiler_events"]]
    assert len(prof) == len(ref) > 0
    check = crosscheck(*profiler_source_events(ref, prof)[:2], source="profiler", backend="gloo")
    assert check.passed and check.matched == len(ref), check.lines()[:10]
    # gloo's own annotations gave every sized call its dtype: dtypes were compared too
    assert all(e.dtype is not None for e in prof if e.op != "barrier")


# In the slow set, each a variant whose path a default case covers: naive-fsdp2-z2 and -z3
# (FSDP2's own traffic: naive-hsdp runs FSDP2 with the reshard, and the uneven-shape case
# below runs dmuon-z3 and dmuon-hsdp-z3 beside it), ddp-muon (DDP's all_reduce of every
# param: dmuon-ddp's rest), dmuon-z2 (Z3 runs its forward broadcasts and reduces;
# test_w2_exact and the gate tests run Z2 whole), and flat dmuon-hsdp-z3 (flat HSDP is the 1-D protocol over W
# ranks: dmuon-z3 and flat dmuon-hsdp-z2), naive-hsdp (FSDP2's HSDP: test_w2_exact runs FSDP2's
# predictor), and hierarchical dmuon-hsdp-z2 (hierarchical Z3 runs its replicate channel and
# more). HSDP runs "auto" (flat on gloo: TinyGPT is one unit) and the hierarchical protocol NCCL
# jobs use (docs/traffic-model.md, "HSDP: flat or hierarchical").
SLOW_W4 = {"naive-fsdp2-z2", "naive-fsdp2-z3", "naive-hsdp", "ddp-muon", "dmuon-z2", "dmuon-hsdp-z3"}
W4_CASES = [pytest.param(m, "auto", marks=pytest.mark.slow) if m in SLOW_W4 else (m, "auto")
            for m in MODES] + [pytest.param("dmuon-hsdp-z2", "hierarchical", marks=pytest.mark.slow),
                               ("dmuon-hsdp-z3", "hierarchical")]


@pytest.mark.parametrize(("mode", "hierarchy"), W4_CASES)
def test_w4_exact_collectives_and_closed_form(pool4, mode, hierarchy):
    # torch.profiler's source checked on the two modes that run every DMuon phase
    profiled = mode == "dmuon-z3" or (mode, hierarchy) == ("dmuon-hsdp-z3", "hierarchical")
    run, results = _compare(pool4, mode, hierarchy=hierarchy, profiler=profiled)
    assert run["missing"] == [] and run["unexpected"] == [], (run["missing"][:5], run["unexpected"][:5])
    assert run["ratio_to_p_m"] == pytest.approx(EXPECTED_RATIO_W4[mode], rel=1e-12)
    assert run["ns_calls_per_step"] == run["ns_calls_expected"]
    assert run["closed_form_matches"] and run["pass"]
    if profiled:
        _assert_profiler_matches(results)
    flat = mode.startswith("dmuon-hsdp") and hierarchy == "auto"
    if mode.startswith("dmuon-hsdp"):
        assert run["hierarchy"] == ("flat" if flat else "hierarchical")
        assert ("replicate" in run["phases"]) is not flat  # flat: no replicate-axis call
    if mode in ("dmuon-z3", "dmuon-hsdp-z3"):  # one unit, kept: the P_M^L term is all of P_M
        assert run["p_m_kept"] == Z3_KEPT_SHARE * run["p_m"]
        assert run["closed_form"].endswith(" − (W-1)/W·P_M^L" if flat else " − (N-1)/N·P_M^L")
    if mode == "dmuon-hsdp-z2" and not flat:  # the HSDP replicate term follows the W-average, not the seed
        rep, p_m = run["phases"]["replicate"], run["p_m"]
        # (R-1)/(N·R)·P_M with N = R = 2: P_M/4, not the seed's (R-1)/R·P_M = P_M/2.
        assert rep["measured_avg_elems"] == pytest.approx(p_m / 4)
        assert rep["seed_avg_elems"] == pytest.approx(p_m / 2)


@pytest.mark.parametrize("mode", ["dmuon-z3", pytest.param("naive-fsdp2-z3", marks=pytest.mark.slow),
                                  "dmuon-hsdp-z3"])
def test_uneven_shapes_padding_predicted_exactly(pool4, mode):
    # d_model=30: qkv (90, 30) and fc2 (30, 120) have dim 0 not divisible by 4 (or 2).
    run, _ = _compare(pool4, mode, d_model=30, n_heads=3, n_layers=1)
    assert run["missing"] == [] and run["unexpected"] == []
    assert run["pass"]


@pytest.mark.slow  # W=4, W=3 (slow) and the uneven-shape runs cover the same paths in make test
@pytest.mark.parametrize("mode", ["dmuon-ddp", "dmuon-z2", "dmuon-z3", "naive-fsdp2-z2"])
def test_w2_exact(pool2, mode):
    run, _ = _compare(pool2, mode)
    assert run["pass"], (run["missing"][:5], run["unexpected"][:5])
    # dmuon-z3: 3(N-1)/N - (N-1)/N·P_M^L with P_M^L = P_M (one unit, EXPECTED_RATIO_W4) at N=2
    expected = {"dmuon-ddp": 1.0, "dmuon-z2": 1.0, "dmuon-z3": 1.5 - 0.5 * Z3_KEPT_SHARE, "naive-fsdp2-z2": 1.5}[mode]
    assert run["ratio_to_p_m"] == pytest.approx(expected)


def test_dmuon_verify_check_passes_on_a_run_and_names_a_dropped_call(pool2, tmp_path, capsys):
    from verify.cli import main as dmuon_verify
    from tracer.events import read_parquet, write_parquet

    results = pool2.run(traffic_tasks.measure_mode, "dmuon-z3")
    run_dir = f"{results[0]['out_dir']}/dmuon-z3"
    files = [f"{r['out_dir']}/dmuon-z3/events_rank{rank}.parquet" for rank, r in enumerate(results)]
    assert dmuon_verify(["check", *files, "--against", run_dir, "--steps", "2"]) == 0
    assert "PASS" in capsys.readouterr().out

    events = read_parquet(files[1])
    dropped = next(ev for ev in events if ev.op in ("reduce", "reduce_scatter"))
    write_parquet([ev for ev in events if ev is not dropped], tmp_path / "rank1.parquet")
    assert dmuon_verify(["check", files[0], str(tmp_path / "rank1.parquet"), "--against", run_dir]) == 1
    out = capsys.readouterr().out
    assert "missing (1)" in out and "rank 1: 1 x reduce" in out and "FAIL" in out


@pytest.mark.slow  # ~8 s; rest="replicate" through the whole gate runs in make test in every EP mode
def test_w4_replicated_rest_verdict_passes(pool4, tmp_path):
    """verify-traffic --rest replicate: DMuon all-reduces the rest itself and nothing wraps the
    model; measured = predicted = closed form (unchanged: it concerns P_M only), three sources."""
    report = pool4.run(traffic_tasks.verdict, str(tmp_path), ("dmuon-z2", "dmuon-hsdp-z3"),
                       rest="replicate")[0]
    assert report["pass"], report["failures"]
    assert report["config"]["rest"] == "replicate"
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"dmuon-z2", "dmuon-hsdp-z3"}
    for mode, run in runs.items():
        assert run["ratio_to_p_m"] == pytest.approx(EXPECTED_RATIO_W4[mode], rel=1e-12)
        assert all(run["sources"][s]["pass"] for s in ("interposer", "flight_recorder", "profiler"))
        layout = json.loads((tmp_path / mode / "layout.json").read_text())
        assert layout["dmuon_rest"] == "replicate" and layout["fsdp_modules"] == []
        # the rest's all_reduce is the only traffic outside P_M: W-average 2(W-1)/W of
        # (rest elements + one usage element per rest param), plus the dedicated reduces' usage
        rest = [p for p in layout["params"] if p["name"] not in layout["muon_names"]]
        elems = sum(math.prod(p["shape"]) for p in rest) + len(rest)
        extra = run["total_measured_avg_elems"] - run["measured_avg_elems"]
        assert extra == pytest.approx(1.5 * elems, abs=64)  # + the dedicated reduces' usage
