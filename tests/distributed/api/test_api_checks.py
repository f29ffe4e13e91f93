"""Validation on every rank, before any collective."""

import pytest
import torch

from tests.distributed.api import api_tasks as A

pytestmark = pytest.mark.distributed


def test_bad_hyperparameters_raise_on_every_rank_including_idle_owners(pool4):
    results = pool4.run_with_timeout(60, A.bad_hyperparameters)
    assert sorted(r["owned"] for r in results) == [0, 0, 1, 1]  # two ranks own nothing
    for rank, r in enumerate(results):
        for key, (_, text) in A.BAD_HYPERPARAMETERS.items():
            assert r[key].startswith("ValueError: ") and text in r[key], (rank, key, r[key])
        assert "Invalid param_groups[0].weight_decay=-1.0" in r["step"], (rank, r["step"])


SETUP_ERRORS = {
    "z2_on_one_rank_z3_elsewhere": ("RuntimeError", "differs across ranks (ranks [0, 2, 3]"),
    "mesh_smaller_than_world": ("ValueError", "W = R * N = 2 must equal the world size 4"),
    "dedicate_twice": ("ValueError", "dedicate_params was already called on it (4 params"),
    "dedicate_twice_submodule": ("ValueError", "dedicate_params was already called on it"),
}


@pytest.mark.parametrize("case", sorted(SETUP_ERRORS))
def test_bad_setup_raises_clear_error_on_every_rank(pool4, case):
    kind, text = SETUP_ERRORS[case]
    for rank, message in enumerate(pool4.run_with_timeout(60, A.setup_error, case)):
        assert message.startswith(kind) and text in message, (rank, message)


def test_conv1d_dedicated_frozen_and_unembed_left_out_and_matches_torch_muon(pool2):
    steps = 3
    results = pool2.run_with_timeout(60, A.gpt2_like_trains_like_torch_muon, steps)
    assert results[0]["names"] == ["c_fc.weight", "c_proj.weight"]
    ref = A.gpt2_like_oracle(steps)
    owned = {n: t for r in results for n, t in r["owned"].items()}
    assert sorted(owned) == sorted(ref)
    for name, t in owned.items():
        # fp32 grads of a 2-rank mean vs one process: a few ulps, then bf16 NS (see parity tests)
        torch.testing.assert_close(t, ref[name], rtol=1e-3, atol=1e-4)


def test_nothing_dedicated_warns_and_trains(pool2):
    for r in pool2.run_with_timeout(60, A.nothing_to_dedicate):
        assert r["dedicated"] == 0
        assert any("found no Muon target in Sequential" in w for w in r["warnings"]), r


def test_matrices_left_to_adamw_are_named_once(pool2):
    for r in pool2.run_with_timeout(60, A.matrices_left_to_adamw):
        assert len(r["warnings"]) == 1, r["warnings"]
        text = r["warnings"][0]
        for name in ("layers.0.router", "layers.0.w_out", "layers.1.w_in", "layers.1.w_out",
                     "layers.1.router", "conv.weight"):
            assert name in text, name
        assert "head.weight" not in text and "norm.weight" not in text
        assert "6 trainable params of at least 2 dims" in text and "dm.assignments()" in text
        rows = {row[0]: row for row in r["rows"]}
        assert rows["layers.0.w_in"][3:] == ("muon", "listed in params=")
        assert rows["layers.0.w_out"][1:4] == ((5, 40, 24), 4800, "adamw")
        assert rows["layers.0.w_out"][4].startswith("not in params= (default: stack of 5")


@pytest.mark.parametrize("wrap", ["none", "ddp", "fsdp2", "frozen"])
def test_a_rest_nothing_averages_is_named_once(pool2, wrap):
    """rest="wrapper" with no wrapper: the ranks' AdamW steps would drift apart silently, so
    the first step warns once, naming a param of the rest; under DDP or FSDP2, or with the
    rest frozen, nothing is said."""
    for warned in pool2.run_with_timeout(60, A.rest_averaging_warnings, wrap):
        if wrap == "none":
            assert len(warned) == 1 and "nothing averages the grads of tok_emb.weight" in warned[0], warned
            assert "rest='replicate'" in warned[0]
        else:
            assert warned == [], warned


def test_gradient_divide_factor_one_gives_the_owners_the_sum(pool2):
    """Control: the default factor gives the mean (world × it equals the sum); factor 1 the sum.
    Each owner holds its matrix's grad, so each rank checks the ones it owns."""
    results = pool2.run_with_timeout(60, A.divide_factor_sums)
    assert sum(len(r["sum_vs_sum"]) for r in results) == 2  # each matrix on its one owner
    for r in results:
        assert all(d < 1e-5 for d in r["mean_vs_sum"].values()), r
        assert all(d < 1e-5 for d in r["sum_vs_sum"].values()), r
        assert len(r["errors"]) == 6 and all("Invalid gradient divide factor" in e and "Must be a finite number > 0" in e
                                             for e in r["errors"]), r["errors"]
