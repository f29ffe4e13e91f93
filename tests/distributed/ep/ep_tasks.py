"""Rank tasks and single-process oracles for the reference EP MoE layer (``examples.ep_moe``).

Two models, each run on the EP ranks and in one process:

- the layer alone (:func:`crafted_layer`): ``EPMoE`` with a router crafted so that world rank 0
  routes no token to any peer of its EP group (only to its own experts) and the last expert
  gets no token from anyone; the loss is the mean squared error to a per-rank target;
- a tiny Qwen3-MoE with its sparse blocks replaced by EPMoE
  (``examples.ep_moe.tiny_qwen3_moe_ep``); its oracle is the Hugging Face model itself.

A rank task returns its loss, its output and its grads (a DTensor grad as its local shard);
the tests compare them with the oracle (test_ep_moe.py says how).
"""

from __future__ import annotations

import pathlib
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from examples.ep_moe import EPMoE, shard_experts, tiny_qwen3_moe, tiny_qwen3_moe_ep

#: The meshes of the tests: name -> (mesh shape, dim names); the EP axis is last.
LAYOUTS = {"ep2": ((2,), ("ep",)), "ep4": ((4,), ("ep",)),
           "shard2xep2": ((2, 2), ("shard", "ep"))}

D, F_FF, X, K, T = 16, 12, 8, 2, 12  # crafted layer: width, expert width, experts, top-k, tokens
#: A logit offset no softmax picks against O(1) logits (e^-30 ≈ 1e-13).
FAR = -30.0
HF_ROWS, HF_SEQ, HF_VOCAB = 2, 8, 64


def ep_size(layout: str) -> int:
    shape, _ = LAYOUTS[layout]
    return shape[-1]


