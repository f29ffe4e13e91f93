"""Rank-side tasks: habits of FSDP2 / DDP scripts that must fail with an error naming the fix."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import dmuon
from dmuon.runtime.rest import warn_if_not_averaged
from tests.distributed.parity import dmuon_tasks as T


def fully_shard_without_ignored_params(mode: str) -> str:
    """``fully_shard(model, mesh=mesh)`` after ``dedicate_params`` (no ``ignored_params``),
    then ``DMuon(model.parameters(), ...)``."""
    mesh = T._mesh("flat")
    model = T.make_model()
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")

    def wrap_and_build():
        fully_shard(model, mesh=mesh)
        dmuon.DMuon(model.parameters(), dedicated=dm)
    return T.error_text(wrap_and_build)


def rest_shape_differs() -> str:
    """Rank 1 builds the model with a 320-token vocabulary (embedding and head: the rest)."""
    config = T.SMALL
    if dist.get_rank() == 1:
        config = dataclasses.replace(config, vocab_size=320)
    model = T.make_model(config)
    return T.error_text(lambda: dmuon.dedicate_params(model, T._mesh("flat")))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class SharedBlockNet(nn.Module):
    """``blocks[0]`` runs twice per forward (weight sharing), each run checkpointed."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.out = nn.Linear(8, 2, bias=False)

    def forward(self, x):
        for b in (self.blocks[0], self.blocks[1], self.blocks[0]):
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.out(x)


def reentrant_shared_block(mode: str, reentrant: bool) -> dict:
    """One step of SharedBlockNet; the error (or ``"no error"``) and, without one, this rank's
    owned grads."""
    torch.manual_seed(0)
    model = SharedBlockNet(reentrant)
    matrices = [model.blocks[0].fc.weight, model.blocks[1].fc.weight]
    dm = dmuon.dedicate_params(model, T._mesh("flat"), params=matrices,
                               reshard_after_forward=mode == "z3")
    wrapped = DistributedDataParallel(model) if mode == "ddp" else model
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(4, 8, requires_grad=True)
    grads = {}

    def run():
        wrapped(x).sum().backward()
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()
                      if p in dm and p.grad is not None})
        opt.step()
    return {"error": T.error_text(run), "grads": grads}


def reentrant_two_forwards(mode: str, reentrant: bool) -> dict:
    """Two forwards of a two-block model, each block checkpointed once per forward, then one
    backward of the summed losses: each block is used twice in one backward, across
    forwards (no block runs twice within one forward). Under reentrant checkpointing each
    use backpropagates on its own, the second after DMuon reduced the first. The error
    (or ``"no error"``) and, without one, this rank's owned grads."""
    torch.manual_seed(0)
    model = SharedBlockNet(reentrant)
    model.forward = lambda x: model.out(checkpoint(model.blocks[1], checkpoint(
        model.blocks[0], x, use_reentrant=reentrant), use_reentrant=reentrant))
    matrices = [model.blocks[0].fc.weight, model.blocks[1].fc.weight]
    dm = dmuon.dedicate_params(model, T._mesh("flat"), params=matrices,
                               reshard_after_forward=mode == "z3")
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    torch.manual_seed(1 + dist.get_rank())
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    grads = {}

    def run():
        (model(xs[0]).sum() + model(xs[1]).sum()).backward()
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()
                      if p in dm and p.grad is not None})
        opt.step()
    return {"error": T.error_text(run), "grads": grads}


def reentrant_oracle() -> dict[str, torch.Tensor]:
    """One process, the global batch of both ranks: the dedicated grads (their mean)."""
    torch.manual_seed(0)
    model = SharedBlockNet(reentrant=False)
    xs = []
    for rank in range(2):
        torch.manual_seed(1 + rank)
        xs.append(torch.randn(4, 8))
    for x in xs:
        (model(x).sum() / 2).backward()
    return {n: model.get_parameter(n).grad.clone() for n in ("blocks.0.fc.weight", "blocks.1.fc.weight")}


def two_forwards_oracle() -> dict[str, torch.Tensor]:
    """One process, both ranks' batches of :func:`reentrant_two_forwards`: the dedicated grads
    (their mean over the ranks)."""
    torch.manual_seed(0)
    model = SharedBlockNet(reentrant=False)
    for rank in range(2):
        torch.manual_seed(1 + rank)
        xs = [torch.randn(4, 8) for _ in range(2)]
        forward = lambda x: model.out(model.blocks[1](model.blocks[0](x)))  # noqa: E731
        ((forward(xs[0]).sum() + forward(xs[1]).sum()) / 2).backward()
    return {n: model.get_parameter(n).grad.clone() for n in ("blocks.0.fc.weight", "blocks.1.fc.weight")}


def tp_rest_warning() -> dict[str, int]:
    """N = T = 2 on 4 ranks: which rest params ``warn_if_not_averaged`` warns about (FSDP2
    shards on the shard axis, of the TP group's size, must not count)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    counts = {}
    for kind in ("fsdp_shard", "tp_only", "plain"):
        torch.manual_seed(0)
        full = torch.randn(4, 4)
        if kind == "plain":
            p = nn.Parameter(full)
        else:
            sub = mesh["shard"] if kind == "fsdp_shard" else mesh["tp"]
            p = nn.Parameter(distribute_tensor(full, sub, [Shard(0)]))
        p.grad = torch.zeros_like(p)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_if_not_averaged([("embed_tokens.weight", p)], False, dp_size=2, tp_size=2)
        counts[kind] = sum("nothing averages the grads" in str(w.message) for w in caught)
    return counts


def shared_weight_warning() -> list[str]:
    """A Linear object used by two blocks: the AdamW-matrices warning's text."""
    model = T.make_model(dataclasses.replace(T.SMALL, n_layers=2))
    model.blocks[1].mlp.fc1 = model.blocks[0].mlp.fc1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = dmuon.dedicate_params(model, T._mesh("flat"))
    dm.close()
    return [str(w.message) for w in caught if "go to AdamW" in str(w.message)]
