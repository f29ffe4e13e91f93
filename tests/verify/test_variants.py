"""The default run's mode variants (verify/modes/variants.py) and the link policy the
harness derives on its own (verify/traffic/predict.py, ``dmuon_policy_backend``)."""

from __future__ import annotations

import pytest

from verify.modes.build import muon_names
from verify.traffic.formulas import MODES
from verify.traffic.predict import (dmuon_coalesce_bytes, dmuon_policy_backend, dmuon_reduce_by_gather,
                                    dmuon_uneven_aligned)
from verify.modes.variants import MODE_VARIANTS, RUN_MODES, split_mode, variant_targets
from verify.workload.model import TinyGPT


def test_every_variant_is_a_dmuon_mode_with_known_knobs_and_no_comma():
    for label, (base, knobs) in MODE_VARIANTS.items():
        assert base in MODES and base.startswith("dmuon-"), label
        assert set(knobs) <= {"coalesce", "hierarchy", "link", "targets"}, label
        assert "," not in label, label  # --modes splits at commas
        assert split_mode(label) == (base, knobs)
    assert RUN_MODES[: len(MODES)] == MODES


def test_largest_targets_of_tinygpt_are_its_four_mlp_matrices():
    model = TinyGPT()
    names = muon_names(model)
    numels = {n: p.numel() for n, p in model.named_parameters()}
    got = variant_targets("largest", names, numels)
    assert got == tuple(n for n in names if ".mlp." in n) and len(got) == 4
    assert variant_targets("all", names, numels) == names


@pytest.mark.parametrize("rule, names, match", [("biggest", ("a",), "Invalid targets='biggest'"),
                                                ("largest", (), "the model has none")])
def test_variant_targets_rejects_bad_input(rule, names, match):
    with pytest.raises(ValueError, match=match):
        variant_targets(rule, names, {"a": 4})


def test_policy_backend_follows_link_else_the_backend():
    """link='nccl' on gloo: the harness's own tables give NCCL's calls (no reduce by gather,
    equal aligned groups only, NCCL's coalescing target)."""
    policy = dmuon_policy_backend("nccl", "gloo")
    assert policy == "nccl"
    assert not dmuon_reduce_by_gather(policy) and not dmuon_uneven_aligned(policy)
    assert dmuon_coalesce_bytes("auto", policy) == 3_600_000
    assert dmuon_policy_backend("auto", "gloo") == "gloo"
    with pytest.raises(ValueError, match=r"Invalid link='rdma'. Must be one of \('auto', 'nccl', 'gloo'\)"):
        dmuon_policy_backend("rdma", "gloo")
