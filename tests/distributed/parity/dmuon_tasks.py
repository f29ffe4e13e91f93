"""Rank-side task functions for the DMuon distributed tests (run inside DistributedPool)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from verify.workload.data import ByteCorpus, local_slice
from verify.workload.model import GPTConfig, TinyGPT

SMALL = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
GLOBAL_BATCH = 8
MUON_LR, ADAMW_LR = 0.02, 3e-3
_corpus = None


def corpus() -> ByteCorpus:
    global _corpus
    if _corpus is None:
        _corpus = ByteCorpus.from_stdlib(200_000)
    return _corpus


def make_model(config: GPTConfig = SMALL) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(config)


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def oracle(steps: int, config: GPTConfig = SMALL, micro_batches: int = 1) -> dict[str, torch.Tensor]:
    """Single process: torch.optim.Muon on the default targets + torch.optim.AdamW, full batch;
    the params after ``steps`` steps (:func:`oracle_run`)."""
    return oracle_run(steps, config, micro_batches)["final"]


def oracle_run(steps: int, config: GPTConfig = SMALL, micro_batches: int = 1,
               nudge: str | None = None) -> dict:
    """:func:`oracle` at the ranks' thread count: ``init`` params, the params after each step
    (``steps``) and after the last (``final``).

    ``micro_batches`` > 1 accumulates the same global batch as that many equal slices (the
    same arithmetic in another summation order); ``nudge``: one of ``noise_floor.NUDGES``.
    """
    with oracle_threads(nudge):
        model = nudge_init_(make_model(config), nudge)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        modules = dict(model.named_modules())
        named = dict(model.named_parameters())
        targets = [n for n, p in named.items()
                   if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]
        muon = torch.optim.Muon([named[n] for n in targets], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n, p in named.items() if n not in targets], lr=ADAMW_LR)
        after = []
        for step in range(steps):
            x, y = corpus().global_batch(step, GLOBAL_BATCH, config.seq_len)
            for m in range(micro_batches):
                xs, ys = local_slice(x, m, micro_batches), local_slice(y, m, micro_batches)
                (_loss(model, xs, ys) / micro_batches).backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"init": init, "steps": after, "final": after[-1] if after else init}


#: An HSDP mesh named as torchtitan names it: its data-parallel dims must be declared.
TITAN_HSDP = ("dp_replicate", "fsdp")


def _mesh(kind: str):
    world = dist.get_world_size()
    if kind == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if kind == "titan-hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=TITAN_HSDP)
    return init_device_mesh("cpu", (world,))


def _mesh_of(mode: str):
    """The mesh of ``mode``: ``titan-hsdp-*`` (:data:`TITAN_HSDP`), ``hsdp-*``, else 1-D."""
    return _mesh(next((k for k in ("titan-hsdp", "hsdp") if mode.startswith(k)), "flat"))


def declared(mesh, mode: str = "") -> dict:
    """``dedicate_params``' declaration of a :data:`TITAN_HSDP` mesh's dims (nothing for the
    default names). ``mode`` ending ``/undeclared``: the control, ``"dp_replicate"`` left out
    (so a model-parallel dim: the grads are averaged over ``"fsdp"`` only, a wrong mean)."""
    if tuple(mesh.mesh_dim_names or ()) != TITAN_HSDP:
        return {}
    if mode.endswith("/undeclared"):
        return {"shard_dims": "fsdp"}
    return {"replicate_dim": "dp_replicate", "shard_dims": ("fsdp",)}


def dedicate(model, mesh, **kw):
    """``dmuon.dedicate_params`` for these tasks: on an HSDP mesh the hierarchical protocol
    (NCCL's) unless ``kw`` has ``hierarchy``. Under the default "auto" gloo would move these
    one-unit models flat, DMuon's 1-D path over all W ranks, which the 1-D modes cover (tests
    that want flat ask for "auto")."""
    if mesh.ndim == 2:
        kw.setdefault("hierarchy", "hierarchical")
    return dmuon.dedicate_params(model, mesh, **{**declared(mesh), **kw})


def build(mode: str, config=SMALL, wrap: bool = True, opt_kw: dict | None = None, **dm_kw):
    """(model to call, bare model, dm, optimizer) for mode ddp / z2 / z3 / hsdp-z2 / hsdp-z3
    (and titan-hsdp-*: :data:`TITAN_HSDP`; :func:`dedicate`); ``opt_kw``: more keyword
    arguments of ``dmuon.DMuon``."""
    mesh = _mesh_of(mode)
    model = make_model(config)
    reshard = mode.endswith("z3")
    dm = dedicate(model, mesh, reshard_after_forward=reshard, **dm_kw)
    if not wrap or dm.rest == "replicate":  # DMuon handles the rest: nothing to wrap
        wrapped = model
    elif mode == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=set(dm))
        fully_shard(model, mesh=mesh, ignored_params=set(dm))
        wrapped = model
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR,
                      **(opt_kw or {}))
    return wrapped, model, dm, opt


def root_unit(model, mesh, dm, ddp: bool, lr: float = MUON_LR, adamw_lr: float = ADAMW_LR):
    """``(wrapped, DMuon)``: the rest of ``model`` under DDP (``ddp``) or one root FSDP2 unit on
    ``mesh`` with ``dm``'s params ignored, and DMuon over the wrapped params."""
    if ddp:
        wrapped = DistributedDataParallel(model)
    else:
        fully_shard(model, mesh=mesh, ignored_params=set(dm))
        wrapped = model
    return wrapped, dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=lr, adamw_lr=adamw_lr)


