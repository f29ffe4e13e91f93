"""Context parallelism (CP) for a small causal decoder, written so that it runs on gloo: each CP
rank holds every param and a contiguous part of each sequence, and its attention all-gathers the
keys and values of the whole sequence over the CP group (torch's ``context_parallel`` ring
attention needs a CUDA SDPA backend). Forward and backward equal the single-process model on
the whole sequence (the all-gather's backward sums each rank's key / value grads and keeps its
own part).

With DMuon, CP is a shard dim: ``dedicate_params(model, mesh, shard_dims=("dp_shard", "cp"))``;
the owners span ``dp_shard × cp`` and the grads are averaged over every data-parallel and CP
rank, which with each rank's loss the mean over its tokens (equal parts) is the mean over the
whole batch (docs/user-guide.md, "Meshes").

    model = CPDecoder(vocab=64, dim=32, layers=2, heads=4, max_len=32)
    loss = model.loss(ids[:, part], targets[:, part], offset=c * part_len, cp_group=mesh["cp"].get_group())
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _GatherSequence(torch.autograd.Function):
    """``(B, H, L, D)`` parts -> ``(B, H, C·L, D)`` in CP-group rank order; backward: the sum of
    every rank's grad of the whole sequence (an all_reduce: gloo has no reduce_scatter), this
    rank's part of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        me = dist.get_group_rank(ctx.group, dist.get_rank())
        return grad.chunk(dist.get_world_size(ctx.group), dim=2)[me].contiguous(), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence of ``x`` (``(B, H, L, D)``, this rank's part) over the CP ``group``;
    ``x`` itself without a group."""
    return x if group is None else _GatherSequence.apply(x, group)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc1 = nn.Linear(dim, 2 * dim, bias=False)
        self.fc2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, offset: int, cp_group) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        k, v = gather_sequence(k, cp_group), gather_sequence(v, cp_group)
        q_pos = torch.arange(offset, offset + L, device=x.device)
        k_pos = torch.arange(k.shape[2], device=x.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # causal over the whole sequence's positions
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CPDecoder(nn.Module):
    """A causal decoder whose forward takes this rank's part of each sequence, its offset in
    the sequence and the CP group (``None``: the whole sequence, one process)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 4,
                 max_len: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, offset: int = 0, cp_group=None) -> torch.Tensor:
        pos = torch.arange(offset, offset + ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x, offset, cp_group)
        return self.head(self.norm(x))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, offset: int = 0, cp_group=None):
        """Mean next-token cross-entropy over this rank's tokens (``targets``: the ids shifted by
        one, this rank's part)."""
        logits = self(ids, offset, cp_group)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
