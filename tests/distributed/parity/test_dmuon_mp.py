"""Mixed precision under DMuon: dedicate_params(..., mp_policy=
MixedPrecisionPolicy(...)) as fully_shard takes it. Owners keep fp32 masters and momentum,
forward computes in bf16, broadcasts send bf16 and reduces run in reduce_dtype; the traffic
equals the prediction and the dedicated bytes of forward and backward halve."""

import pytest
import torch

from tests.distributed.runtime import runtime_tasks as T
from tests.distributed.phase_d import traffic_tasks
from tracer.events import DTYPE_BYTES
from verify.compare import compare_run

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120


def test_mp_masters_fp32_compute_bf16_and_z2_equals_z3(pool4):
    runs = {m: pool4.run_with_timeout(TIMEOUT_S, T.train_mp, m) for m in ("z2", "z3", "hsdp-z3", "ddp")}
    for mode, results in runs.items():
        for r in results:
            assert r["registered"] == ["torch.float32"], mode  # the master / registered params
            assert r["momentum"] in ([], ["torch.float32"]), mode
            # a dedicated module hands its output back in its input's dtype: fp32 under DDP
            out_dtype = "torch.float32" if mode == "ddp" else "torch.bfloat16"
            assert {o for _, o in r["seen"]} == {out_dtype}, (mode, r["seen"])
            assert r["losses"][-1] < r["losses"][0], mode
    merged = {m: {n: t for r in rs for n, t in r["params"].items()} for m, rs in runs.items()}
    assert all(torch.equal(merged["z2"][n], merged["z3"][n]) for n in merged["z2"])
    assert all(t.dtype == torch.float32 for t in merged["z3"].values())


@pytest.mark.parametrize("mode, out_dtype", [("root", "torch.bfloat16"), ("replicate", "torch.float32")])
def test_one_policy_with_output_dtype_serves_fully_shard_and_dmuon(pool4, mode, out_dtype):
    """The policy fully_shard takes, output_dtype=float32 included, given to both calls (a
    break-it trial: with a root-only FSDP2 unit DMuon cast each dedicated Linear's output to
    fp32 and the next bf16 LayerNorm raised "mixed dtype"); and rest="replicate" with or
    without output_dtype: the dedicated outputs come back in the rest's fp32."""
    for output_dtype in (torch.float32, None):
        for r in pool4.run_with_timeout(TIMEOUT_S, T.train_mp, mode, output_dtype=output_dtype):
            assert {o for _, o in r["seen"]} == {out_dtype}, (mode, output_dtype, r["seen"])
            assert r["losses"][-1] < r["losses"][0], (mode, r["losses"])


def _dedicated_bytes(events, phases=("forward", "backward")) -> int:
    """Input bytes of DMuon's calls in ``phases`` (every rank, all measured steps): the calls
    of its buckets, whose module is a block (FSDP2's calls for the rest carry none), whatever
    op carries them (broadcast / gather, or an aligned group's all_gather / all_to_all)."""
    dedicated = [ev for ev in events if ev.phase in phases and (ev.module or "").startswith("blocks")]
    assert dedicated, "no DMuon call measured"
    return sum((ev.count if ev.in_elems is None else ev.in_elems) * DTYPE_BYTES[ev.dtype]
               for ev in dedicated)


@pytest.mark.parametrize(("mode", "hierarchy"), [
    # every DMuon phase: forward, re-broadcast, both reduces, replicate
    ("dmuon-hsdp-z3", "hierarchical"),
    pytest.param("dmuon-hsdp-z3", "auto", marks=pytest.mark.slow),  # flat: the 1-D path over W
    pytest.param("dmuon-z3", "auto", marks=pytest.mark.slow),
    pytest.param("dmuon-ddp", "auto", marks=pytest.mark.slow),
])
def test_mp_traffic_equals_prediction_and_dedicated_bytes_halve(pool4, mode, hierarchy):
    measured = {}
    for mp in (None, "bf16"):
        results = pool4.run_with_timeout(TIMEOUT_S, traffic_tasks.measure_mode, mode, mixed_precision=mp,
                                         hierarchy=hierarchy)
        events = [ev for r in results for ev in r["events"]]
        run = compare_run(results[0]["layout"], events, steps=2, ns_calls=sum(r["ns_calls"] for r in results))
        assert run["missing"] == [] and run["unexpected"] == [], (mp, run["missing"][:3], run["unexpected"][:3])
        assert run["pass"], mp
        measured[mp] = _dedicated_bytes(events)
    assert measured["bf16"] * 2 == measured[None]
