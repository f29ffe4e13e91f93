"""The reference expert-parallel (EP) MoE layer: copy it into a model, shard its experts over a
1-D ``mesh["ep"]`` with :func:`shard_experts`, and every rank holds only its experts while
tokens travel to them by all_to_all (the layout of docs/user-guide.md, "Expert parallelism:
the reference layer").

Params of one :class:`EPMoE` (X experts, model width D, expert width F), transformers-5 style
fused stacks with Qwen3-MoE's math (SwiGLU experts, softmax top-k routing):

- ``router (X, D)``: a plain tensor, the same on every rank (data parallel);
- ``gate_up_proj (X, 2F, D)``: rows ``[0, F)`` of expert ``x`` are its gate projection, rows
  ``[F, 2F)`` its up projection (Hugging Face's ``Qwen3MoeExperts.gate_up_proj``);
- ``down_proj (X, D, F)``.

After :func:`shard_experts` the two stacks are DTensors with placements ``(Shard(0),)`` on the
EP mesh of E ranks: EP rank e holds experts ``[e·X/E, (e+1)·X/E)`` as a local ``(X/E, ·, ·)``
stack. Without a mesh the same forward runs in one process with every expert local (E = 1):
that unsharded layer is the oracle the tests compare the EP ranks with.

Forward on one rank, for its own tokens (T = the product of the leading dims):

1. route: ``softmax(x @ routerᵀ)`` in fp32, top-k experts and gates per token (gates divided
   by their sum when ``norm_topk_prob``), the T·k (token, expert) assignments sorted by expert;
2. counts: this rank's per-expert assignment counts ``(X,)`` int64 go to their experts' ranks
   by one ``all_to_all_single`` over the EP group, so each rank learns how many rows it gets
   from each peer for each of its local experts (``(E, X/E)``);
3. dispatch: the sorted token rows go to their experts' ranks by
   ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (differentiable:
   its backward is the transposed all_to_all, so each expert's grad sums every token of the
   EP group routed to it; checked on gloo with torch 2.13 and 2.11);
4. the local experts run on their rows, grouped by expert (every local expert runs, also on
   zero rows, so an expert that got no token has a zero grad slice, never a missing one);
5. combine: the results go back by the transposed all_to_all, are put back in token order,
   weighted by the gates and summed over the k choices.

Every rank issues the three all_to_alls of every forward (and the two transposes in backward)
even when it sends zero rows to a peer or an expert gets none, so nothing hangs.

Build the tiny Qwen3-MoE whose sparse blocks are EPMoE with :func:`tiny_qwen3_moe_ep` (or
:func:`tiny_qwen3_moe` then :func:`replace_qwen3_moe_blocks`); :func:`tiny_qwen3_moe` with the
same seed, before the replacement, is its oracle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

#: The expert stacks of an :class:`EPMoE`, sharded over the EP mesh by :func:`shard_experts`.
EXPERT_STACKS = ("gate_up_proj", "down_proj")


class EPMoE(nn.Module):
    """Top-k routed SwiGLU experts, expert parallel once :func:`shard_experts` has run.

    Args:
        d_model: D, the width of the tokens.
        d_ff: F, each expert's hidden width.
        n_experts: X, the number of experts (global, over the whole EP group).
        top_k: k, experts per token, ``1 <= k <= X``.
        norm_topk_prob: divide each token's k gates by their sum (Qwen3-MoE's config flag).

    The params are created uninitialised (``torch.empty``): fill them (``nn.init``, or
    :meth:`from_hf`) before :func:`shard_experts`, with the same values on every rank.

    Raises:
        ValueError: a non-positive size, or ``top_k`` outside ``[1, n_experts]``.
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int,
                 norm_topk_prob: bool = True) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("d_ff", d_ff), ("n_experts", n_experts)):
            if value < 1:
                raise ValueError(f"Invalid EPMoE {name}={value}. Must be >= 1.")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"Invalid EPMoE top_k={top_k}. Must be in [1, n_experts={n_experts}].")
        self.d_model, self.d_ff, self.n_experts, self.top_k = d_model, d_ff, n_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Parameter(torch.empty(n_experts, d_model))
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        #: The EP mesh the stacks are sharded over (set by :func:`shard_experts`), or None.
        self.ep_mesh: DeviceMesh | None = None

    @classmethod
    def from_hf(cls, block: nn.Module) -> EPMoE:
        """An EPMoE carrying a Hugging Face ``Qwen3MoeSparseMoeBlock``'s own weights (copies, on
        the block's device, in its dtype).

        Raises:
            ValueError: the block's experts use another activation than SiLU.
        """
        experts, gate = block.experts, block.gate
        act = type(experts.act_fn).__name__
        if act not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"Invalid experts act_fn={act}. EPMoE computes SwiGLU: must be SiLU.")
        x, two_f, d = experts.gate_up_proj.shape
        layer = cls(d, two_f // 2, x, gate.top_k, gate.norm_topk_prob).to(
            device=experts.gate_up_proj.device, dtype=experts.gate_up_proj.dtype)
        with torch.no_grad():
            for name, src in (("router", gate.weight), ("gate_up_proj", experts.gate_up_proj),
                              ("down_proj", experts.down_proj)):
                getattr(layer, name).copy_(src)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., D) -> (..., D)``, any float dtype (routing in fp32, as Qwen3-MoE's).

        Raises:
            ValueError: the last dim of ``x`` is not D.
        """
        if x.shape[-1] != self.d_model:
            raise ValueError(f"Invalid EPMoE input shape {tuple(x.shape)}: last dim must be "
                             f"d_model={self.d_model}.")
        shape, k = x.shape, self.top_k
        x = x.reshape(-1, self.d_model)
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float)
        gates, experts = probs.topk(k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        flat = experts.reshape(-1)  # (T·k,) the expert of each assignment
        order = flat.argsort(stable=True)  # assignments by expert
        counts = torch.bincount(flat, minlength=self.n_experts)  # (X,) int64
        rows = self._exchange(x[order // k], counts)  # (T·k, D) in `order`
        y = torch.empty_like(rows).index_copy(0, order, rows).view(-1, k, self.d_model)
        return (y * gates.to(y.dtype).unsqueeze(-1)).sum(dim=1).view(shape)

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch ``rows`` (sorted by expert, ``counts (X,)`` of each), run the experts,
        combine: each row's expert output, in the same order."""
        mesh = self.ep_mesh
        e = 1 if mesh is None else mesh.size()
        local = self.n_experts // e
        if mesh is None:
            return self._experts(rows, counts.view(1, local))
        group = mesh.get_group()
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # (E·X/E,) from each peer
        recv_counts = recv_counts.view(e, local)
        send_splits = counts.view(e, local).sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        got = funcol.wait_tensor(funcol.all_to_all_single_autograd(
            rows, recv_splits, send_splits, group))
        out = self._experts(got, recv_counts)
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(
            out, send_splits, recv_splits, group))

    def _experts(self, rows: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """The local experts on ``rows`` ordered by (source rank, local expert) with
        ``recv_counts (E, X/E)`` rows per pair; their outputs in the same order."""
        perm = self._by_expert(recv_counts)
        gate_up, down = (_local(getattr(self, n)) for n in EXPERT_STACKS)
        segments = rows[perm].split(recv_counts.sum(dim=0).tolist())
        outs = []
        for j, seg in enumerate(segments):  # every local expert, also on zero rows
            g, u = F.linear(seg, gate_up[j]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(g) * u, down[j]))
        return torch.empty_like(rows).index_copy(0, perm, torch.cat(outs))

    @staticmethod
    def _by_expert(recv_counts: torch.Tensor) -> torch.Tensor:
        """The permutation that orders rows received source-major by local expert (stable)."""
        e, local = recv_counts.shape
        experts = torch.arange(local, device=recv_counts.device).repeat(e)
        expert_of_row = experts.repeat_interleave(recv_counts.reshape(-1))
        return expert_of_row.argsort(stable=True)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A stack's local experts: the DTensor's local shard (differentiable), or ``p`` itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard the expert stacks of every :class:`EPMoE` in ``module`` over ``ep_mesh`` (in place).

    Each stack ``(X, a, b)``, the same full values on every rank, becomes a DTensor param with
    placements ``(Shard(0),)``: EP rank e keeps experts ``[e·X/E, (e+1)·X/E)`` (a local split,
    no collective). Routers and every other param stay plain tensors. Everything is checked
    before anything changes, on every rank, before any collective.

    Args:
        module: a model holding EPMoE layers (or one EPMoE).
        ep_mesh: the 1-D EP mesh, ``mesh["ep"]`` of a ``("shard", "ep")`` or
            ``("replicate", "shard", "ep")`` mesh (or a 1-D ``("ep",)`` mesh).

    Returns:
        ``module``.

    Raises:
        ValueError: ``ep_mesh`` is not 1-D; ``module`` holds no EPMoE; a layer's X is not a
            multiple of the EP size; a layer is sharded already.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"Invalid ep_mesh with {ep_mesh.ndim} dims {ep_mesh.mesh_dim_names}. "
                         f"Must be 1-D: pass mesh['ep'].")
    e = ep_mesh.size()
    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, EPMoE)]
    if not layers:
        raise ValueError(f"Invalid module {type(module).__name__}: holds no EPMoE to shard.")
    for name, m in layers:
        if m.ep_mesh is not None:
            raise ValueError(f"Invalid EPMoE {name or '<root>'}: sharded already; call "
                             f"shard_experts once, on full stacks.")
        if m.n_experts % e:
            raise ValueError(f"Invalid EPMoE {name or '<root>'} n_experts={m.n_experts}: must be "
                             f"a multiple of the EP size {e}; change the experts or mesh['ep'].")
    for _, m in layers:
        for stack in EXPERT_STACKS:
            full = getattr(m, stack).detach()
            setattr(m, stack, nn.Parameter(
                distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)))
        m.ep_mesh = ep_mesh
    return module


