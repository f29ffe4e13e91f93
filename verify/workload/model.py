"""TinyGPT: the small byte-level GPT-style decoder that the traffic verification trains.

Shapes use B = batch, T = sequence length (<= ``seq_len``), D = ``d_model``, H = ``n_heads``,
V = ``vocab_size``. Module names are stable (the ownership plan and the predicted collective
list are keyed on them)::

    tok_emb, pos_emb,
    blocks.{i}.ln1, blocks.{i}.attn.qkv, blocks.{i}.attn.proj,
    blocks.{i}.ln2, blocks.{i}.mlp.fc1, blocks.{i}.mlp.fc2,
    ln_f, head

The Muon targets are the hidden 2-D weights (``qkv``, ``proj``, ``fc1``, ``fc2``); embeddings,
norms and the untied output head are AdamW's (as recommended for Muon by torch.optim.Muon's
docs). No buffers are registered: the model's state is exactly its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPTConfig", "TinyGPT"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Size of a :class:`TinyGPT`. The defaults give 135,808 params (530.5 KiB of float32)."""

    vocab_size: int = 256
    """Tokens are bytes, so 256 by default."""
    seq_len: int = 64
    """Longest input sequence (rows of the learned position embedding)."""
    d_model: int = 64
    """Residual stream width D."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Invalid {name}={value!r}. Must be a positive int.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"Invalid n_heads={self.n_heads} for d_model={self.d_model}. Must divide "
                "d_model (each head has d_model // n_heads dims)."
            )


class CausalSelfAttention(nn.Module):
    """``qkv`` Linear(D, 3D) -> causal SDPA over H heads -> ``proj`` Linear(D, D); no biases."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        #: ``None``, or an object whose ``observe_qk(q, k, scaling=, is_causal=True)`` receives
        #: every training forward's q, k (B, H, T, D / H): MuonClip's per-head max logit
        #: (``dmuon.optim.qk_clip.HeadLogitMax``); not a module, not in the state.
        self.qk_observer = None
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, T, D) -> (B, T, D)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)  # each (B, T, D)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if self.qk_observer is not None and self.training:
            self.qk_observer.observe_qk(q, k, scaling=q.shape[-1] ** -0.5, is_causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D / H)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """``fc1`` Linear(D, 4D) -> GELU -> ``fc2`` Linear(4D, D); no biases."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model, bias=False)
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, T, D) -> (B, T, D)."""
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, T, D) -> (B, T, D)."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level GPT-style decoder with learned positions and an untied output head.

    Init (deterministic given ``torch.manual_seed``, in module registration order): Linear and
    Embedding weights ~ N(0, 0.02), with the residual projections (``attn.proj``, ``mlp.fc2``)
    scaled by 1 / sqrt(2 * n_layers) as in GPT-2; LayerNorms weight 1, bias 0.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        c = self.config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every parameter from the current torch RNG (see the class docstring)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.proj", "mlp.fc2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``idx`` (B, T) int64 in [0, V), T <= seq_len -> logits (B, T, V), float.

        Raises:
            ValueError: ``idx`` not a 2-D integer tensor or T > ``seq_len``.
        """
        if idx.ndim != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"Invalid idx shape={tuple(idx.shape)} dtype={idx.dtype}. Must be a (batch, "
                "seq) int64 tensor of token ids."
            )
        t = idx.size(1)
        if t > self.config.seq_len:
            raise ValueError(
                f"Invalid idx sequence length={t}. Must be <= seq_len={self.config.seq_len} "
                "(the position embedding's rows); raise GPTConfig.seq_len or crop the input."
            )
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy (nats) of ``forward(idx)`` against ``targets`` (B, T)."""
        if targets.shape != idx.shape:
            raise ValueError(
                f"Invalid targets shape={tuple(targets.shape)}. Must equal idx's shape "
                f"{tuple(idx.shape)}."
            )
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten().long())
