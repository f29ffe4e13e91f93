"""verify.workload.presets: published parameter totals, Muon-target counts, meta construction time,
and that the architectures run (forward + backward) at small sizes on CPU."""

from __future__ import annotations

import time

import pytest
import torch

from dmuon.ownership.plan import plan_ownership, specs_from_named_parameters
from dmuon.ownership.select import select_params
from verify.workload.presets import (
    PRESETS,
    Decoder,
    DecoderConfig,
    GPT2,
    GPT2Config,
    MLAConfig,
    MoEConfig,
    build_preset,
    resolve_model,
)

#: Muon targets under dmuon.default_predicate, counted from each architecture by hand:
#: GPT-2: 4 per block; Llama: qkv, o, gate, up, down per layer; Qwen3-MoE: qkv, o, router and
#: 3 per expert per layer; DeepSeek-V3: 5 MLA matrices per layer, 3 dense layers of 3, 58 MoE
#: layers of router + 3 x (256 routed + 1 shared).
EXPECTED_MATRICES = {
    "gpt2-small": 12 * 4,
    "llama3-8b": 32 * 5,
    "llama3-70b": 80 * 5,
    "llama-tiny": 3 * 5,
    "qwen3-30b-a3b": 48 * (3 + 128 * 3),
    "deepseek-v3-like": 61 * 5 + 3 * 3 + 58 * (1 + 257 * 3),
    # the same with the routed experts as three 3-D stacks per MoE layer (one param each)
    "deepseek-v3-like-stacked": 61 * 5 + 3 * 3 + 58 * (1 + 3 + 3),
}

#: Generous bound on building the largest preset (45k Linear modules) on the meta device; it
#: takes ~5 s on an idle core of the dev machine, this bar allows for a shared, busy machine.
META_BUILD_BAR_S = 60.0


class _Built(dict):
    """name -> (model on meta, build seconds), each preset built on first use only."""

    def __missing__(self, name):
        t0 = time.perf_counter()
        model = build_preset(name)
        self[name] = (model, time.perf_counter() - t0)
        return self[name]


@pytest.fixture(scope="module")
def built():
    """Each preset built once on meta (lazily), with its build time."""
    return _Built()


#: Building DeepSeek-V3-like's 45k modules or Qwen3-30B-A3B's 48 x 128 experts on meta takes
#: ~10 s here: `make test-all` only (the other presets run the same builders and checks).
_PRESET_PARAMS = [pytest.param(n, marks=pytest.mark.slow)
                  if n.startswith(("deepseek-v3-like", "qwen3-30b-a3b")) else n for n in sorted(PRESETS)]


@pytest.mark.parametrize("name", _PRESET_PARAMS)
def test_parameter_totals_match_published_sizes(built, name):
    preset = PRESETS[name]
    model, seconds = built[name]
    count = sum(p.numel() for p in model.parameters())
    print(f"{name}: {count:,} params (published {preset.published_params}), built on meta in {seconds:.2f} s")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert seconds < META_BUILD_BAR_S
    if preset.published_params is not None:
        # within half the published figure's rounding unit: exact for 1, '30.5B' for 1e8
        assert abs(count - preset.published_params) <= preset.published_rounding // 2, preset.source
    targets = select_params(model, None, None)
    assert len(targets) == EXPECTED_MATRICES[name]
    names = {n for n, _, _ in targets}
    assert not any("lm_head" in n or "embed" in n or "wte" in n or "norm" in n for n in names)


def test_llama_tiny_dims_avoid_3_and_4_and_it_trains_on_cpu():
    torch.manual_seed(0)
    model = build_preset("llama-tiny", device="cpu")
    assert sum(p.numel() for p in model.parameters()) < 4_000_000
    targets = select_params(model, None, None)
    for name, p, _ in targets:
        assert all(d % 3 and d % 4 for d in p.shape), (name, tuple(p.shape))
    idx = torch.randint(0, model.config.vocab_size, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for _, p, _ in targets)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _tiny_moe_mla() -> DecoderConfig:
    return DecoderConfig(
        vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=48,
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16, n_shared_experts=1,
                      first_dense_layers=1, scoring="sigmoid"),
        mla=MLAConfig(q_lora_rank=16, kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=6),
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: Decoder(_tiny_moe_mla()),
        lambda: Decoder(DecoderConfig(
            vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
            qk_norm=True, ffn_dim=48, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16))),
        lambda: GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=24, n_layers=2, n_heads=3)),
    ],
    ids=["deepseek-like-mla-moe", "qwen-like-gqa-qknorm-moe", "gpt2"],
)
def test_small_instances_run_and_are_causal(make):
    torch.manual_seed(0)
    model = make()
    idx = torch.randint(0, 50, (2, 9))
    logits = model(idx)
    assert logits.shape == (2, 9, 50)
    # causal: changing the last token leaves earlier positions' logits unchanged
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 50
    torch.testing.assert_close(model(idx2)[:, :-1], logits[:, :-1])
    logits.sum().backward()


def test_moe_routes_each_token_to_top_k_experts():
    torch.manual_seed(0)
    model = Decoder(_tiny_moe_mla())
    moe = model.layers[1].mlp
    calls = []
    for j, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, a, o, j=j: calls.append((j, a[0].shape[0])))
    model(torch.randint(0, 50, (3, 5)))
    assert sum(rows for _, rows in calls) == 3 * 5 * moe.cfg.top_k


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GPT2Config(d_model=100, n_heads=12), "n_heads"),
        (lambda: DecoderConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=8), "n_kv_heads"),
        (lambda: DecoderConfig(vocab_size=8, d_model=35, n_layers=1, n_heads=5, n_kv_heads=5, ffn_dim=8), "head_dim"),
        (lambda: MoEConfig(n_experts=2, top_k=3, expert_ffn_dim=4), "top_k"),
        (lambda: MoEConfig(n_experts=2, top_k=1, expert_ffn_dim=4, scoring="relu"), "scoring"),
        (lambda: build_preset("llama-9000"), "preset"),
        (lambda: resolve_model("nonsense"), "Must be a preset"),
        (lambda: resolve_model("no_such_module_x:f"), "importable"),
    ],
)
def test_invalid_configs_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_resolve_model_builds_factories_on_meta():
    model = resolve_model("tests.verify.test_presets:_gpt2_tiny")()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert resolve_model("llama-tiny")().config.d_model == 230


def _gpt2_tiny():
    return GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=24, n_layers=2, n_heads=3))


#: The issue's bar for the planner on real NS cost: max owner load within 5% of the bound.
BALANCE_BAR = 1.05


@pytest.mark.parametrize("name", _PRESET_PARAMS)
def test_planner_balance_on_real_cost_within_bar_of_the_bound(built, name):
    model, _ = built[name]
    specs = specs_from_named_parameters((n, p) for n, p, _ in select_params(model, None, None))
    for world in (8, 16, 32, 64, 128, 256, 512, 1024):
        plan = plan_ownership(specs, (1, world))
        costs = list(plan.ns_cost.values())
        trivial = max(max(costs), sum(costs) / world)
        l2 = plan.ns_lower_bound()
        worst = max(plan.ns_load)
        print(f"{name} W={world}: max/trivial {worst / trivial:.4f} max/L2 {worst / l2:.4f}")
        # the trivial bound is reachable unless L2 proves otherwise; L2 is a bound everywhere
        assert worst <= BALANCE_BAR * l2, (name, world)
        if l2 == trivial:
            assert worst <= BALANCE_BAR * trivial, (name, world)
        assert plan.idle_owners == max(0, world - len(specs)) or len(specs) > world