def crafted_layer(ep: int, norm_topk_prob: bool, cls: type[EPMoE] = EPMoE) -> EPMoE:
    """The seeded layer (full stacks) for EP size ``ep``. Feature 0 of every token is 1 and
    feature 1 is 1 on world rank 0 only (:func:`layer_batch`); the router gives the last expert
    ``FAR`` on feature 0 (nobody picks it) and every expert outside EP rank 0's
    ``[0, X/ep)`` ``FAR`` on feature 1 (world rank 0 picks only its own experts)."""
    torch.manual_seed(0)
    layer = cls(D, F_FF, X, K, norm_topk_prob)
    with torch.no_grad():
        layer.router.copy_(torch.randn(X, D) / D**0.5)
        layer.gate_up_proj.copy_(torch.randn(X, 2 * F_FF, D) / D**0.5)
        layer.down_proj.copy_(torch.randn(X, D, F_FF) / F_FF**0.5)
        layer.router[:, :2] = 0.0
        layer.router[X - 1, 0] = FAR
        layer.router[X // ep:, 1] = FAR
    return layer


def layer_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """World rank ``rank``'s tokens ``(T, D)`` and target ``(T, D)``, a pure function of it."""
    g = torch.Generator().manual_seed(100 + rank)
    x, target = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    x[:, 0] = 1.0
    x[:, 1] = 1.0 if rank == 0 else 0.0
    return x, target


def layer_loss(layer: nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, target = layer_batch(rank)
    out = layer(x)
    return ((out - target) ** 2).mean(), out


def hf_batch(rank: int) -> torch.Tensor:
    """World rank ``rank``'s token ids ``(HF_ROWS, HF_SEQ)``."""
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randint(0, HF_VOCAB, (HF_ROWS, HF_SEQ), generator=g)


def hf_loss(model: nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = hf_batch(rank)
    res = model(input_ids=ids, labels=ids)
    return res.loss, res.logits


def hf_name(name: str) -> str:
    """The Hugging Face model's name of an EPMoE-replaced model's param."""
    for ours, theirs in (("mlp.router", "mlp.gate.weight"),
                         ("mlp.gate_up_proj", "mlp.experts.gate_up_proj"),
                         ("mlp.down_proj", "mlp.experts.down_proj")):
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


class SourceMajorEPMoE(EPMoE):
    """A planted bug for the control: the received rows are handed to the local experts in
    arrival order (source-major) instead of grouped by expert. Without a mesh (one source)
    arrival order is expert order, so the single-process layer is unchanged."""

    @staticmethod
    def _by_expert(recv_counts: torch.Tensor) -> torch.Tensor:
        return torch.arange(int(recv_counts.sum()), device=recv_counts.device)


def _ep_mesh(layout: str):
    shape, names = LAYOUTS[layout]
    if dist.get_world_size() != int(torch.tensor(shape).prod()):
        raise ValueError(f"Invalid layout {layout!r} {shape} for world {dist.get_world_size()}.")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)["ep"]


def _result(model: nn.Module, loss: torch.Tensor, out: torch.Tensor, ep_mesh) -> dict:
    """After backward: the loss, the output and every grad (a DTensor's as its local shard)."""
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
             for n, p in model.named_parameters()}
    return {"loss": loss.item(), "out": out.detach(), "grads": grads,
            "ep_rank": ep_mesh.get_local_rank()}


def _step(model: nn.Module, loss: torch.Tensor, out: torch.Tensor, ep_mesh) -> dict:
    loss.backward()
    return _result(model, loss, out, ep_mesh)


def run_layer(layout: str, norm_topk_prob: bool, control: bool = False) -> dict:
    """One forward/backward of the crafted layer, sharded over ``layout``'s EP axis."""
    ep_mesh = _ep_mesh(layout)
    layer = crafted_layer(ep_size(layout), norm_topk_prob,
                          SourceMajorEPMoE if control else EPMoE)
    shard_experts(layer, ep_mesh)
    return _step(layer, *layer_loss(layer, dist.get_rank()), ep_mesh)


def run_hf(layout: str) -> dict:
    """One forward/backward of the EPMoE Qwen3-MoE, sharded over ``layout``'s EP axis."""
    ep_mesh = _ep_mesh(layout)
    model = tiny_qwen3_moe_ep(ep_mesh)
    return _step(model, *hf_loss(model, dist.get_rank()), ep_mesh)


def run_guide_snippet() -> dict:
    """Run docs/user-guide.md's ``<!-- snippet: ep-reference-layer -->`` block here (W = 4,
    N = E = 2, ``"cuda"`` read as ``"cpu"``, ``ids`` = :func:`hf_batch` of this rank)."""
    text = (pathlib.Path(__file__).parents[3] / "docs" / "user-guide.md").read_text()
    match = re.search(r"<!-- snippet: ep-reference-layer -->\n```python\n(.*?)```", text, re.S)
    if match is None:
        raise ValueError("docs/user-guide.md has no <!-- snippet: ep-reference-layer --> block.")
    ns = {"N": 2, "E": 2, "ids": hf_batch(dist.get_rank())}
    code = match.group(1).replace('"cuda"', '"cpu"')
    exec(compile(code, "docs/user-guide.md:ep-reference-layer", "exec"), ns)  # noqa: S102
    out = ns["out"]
    return _result(ns["model"], out.loss, out.logits, ns["mesh"]["ep"])


def shard_errors() -> list[str]:
    """The errors shard_experts raises here: X = 3 over EP 2, and a 2-D mesh (each a str)."""
    world = dist.get_world_size()
    msgs = []
    for layer, mesh in ((EPMoE(4, 4, 3, 1), init_device_mesh("cpu", (world,))),
                        (EPMoE(4, 4, 4, 1), init_device_mesh(
                            "cpu", (1, world), mesh_dim_names=("shard", "ep")))):
        try:
            shard_experts(layer, mesh)
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def oracle(kind: str, layout: str, world: int, norm_topk_prob: bool = True) -> dict:
    """One process: each world rank's loss and output on its batch, and the grads of the sum
    of all ranks' losses, keyed by the oracle's names (:func:`hf_name` of the EP model's);
    ``kind`` is ``"layer"`` (:func:`crafted_layer`) or ``"hf"`` (the Hugging Face model)."""
    if kind == "layer":
        model, loss_fn = crafted_layer(ep_size(layout), norm_topk_prob), layer_loss
    else:
        model, loss_fn = tiny_qwen3_moe(), hf_loss
    losses, outs = zip(*(loss_fn(model, r) for r in range(world)))
    sum(losses).backward()
    return {"losses": [loss.item() for loss in losses], "outs": [o.detach() for o in outs],
            "grads": {n: p.grad for n, p in model.named_parameters()}, "model": model}
