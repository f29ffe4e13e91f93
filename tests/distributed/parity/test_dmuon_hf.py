"""DMuon on Hugging Face models (transformers 5, tiny configs, no download) against a
single-process oracle (``hf_tasks``): Qwen3-MoE's 3-D expert stacks and routers are dedicated
by default, and every Muon param of every mode lands within 1% of the oracle's displacement.

What is compared is what is well-conditioned, so the result does not depend on the machine:

- the oracle runs at the ranks' thread count (``hf_tasks.RANK_THREADS``; a GEMM's rounding
  depends on its thread count);
- at W = 2 the trajectories of :data:`hf_tasks.STEPS` steps (momentum carried across steps):
  the ranks' all-reduce adds two gradients, which is the oracle's sum in any order;
- at W = 4 (HSDP) the one-step update: four gradients summed in the all-reduce's order and in
  the oracle's differ in the last bit, and Muon amplifies such a difference over steps on the
  rank-deficient gradients of routers and thinly routed expert slices (measured over 3 steps:
  up to 5.6% of the displacement on a Llama ``o_proj``, with both sides at one thread);
- a router without its mean over the experts (``hf_tasks.routing_part``: no routing sees it).

Measured max |p - oracle| / max |oracle - init| on this CPU build: 0 (bit-identical) in every
mode on both models. DIST_TOL is 1%: room for one bf16 ulp (2**-8 relative) between DMuon's
batched ``bmm`` Newton–Schulz of an expert stack and the oracle's per-slice ``mm`` chain
(``muon_math``), which other CPUs may round differently. A planted error (each expert slice
given its neighbour's update, ``test_a_planted_expert_mix_up_fails_the_comparison``) sits far
above it.
"""

import pytest

pytest.importorskip("transformers")  # the test extra; imported here so the pools inherit it

from tests.distributed.parity import hf_tasks as H  # noqa: E402

pytestmark = pytest.mark.distributed

DIST_TOL = 0.01
TIMEOUT_S = 120


#: Steps compared at each world size (module docstring).
STEPS_AT = {2: H.STEPS, 4: 1}


@pytest.fixture(scope="module")
def oracles():
    return {(kind, w): H.oracle(kind, w, STEPS_AT[w]) for kind in ("qwen3-moe", "llama")
            for w in STEPS_AT}


def _distances(ref: dict, results: list[dict]) -> dict[str, float]:
    """Per Muon param: max |DMuon - oracle| / max |oracle - init|, on their routing parts."""
    owned = {}
    for r in results:
        owned.update(r["owned"])
    assert owned.keys() == ref["muon"].keys()  # every Muon param has exactly one owner
    out = {}
    for name in ref["muon"]:
        final, init = (H.routing_part(name, ref[k][name]) for k in ("final", "init"))
        disp = (final - init).abs().max().item()
        out[name] = (H.routing_part(name, owned[name]) - final).abs().max().item() / disp
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
    results = pool.run_with_timeout(TIMEOUT_S, H.train, kind, mode, STEPS_AT[world])
    dist = _distances(ref, results)
    assert max(dist.values()) <= DIST_TOL, sorted(dist.items(), key=lambda kv: -kv[1])[:4]
    # one Newton–Schulz per matrix per step over all ranks (an expert stack counts E)
    matrices = sum(ref["final"][n].numel() // (m[0] * m[1]) for n, m in ref["muon"].items())
    assert sum(r["ns_calls"] for r in results) == STEPS_AT[world] * matrices
    # the assignments say where every param went, the same on every rank
    assert all(r["assignments"] == results[0]["assignments"] for r in results)
    muon = [row[0] for row in results[0]["assignments"] if row[3] == "muon"]
    assert muon == list(ref["muon"])


@pytest.mark.parametrize("world", [2, 4])
def test_a_planted_expert_mix_up_fails_the_comparison(pool2, pool4, oracles, world):
    """The control: each expert slice given its neighbour's orthogonalized update
    (``hf_tasks.rolled_experts``) must sit far outside DIST_TOL on the expert stacks, at both
    world sizes and step counts the test above compares."""
    pool, mode = (pool4, "hsdp-z3") if world == 4 else (pool2, "z2")
    results = pool.run_with_timeout(TIMEOUT_S, H.train, "qwen3-moe", mode, STEPS_AT[world],
                                    plant="roll-experts")
    dist = _distances(oracles[("qwen3-moe", world)], results)
    experts = {n: d for n, d in dist.items() if ".experts." in n}
    assert experts and min(experts.values()) > 10 * DIST_TOL, experts
