"""Model presets with published shapes: real ``nn.Module`` architectures built from configs.

Two architecture definitions, each a working module (forward runs on CPU at small sizes):

- :class:`GPT2` (family ``gpt2``): learned positions, LayerNorm, GELU MLP, biases, the output
  head tied to the token embedding (OpenAI GPT-2, Radford et al. 2019).
- :class:`Decoder` (families ``llama`` and ``moe``): RMSNorm pre-norm blocks, rotary positions,
  untied ``lm_head``; attention is grouped-query with one fused ``qkv_proj`` (optionally with
  per-head RMSNorm of q and k, as Qwen3) or DeepSeek's multi-head latent attention
  (:class:`MLAConfig`); the MLP is SwiGLU, or a mixture of experts (:class:`MoEConfig`) whose
  experts are separate SwiGLU modules of 2-D ``nn.Linear`` weights (``mlp.experts.{j}``), or
  three 3-D expert stacks (``MoEConfig.stacked``: ``mlp.experts.{gate_proj, up_proj,
  down_proj}``, preset ``deepseek-v3-like-stacked``).

Names follow Hugging Face's where they exist; :func:`dmuon.ownership.select.default_predicate` picks
every hidden ``nn.Linear`` (attention, MLP, experts, routers) and leaves embeddings, norms and
``lm_head`` to AdamW.

Build a preset with :func:`build_preset` (``device="meta"`` allocates nothing: the way to
size a 671B model on a laptop). Parameter totals are pinned against the published sizes in
``tests/verify/test_presets.py``; each config below cites its source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "PRESETS",
    "Decoder",
    "DecoderConfig",
    "GPT2",
    "GPT2Config",
    "MLAConfig",
    "MoEConfig",
    "build_preset",
]


def _check_positive(obj, names) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid {name}={value!r} in {type(obj).__name__}. Must be a positive int.")


# ----- GPT-2 ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GPT2Config:
    """GPT-2 sizes (defaults: GPT-2 small)."""

    vocab_size: int = 50257
    """Tokens (GPT-2's BPE vocabulary)."""
    n_positions: int = 1024
    """Rows of the learned position embedding (longest sequence)."""
    d_model: int = 768
    """Residual width D."""
    n_layers: int = 12
    """Transformer blocks."""
    n_heads: int = 12
    """Attention heads; must divide ``d_model``."""

    def __post_init__(self) -> None:
        _check_positive(self, ("vocab_size", "n_positions", "d_model", "n_layers", "n_heads"))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"Invalid n_heads={self.n_heads} for d_model={self.d_model}. Must divide d_model."
            )


