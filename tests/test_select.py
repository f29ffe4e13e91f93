"""Which params DMuon dedicates by default, and what the setup digest covers (pure, no ranks)."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from dmuon.api import setup_digest
from dmuon.ownership.plan import plan_ownership, specs_from_named_parameters
from dmuon.ownership.select import HEAD_NAMES, select_params
from tests.distributed.api_tasks import GPT2Like


def _selected(model: nn.Module) -> list[str]:
    return [n for n, _, _ in select_params(model, None, None)]


def test_conv1d_is_a_linear_frozen_and_head_are_not():
    assert _selected(GPT2Like()) == ["c_fc.weight", "c_proj.weight"]


def test_conv1d_needs_the_hf_layout():
    model = GPT2Like()
    model.c_fc.nf = 999  # not (nx, nf): not recognised
    assert _selected(model) == ["c_proj.weight"]


@pytest.mark.parametrize("head", sorted(HEAD_NAMES))
def test_head_names_go_to_adamw(head):
    model = nn.Module()
    model.emb = nn.Embedding(50, 8)
    model.hidden = nn.Linear(8, 8)
    model.add_module(head, nn.Linear(8, 50))
    assert _selected(model) == ["hidden.weight"]


def test_head_tied_to_embedding_goes_to_adamw():
    model = nn.Module()
    model.emb = nn.Embedding(50, 8)
    model.hidden = nn.Linear(8, 8)
    model.proj_vocab = nn.Linear(8, 50, bias=False)
    model.proj_vocab.weight = model.emb.weight
    assert _selected(model) == ["hidden.weight"]


def test_explicit_frozen_param_still_raises():
    model = GPT2Like()
    with pytest.raises(ValueError, match="Invalid dedicated param frozen.weight: requires_grad is False"):
        select_params(model, ["frozen.weight"], None)


def _digest(model, **kw):
    named = select_params(model, None, None)
    plan = plan_ownership(specs_from_named_parameters((n, p) for n, p, _ in named), (1, 2))
    return setup_digest(plan, named, **kw)


def test_setup_digest_covers_reshard_and_mixed_precision():
    model = GPT2Like()
    z3 = _digest(model, reshard_after_forward=True)
    assert z3 == _digest(GPT2Like(), reshard_after_forward=True)  # values do not matter
    assert z3 != _digest(model, reshard_after_forward=False)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with_bf16 = _digest(model, reshard_after_forward=True, mp_policy=bf16)
    assert with_bf16 not in (z3, _digest(model, reshard_after_forward=True,
                                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.float32)))
    assert with_bf16 == _digest(model, reshard_after_forward=True,
                                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert z3 != _digest(model.to(torch.float64), reshard_after_forward=True)  # dtypes (the plan)


def test_setup_digest_rejects_a_non_bool_reshard():
    with pytest.raises(ValueError, match="Invalid reshard_after_forward=1. Must be True"):
        _digest(GPT2Like(), reshard_after_forward=1)
