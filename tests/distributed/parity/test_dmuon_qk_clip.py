"""MuonClip (QK-clip) under DMuon matches a single-process MuonClip oracle
(``qk_clip_tasks``) on a tiny HF Llama with GQA, in DDP, Z2, Z3 and HSDP-Z3.

What is compared, as in ``test_dmuon_hf.py`` (why: its docstring): at W = 2 the trajectories
of 3 steps, at W = 4 one step; max |p - oracle| / max |oracle - init| per Muon param.
τ = ``qk_clip_tasks.TAU`` is low enough that the clip scales some heads at every step
(checked: the oracle's clipped set is not empty and not every head), so q_proj / k_proj land
on the oracle only if DMuon clips the same heads by the same factors on the owners before the
refresh. Fails without the feature: ``dmuon.optim.qk_clip`` did not exist; and the control
(``enabled=False``: the same maxima and all_reduce, no scaling) must sit far outside the
tolerance on q_proj / k_proj, so the comparison can tell.
"""

import pytest

pytest.importorskip("transformers")

from tests.distributed.parity import qk_clip_tasks as Q  # noqa: E402

pytestmark = pytest.mark.distributed

DIST_TOL = 0.01
TIMEOUT_S = 120
STEPS_AT = {2: 3, 4: 1}
HEADS = 2 * 4  # layers × query heads of hf_tasks.make_model("llama")


@pytest.fixture(scope="module")
def oracles():
    return {w: Q.oracle(w, STEPS_AT[w]) for w in STEPS_AT}


def _distances(ref: dict, results: list[dict]) -> dict[str, float]:
    owned = {}
    for r in results:
        owned.update(r["owned"])
    assert owned.keys() == ref["muon"].keys()
    return {n: (owned[n] - ref["final"][n]).abs().max().item()
            / (ref["final"][n] - ref["init"][n]).abs().max().item() for n in ref["muon"]}


def test_the_oracle_clips_some_heads_not_all(oracles):
    for w, ref in oracles.items():
        for maxima in ref["maxima"]:
            over = [s > Q.TAU for layer in maxima.values() for s in layer]
            assert any(over) and not all(over), (w, maxima)


@pytest.mark.parametrize("mode", ["ddp", "z2", "z3", "hsdp-z3"])
def test_muonclip_lands_on_the_oracle(pool2, pool4, oracles, mode):
    pool, world = (pool4, 4) if mode.startswith("hsdp") else (pool2, 2)
    ref = oracles[world]
    results = pool.run_with_timeout(TIMEOUT_S, Q.train, mode, STEPS_AT[world])
    dist = _distances(ref, results)
    assert max(dist.values()) <= DIST_TOL, sorted(dist.items(), key=lambda kv: -kv[1])[:4]
    for r in results:
        # one packed MAX all_reduce per step, 4 bytes per head, phase qk_clip
        assert r["qk_calls"] == [("qk_clip", 4 * HEADS)] * STEPS_AT[world], r["qk_calls"]
        # every rank reports the global maxima (all ranks' batches), the oracle's
        for step, (maxima, clipped) in enumerate(r["history"]):
            want = ref["maxima"][step]
            assert maxima.keys() == want.keys()
            for name, s in maxima.items():
                assert s == pytest.approx(want[name], rel=1e-5), (step, name)
                assert clipped[name] == [h for h, x in enumerate(want[name]) if x > Q.TAU]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_without_the_clip_the_comparison_fails(pool2, pool4, oracles, world):
    pool, mode = (pool4, "hsdp-z3") if world == 4 else (pool2, "z2")
    results = pool.run_with_timeout(TIMEOUT_S, Q.train, mode, STEPS_AT[world], enabled=False)
    dist = _distances(oracles[world], results)
    qk = {n: d for n, d in dist.items() if n.endswith(("q_proj.weight", "k_proj.weight"))}
    assert min(qk.values()) > 10 * DIST_TOL, qk


@pytest.mark.parametrize("mode", ["ddp", "z3"])
def test_tinygpt_issues_exactly_the_predicted_call(pool2, mode):
    """Phase D's prediction (``verify.traffic.predict.qk_clip_calls``, from TinyGPT's head
    count) against the calls DMuon + QKClip issue in phase ``qk_clip`` (counted at
    ``dist.all_reduce``, 2 steps, W = 2; τ ≈ 0 so every head of the fused ``qkv`` is clipped)."""
    from tests.distributed.parity import dmuon_tasks as T
    from tests.verify.test_predict_qk_clip import _layout
    from verify.traffic.predict import qk_clip_calls

    heads = T.SMALL.n_layers * T.SMALL.n_heads
    want = qk_clip_calls(_layout(heads=heads), 0)[0]
    for r in pool2.run_with_timeout(TIMEOUT_S, Q.tinygpt_qk_calls, mode):
        assert r == [([0, 1], want.count, want.dtype)] * 2


@pytest.mark.parametrize("case,match", [("tau", "Invalid tau"), ("alpha", "Invalid alpha"),
                                        ("not_dmuon", "Must be a dmuon.DMuon"),
                                        ("foreign", "not among the optimizer's params")])
def test_bad_arguments_raise_on_every_rank(pool2, case, match):
    for msg in pool2.run_with_timeout(TIMEOUT_S, Q.bad_qkclip, case):
        assert match in msg, msg
