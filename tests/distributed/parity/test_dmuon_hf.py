"""DMuon on Hugging Face models (transformers 5, tiny configs, no download) against a
single-process oracle (``hf_tasks``): Qwen3-MoE's 3-D expert stacks and routers are dedicated
by default, and after 3 steps every Muon param of every mode sits within 1% of the oracle's
displacement.

Tolerance: the ranks sum the same fp32 gradients in another order than one process does, and
DMuon orthogonalizes an expert stack's slices in one bf16 ``bmm`` chain where the oracle runs
one ``mm`` chain per slice (one bf16 ulp apart at most, ``muon_math``); top-2 routing can
turn such a difference into a visible one. Measured max |p - oracle| / max |oracle - init|
per Muon param over 3 steps on this CPU build: 0 (bit-identical) in DDP, Z2, Z3, HSDP-Z2 and
HSDP-Z3 on both models (the oracle accumulates W micro-batches, the ranks' summation order).
DIST_TOL is 1%: room for one bf16 ulp (2**-8 relative) in one step's update of a few
elements, well below where the trajectories part (1.3-3.8% for the dense matrices with the
experts on AdamW). With the Linear-only selection of
before, the expert stacks and routers sat 60-86% of the displacement away.
"""

import pytest

pytest.importorskip("transformers")  # the test extra; imported here so the pools inherit it

from tests.distributed.parity import hf_tasks as H  # noqa: E402

pytestmark = pytest.mark.distributed

DIST_TOL = 0.01
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def oracles():
    return {(kind, w): H.oracle(kind, w) for kind in ("qwen3-moe", "llama") for w in (2, 4)}


def _distances(ref: dict, results: list[dict]) -> dict[str, float]:
    owned = {}
    for r in results:
        owned.update(r["owned"])
    assert owned.keys() == ref["muon"].keys()  # every Muon param has exactly one owner
    out = {}
    for name in ref["muon"]:
        disp = (ref["final"][name] - ref["init"][name]).abs().max().item()
        out[name] = (owned[name] - ref["final"][name]).abs().max().item() / disp
    return out


def test_qwen3_moe_dedicates_every_expert_stack_and_router_by_default():
    model = H.make_model("qwen3-moe")
    muon = H.muon_matrices(model)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp"
        assert muon[f"{p}.experts.gate_up_proj"] == (32, 32)  # (2I, H) slices of (E, 2I, H)
        assert muon[f"{p}.experts.down_proj"] == (32, 16)
        assert muon[f"{p}.gate.weight"] == (4, 32)
    assert "model.embed_tokens.weight" not in muon and "lm_head.weight" not in muon


@pytest.mark.parametrize("kind", ["qwen3-moe", "llama"])
@pytest.mark.parametrize("mode", ["ddp", "z2", "z3", "hsdp-z3"])
def test_every_muon_param_lands_on_the_oracle(pool2, pool4, oracles, kind, mode):
    pool, world = (pool4, 4) if mode.startswith("hsdp") else (pool2, 2)
    ref = oracles[(kind, world)]
    results = pool.run_with_timeout(TIMEOUT_S, H.train, kind, mode)
    dist = _distances(ref, results)
    assert max(dist.values()) <= DIST_TOL, sorted(dist.items(), key=lambda kv: -kv[1])[:4]
    # one Newton–Schulz per matrix per step over all ranks (an expert stack counts E)
    matrices = sum(ref["final"][n].numel() // (m[0] * m[1]) for n, m in ref["muon"].items())
    assert sum(r["ns_calls"] for r in results) == H.STEPS * matrices
    # the assignments say where every param went, the same on every rank
    assert all(r["assignments"] == results[0]["assignments"] for r in results)
    muon = [row[0] for row in results[0]["assignments"] if row[3] == "muon"]
    assert muon == list(ref["muon"])
