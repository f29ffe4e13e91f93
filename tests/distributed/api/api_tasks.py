"""Rank-side tasks of the API-check tests (validation on every rank, plan digest, selection)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests.distributed.parity import dmuon_tasks as T
from verify.workload.data import local_slice

#: Two dedicated matrices: on 4 ranks two ranks own nothing (the ranks that used to hang).
TWO_MATRICES = ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight"]

#: Bad DMuon keyword -> the text its error must contain (rules: torch.optim.Muon / AdamW).
BAD_HYPERPARAMETERS = {
    "lr": (-0.1, "Invalid lr=-0.1. Must be a finite float >= 0"),
    "weight_decay": (-1, "Invalid weight_decay=-1. Must be a finite float >= 0"),
    "momentum": (float("nan"), "Invalid momentum=nan"),
    "nesterov": ("yes", "Invalid nesterov='yes'. Must be True or False"),
    "ns_coefficients": ((3.4, -4.7), "Invalid ns_coefficients=(3.4, -4.7)"),
    "eps": (0.0, "Invalid eps=0.0. Must be a finite float > 0"),
    "ns_steps": (100, "Invalid ns_steps=100. Must be an int in [0, 100)"),
    "adjust_lr_fn": ("rms", "Invalid adjust_lr_fn='rms'"),
    "adamw_lr": (float("inf"), "Invalid adamw_lr=inf"),
    "adamw_betas": ((0.9, 1.0), "Invalid adamw_betas=(0.9, 1.0). Must be two floats in [0, 1)"),
    "adamw_eps": (-1e-8, "Invalid adamw_eps=-1e-08"),
    "adamw_weight_decay": (-0.01, "Invalid adamw_weight_decay=-0.01"),
    "dedicated": (None, "Invalid dedicated=None (type NoneType). Must be the DedicatedParams"),
}


def bad_hyperparameters() -> dict:
    """Every bad keyword of DMuon on this rank: {keyword: error text}, plus ``owned`` and a
    bad value set in ``param_groups`` after construction (``step``)."""
    model = T.make_model()
    dm = dmuon.dedicate_params(model, T._mesh("flat"), params=TWO_MATRICES)
    out = {"owned": len(dm.owned())}
    for key, (value, _) in BAD_HYPERPARAMETERS.items():
        kwargs = {"dedicated": dm, key: value}
        out[key] = T.error_text(lambda: dmuon.DMuon(model.parameters(), **kwargs))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = T.corpus().global_batch(0, T.GLOBAL_BATCH, T.SMALL.seq_len)
    T._loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    opt.param_groups[0]["weight_decay"] = -1.0  # e.g. a broken scheduler
    out["step"] = T.error_text(opt.step)
    # the object stays usable: fix the value, step, and the next iteration runs
    opt.param_groups[0]["weight_decay"] = 0.1
    opt.step()
    opt.zero_grad()
    out["after"] = T._loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).item()
    return out


def setup_error(case: str) -> str:
    """One bad ``dedicate_params`` setup on every rank; this rank's error text."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = T.make_model()

    def run():
        if case == "z2_on_one_rank_z3_elsewhere":
            dmuon.dedicate_params(model, T._mesh("flat"), reshard_after_forward=rank != 1)
        elif case == "mesh_smaller_than_world":
            # ranks 0 and 1 are in the mesh, the others are not: none may reach get_group
            dmuon.dedicate_params(model, init_device_mesh("cpu", (world // 2,)))
        elif case == "dedicate_twice":
            dmuon.dedicate_params(model, T._mesh("flat"))
            dmuon.dedicate_params(model, T._mesh("flat"))
        elif case == "dedicate_twice_submodule":
            dmuon.dedicate_params(model, T._mesh("flat"))
            dmuon.dedicate_params(model.blocks[0], T._mesh("flat"))
        else:
            raise AssertionError(case)

    return T.error_text(run)


class Conv1D(nn.Module):
    """Hugging Face GPT-2's ``Conv1D`` semantics (``transformers.pytorch_utils.Conv1D``, not
    imported): ``y = x @ weight + bias`` with ``weight`` of shape ``(nx, nf)`` = (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class GPT2Like(nn.Module):
    """A GPT-2-shaped toy: embedding, an MLP of ``Conv1D`` (``c_fc``, ``c_proj``), a frozen
    hidden Linear, an ``unembed`` head."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.c_fc = Conv1D(4 * d, d)
        self.c_proj = Conv1D(d, 4 * d)
        self.frozen = nn.Linear(d, d, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.unembed = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx)
        h = h + self.c_proj(torch.relu(self.c_fc(h)))
        return self.unembed(self.frozen(h))


def gpt2_like_trains_like_torch_muon(steps: int) -> dict:
    """GPT2Like under DMuon-DDP (the default predicate) for ``steps`` steps; returns the
    dedicated names and the params this rank owns."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT2Like()
    dm = dmuon.dedicate_params(model, T._mesh("flat"), reshard_after_forward=False)
    ddp = DistributedDataParallel(model)
    opt = dmuon.DMuon(ddp.parameters(), dedicated=dm, lr=T.MUON_LR, adamw_lr=T.ADAMW_LR)
    for step in range(steps):
        x = gpt2_batch(step)
        ddp(local_slice(x, rank, world)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    owned = {id(p) for p in dm.owned()}
    return {"names": dm.names, "owned": {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in owned}}


def gpt2_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 32, (8, 6), generator=g)


def gpt2_like_oracle(steps: int) -> dict[str, torch.Tensor]:
    """Single process: torch.optim.Muon on the Conv1D weights + AdamW on the rest."""
    torch.manual_seed(0)
    model = GPT2Like()
    muon_names = ("c_fc.weight", "c_proj.weight")
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[n] for n in muon_names], lr=T.MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names and p.requires_grad], lr=T.ADAMW_LR)
    for step in range(steps):
        model(gpt2_batch(step)).logsumexp(-1).mean().backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return {n: named[n].detach().clone() for n in muon_names}


def nothing_to_dedicate() -> dict:
    """A model with no hidden Linear: a warning, and DMuon trains it with AdamW only."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = dmuon.dedicate_params(model, T._mesh("flat"))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    model(torch.arange(4)).sum().backward()
    opt.step()
    return {"dedicated": len(dm), "warnings": [str(w.message) for w in caught]}


def matrices_left_to_adamw() -> dict:
    """``params=`` that leaves an expert stack, a router and a conv to AdamW: one warning
    naming them (not the embedding, the head or 1-D params), and the assignments."""
    import warnings

    from examples.experts import ExpertsMLP

    torch.manual_seed(0)
    model = ExpertsMLP()
    model.add_module("conv", nn.Conv1d(4, 4, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = dmuon.dedicate_params(model, T._mesh("flat"), params=["inp.weight", "layers.0.w_in"])
    return {"warnings": [str(w.message) for w in caught if "go to AdamW" in str(w.message)],
            "rows": [a.as_row() for a in dm.assignments()]}


def rest_averaging_warnings(wrap: str) -> list[str]:
    """Two steps of TinyGPT under ``rest="wrapper"`` with the model wrapped by ``wrap``
    ("none", "ddp", "fsdp2") or with its rest frozen ("frozen"): the DMuon warnings of the
    steps (``rest.warn_if_not_averaged``)."""
    import warnings

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model = T.make_model()
    dm = dmuon.dedicate_params(model, T._mesh("flat"))
    if wrap == "frozen":
        for name, p in model.named_parameters():
            p.requires_grad_(p in dm)
    wrapped = {"ddp": lambda: DistributedDataParallel(model),
               "fsdp2": lambda: fully_shard(model, mesh=T._mesh("flat"), ignored_params=set(dm))}.get(
        wrap, lambda: model)()
    opt = dmuon.DMuon([p for p in wrapped.parameters() if p.requires_grad], dedicated=dm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
            T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    dm.close()
    return [str(w.message) for w in caught if "DMuon" in str(w.message)]


def divide_factor_sums() -> dict:
    """Two dedicated Linears on 2 ranks, each rank a batch of its own: each owner's reduced grad
    under the default divide factor (the mean over the ranks) and under
    ``set_gradient_divide_factor(1)`` (the sum), the sum of the ranks' grads of a plain copy as
    the reference, and the errors of bad factors (raised here, before any collective)."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 6, bias=False))
    plain = copy.deepcopy(model)
    dm = dmuon.dedicate_params(model, T._mesh("flat"), params=["0.weight", "1.weight"])
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 + rank))
    plain(x).square().sum().backward()
    summed_ref = {}
    for n, p in plain.named_parameters():
        dist.all_reduce(p.grad)
        summed_ref[n] = p.grad

    def owned_grads() -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    mean = owned_grads()
    dm.set_gradient_divide_factor(1)
    summed = owned_grads()
    errors = []
    for bad in (0, -2.0, float("inf"), float("nan"), True, "2"):
        try:
            dm.set_gradient_divide_factor(bad)
        except ValueError as e:
            errors.append(str(e))
    return {"errors": errors,
            "mean_vs_sum": {n: float((g * world - summed_ref[n]).abs().max()) for n, g in mean.items()},
            "sum_vs_sum": {n: float((g - summed_ref[n]).abs().max()) for n, g in summed.items()}}
