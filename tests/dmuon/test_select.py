"""Which params DMuon dedicates by default, and what the setup digest covers (pure, no ranks)."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from dmuon.api import setup_digest
from dmuon.ownership.plan import plan_ownership, specs_from_named_parameters
from dmuon.ownership.select import HEAD_NAMES, adamw_matrices, assign_params, select_params
from tests.distributed.api.api_tasks import GPT2Like


def _selected(model: nn.Module) -> list[str]:
    return [n for n, _, _ in select_params(model, None, None)]


def test_conv1d_is_a_linear_frozen_and_head_are_not():
    assert _selected(GPT2Like()) == ["c_fc.weight", "c_proj.weight"]


def test_conv1d_without_the_hf_layout_is_still_a_matrix():
    model = GPT2Like()
    model.c_fc.nf = 999  # not (nx, nf): not recognised as a Linear, still a hidden matrix
    assert _selected(model) == ["c_fc.weight", "c_proj.weight"]
    reasons = {a.name: a.reason for a in assign_params(model)}
    assert reasons["c_fc.weight"] == "matrix of a Conv1D (e.g. a router)"
    assert reasons["c_proj.weight"] == "weight of a hidden Conv1D"


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


def _tied_hidden() -> nn.Module:
    """Two hidden Linears sharing one weight (weight tying between modules), and one module
    object reused at two places (not sharing)."""
    model = nn.Module()
    a, reused = nn.Linear(8, 8), nn.Linear(8, 8)
    model.blocks = nn.ModuleList([a, nn.Linear(8, 8), reused, reused])
    model.blocks[1].weight = a.weight
    return model


def test_a_weight_shared_by_two_modules_goes_to_adamw_and_cannot_be_forced():
    model = _tied_hidden()
    got = {a.name: a for a in assign_params(model)}
    assert got["blocks.0.weight"].optimizer == "adamw" and got["blocks.0.weight"].role == "shared"
    assert "['blocks.0', 'blocks.1']" in got["blocks.0.weight"].reason
    assert _selected(model) == ["blocks.2.weight"]  # the reused module object is one holder
    assert [a.name for a in adamw_matrices(list(got.values()))] == ["blocks.0.weight"]
    for how in ({"params": ["blocks.0.weight"]}, {"predicate": lambda n, p, m: p.ndim == 2}):
        with pytest.raises(ValueError, match=r"blocks.0.weight: the same Parameter is registered in modules"):
            select_params(model, how.get("params"), how.get("predicate"))


def test_a_module_reached_through_two_blocks_is_shared():
    """``blocks[3].fc = blocks[0].fc``: the block of the first path (``blocks.0``) moves it,
    and ``blocks.3`` would read it freed under Z3 (found by a break-it trial: the ranks'
    collectives diverged and the job hung). A reused block object is not shared."""
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(8, 8)}) for _ in range(3))
    model.blocks[2]["fc"] = model.blocks[0]["fc"]
    model.reused = nn.ModuleList([model.blocks[1], model.blocks[1]])
    got = {a.name: a for a in assign_params(model)}
    assert got["blocks.0.fc.weight"].role == "shared" and got["blocks.0.fc.weight"].optimizer == "adamw"
    assert "['blocks.0.fc', 'blocks.2.fc']" in got["blocks.0.fc.weight"].reason
    assert _selected(model) == ["blocks.1.fc.weight"]  # blocks.1 reused whole as reused.0 / .1
    with pytest.raises(ValueError, match=r"blocks.0.fc.weight: the same Parameter is registered in "
                                         r"modules \['blocks.0.fc', 'blocks.2.fc'\] \(different module"):
        select_params(model, ["blocks.0.fc.weight"], None)


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


class _Router(nn.Module):
    def __init__(self, experts: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d))


class _Experts(nn.Module):
    def __init__(self, experts: int, d: int, f: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * f, d))
        self.down_proj = nn.Parameter(torch.randn(experts, d, f))


class _Modern(nn.Module):
    """The roles the default rule must tell apart: an MoE layer stored as in transformers 5
    (3-D expert stacks, a router that is not an nn.Linear), a conv, learned position and
    class tokens, a (1, d) gain, an embedding, a head."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(20, d)
        self.pos_embed = nn.Parameter(torch.zeros(1, 6, d))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.patch = nn.Conv2d(3, d, 2)
        self.seq = nn.Conv1d(d, d, 3)
        self.gate = _Router(4, d)
        self.experts = _Experts(4, d, 6)
        self.gain = nn.Parameter(torch.ones(1, d))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 20, bias=False)


def test_default_rule_goes_by_role_with_a_reason_each():
    got = {a.name: (a.optimizer, a.matrix, a.reason) for a in assign_params(_Modern())}
    muon = {n: m for n, (o, m, _) in got.items() if o == "muon"}
    assert muon == {
        "patch.weight": (8, 12), "seq.weight": (8, 24),  # conv: (out, in·k…)
        "gate.weight": (4, 8),  # a router: a 2-D param of a custom module
        "experts.gate_up_proj": (12, 8), "experts.down_proj": (8, 6),  # stacks: shape[-2:]
    }
    assert got["experts.gate_up_proj"][2] == "stack of 4 (12, 8) matrices (_Experts)"
    assert got["patch.weight"][2] == "conv weight (Conv2d), Muon on its (8, 12) view"
    assert got["pos_embed"][2] == "embedding-like table (name 'pos_embed', EMBEDDING_WORDS)"
    assert got["cls_token"][0] == "adamw" and got["embed_tokens.weight"][0] == "adamw"
    assert got["lm_head.weight"][2] == "output head (module named 'lm_head', HEAD_NAMES)"
    assert got["gain"][2].startswith("a vector stored as a matrix (1, 8)")
    assert got["patch.bias"][2] == "1-D (bias, norm gain or scalar)"


def test_explicit_params_take_stacks_and_reject_1d():
    model = _Modern()
    names = [n for n, _, _ in select_params(model, ["experts.down_proj", model.gate.weight], None)]
    assert names == ["gate.weight", "experts.down_proj"]  # model order
    with pytest.raises(ValueError, match=r"norm.weight of shape \(8,\): Muon needs a matrix"):
        select_params(model, ["norm.weight"], None)


def test_a_predicate_overrides_the_default_and_keeps_the_tie_rule():
    model = _Modern()
    model.lm_head.weight = model.embed_tokens.weight
    chosen = [n for n, _, _ in select_params(model, None, lambda n, p, m: p.ndim == 2)]
    assert chosen == ["gain", "gate.weight"]  # not the embedding, nor the head tied to it
    reasons = {a.name: a.reason for a in assign_params(model, None, lambda n, p, m: p.ndim == 3)}
    assert reasons["experts.down_proj"] == "predicate= returned True"
    assert reasons["gate.weight"].startswith("predicate= returned False (default: matrix of")


def test_adamw_matrices_name_what_the_selection_left_out():
    model = _Modern()
    left = adamw_matrices(assign_params(model, ["experts.down_proj"]))
    names = {a.name for a in left}
    # hidden matrices left to AdamW by params= are reported; embeddings, heads, the position
    # table, the class token and 1-D params are not (AdamW by design)
    assert names == {"patch.weight", "seq.weight", "gate.weight", "experts.gate_up_proj", "gain"}
