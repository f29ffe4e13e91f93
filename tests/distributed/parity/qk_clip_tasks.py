"""MuonClip (QK-clip) on a tiny HF Llama (4 query heads, 2 KV heads: GQA) under DMuon, and a
single-process MuonClip oracle written independently of ``dmuon/optim/qk_clip.py``.

The oracle: ``torch.optim.Muon`` over every matrix (``MatrixMuon``) + ``AdamW``, loss = the
mean of the W ranks' losses (each rank's batch its own forward, as the ranks run it), and
QK-clip after each step from maxima it computes itself: a forward pre-hook on every attention
module recomputes q and k from the hidden states (``q_proj`` / ``k_proj``, the model's own
RoPE), the logits of each query head against its KV head one head at a time with an explicit
causal mask, and the clip scales each head's rows in a loop (γ_h^α on the queries, the
group's smallest γ to the power 1-α on the keys).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

import dmuon
from dmuon.optim.qk_clip import QKClip
from dmuon.optim.qk_clip_hf import attention_layers
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity import hf_tasks as H
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR, _mesh, root_unit
from verify.modes.baselines import MatrixMuon

#: Below the init maxima of some heads (0.019 … 0.036 at step 0), above others: the clip bites
#: on a mix of heads, and on a KV group with one clipped and one unclipped head.
TAU, ALPHA = 0.03, 0.5


def _record_maxima(model, maxima: dict):
    """Pre-hooks that fold each attention call's per-head max logit into ``maxima[name]``."""
    rope = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
    handles = []
    for name, m in model.named_modules():
        if not name.endswith("self_attn"):
            continue

        def hook(mod, args, kwargs, name=name):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = h.shape
            with torch.no_grad():
                q = mod.q_proj(h).view(b, t, -1, mod.head_dim).transpose(1, 2)
                k = mod.k_proj(h).view(b, t, -1, mod.head_dim).transpose(1, 2)
                q, k = rope(q, k, cos, sin)
                rep = q.shape[1] // k.shape[1]
                future = torch.ones(t, t, dtype=torch.bool).triu(1)
                out = maxima.setdefault(name, [-math.inf] * q.shape[1])
                for head in range(q.shape[1]):
                    s = (q[:, head] @ k[:, head // rep].transpose(-1, -2)) * mod.scaling
                    out[head] = max(out[head], s.masked_fill(future, -math.inf).max().item())

        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


@torch.no_grad()
def _oracle_clip(model, maxima: dict, tau: float, alpha: float) -> None:
    for name, s in maxima.items():
        mod = model.get_submodule(name)
        d, heads = mod.head_dim, len(s)
        rep = heads // (mod.k_proj.weight.shape[0] // d)
        gamma = [min(1.0, tau / x) for x in s]
        for head in range(heads):
            mod.q_proj.weight[head * d:(head + 1) * d] *= gamma[head] ** alpha
        for g in range(heads // rep):
            mod.k_proj.weight[g * d:(g + 1) * d] *= min(gamma[g * rep:(g + 1) * rep]) ** (1 - alpha)


def oracle(world: int, steps: int, tau: float = TAU, alpha: float = ALPHA,
           nudge: str | None = None) -> dict:
    """The single-process MuonClip oracle (module docstring) at the ranks' thread count:
    initial params, the params after each step (``steps``) and after the last (``final``), the
    Muon params, and each step's per-head maxima. ``nudge``: one of ``noise_floor.NUDGES``."""
    with oracle_threads(nudge):
        model = nudge_init_(H.make_model("llama"), nudge)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        after = []
        named = dict(model.named_parameters())
        matrices = H.muon_matrices(model)
        muon = MatrixMuon([named[n] for n in matrices], list(matrices.values()), lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=ADAMW_LR)
        history = []
        for step in range(steps):
            maxima: dict = {}
            handles = _record_maxima(model, maxima)
            (sum(H._loss(model, H.batch(step, r)) for r in range(world)) / world).backward()
            for h in handles:
                h.remove()
            for opt in (muon, adamw):
                opt.step()
                opt.zero_grad()
            _oracle_clip(model, maxima, tau, alpha)
            history.append(maxima)
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return {"init": init, "steps": after, "final": after[-1], "muon": matrices,
                "maxima": history}


def train(mode: str, steps: int, tau: float = TAU, alpha: float = ALPHA, enabled: bool = True) -> dict:
    """DMuon + QKClip on the tiny Llama in ``mode`` (ddp, z2, z3, hsdp-z3): the owned
    dedicated params after each step (``steps``) and after the last (``owned``), each step's
    reported maxima and clipped heads, and the number of ``qk_clip``-phase all_reduces this
    rank issued (counted at ``dist.all_reduce``)."""
    rank = dist.get_rank()
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    model = H.make_model("llama")
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=mode.endswith("z3"))
    wrapped, opt = root_unit(model, mesh, dm, ddp=mode == "ddp")
    clip = QKClip(opt, attention_layers(model), tau=tau, alpha=alpha, enabled=enabled)
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        from tracer.context import current_phase
        calls.append((current_phase(), tensor.numel() * tensor.element_size()))
        return original(tensor, *args, **kwargs)

    history, after = [], []
    owned = {id(p) for p in dm.owned()}
    dist.all_reduce = counting
    try:
        for step in range(steps):
            H._loss(wrapped, H.batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            history.append(({n: s.tolist() for n, s in clip.max_logits.items()}, dict(clip.clipped)))
            dm.wait_pending()
            after.append({n: p.detach().clone() for n, p in model.named_parameters() if id(p) in owned})
    finally:
        dist.all_reduce = original
    return {"owned": after[-1], "steps": after, "history": history,
            "qk_calls": [c for c in calls if c[0] == "qk_clip"]}


from verify.measure.qk_clip import tinygpt_layers  # noqa: E402 - TinyGPT's layers, moved to the harness


def tinygpt_qk_calls(mode: str, steps: int = 2) -> list:
    """TinyGPT (``dmuon_tasks.build``) with QKClip at τ = 0 + ε (every head clipped): the
    ``qk_clip``-phase all_reduces this rank issued, as (group ranks, numel, dtype)."""
    from tests.distributed.parity import dmuon_tasks as T
    from tracer.context import current_phase
    from verify.workload.data import local_slice

    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model, dm, opt = T.build(mode)
    QKClip(opt, tinygpt_layers(model), tau=1e-6)
    calls, original = [], dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        if current_phase() == "qk_clip":
            calls.append((sorted(dist.get_process_group_ranks(group)), tensor.numel(),
                          str(tensor.dtype).removeprefix("torch.")))
        return original(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counting
    try:
        for step in range(steps):
            x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
            T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_reduce = original
    dm.wait_pending()
    return calls


def bad_qkclip(case: str) -> str:
    """One invalid QKClip construction on TinyGPT (z2): the error message on this rank."""
    from tests.distributed.parity import dmuon_tasks as T

    wrapped, model, dm, opt = T.build("z2")
    layers = tinygpt_layers(model)
    kw = {"tau": -1.0} if case == "tau" else {"alpha": 1.5} if case == "alpha" else {}
    if case == "foreign":  # a layer built from another model's weights
        layers = tinygpt_layers(T.make_model())
    try:
        QKClip(torch.optim.SGD(model.parameters()) if case == "not_dmuon" else opt, layers, **kw)
    except ValueError as exc:
        return str(exc)
    finally:
        dm.close()
    return "no error"
