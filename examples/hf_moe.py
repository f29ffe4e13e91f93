"""A Hugging Face Qwen3-MoE from a tiny config (transformers 5, no download) for
``make verify-traffic ARGS="--nproc 2 --model examples.hf_moe:factory"``.

transformers 5 stores each layer's experts as two 3-D params (``mlp.experts.gate_up_proj
(E, 2I, H)``, ``mlp.experts.down_proj (E, H, I)``) and the router as a bare 2-D param
(``mlp.gate.weight (E, H)``); DMuon's default selection dedicates all of them
(docs/selection.md). Causal-LM loss on random token ids, one fixed batch per rank (the loss
falls within the harness's few steps).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, ROWS_PER_RANK = 64, 8, 2


def loss_fn(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """Next-token cross-entropy of rank ``rank``'s fixed batch (``step`` is ignored)."""
    ids = torch.randint(0, VOCAB, (ROWS_PER_RANK, SEQ), generator=torch.Generator().manual_seed(rank))
    ids = ids.to(next(model.parameters()).device)
    return model(input_ids=ids, labels=ids).loss


def factory() -> tuple[nn.Module, object]:
    """Qwen3-MoE: 2 layers of 4 experts (top-2), hidden 32, untied head."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            max_position_embeddings=SEQ, tie_word_embeddings=False,
                            intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                            num_experts_per_tok=2, decoder_sparse_step=1)
    return Qwen3MoeForCausalLM(config), loss_fn