def authoritative_params(model, dm) -> dict[str, torch.Tensor]:
    """After ``dm.wait_pending()``: {name: copy} of the params this rank holds authoritative
    values of: the dedicated params it owns, and every other param in full
    (``full_tensor()`` of an FSDP2 shard)."""
    dm.wait_pending()
    owned = {id(p) for p in dm.owned()}
    out = {}
    for name, p in model.named_parameters():
        if p in dm:
            if id(p) in owned:
                out[name] = p.detach().clone()
        else:
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def error_text(fn) -> str:
    """``"<type>: <message>"`` of the ValueError / RuntimeError ``fn()`` raises, else ``"no error"``."""
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def train_dmuon(mode: str, steps: int, config: GPTConfig = SMALL, every_step: bool = False,
                opt_kw: dict | None = None, **dm_kw) -> dict:
    """Train with DMuon; returns the full params this rank holds authoritative values of
    (``params``; with ``every_step``, also after each step: ``steps``).

    mode: "ddp", "z2", "z3", "hsdp-z2", "hsdp-z3"; ``opt_kw``: more keyword arguments of
    ``dmuon.DMuon`` (a control's changed hyper-parameter).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model, dm, opt = build(mode, config, opt_kw=opt_kw, **dm_kw)
    after = []
    for step in range(steps):
        x, y = corpus().global_batch(step, GLOBAL_BATCH, config.seq_len)
        _loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if every_step:
            after.append(authoritative_params(model, dm))
    return {"params": authoritative_params(model, dm), "steps": after, "ns_calls": opt.ns_calls,
            "hierarchy": dm.coalescing()["hierarchy"], "momentum_on": sorted(
        n for n, p in model.named_parameters() if p in dm and "momentum_buffer" in opt.state.get(p, {}))}


def merge_owned(results: list[dict]) -> dict[str, torch.Tensor]:
    """One full parameter set from the ranks' results (dedicated ones from their owners)."""
    merged = {}
    for r in results:
        for name, t in r["params"].items():
            merged.setdefault(name, t)
    return merged


