"""Rank-side tasks of ``test_z3_memory.py``: what a rank holds at every hook of a
step, measured from outside DMuon's schedule.

The models: a tiny Hugging Face Llama from a config (no download) called as Hugging Face
nests it (``model.model.layers.i``: ``model.model`` is called and encloses every block), the
same layers called from a flat root (``layers.i``, the root's own children), and an
encoder-decoder of two enclosing stacks. Each layer is one unit (``COALESCE_BYTES``).

The measuring hook is the test's own: a forward pre- and post-hook on every module, a hook
on every tensor output that requires grad (it fires when that output's grad is computed,
the module's backward) and a post-accumulate-grad hook on every param. At each it sums the
storage bytes (``untyped_storage().nbytes()``: 0 once freed) of the buckets this rank does
not hold: their compute copies, and their flat grad buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._pytree import tree_leaves

import dmuon

VOCAB, SEQ, ROWS = 64, 16, 2
#: The issue's Llama (8 layers, 256 / 512: 2.62 MB units under "auto") at a quarter of its
#: bytes, to keep the test fast on 2 cores; a unit target below one layer keeps one unit (one
#: uneven aligned group on gloo) per layer, as "auto" gives the full-size model.
HIDDEN, INTERMEDIATE, LAYERS = 128, 256, 8
COALESCE_BYTES = 2**19


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


class FlatLlama(nn.Module):
    """The Hugging Face Llama's modules with its decoder layers as the root's children
    (``layers.i``): no module encloses the blocks and is called."""

    def __init__(self) -> None:
        super().__init__()
        hf = _llama()
        self.embed, self.rotary = hf.model.embed_tokens, hf.model.rotary_emb
        self.layers, self.norm, self.head = hf.model.layers, hf.model.norm, hf.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        rope = self.rotary(x, position_ids=pos)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_embeddings=rope, position_ids=pos)
        return self.head(self.norm(x))


class Block(nn.Module):
    """A residual MLP block of two bias-free Linears, ``d`` → ``hidden`` → ``d``."""

    def __init__(self, d: int = HIDDEN, hidden: int = 4 * HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """``n`` :class:`Block` s (``layers.i``), called in order: the enclosing module a nested
    model calls (Hugging Face's ``model.model``)."""

    def __init__(self, n: int, **block_dims) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(**block_dims) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderDecoder(nn.Module):
    """Two enclosing stacks (``encoder.layers.i``, ``decoder.layers.i``), both called; the
    decoder reads the encoder's output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.encoder, self.decoder = Stack(LAYERS // 2), Stack(LAYERS // 2)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(self.decoder(x + self.encoder(x)))


def make(kind: str) -> tuple[nn.Module, callable]:
    """The model and its loss(ids)."""
    if kind == "nested":
        model = _llama()
        return model, lambda ids: model(input_ids=ids, labels=ids).loss
    model = FlatLlama() if kind == "flat" else EncoderDecoder()
    return model, lambda ids: nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


class Meter:
    """Peak bytes of the non-held buckets' compute copies and grad buffers, per pass."""

    def __init__(self, dm) -> None:
        self.buckets = [b for b in dm.buckets if not b.is_holder]
        self.peak = {"forward": 0, "backward": 0, "grads": 0}
        self.on = False

    def __call__(self, *_) -> None:
        if not self.on:
            return
        copies = sum(b.lp.untyped_storage().nbytes() for b in self.buckets)
        grads = sum(b.grad_flat.untyped_storage().nbytes() for b in self.buckets
                    if b.grad_flat is not None)
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.peak[phase] = max(self.peak[phase], copies)
        self.peak["grads"] = max(self.peak["grads"], grads)

    def attach(self, model: nn.Module) -> None:
        def on_output(module, args, output):
            self()
            if torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda grad: self())

        for m in model.modules():
            m.register_forward_pre_hook(lambda *a: self())
            m.register_forward_hook(on_output)
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self)


def peaks(kind: str, z3: bool = True, steps: int = 2) -> dict:
    """Train ``steps`` steps (W ranks, ``COALESCE_BYTES``, ``rest="replicate"``) and return
    this rank's peaks over the last one, with the unit sizes and ``dm.coalescing()``."""
    model, loss_of = make(kind)
    dm = dmuon.dedicate_params(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                               reshard_after_forward=z3, rest="replicate",
                               coalesce=COALESCE_BYTES)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    meter = Meter(dm)
    meter.attach(model)
    for step in range(steps):
        meter.on = step == steps - 1
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss_of(torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    report = dm.coalescing()
    out = {"peak": meter.peak, "units": [u["bytes"] for u in report["units"]],
           "z3_peak_bytes": report["z3_peak_bytes"],
           "non_held_bytes": sum(b.numel * b.lp.element_size() for b in meter.buckets)}
    dm.close()
    return out