class _GPT2Block(nn.Module):
    def __init__(self, c: GPT2Config) -> None:
        super().__init__()
        d = c.d_model
        self.n_heads = c.n_heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn.c_proj(y)
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2: ``wte``, ``wpe``, ``blocks.{i}.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
    mlp.c_proj}``, ``ln_f``, ``lm_head`` (weight tied to ``wte``). Linear layers have biases.

    ``forward(idx)``: (B, T) int64 token ids, T <= n_positions -> (B, T, V) logits.
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.n_positions, c.d_model)
        self.blocks = nn.ModuleList(_GPT2Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        if t > self.config.n_positions:
            raise ValueError(f"Invalid sequence length={t}. Must be <= n_positions={self.config.n_positions}.")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----- Llama / MoE decoder ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts MLP: ``n_experts`` routed SwiGLU experts, top-``top_k`` routing."""

    n_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is sent to."""
    expert_ffn_dim: int
    """Hidden width of one expert's SwiGLU."""
    n_shared_experts: int = 0
    """Always-on experts, fused into one SwiGLU of width ``n_shared_experts * expert_ffn_dim``."""
    first_dense_layers: int = 0
    """The first layers use the dense MLP (``DecoderConfig.ffn_dim``) instead of experts."""
    scoring: str = "softmax"
    """Router scores: ``"softmax"`` (Qwen3) or ``"sigmoid"`` (DeepSeek-V3); the top-k weights
    are renormalised to sum to 1 in both."""
    stacked: bool = False
    """Routed experts as three 3-D expert stacks ``experts.{gate_proj, up_proj, down_proj}``
    of shapes (X, I, D), (X, I, D), (X, D, I) (:class:`StackedExperts`; torchtitan's
    ``GroupedExperts`` w1 / w3 / w2, the layout expert parallelism shards on dim 0) instead of
    X :class:`SwiGLU` modules; the same parameters, the same function."""

    def __post_init__(self) -> None:
        _check_positive(self, ("n_experts", "top_k", "expert_ffn_dim"))
        if self.top_k > self.n_experts:
            raise ValueError(f"Invalid top_k={self.top_k}. Must be <= n_experts={self.n_experts}.")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"Invalid scoring={self.scoring!r}. Must be 'softmax' or 'sigmoid'.")


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv."""

    q_lora_rank: int
    """Width of the compressed query (``q_a_proj`` output)."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (``kv_a_proj`` output, less the rope part)."""
    qk_nope_dim: int
    """Per-head query/key dims without rotary embedding."""
    qk_rope_dim: int
    """Per-head query/key dims with rotary embedding (the key's are shared by all heads)."""
    v_head_dim: int
    """Per-head value dims."""

    def __post_init__(self) -> None:
        _check_positive(self, ("q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"))
        if self.qk_rope_dim % 2:
            raise ValueError(f"Invalid qk_rope_dim={self.qk_rope_dim}. Must be even (rotary pairs).")


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """A Llama-style decoder; ``moe`` and ``mla`` switch the MLP and the attention."""

    vocab_size: int
    """Tokens."""
    d_model: int
    """Residual width D."""
    n_layers: int
    """Decoder blocks."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``n_heads``. Unused with MLA."""
    ffn_dim: int
    """Hidden width of the dense SwiGLU MLP."""
    head_dim: int | None = None
    """Per-head dims of q/k/v; default ``d_model // n_heads`` (must then divide evenly)."""
    qk_norm: bool = False
    """RMSNorm each head of q and k before rotary (Qwen3)."""
    rope_theta: float = 500000.0
    """Rotary base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    moe: MoEConfig | None = None
    """Mixture-of-experts MLP, or ``None`` for dense."""
    mla: MLAConfig | None = None
    """Multi-head latent attention, or ``None`` for grouped-query attention."""

    def __post_init__(self) -> None:
        _check_positive(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Invalid n_kv_heads={self.n_kv_heads} for n_heads={self.n_heads}. Must divide n_heads."
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"Invalid n_heads={self.n_heads} for d_model={self.d_model}. Must divide d_model, "
                "or set head_dim explicitly."
            )
        if self.mla is None and self.resolved_head_dim % 2:
            raise ValueError(f"Invalid head_dim={self.resolved_head_dim}. Must be even (rotary pairs).")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads


def _rotate(x: Tensor, theta: float) -> Tensor:
    """Rotary position embedding of ``x`` (B, H, T, E), E even; half-split pairs as Llama."""
    t, e = x.shape[-2], x.shape[-1]
    inv = theta ** (-torch.arange(0, e, 2, device=x.device, dtype=torch.float32) / e)  # (E/2,)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)  # (T, E/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases: (..., D) -> (..., D)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StackedExperts(nn.Module):
    """X SwiGLU experts as three 3-D params: ``gate_proj`` (X, I, D), ``up_proj`` (X, I, D),
    ``down_proj`` (X, D, I); slice j is expert j's ``nn.Linear`` weight (out, in), so expert
    j computes what :class:`SwiGLU` with those weights computes.

    ``forward(x, j)``: (T_j, D) rows routed to expert j -> (T_j, D).
    """

    def __init__(self, d: int, m: MoEConfig) -> None:
        super().__init__()
        x, i = m.n_experts, m.expert_ffn_dim
        self.gate_proj = nn.Parameter(torch.empty(x, i, d))
        self.up_proj = nn.Parameter(torch.empty(x, i, d))
        self.down_proj = nn.Parameter(torch.empty(x, d, i))
        if self.gate_proj.device.type != "meta":  # nn.Linear's default init, per slice
            for w in (self.gate_proj, self.up_proj, self.down_proj):
                bound = w.shape[-1] ** -0.5
                nn.init.uniform_(w, -bound, bound)

    def forward(self, x: Tensor, j: int) -> Tensor:
        return (F.silu(x @ self.gate_proj[j].T) * (x @ self.up_proj[j].T)) @ self.down_proj[j].T


class MoE(nn.Module):
    """``router`` Linear(D, E), ``experts.{j}`` (:class:`SwiGLU`; ``MoEConfig.stacked``: one
    :class:`StackedExperts`), optional ``shared_experts``.

    Each token goes to its top-k experts, weighted by the renormalised router scores; experts
    no token picked are not run in that forward (their grads are absent, as in any MoE).
    """

    def __init__(self, d: int, m: MoEConfig) -> None:
        super().__init__()
        self.cfg = m
        self.router = nn.Linear(d, m.n_experts, bias=False)
        if m.stacked:
            self.experts = StackedExperts(d, m)
        else:
            self.experts = nn.ModuleList(SwiGLU(d, m.expert_ffn_dim) for _ in range(m.n_experts))
        if m.n_shared_experts:
            self.shared_experts = SwiGLU(d, m.n_shared_experts * m.expert_ffn_dim)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (B*T, D)
        logits = self.router(flat)
        scores = logits.softmax(-1) if self.cfg.scoring == "softmax" else logits.sigmoid()
        weight, chosen = scores.topk(self.cfg.top_k, dim=-1)  # (B*T, k)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts(flat[rows], e) if self.cfg.stacked else self.experts[e](flat[rows])
            out.index_add_(0, rows, y * weight[rows, slot, None])
        if self.cfg.n_shared_experts:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


class GQAttention(nn.Module):
    """Grouped-query attention with one fused ``qkv_proj`` Linear(D, (H + 2 KV) E) and
    ``o_proj`` Linear(H E, D); optional ``q_norm`` / ``k_norm`` RMSNorm(E) per head."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.h, self.kv, self.e, self.theta = c.n_heads, c.n_kv_heads, c.resolved_head_dim, c.rope_theta
        self.qkv_proj = nn.Linear(c.d_model, (self.h + 2 * self.kv) * self.e, bias=False)
        self.o_proj = nn.Linear(self.h * self.e, c.d_model, bias=False)
        if c.qk_norm:
            self.q_norm = nn.RMSNorm(self.e, eps=c.norm_eps)
            self.k_norm = nn.RMSNorm(self.e, eps=c.norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.h * self.e, self.kv * self.e, self.kv * self.e], dim=2)
        q, k, v = (z.view(b, t, -1, self.e).transpose(1, 2) for z in (q, k, v))  # (B, heads, T, E)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, self.theta), _rotate(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention: ``q_a_proj`` -> ``q_a_norm`` -> ``q_b_proj``;
    ``kv_a_proj`` (latent + shared rope key) -> ``kv_a_norm`` -> ``kv_b_proj``; ``o_proj``."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        m = c.mla
        self.m, self.h, self.theta = m, c.n_heads, c.rope_theta
        qk = m.qk_nope_dim + m.qk_rope_dim
        self.q_a_proj = nn.Linear(c.d_model, m.q_lora_rank, bias=False)
        self.q_a_norm = nn.RMSNorm(m.q_lora_rank, eps=c.norm_eps)
        self.q_b_proj = nn.Linear(m.q_lora_rank, self.h * qk, bias=False)
        self.kv_a_proj = nn.Linear(c.d_model, m.kv_lora_rank + m.qk_rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(m.kv_lora_rank, eps=c.norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.h * (m.qk_nope_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.h * m.v_head_dim, c.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        m, h = self.m, self.h
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(b, t, h, -1).transpose(1, 2)
        q_nope, q_rope = q.split([m.qk_nope_dim, m.qk_rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([m.kv_lora_rank, m.qk_rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(b, t, h, -1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_dim, m.v_head_dim], dim=-1)
        k_rope = _rotate(k_rope.unsqueeze(1), self.theta).expand(b, h, t, m.qk_rope_dim)
        q = torch.cat([q_nope, _rotate(q_rope, self.theta)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, v_head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _DecoderBlock(nn.Module):
    def __init__(self, c: DecoderConfig, dense: bool) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.self_attn = GQAttention(c) if c.mla is None else MLAttention(c)
        self.post_attn_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.mlp = SwiGLU(c.d_model, c.ffn_dim) if dense else MoE(c.d_model, c.moe)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_norm(x))
        return x + self.mlp(self.post_attn_norm(x))


class Decoder(nn.Module):
    """``embed_tokens``, ``layers.{i}.{input_norm, self_attn.*, post_attn_norm, mlp.*}``,
    ``norm``, ``lm_head`` (untied).

    ``forward(idx)``: (B, T) int64 token ids -> (B, T, V) logits.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = c = config
        dense_layers = c.n_layers if c.moe is None else c.moe.first_dense_layers
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(_DecoderBlock(c, i < dense_layers) for i in range(c.n_layers))
        self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# ----- the presets ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """A named configuration: ``build()`` makes the module; ``published_params`` is the size
    its authors state (``None`` for ours), ``source`` where that figure and the config come from."""

    name: str
    family: str
    config: GPT2Config | DecoderConfig
    published_params: int | None
    published_rounding: int
    """Rounding unit of ``published_params`` (1 = exact; 10**8 for '30.5B')."""
    source: str

    def build(self) -> nn.Module:
        return GPT2(self.config) if isinstance(self.config, GPT2Config) else Decoder(self.config)


_LLAMA3_SOURCE = (
    "Llama 3 paper (Grattafiori et al., arXiv:2407.21783, Table 3) and the Hugging Face "
    "config.json of meta-llama/Meta-Llama-3-{8B,70B} (vocab 128256, rope_theta 5e5); totals "
    "from the safetensors index of the same repositories"
)

#: Every preset by name. ``published_params`` are exact where the authors publish exact counts
#: (Hugging Face safetensors totals) and rounded otherwise (the test's tolerance says which).
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "gpt2-small",
            "gpt2",
            GPT2Config(),
            124_439_808,
            1,
            "OpenAI GPT-2 (Radford et al. 2019); config.json and parameter count of "
            "openai-community/gpt2 on Hugging Face ('124M')",
        ),
        Preset(
            "llama3-8b",
            "llama",
            DecoderConfig(
                vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336
            ),
            8_030_261_248,
            1,
            _LLAMA3_SOURCE,
        ),
        Preset(
            "llama3-70b",
            "llama",
            DecoderConfig(
                vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672
            ),
            70_553_706_496,
            1,
            _LLAMA3_SOURCE,
        ),
        # Ours: trainable on CPU in seconds. Dims divisible by neither 3 nor 4 (d_model 230,
        # qkv rows 322, ffn 614, vocab 262), so FSDP2's dim-0 padding shows at W = 3 and 4.
        Preset(
            "llama-tiny",
            "llama",
            DecoderConfig(
                vocab_size=262, d_model=230, n_layers=3, n_heads=5, n_kv_heads=1, ffn_dim=614
            ),
            None,
            1,
            "DMuon's own test size (byte vocabulary plus 6 spare ids)",
        ),
        Preset(
            "qwen3-30b-a3b",
            "moe",
            DecoderConfig(
                vocab_size=151936,
                d_model=2048,
                n_layers=48,
                n_heads=32,
                n_kv_heads=4,
                head_dim=128,
                ffn_dim=6144,
                qk_norm=True,
                rope_theta=1e6,
                norm_eps=1e-6,
                moe=MoEConfig(n_experts=128, top_k=8, expert_ffn_dim=768),
            ),
            30_500_000_000,
            100_000_000,
            "Hugging Face Qwen/Qwen3-30B-A3B model card ('30.5B in total, 3.3B activated') "
            "and config.json",
        ),
        Preset(
            "deepseek-v3-like",
            "moe",
            DecoderConfig(
                vocab_size=129280,
                d_model=7168,
                n_layers=61,
                n_heads=128,
                n_kv_heads=128,
                ffn_dim=18432,
                rope_theta=10000.0,
                norm_eps=1e-6,
                moe=MoEConfig(
                    n_experts=256,
                    top_k=8,
                    expert_ffn_dim=2048,
                    n_shared_experts=1,
                    first_dense_layers=3,
                    scoring="sigmoid",
                ),
                mla=MLAConfig(
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128
                ),
            ),
            671_000_000_000,
            1_000_000_000,
            "DeepSeek-V3 Technical Report (arXiv:2412.19437: '671B total parameters', without "
            "the 14B multi-token-prediction module) and deepseek-ai/DeepSeek-V3 config.json. "
            "'Like': no routing groups, no score-correction bias, no MTP module",
        ),
    )
}


def _stacked(name: str, base: Preset) -> Preset:
    """``base`` with its routed experts as 3-D expert stacks (``MoEConfig.stacked``): the same
    config, parameter count and function; the layout expert parallelism shards."""
    config = dataclasses.replace(base.config, moe=dataclasses.replace(base.config.moe, stacked=True))
    return Preset(name, base.family, config, base.published_params, base.published_rounding,
                  f"{base.source}. Experts stacked as torchtitan's GroupedExperts (w1/w3/w2 as "
                  "experts.gate_proj/up_proj/down_proj), the layout `dmuon-plan --ep` shards")


#: DeepSeek-V3-like with expert stacks: 58 MoE layers of three (256, ·, ·) stacks, what
#: ``dmuon-plan --ep`` plans (the config checked against deepseek-ai/DeepSeek-V3's
#: inference/configs/config_671B.json: dim 7168, inter_dim 18432, moe_inter_dim 2048,
#: n_layers 61, n_dense_layers 3, n_heads 128, 256 routed + 1 shared experts, 8 activated,
#: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, vocab 129280).
PRESETS["deepseek-v3-like-stacked"] = _stacked("deepseek-v3-like-stacked", PRESETS["deepseek-v3-like"])


def build_preset(name: str, device: str | torch.device = "meta") -> nn.Module:
    """Build preset ``name`` with its parameters on ``device`` (default meta: no memory).

    Initialisation is torch's per-layer default (the shapes are the point; train from your
    own init). Raises ``ValueError`` for an unknown name.
    """
    if name not in PRESETS:
        raise ValueError(f"Invalid preset {name=}. Must be one of {sorted(PRESETS)}.")
    with torch.device(device):
        return PRESETS[name].build()


def resolve_model(spec: str) -> Callable[[], nn.Module]:
    """A factory for ``spec``: a preset name or ``pkg.module:factory`` (importable from the
    current directory, for a console script too; called under meta;
    returning an ``nn.Module``, or ``(model, loss_fn)`` as ``verify-traffic``'s factories do).

    Raises:
        ValueError: an unknown preset, or a ``module:factory`` that cannot be imported or is
            not callable.
    """
    if spec in PRESETS:
        return lambda: build_preset(spec)
    if ":" not in spec:
        raise ValueError(
            f"Invalid model={spec!r}. Must be a preset ({', '.join(sorted(PRESETS))}) or "
            "'pkg.module:factory' (a callable returning an nn.Module)."
        )
    import importlib
    import os
    import sys

    module_name, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:  # a console script: as `python -m` does
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"Invalid model={spec!r}: {exc}. Must name an importable callable.") from exc
    if not callable(factory):
        raise ValueError(f"Invalid model={spec!r}: {attr} is not callable.")

    def build() -> nn.Module:
        with torch.device("meta"):
            model = factory()
        if isinstance(model, tuple) and model and isinstance(model[0], nn.Module):
            model = model[0]  # a verify-traffic factory: (model, loss_fn)
        if not isinstance(model, nn.Module):
            raise ValueError(f"Invalid model={spec!r}: the factory returned {type(model).__name__}, not an nn.Module.")
        return model

    return build


