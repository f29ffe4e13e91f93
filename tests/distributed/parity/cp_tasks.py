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
from tests.distributed.noise_floor import nudge_init_, oracle_threads
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


def oracle(steps: int, nudge: str | None = None, momentum: float = 0.95) -> dict:
    """One process, whole sequences: torch.optim.Muon on DMuon's default targets, AdamW on the
    rest, the mean loss over every token of the global batch. ``nudge``: one of
    ``noise_floor.NUDGES``; ``momentum``: Muon's. Returns ``init`` and the params after each
    step (``steps``, one name -> tensor dict per step), as ``noise_floor.floors`` reads a run."""
    with oracle_threads(nudge):
        model = nudge_init_(make_model(), nudge)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        named = dict(model.named_parameters())
        muon_names = targets(model)
        muon = torch.optim.Muon([named[n] for n in muon_names], lr=MUON_LR, momentum=momentum)
        adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=ADAMW_LR)
        after = []
        for step in range(steps):
            model.loss(*batch(step)).backward()
            for opt in (muon, adamw):
                opt.step()
                opt.zero_grad()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"init": init, "steps": after}


def train(steps: int, z3: bool = True, declared: tuple[str, ...] = ("dp_shard", "cp")) -> dict:
    """DMuon on the (DP, CP) = (2, 2) mesh ``("dp_shard", "cp")``: this rank's rows of each global
    batch (its dp_shard index) and its part of each sequence (its cp index); the rest's grads
    averaged over all W ranks by hand (one all_reduce: nothing else handles them here).
    ``declared``: the shard dims declared; ``("dp_shard",)`` is the control (cp left model
    parallel: the dedicated grads are averaged over dp_shard only). Returns every param after
    ``steps`` steps (``sync_params``: every rank the owners' values; ``steps``: after each
    step) and the NS count."""
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
    after = []
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
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    out = {"params": after[-1], "steps": after, "ns_calls": opt.ns_calls, "dedicated": sorted(dm.names)}
    dm.close()
    return out


#: Layouts a checkpoint moves between: name -> (mesh shape, dim names, declared shard dims).
LAYOUTS = {"dp2xcp2": ((DP, CP), ("dp_shard", "cp"), ("dp_shard", "cp")),
           "dp4": ((DP * CP,), ("dp_shard",), None)}


def checkpoint_run(layout: str, path: str, steps: range, load: bool) -> dict:
    """On ``layout`` (Z3): a fresh model (seeded differently when ``load``: the load must
    overwrite every value), loaded from the DCP checkpoint at ``path`` when ``load``
    (``get_state_dict`` / ``dcp.load`` / ``set_state_dict``), the steps ``steps`` (batches of
    those step numbers: on ``"dp4"`` each rank one whole row, on ``"dp2xcp2"`` its rows and its
    half of every sequence), then saved to ``path`` unless ``load``. Returns every param and the
    momentum of each param this rank owns, at the save or right after the load, and every param
    at the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    shape, names, declared = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    cp = "cp" in names
    d = mesh.get_local_rank("dp_shard")
    c = mesh.get_local_rank("cp") if cp else 0
    n_dp, n_cp = (DP, CP) if cp else (DP * CP, 1)
    group = mesh["cp"].get_group() if cp else None
    rows = slice(d * ROWS // n_dp, (d + 1) * ROWS // n_dp)
    part = slice(c * SEQ // n_cp, (c + 1) * SEQ // n_cp)
    if load:
        torch.manual_seed(1)
        model = CPDecoder(vocab=VOCAB, dim=32, layers=2, heads=4, max_len=SEQ)
    else:
        model = make_model()
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=True,
                               **({"shard_dims": declared} if declared else {}))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    rest = [p for p in model.parameters() if p not in dm]

    def state() -> dict:
        dm.sync_params()
        owned = {id(p) for p in dm.owned()}
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "momentum": {n: opt.state[p]["momentum_buffer"].clone()
                             for n, p in zip(dm.names, dm.params) if id(p) in owned}}

    out = {}
    if load:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        out["loaded"] = state()
    for step in steps:
        ids, tgt = batch(step)
        model.loss(ids[rows, part], tgt[rows, part], offset=part.start, cp_group=group).backward()
        for p in rest:  # averaged over every rank by hand, as in train()
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        opt.zero_grad()
    if not load:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        out["saved"] = state()
    out["final"] = state()["params"]
    dm.close()
    return out
