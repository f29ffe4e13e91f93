"""Rank-side tasks of the context-parallel (CP) tests: ``examples/cp_attention.py``'s decoder on a
``("dp_shard", "cp")`` mesh, DMuon with both dims declared shard dims, against a single-process
``torch.optim.Muon`` + ``AdamW`` oracle on the whole sequences."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from examples.cp_attention import CPDecoder
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR

VOCAB, SEQ, ROWS = 64, 16, 4  # the global batch: ROWS sequences of SEQ tokens (+1 for targets)
DP, CP = 2, 2


def make_model() -> CPDecoder:
    torch.manual_seed(0)
    return CPDecoder(vocab=VOCAB, dim=32, layers=2, heads=4, max_len=SEQ)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def targets(model) -> list[str]:
    modules = dict(model.named_modules())
    return [n for n, p in model.named_parameters()
            if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]


def oracle(steps: int) -> dict[str, torch.Tensor]:
    """One process, whole sequences: torch.optim.Muon on DMuon's default targets, AdamW on the
    rest, the mean loss over every token of the global batch."""
    model = make_model()
    named = dict(model.named_parameters())
    muon_names = targets(model)
    muon = torch.optim.Muon([named[n] for n in muon_names], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=ADAMW_LR)
    for step in range(steps):
        model.loss(*batch(step)).backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(steps: int, z3: bool = True, declared: tuple[str, ...] = ("dp_shard", "cp")) -> dict:
    """DMuon on the (DP, CP) = (2, 2) mesh ``("dp_shard", "cp")``: this rank's rows of each global
    batch (its dp_shard index) and its part of each sequence (its cp index); the rest's grads
    averaged over all W ranks by hand (one all_reduce: nothing else handles them here).
    ``declared``: the shard dims declared; ``("dp_shard",)`` is the control (cp left model
    parallel: the dedicated grads are averaged over dp_shard only). Returns every param after
    ``steps`` steps (``sync_params``: every rank the owners' values) and the NS count."""
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp_shard", "cp"))
    d, c = mesh.get_local_rank("dp_shard"), mesh.get_local_rank("cp")
    group = mesh["cp"].get_group()
    rows, part = slice(d * ROWS // DP, (d + 1) * ROWS // DP), slice(c * SEQ // CP, (c + 1) * SEQ // CP)
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the control's undeclared dim warns
        dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3, shard_dims=declared)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    rest = [p for p in model.parameters() if p not in dm]
    for step in range(steps):
        ids, tgt = batch(step)
        model.loss(ids[rows, part], tgt[rows, part], offset=part.start, cp_group=group).backward()
        for p in rest:  # the rest: averaged over every rank (DMuon's own rest="replicate" does it
            dist.all_reduce(p.grad)  # too; done by hand so the control's mesh takes it)
            p.grad.div_(dist.get_world_size())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "nothing averages the grads of the rest"
            opt.step()
        opt.zero_grad()
    dm.sync_params()
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "ns_calls": opt.ns_calls, "dedicated": sorted(dm.names)}
    dm.close()
    return out
