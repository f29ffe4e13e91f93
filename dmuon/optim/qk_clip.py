"""MuonClip's QK-clip (Kimi K2, arXiv 2507.20534 §2.1) on DMuon's owners.

Per attention head h the forward records S_h, the largest pre-softmax logit
``scaling · q_i · k_j`` of the step (over the batch, every micro-batch and every position
pair the mask lets attend; RoPE and any q/k norm applied, as the model computes them). At
``step()``, after the Muon / AdamW update and before DMuon refreshes the compute copies and
HSDP replicas from the masters, every head with S_h > τ is clipped::

    γ_h = min(1, τ / S_h)
    W_q[rows of query head h] *= γ_h ** α
    W_k[rows of KV head g]    *= (min over the query heads h of g of γ_h) ** (1 - α)

**GQA** (n_rep = n_heads / n_kv_heads query heads share one KV head g): the key rows take the
factor of the group's most clipped head. Every clipped head's largest logit then ends at or
below τ (γ_h^α · γ_g^(1-α) ≤ γ_h because γ_g ≤ γ_h); the cost is that the other heads of the
group shrink by γ_g^(1-α) too. With MHA (n_rep = 1) this is the K2 report's rule exactly.
``alpha=1.0`` leaves shared keys untouched and puts the whole factor on each head's queries
(the report's rule for MLA's shared rotary key). A bias of q_proj / k_proj is scaled with its
rows (a logit scales with the whole of q).

**Collectives**: one ``all_reduce(MAX)`` per step of every layer's maxima packed into one
fp32 vector (``4 · Σ n_heads`` bytes) over DMuon's ``world`` group (all W ranks of the mesh;
on a TP mesh each rank fills only its own heads, the others stay -inf), phase ``qk_clip``,
span ``dmuon.qk_clip``. Every rank learns every head's S_h; each master is then scaled where
it is authoritative: a dedicated param on its owner(s) only (``dm.owned()``; the refresh
carries it to every other rank's copy), any other param (DDP-replicated, FSDP2 shard) on
every rank, a DTensor through its local shard.

The API: :class:`HeadLogitMax` (one attention layer: where its q and k rows are, and the
running maxima; ``observe_qk`` computes them from q and k, ``observe`` takes maxima a kernel
already returns, e.g. flex attention's ``max_scores``), :class:`QKClip` (the step post-hook;
``max_logits`` and ``clipped`` report the last step). The ready adapter for Hugging Face
attention with ``q_proj`` / ``k_proj``: :mod:`dmuon.optim.qk_clip_hf`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from dmuon import annotate
from dmuon.runtime import collectives


def _check_int(name: str, value, low: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}={value!r}. Must be an int >= {low}.")


class HeadLogitMax:
    """One attention layer's per-query-head maxima of the pre-softmax logits, and where its
    query and key rows live.

    Args:
        name: the layer's name (the key of :attr:`QKClip.max_logits`).
        q_weight, k_weight: the params whose rows produce q and k (``(rows, in)``; the same
            param for a fused qkv projection). Query head h is rows
            ``q_row0 + h·head_dim`` … ``+ head_dim``, KV head g rows ``k_row0 + g·head_dim`` …,
            query head h reads KV head ``h // (n_heads // n_kv_heads)`` (``repeat_kv``'s order).
        n_heads, n_kv_heads, head_dim: global counts (all TP ranks together).
        q_bias, k_bias: the projections' biases (``(rows,)``, same row layout), or ``None``.

    Attributes:
        maxima: ``(n_heads,)`` float32, the running maxima since the last step (-inf where
            nothing was observed), or ``None`` before the first observation.
        head_shard: set by :class:`QKClip`: which of the equal row shards of ``q_weight`` this
            rank holds when it computes fewer than ``n_heads`` heads (its heads are
            ``head_shard·h_local`` …; read from the weight's DTensor placements).

    Raises:
        ValueError: a count is not a positive int, ``n_heads`` is not a multiple of
            ``n_kv_heads``, or a weight has too few rows for its heads.
    """

    def __init__(self, name: str, q_weight: torch.Tensor, k_weight: torch.Tensor, *,
                 n_heads: int, n_kv_heads: int, head_dim: int, q_row0: int = 0, k_row0: int = 0,
                 q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None) -> None:
        for arg, v in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            _check_int(f"{name}: {arg}", v, 1)
        for arg, v in (("q_row0", q_row0), ("k_row0", k_row0)):
            _check_int(f"{name}: {arg}", v, 0)
        if n_heads % n_kv_heads:
            raise ValueError(f"Invalid {name}: n_heads={n_heads} is not a multiple of "
                             f"n_kv_heads={n_kv_heads}. Each KV head serves n_heads // n_kv_heads "
                             "query heads: pass the model's counts.")
        for what, w, row0, heads in (("q_weight", q_weight, q_row0, n_heads),
                                     ("k_weight", k_weight, k_row0, n_kv_heads)):
            if w.ndim != 2 or w.shape[0] < row0 + heads * head_dim:
                raise ValueError(
                    f"Invalid {name}: {what} of shape {tuple(w.shape)} has no rows "
                    f"{row0}..{row0 + heads * head_dim} for {heads} heads of head_dim {head_dim}. "
                    "Must be the 2-D (rows, in) projection weight whose rows are the heads.")
        self.name = name
        self.q_weight, self.k_weight, self.q_bias, self.k_bias = q_weight, k_weight, q_bias, k_bias
        self.q_row0, self.k_row0 = q_row0, k_row0
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.maxima: torch.Tensor | None = None
        self.head_shard = 0

    @torch.no_grad()
    def observe(self, max_logit: torch.Tensor) -> None:
        """Fold in one forward's maxima of this rank's heads.

        Args:
            max_logit: ``(h_local,)`` any float dtype: the largest pre-softmax logit of each
                head this rank computes (all ``n_heads``, or its TP shard of them).

        Raises:
            ValueError: ``max_logit`` is not 1-D or ``h_local`` does not divide ``n_heads``.
        """
        h = max_logit.shape[0] if max_logit.ndim == 1 else -1
        if h < 1 or self.n_heads % h:
            raise ValueError(f"Invalid {self.name}: max_logit of shape {tuple(max_logit.shape)}. "
                             f"Must be (h_local,), h_local dividing n_heads={self.n_heads}: one "
                             "value per head this rank computes.")
        if self.maxima is None:
            self.maxima = torch.full((self.n_heads,), -math.inf, dtype=torch.float32,
                                     device=max_logit.device)
        lo = 0 if h == self.n_heads else self.head_shard * h
        part = self.maxima[lo:lo + h]
        torch.maximum(part, max_logit.detach().to(part), out=part)

    @torch.no_grad()
    def observe_qk(self, q: torch.Tensor, k: torch.Tensor, *, scaling: float,
                   mask: torch.Tensor | None = None, is_causal: bool = False) -> None:
        """Fold in the maxima of ``scaling · q kᵀ`` over the positions that attend.

        Args:
            q: ``(B, h, Tq, head_dim)``, k: ``(B, h_kv, Tk, head_dim)``: what the attention
                kernel receives (after RoPE; h / h_kv this rank's heads), any float dtype
                (computed in float32, one batch row at a time: ``h·Tq·Tk`` floats at once).
            scaling: the softmax scale (``head_dim ** -0.5`` usually).
            mask: ``None``, a bool mask (True attends) or an additive float mask,
                broadcastable to ``(B, h, Tq, Tk)``.
            is_causal: without ``mask``, query i attends keys j ≤ i (top-left aligned, as
                ``scaled_dot_product_attention(is_causal=True)``).
        """
        b, h, tq, _ = q.shape
        rep = h // k.shape[1]
        if mask is None and is_causal:
            mask = torch.ones(tq, k.shape[2], dtype=torch.bool, device=q.device).tril()
        out = torch.full((h,), -math.inf, dtype=torch.float32, device=q.device)
        for i in range(b):
            s = q[i].float() @ k[i].float().repeat_interleave(rep, dim=0).transpose(-1, -2)
            s.mul_(scaling)
            if mask is not None:
                m = mask[i] if mask.ndim == 4 else mask
                s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
            torch.maximum(out, s.amax(dim=(1, 2)), out=out)
        self.observe(out)

    def take(self, device: torch.device) -> torch.Tensor:
        """The running maxima on ``device`` (-inf where none), reset for the next step."""
        out = (torch.full((self.n_heads,), -math.inf, dtype=torch.float32, device=device)
               if self.maxima is None else self.maxima.to(device))
        self.maxima = None
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def row_shard_index(w: torch.Tensor) -> int:
    """Which of the equal row shards of ``w`` this rank holds: 0 for a plain tensor; for a
    DTensor, its index along the mesh dims whose placement splits dim 0 (row-major, as torch
    splits them)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(w, DTensor):
        return 0
    index = 0
    for dim, pl in enumerate(w.placements):
        if isinstance(pl, Shard) and pl.dim % w.ndim == 0:
            index = index * w.device_mesh.size(dim) + w.device_mesh.get_local_rank(dim)
    return index


@torch.no_grad()
def scale_rows_(p: torch.Tensor, row0: int, factors: torch.Tensor, head_dim: int) -> None:
    """Multiply rows ``row0 + i·head_dim`` … ``+ head_dim`` of ``p`` (2-D weight or 1-D bias)
    by ``factors[i]`` in place, other rows unchanged. A DTensor is scaled through its local
    shard (the full row-scale cut by its own placements: any sharding, no communication)."""
    scale = torch.ones(p.shape[0], dtype=torch.float32, device=_local(p).device)
    scale[row0:row0 + factors.numel() * head_dim] = factors.to(scale).repeat_interleave(head_dim)
    full = scale.view(-1, *([1] * (p.ndim - 1))).expand(p.shape)
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    local = _local(p)
    local.mul_(full.to(local.dtype))


class QKClip:
    """MuonClip's QK-clip on a :class:`~dmuon.DMuon` optimizer (module docstring): a step
    post-hook that runs after the update and before DMuon's refresh, on every rank.

    Args:
        optimizer: the :class:`~dmuon.DMuon` whose ``step()`` triggers the clip.
        layers: the attention layers (:class:`HeadLogitMax`; e.g.
            ``dmuon.optim.qk_clip_hf.attention_layers(model)``), the same list on every rank.
        tau: the threshold τ on the logit (K2: 100), a finite float > 0.
        alpha: the share of the factor on the queries, in [0, 1] (K2: 0.5).
        enabled: ``False`` records and reduces the maxima (``max_logits`` is still reported,
            the all_reduce still issued) but scales nothing: a monitor.

    Attributes:
        max_logits: ``{layer name: (n_heads,) float32 CPU tensor}``, the last step's S_h over
            every rank (-inf for a head no rank observed); empty before the first step.
        clipped: ``{layer name: [query heads with S_h > τ]}`` at the last step.

    Raises:
        ValueError (on every rank, at construction, before any collective): ``optimizer`` is
            not a DMuon, ``layers`` is empty or names a layer twice, a q/k weight or bias is
            not among the optimizer's params, ``tau`` or ``alpha`` is out of range.
    """

    def __init__(self, optimizer, layers: Sequence[HeadLogitMax], *, tau: float = 100.0,
                 alpha: float = 0.5, enabled: bool = True) -> None:
        dm = getattr(optimizer, "dedicated", None)
        if dm is None or not hasattr(optimizer, "register_step_post_hook"):
            raise ValueError(f"Invalid optimizer={type(optimizer).__name__}. Must be a dmuon.DMuon: "
                             "QKClip(opt, layers) with opt = dmuon.DMuon(..., dedicated=dm).")
        layers = list(layers)
        names = [getattr(x, "name", None) for x in layers]
        if not layers or not all(isinstance(x, HeadLogitMax) for x in layers) or (
                len(set(names)) != len(names)):
            raise ValueError(f"Invalid layers={names!r}. Must be a non-empty list of HeadLogitMax "
                             "with distinct names, e.g. dmuon.optim.qk_clip_hf.attention_layers(model).")
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not 0 < tau < math.inf:
            raise ValueError(f"Invalid tau={tau!r}. Must be a finite number > 0 (the K2 report "
                             "uses 100).")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise ValueError(f"Invalid alpha={alpha!r}. Must be in [0, 1] (the share of the "
                             "clip factor on W_q; 0.5 splits it evenly).")
        known = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for x in layers:
            for what in ("q_weight", "k_weight", "q_bias", "k_bias"):
                t = getattr(x, what)
                if t is not None and id(t) not in known:
                    raise ValueError(
                        f"Invalid {x.name}: its {what} of shape {tuple(t.shape)} is not among the "
                        "optimizer's params. Build the layers from the model whose parameters() "
                        "went to DMuon (after fully_shard / parallelize_module, which replace "
                        "params): attention_layers(model) after wrapping.")
            x.head_shard = row_shard_index(x.q_weight)
        self.layers, self.tau, self.alpha, self.enabled = layers, float(tau), float(alpha), enabled
        self._dm = dm
        self._owned = {id(p) for p in dm.owned()}
        self.max_logits: dict[str, torch.Tensor] = {}
        self.clipped: dict[str, list[int]] = {}
        self._handle = optimizer.register_step_post_hook(self._post_step)

    def remove(self) -> None:
        """Stop clipping (the post-hook goes; the layers keep recording until detached)."""
        self._handle.remove()

    def _authoritative(self, p: torch.Tensor | None) -> bool:
        return p is not None and (id(p) in self._owned or p not in self._dm)

    @torch.no_grad()
    def _post_step(self, optimizer=None, args=None, kwargs=None) -> None:
        world = self._dm.groups.world
        device = collectives.collective_device(world)
        packed = torch.cat([x.take(device) for x in self.layers])
        with annotate.phase("qk_clip"), annotate.span("dmuon.qk_clip"):
            collectives.all_reduce_max_(packed, world)
        gammas = (self.tau / packed).clamp(max=1.0)  # S <= tau (or -inf): 1
        gammas = torch.where(packed > self.tau, gammas, torch.ones_like(gammas))
        self.max_logits, self.clipped = {}, {}
        for x, s, g in zip(self.layers, packed.cpu().split([x.n_heads for x in self.layers]),
                           gammas.split([x.n_heads for x in self.layers])):
            self.max_logits[x.name] = s
            self.clipped[x.name] = [h for h in range(x.n_heads) if s[h] > self.tau]
            if self.enabled and self.clipped[x.name]:
                self._clip(x, g)

    def _clip(self, x: HeadLogitMax, gamma: torch.Tensor) -> None:
        q_factor = gamma.pow(self.alpha)
        k_factor = gamma.view(x.n_kv_heads, -1).amin(dim=1).pow(1.0 - self.alpha)
        for w, b, row0, f in ((x.q_weight, x.q_bias, x.q_row0, q_factor),
                              (x.k_weight, x.k_bias, x.k_row0, k_factor)):
            for t in (w, b):
                if self._authoritative(t):
                    scale_rows_(t, row0, f, x.head_dim)
