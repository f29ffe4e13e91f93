"""Hugging Face models from tiny configs (no download) under DMuon, and a single-process oracle.

Qwen3-MoE as transformers 5 stores it: fused 3-D expert stacks
(``mlp.experts.gate_up_proj (E, 2I, H)``, ``mlp.experts.down_proj (E, H, I)``) and a router
``mlp.gate.weight (E, H)`` that is not an ``nn.Linear``; Llama for the dense case. DMuon's
default selection must dedicate every one of them; the oracle applies ``torch.optim.Muon`` to
every matrix (each expert slice its own 2-D parameter: ``verify.modes.baselines.MatrixMuon``)
and ``torch.optim.AdamW`` to the rest, on the same global batch.

The oracle runs at the ranks' thread count (``noise_floor.RANK_THREADS``): a CPU GEMM's blocking, and
so its rounding, depends on the thread count. Its nudged runs (``noise_floor.NUDGES``: the
same arithmetic rounded otherwise) give the tests their noise floor.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

import dmuon
from dmuon.ownership.select import assign_params
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR, _mesh, root_unit
from verify.modes.baselines import MatrixMuon

VOCAB, SEQ, ROWS_PER_RANK, STEPS = 64, 8, 2, 2


def make_model(kind: str):
    """A tiny ``qwen3-moe`` (2 layers of 4 experts, top-2) or ``llama`` (2 layers), seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
                  tie_word_embeddings=False)
    if kind == "qwen3-moe":
        config = Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16,
                                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        return Qwen3MoeForCausalLM(config)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, intermediate_size=48))
    raise ValueError(f"Invalid kind={kind!r}. Must be 'qwen3-moe' or 'llama'.")


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids at ``step``: (ROWS_PER_RANK, SEQ), a pure function of both."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, VOCAB, (ROWS_PER_RANK, SEQ), generator=g)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def muon_matrices(model) -> dict[str, tuple[int, int]]:
    """The default Muon params of ``model`` and their matrix shapes."""
    return {a.name: a.matrix for a in assign_params(model) if a.optimizer == "muon"}


def is_router(name: str) -> bool:
    """Qwen3-MoE's router weight ``(E, H)``: one row of logits per expert."""
    return name.endswith(".mlp.gate.weight")


def routing_part(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` without what routing cannot see: for a router, its mean over the experts (dim 0)
    removed. Adding one vector to every expert's row adds the same logit to every expert of a
    token, which changes no softmax and no top-k: a router's gradient has no component along
    that direction (it sums to zero over the experts), so its value there is rounding that Muon
    amplifies, not training. Other params are returned as they are."""
    return t - t.mean(dim=0, keepdim=True) if is_router(name) else t


def oracle(kind: str, world: int, steps: int = STEPS, nudge: str | None = None) -> dict:
    """One process at the ranks' thread count: MatrixMuon (torch.optim.Muon over every
    matrix) + AdamW, loss = the mean of the W ranks' losses; :func:`run_oracle`'s result.
    ``nudge``: one of ``noise_floor.NUDGES`` (a run for the noise floor)."""
    with oracle_threads(nudge):
        return run_oracle(nudge_init_(make_model(kind), nudge), world, steps)


def run_oracle(model, world: int, steps: int) -> dict:
    """MatrixMuon over ``model``'s default Muon matrices + AdamW on the rest, ``steps`` steps on
    the mean of the W ranks' losses: ``init`` params, the params after each step (``steps``)
    and after the last (``final``), ``muon`` (name -> matrix shape) and the global grad norm of
    each step (``grad_norms``)."""
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = []
    named = dict(model.named_parameters())
    matrices = muon_matrices(model)
    muon = MatrixMuon([named[n] for n in matrices], list(matrices.values()), lr=MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=ADAMW_LR)
    norms = []
    for step in range(steps):
        (sum(_loss(model, batch(step, r)) for r in range(world)) / world).backward()
        norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in named.values() if p.grad is not None])).item())
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"init": init, "steps": after, "final": after[-1], "muon": matrices,
            "grad_norms": norms}


@contextmanager
def rolled_experts():
    """A planted error for the duration: DMuon's batched Newton–Schulz result rolled by one
    matrix, so each expert slice gets its neighbour's orthogonalized update (a slice-to-expert
    mix-up)."""
    from dmuon.optim import muon_math

    original = muon_math.zeropower_via_newtonschulz_batched
    muon_math.zeropower_via_newtonschulz_batched = (
        lambda *args, **kwargs: original(*args, **kwargs).roll(1, dims=0))
    try:
        yield
    finally:
        muon_math.zeropower_via_newtonschulz_batched = original


def train(kind: str, mode: str, steps: int = STEPS, plant: str | None = None) -> dict:
    """DMuon with the default selection in ``mode`` (ddp, z2, z3, hsdp-z3) for ``steps`` steps:
    the dedicated params this rank owns after each step (``steps``) and after the last
    (``owned``), the assignments and the Newton–Schulz count.
    ``plant="roll-experts"`` plants :func:`rolled_experts` in DMuon's batched Newton–Schulz (the
    test that the comparison can fail)."""
    if plant is not None:
        if plant != "roll-experts":
            raise ValueError(f"Invalid plant={plant!r}. Must be None or 'roll-experts'.")
        with rolled_experts():
            return train(kind, mode, steps)
    rank = dist.get_rank()
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    model = make_model(kind)
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=mode.endswith("z3"))
    wrapped, opt = root_unit(model, mesh, dm, ddp=mode == "ddp")
    owned, after = {id(p) for p in dm.owned()}, []
    for step in range(steps):
        _loss(wrapped, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        dm.wait_pending()
        after.append({n: p.detach().clone() for n, p in model.named_parameters() if id(p) in owned})
    return {
        "owned": after[-1],
        "steps": after,
        "assignments": [a.as_row() for a in dm.assignments()],
        "ns_calls": opt.ns_calls,
    }