#: :func:`tiny_qwen3_moe`'s ``Qwen3MoeConfig`` fields: vocab 64, hidden 32, 2 layers, 4 heads
#: (2 KV, head dim 8), 8 experts of width 16, top-2, ``norm_topk_prob=True``.
TINY_QWEN3_MOE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
                      tie_word_embeddings=False, intermediate_size=48, moe_intermediate_size=16,
                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                      norm_topk_prob=True)


def tiny_qwen3_moe(seed: int = 0, **overrides):
    """A tiny Hugging Face ``Qwen3MoeForCausalLM`` (transformers 5, no download), seeded: the
    config :data:`TINY_QWEN3_MOE` with ``overrides``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides}))


def replace_qwen3_moe_blocks(model: nn.Module) -> nn.Module:
    """Replace every ``Qwen3MoeSparseMoeBlock`` of ``model`` by :meth:`EPMoE.from_hf` (in place).

    The result computes what the Hugging Face model computes (same routing: fp32 softmax,
    top-k, ``norm_topk_prob`` as its config says), so the model before the replacement is the
    oracle; then :func:`shard_experts` makes it expert parallel.

    Raises:
        ValueError: ``model`` holds no sparse MoE block.
    """
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, Qwen3MoeSparseMoeBlock)]
    if not blocks:
        raise ValueError(f"Invalid model {type(model).__name__}: holds no Qwen3MoeSparseMoeBlock.")
    for name, block in blocks:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, EPMoE.from_hf(block))
    return model


def tiny_qwen3_moe_ep(ep_mesh: DeviceMesh | None = None, seed: int = 0, **overrides) -> nn.Module:
    """:func:`tiny_qwen3_moe` with its sparse blocks replaced by EPMoE, expert-sharded over
    ``ep_mesh`` when given (:func:`shard_experts`; its errors), else unsharded."""
    model = replace_qwen3_moe_blocks(tiny_qwen3_moe(seed, **overrides))
    return model if ep_mesh is None else shard_experts(model, ep_mesh)
