"""DMuon on Hugging Face models (transformers 5, tiny configs, no download) against a
single-process oracle (``hf_tasks``): Qwen3-MoE's 3-D expert stacks and routers are dedicated
by default, and every Muon param of every mode lands on the oracle.

What is compared is what is well-conditioned, with a bound from a noise floor the test
measures (``noise_floor``: the oracle against its nudged runs, times ``FACTOR``):

- after each step: :data:`hf_tasks.STEPS` at W = 2 (the second uses the momentum), one at
  W = 4 (four gradients summed in the all-reduce's order and in the oracle's differ in the
  last bit, and Muon amplifies such a difference over steps on the rank-deficient gradients of
  routers and thinly routed expert slices);
- |p - oracle| / |oracle - init| per Muon param in the Frobenius norm (the largest entry of a
  thinly routed expert slice triples the floor), a router without its mean over the experts
  (``hf_tasks.routing_part``: no routing sees it).

Measured on a 2-core AMD EPYC: DMuon bit-identical to the oracle in every mode on both models.
A planted error (each expert slice given its neighbour's update,
``test_a_planted_expert_mix_up_fails_the_comparison``) must land beyond the first step's bound.
"""

import pytest

pytest.importorskip("transformers")  # the test extra; imported here so the pools inherit it

from tests.distributed import noise_floor as NF  # noqa: E402
from tests.distributed.parity import hf_tasks as H  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120


#: Steps compared at each world size (module docstring).
STEPS_AT = {2: H.STEPS, 4: 1}


@pytest.fixture(scope="module")
def oracles():
    """Per (model, world size): the oracle run with its per-step floors (``floors``)."""
    out = {}
    for kind in ("qwen3-moe", "llama"):
        for w, steps in STEPS_AT.items():
            ref = H.oracle(kind, w, steps)
            nudged = {n: H.oracle(kind, w, steps, nudge=n) for n in NF.NUDGES}
            ref["floors"] = NF.floors(ref, nudged, names=ref["muon"], part=H.routing_part, norm="fro")
            out[(kind, w)] = ref
    return out


def _distances(ref: dict, results: list[dict], step: int) -> dict[str, float]:
    """Per Muon param after step ``step`` (0-based): |DMuon - oracle| / |oracle - init|
    (Frobenius), on their routing parts."""
    owned = {}
    for r in results:
        owned.update(r["steps"][step])
    assert owned.keys() == ref["muon"].keys()  # every Muon param has exactly one owner
    return NF.distances(owned, ref["steps"][step], ref["init"], ref["muon"], H.routing_part, "fro")


def test_qwen3_moe_dedicates_every_expert_stack_and_router_by_default():
    model = H.make_model("qwen3-moe")
    muon = H.muon_matrices(model)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp"
        assert muon[f"{p}.experts.gate_up_proj"] == (32, 32)  # (2I, H) slices of (E, 2I, H)
        assert muon[f"{p}.experts.down_proj"] == (32, 16)
        assert muon[f"{p}.gate.weight"] == (4, 32)
    assert "model.embed_tokens.weight" not in muon and "lm_head.weight" not in muon


#: Llama under Z2 and Z3 is slow (``make test-all``): the same tiny Llama runs under Z2 and Z3
#: against its oracle in ``test_dmuon_qk_clip.py`` and ``test_fsdp2_script.py``, and Qwen3-MoE
#: covers the default selection in every mode here.
_LLAMA_SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind, mode", [
    *((("qwen3-moe", m) for m in ("ddp", "z2", "z3", "hsdp-z3"))),
    ("llama", "ddp"), ("llama", "hsdp-z3"),
    pytest.param("llama", "z2", marks=_LLAMA_SLOW), pytest.param("llama", "z3", marks=_LLAMA_SLOW),
])
def test_every_muon_param_lands_on_the_oracle(pool2, pool4, oracles, kind, mode):
    pool, world = (pool4, 4) if mode.startswith("hsdp") else (pool2, 2)
    ref = oracles[(kind, world)]
    results = pool.run_with_timeout(TIMEOUT_S, H.train, kind, mode, STEPS_AT[world])
    for step, floor in enumerate(ref["floors"]):
        NF.assert_within(_distances(ref, results, step), floor, f"{kind} {mode}, step {step + 1}")
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
    (``hf_tasks.rolled_experts``) must land beyond the first step's bound on every expert
    stack, at both world sizes."""
    pool, mode = (pool4, "hsdp-z3") if world == 4 else (pool2, "z2")
    results = pool.run_with_timeout(TIMEOUT_S, H.train, "qwen3-moe", mode, 1, plant="roll-experts")
    ref = oracles[("qwen3-moe", world)]
    experts = {n: d for n, d in _distances(ref, results, 0).items() if ".experts." in n}
    NF.assert_beyond(experts, ref["floors"][0], f"rolled experts at W={world}")