def oracle_grads(config: GPTConfig = SMALL) -> dict[str, torch.Tensor]:
    """Single process: grads of one backward on global batch 0."""
    model = make_model(config)
    x, y = corpus().global_batch(0, GLOBAL_BATCH, config.seq_len)
    _loss(model, x, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def dmuon_owner_grads(mode: str, config: GPTConfig = SMALL) -> dict[str, torch.Tensor]:
    """One backward under DMuon; the dedicated grads this rank owns (after reduce-to-owner),
    and the names whose grad is None here (non-owners must have dropped theirs)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh_of(mode)
    model = make_model(config)
    z3 = mode.removesuffix("/undeclared").endswith("z3")
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3, **declared(mesh, mode))
    wrapped = DistributedDataParallel(model) if mode == "ddp" else model
    x, y = corpus().global_batch(0, GLOBAL_BATCH, config.seq_len)
    _loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    owned = {id(p) for p in dm.owned()}
    grads, dropped = {}, []
    for n, p in model.named_parameters():
        if p in dm:
            if id(p) in owned:
                grads[n] = p.grad.clone()
            elif p.grad is None:
                dropped.append(n)
    return {"grads": grads, "dropped": dropped, "n_dedicated": len(dm)}


def expect_error(case: str) -> str:
    """Run one bad-input case; return the exception type and message raised on this rank."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    model = make_model()
    try:
        if case == "non_2d_param":
            dmuon.dedicate_params(model, _mesh("flat"), params=[model.blocks[0].ln1.weight])
        elif case == "param_not_in_model":
            dmuon.dedicate_params(model, _mesh("flat"), params=[nn.Parameter(torch.zeros(4, 4))])
        elif case == "mesh_3d":
            mesh = init_device_mesh("cpu", (1, 2, world // 2), mesh_dim_names=("a", "replicate", "shard"))
            dmuon.dedicate_params(model, mesh)
        elif case == "mesh_axes_swapped":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("shard", "replicate"))
            dmuon.dedicate_params(model, mesh)
        elif case == "mesh_not_world":
            # every rank builds the same 2-D mesh, then passes its 1-D row (N = W/2)
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "row"))
            dmuon.dedicate_params(model, mesh["row"])
        elif case == "plan_mismatch":
            # rank 1 builds a wider model: the plan digests differ
            if rank == 1:
                model = make_model(GPTConfig(seq_len=16, d_model=48, n_layers=1, n_heads=2))
            dmuon.dedicate_params(model, _mesh("flat"))
        elif case == "bucket_cap_mismatch":  # the same model, rank 1 another bucket cap
            dmuon.dedicate_params(model, _mesh("flat"), bucket_cap_mb=25 if rank != 1 else 1)
        elif case == "coalesce_mismatch":  # rank 1 coalesces differently: other buckets
            dmuon.dedicate_params(model, _mesh("flat"), coalesce="auto" if rank != 1 else "block")
        elif case == "rest_mismatch":  # rank 1 leaves the rest to a wrapper: no rest all_reduce
            dmuon.dedicate_params(model, _mesh("flat"), rest="replicate" if rank != 1 else "wrapper")
        elif case == "coalesce_invalid":
            dmuon.dedicate_params(model, _mesh("flat"), coalesce="fastest")
        elif case == "hierarchy_mismatch":  # rank 1 keeps HSDP's replicate calls, the others go flat
            dmuon.dedicate_params(model, _mesh("hsdp"), hierarchy="auto" if rank != 1 else "hierarchical")
        elif case == "one_rank_invalid":  # only rank 1's argument is invalid: no rank may hang
            dmuon.dedicate_params(model, _mesh("flat"), coalesce="fastest" if rank == 1 else "auto")
        elif case == "hierarchy_invalid":
            dmuon.dedicate_params(model, _mesh("hsdp"), hierarchy="2d")
        elif case == "link_invalid":
            dmuon.dedicate_params(model, _mesh("flat"), link="infiniband")
        elif case == "link_mismatch":  # rank 1 follows NCCL's policy on gloo: other calls, caught
            dmuon.dedicate_params(model, _mesh("flat"), link="nccl" if rank == 1 else "auto")
        elif case == "already_ddp":
            dmuon.dedicate_params(DistributedDataParallel(model), _mesh("flat"))
        elif case == "optimizer_missing_params":
            dm = dmuon.dedicate_params(model, _mesh("flat"))
            dmuon.DMuon([model.head.weight], dedicated=dm)
        elif case == "optimizer_param_groups":  # groups are taken; AdamW's amsgrad is not
            dm = dmuon.dedicate_params(model, _mesh("flat"))
            params = list(model.parameters())
            dmuon.DMuon([{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
                         {"params": [p for p in params if p.ndim < 2], "amsgrad": True}], dedicated=dm)
        elif case == "optimizer_add_param_group":
            dm = dmuon.dedicate_params(model, _mesh("flat"))
            opt = dmuon.DMuon(model.parameters(), dedicated=dm)
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
        else:
            raise AssertionError(case)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def fewer_matrices_than_ranks(steps: int) -> dict:
    """Only 2 dedicated matrices on 4 ranks: two owners idle, training still works."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    dm = dmuon.dedicate_params(model, _mesh("flat"), params=["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight"])
    ddp = DistributedDataParallel(model)
    opt = dmuon.DMuon(ddp.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    losses = []
    for step in range(steps):
        x, y = corpus().global_batch(step, GLOBAL_BATCH, SMALL.seq_len)
        loss = _loss(ddp, local_slice(x, rank, world), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"owned": len(dm.owned()), "ns_calls": opt.ns_calls, "losses": losses}


class _SkipMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 2)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.a(x))
        if use_b:
            h = torch.relu(self.b(h))
        return self.out(h)


def unused_param() -> dict:
    """`b` unused in the first step on every rank: its owner gets grad None and no update
    (like torch.optim.Muon), even with weight decay; the next step (b used) still runs."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _SkipMLP()
    dm = dmuon.dedicate_params(model, _mesh("flat"), params=[model.a.weight, model.b.weight], reshard_after_forward=False)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, weight_decay=0.1, adamw_lr=ADAMW_LR)
    b_before = model.b.weight.detach().clone()
    x = torch.randn(4, 8)
    model(x, False).sum().backward()
    b_grad = model.b.weight.grad
    opt.step()
    b_after = model.b.weight.detach().clone()
    opt.zero_grad()
    model(x, True).sum().backward()  # the next step still runs (no hang, sequences aligned)
    got_grad = model.b.weight.grad is not None
    opt.step()
    return {"owns_b": dm.owner_of(model.b.weight) == rank, "b_grad": b_grad,
            "unchanged": torch.equal(b_before, b_after), "second_grad": got_grad,
            "momentum": "momentum_buffer" in opt.state.get(model.b.weight, {})}


def hsdp_replicate_waits() -> dict:
    """HSDP Z2: state_dict() and a second step() right after step() wait for the in-flight
    replicate broadcasts; returns what each rank held at both points."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh("hsdp")
    model = make_model()
    dm = dedicate(model, mesh, reshard_after_forward=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, ignored_params=set(dm))
    fully_shard(model, mesh=mesh, ignored_params=set(dm))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    x, y = corpus().global_batch(0, GLOBAL_BATCH, SMALL.seq_len)
    _loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    opt.step()
    holders = [b for b in dm.buckets if b.is_holder]
    issued = sum(b._replicate is not None for b in holders)
    sd = model.state_dict()
    after_state_dict = sum(b._replicate is not None for b in dm.buckets)
    at_state_dict = {b.names[0]: torch.cat([sd[n].reshape(-1) for n in b.names]).clone() for b in holders}
    opt.step()  # same grads again, while this step's replicate broadcasts would be in flight
    dm.wait_pending()
    return {"issued": issued, "holders": len(holders), "after_state_dict": after_state_dict,
            "at_state_dict": at_state_dict,
            "after_second_step": {b.names[0]: b.flat.clone() for b in holders}}
