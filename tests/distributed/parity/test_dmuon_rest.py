"""``dedicate_params(rest="replicate")`` (``dmuon/runtime/rest.py``): DMuon keeps the params it
does not dedicate replicated, broadcasts rank 0's values at the first forward and averages
their grads with one all_reduce per dtype per step; nothing wraps the model.

Against the single-process TinyGPT oracle of ``test_dmuon_parity.py`` (the same comparison:
each step within the bound of its measured noise floor, ``noise_floor``), on the interposer's
calls, and on what users combine it with: no_sync, clipping, unused params, DCP, wrong
wrapping."""

import pytest
import torch

from tests.distributed.parity import dmuon_tasks as T
from tests.distributed.parity import rest_tasks as R
from tests.distributed.parity.conftest import STEPS, assert_on_oracle

pytestmark = pytest.mark.distributed

MODES = ("ddp", "z2", "z3", "hsdp-z2", "hsdp-z3")


def test_every_mode_matches_the_oracle(pool4, tinygpt_oracle):
    ref = tinygpt_oracle["final"]
    # HSDP both ways: hierarchical (the tasks' default) and "auto", flat for this one-unit model
    runs = [(m, {}) for m in MODES] + [(m, {"hierarchy": "auto"}) for m in MODES if "hsdp" in m]
    merged = {}
    for m, kw in runs:
        results = pool4.run(T.train_dmuon, m, STEPS, every_step=True, rest="replicate", **kw)
        assert_on_oracle(tinygpt_oracle, results, f"{m} {kw}")
        merged[(m, *kw.values())] = T.merge_owned(results)
    # residency, the mesh and its hierarchy change no arithmetic: the modes are bit-identical
    for mode in merged:
        assert all(torch.equal(merged[mode][n], merged[("ddp",)][n]) for n in ref), mode


@pytest.mark.parametrize("mode", ["z2", "hsdp-z3"])
def test_one_all_reduce_per_step_and_no_wrapper_calls(pool4, mode):
    results = pool4.run(R.one_step_calls, mode)
    for r in results:
        rest = [e for e in r["events"] if e[5] is None]
        # the rest's only call: one all_reduce over all 4 ranks, grads + one usage element each
        assert rest == [("all_reduce", "backward", 4, r["rest_numel"] + r["rest_params"], "float32", None)]
        assert all(e[5].startswith("blocks") for e in r["events"] if e[5] is not None)  # DMuon's own
        calls = r["coalescing"]["calls_per_step"]
        assert calls["backward"] == sum(1 for e in r["events"] if e[1] == "backward")
        assert r["coalescing"]["rest"] == {"mode": "replicate", "params": r["rest_params"],
                                           "bytes": 4 * r["rest_numel"]}
    r = results[0]  # the rest and the dedicated params partition the model's params, in model order
    assert sorted(r["rest_names"] + r["dedicated"]) == sorted(r["all_names"])
    assert r["rest_names"] == [n for n in r["all_names"] if n not in r["dedicated"]]
    assert "tok_emb.weight" in r["rest_names"] and r["dedicated"]


def test_the_first_forward_broadcasts_rank0s_rest(pool4):
    clean = pool4.run(R.divergent_init, False)
    perturbed = pool4.run(R.divergent_init, True)
    for a, b in zip(clean, perturbed):
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_no_sync_accumulation_and_clipping(pool4):
    ref = T.oracle_grads()
    results = pool4.run(R.accumulate, 2)
    for r in results:
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, ref[n], rtol=1e-5, atol=1e-7)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref.values()]))
    for r in results:  # DMuon's global norm equals torch's over the full grads, on every rank
        torch.testing.assert_close(r["norm"], total, rtol=1e-5, atol=0)


def test_a_rest_param_used_on_one_rank_or_none(pool4):
    one = pool4.run(R.usage, "rank0")
    for r in one:  # the average over ranks of rank 0's grad and three zeros
        torch.testing.assert_close(r["grad"], one[0]["local"] / 4, rtol=1e-6, atol=1e-8)
    for r in pool4.run(R.usage, "nowhere"):  # no grad anywhere: None, AdamW skips it
        assert r["grad"] is None and r["unchanged"]


@pytest.mark.parametrize("mode", ["z3", "hsdp-z2"])
def test_dcp_resume_is_exact(pool4, mode):
    for r in pool4.run(R.checkpoint_resume, mode):
        assert r["losses"][0] == r["losses"][1] and r["diff"] == 0.0


@pytest.mark.parametrize("case, expected", [
    ("value", "ValueError: Invalid rest='shard'. Must be 'wrapper'"),
    ("mp_bias", "ValueError: Invalid mp_policy with rest='replicate': module '0' holds the dedicated '0.weight'"),
    ("wrapped", "ValueError: Invalid model: module '<root>' was wrapped by fully_shard"),
])
def test_misuse_raises_on_every_rank(pool4, case, expected):
    for message in pool4.run(R.bad_input, case):
        assert message.startswith(expected), message
