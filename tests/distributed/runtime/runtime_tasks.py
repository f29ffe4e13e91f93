"""Rank-side tasks for the runtime tests (state, exceptions, sync, residency, AC, MoE)."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon import annotate
from tests.distributed.parity.dmuon_tasks import (  # noqa: F401 - build: re-exported for the tasks
    ADAMW_LR, GLOBAL_BATCH, MUON_LR, SMALL, _loss, _mesh, build, corpus, make_model)
from verify.workload.data import local_slice


class Boom(Exception):
    """The injected failure."""


def batch(step: int, config=SMALL):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = corpus().global_batch(step, GLOBAL_BATCH, config.seq_len)
    return local_slice(x, rank, world), local_slice(y, rank, world)


def owned_params(model, dm) -> dict[str, torch.Tensor]:
    """Dedicated params this rank owns (authoritative values)."""
    dm.wait_pending()
    owned = {id(p) for p in dm.owned()}
    return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in owned}


def train_with_failure(mode: str, fail: str | None, wrap: bool, steps: int = 3, **dm_kw) -> dict:
    """Train ``steps`` steps; with ``fail``, an extra iteration before step 1 raises inside
    forward ("forward") or inside backward ("backward") on every rank and is abandoned
    (followed by zero_grad() for "backward", by nothing for "forward"). ``wrap=False`` leaves
    the non-dedicated params unwrapped (neither DDP nor FSDP2 recovers from an exception
    inside backward by itself: DDP raises at the next forward, FSDP2's results differ).
    Also returns DMuon's warnings."""
    import warnings

    wrapped, model, dm, opt = build(mode, wrap=wrap, **dm_kw)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        _train_failing(wrapped, model, opt, fail, steps)
    return {"params": owned_params(model, dm), "state": dm.state.name,
            "warnings": [str(w.message) for w in log if str(w.message).startswith("DMuon")]}


def _train_failing(wrapped, model, opt, fail: str | None, steps: int) -> None:
    for step in range(steps):
        if step == 1 and fail is not None:
            x, y = batch(step)
            target = model.blocks[0].mlp
            if fail == "forward":
                h = target.register_forward_hook(lambda *a: (_ for _ in ()).throw(Boom()))
                try:
                    _loss(wrapped, x, y).backward()
                except Boom:
                    pass
                h.remove()
            else:
                def bad(grad):
                    raise Boom()
                def arm(module, args, out):
                    out.register_hook(bad)

                h = target.fc1.register_forward_hook(arm)
                try:
                    _loss(wrapped, x, y).backward()
                except Boom:
                    pass
                h.remove()
                opt.zero_grad()
        x, y = batch(step)
        _loss(wrapped, x, y).backward()
        opt.step()
        opt.zero_grad()


def sync_and_residency(mode: str) -> dict:
    """After a step: a freed Z3 copy raises on read; sync_params makes every copy the owner's
    (counting its broadcasts); a second sync and the next forward broadcast nothing."""
    wrapped, model, dm, opt = build(mode)
    spans = []
    annotate.add_span_listener(spans.append)
    try:
        x, y = batch(0)
        _loss(wrapped, x, y).backward()
        opt.step()
        opt.zero_grad()
        errors = []
        for pname, p in zip(dm.names, dm.params):
            if dm.reshard_after_forward and not any(p is q for b in dm.buckets if b.is_holder for q in b.params):
                for name, fn in (("norm", lambda: p.norm()),
                                 ("save_param", lambda: torch.save(p, io.BytesIO())),
                                 # nn.init passes the tensor as a keyword (tensor=)
                                 ("init", lambda: torch.nn.init.kaiming_uniform_(p))):
                    try:
                        fn()
                        errors.append((name, "no error"))
                    except RuntimeError as exc:
                        errors.append((name, str(exc), pname))
                break
        dm.wait_pending()
        spans.clear()
        dm.sync_params()
        first = sum(s.name == "dmuon.sync" for s in spans)
        values = {n: p.detach().clone() for n, p in zip(dm.names, dm.params)}
        spans.clear()
        dm.sync_params()
        second = sum(s.name == "dmuon.sync" for s in spans)
        spans.clear()
        x, y = batch(1)
        _loss(wrapped, x, y).backward()
        forward_broadcasts = sum(s.name == "dmuon.broadcast" for s in spans)
        opt.step()
        opt.zero_grad()
    finally:
        annotate.remove_span_listener(spans.append)
    return {"errors": errors, "first": first, "second": second, "values": values,
            "forward_broadcasts": forward_broadcasts, "buckets": len(dm.buckets),
            "owned": [n for n, p in zip(dm.names, dm.params) if any(p is q for q in dm.owned())]}


def loaded_then_train(mode: str) -> dict:
    """sync_params, write the same values (owner's + 0.25) on every rank, params_loaded:
    no broadcast until the next step, and training continues from the written values."""
    wrapped, model, dm, opt = build(mode)
    x, y = batch(0)
    _loss(wrapped, x, y).backward()
    opt.step()
    opt.zero_grad()
    dm.sync_params()
    with torch.no_grad():
        for p in dm.params:
            p.add_(0.25)
    dm.params_loaded()
    spans = []
    annotate.add_span_listener(spans.append)
    try:
        x, y = batch(1)
        loss = _loss(wrapped, x, y)
        loss.backward()
    finally:
        annotate.remove_span_listener(spans.append)
    return {"loss": loss.item(), "broadcasts": sum(s.name == "dmuon.broadcast" for s in spans),
            "values": {n: p.detach().clone() for n, p in zip(dm.names, dm.params)} if not dm.reshard_after_forward else None}


def _apply_ac(model, variant: str) -> None:
    """Activation checkpointing of every block: torch.utils.checkpoint reentrant,
    non-reentrant (early stop on / off), or checkpoint_wrapper (non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    if variant == "wrapper":
        for i in range(len(model.blocks)):
            model.blocks[i] = checkpoint_wrapper(model.blocks[i])
        return
    for block in model.blocks:
        inner = block.forward

        def forward(x, inner=inner):
            if variant == "reentrant":
                return checkpoint(inner, x, use_reentrant=True)
            with set_checkpoint_early_stop(variant == "early-stop"):
                return checkpoint(inner, x, use_reentrant=False)

        block.forward = forward


def train_ac(mode: str, variant: str | None, steps: int = 3) -> dict:
    """verify-traffic's model and mode, every block checkpointed (``variant``, None = no AC);
    the interposer records steps 1.. ; returns events, layout and the owned params."""
    from tracer.interposer import Interposer
    from verify.modes.build import build as build_mode
    from verify.run.runner import train_step

    built = build_mode(mode, lambda: make_model(SMALL))
    if variant is not None:
        _apply_ac(built.model.module if mode == "dmuon-ddp" else built.model, variant)
    fc1 = (built.model.module if mode == "dmuon-ddp" else built.model).get_submodule("blocks.0.mlp.fc1")
    calls = []
    fc1.register_forward_pre_hook(lambda m, a: calls.append(1))
    interposer = Interposer()
    for step in range(steps):
        if step == 1:
            interposer.__enter__()
        x, y = batch(step)
        train_step(built.model, built.optimizer, x, y)
    interposer.__exit__(None, None, None)
    dm = built.dedicated
    dm.wait_pending()
    owned = {id(p) for p in dm.owned()}
    params = {n: p.detach().clone() for n, p in zip(dm.names, dm.params) if id(p) in owned}
    return {"events": interposer.events, "layout": built.layout, "params": params,
            "ns_calls": built.optimizer.ns_calls, "fc1_calls": len(calls)}


def _train_steps(wrapped, model, dm, opt, steps: int) -> dict:
    for step in range(steps):
        x, y = batch(step)
        _loss(wrapped, x, y).backward()
        opt.step()
        opt.zero_grad()
    return owned_params(model, dm)


def meta_init(mode: str, steps: int = 2) -> dict:
    """The documented meta-device flow (docs/user-guide.md 'Meta-device init'): build on meta,
    dedicate_params, to_empty, init the weights, wrap, optimizer; against the ordinary flow."""
    from tests.distributed.parity.dmuon_tasks import make_model as ordinary

    reshard = mode.endswith("z3")
    mesh = _mesh("flat")
    with torch.device("meta"):
        model = type(ordinary())(SMALL)
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard)
    model.to_empty(device="cpu")
    with torch.no_grad():  # the init: here the ordinary model's seeded values
        model.load_state_dict(ordinary().state_dict())
    wrapped = DistributedDataParallel(model)
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    got = _train_steps(wrapped, model, dm, opt, steps)
    wrapped, model, dm, opt = build("ddp" if mode == "ddp" else mode, wrap=False)
    wrapped = DistributedDataParallel(model)
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    ref = _train_steps(wrapped, model, dm, opt, steps)
    return {"got": got, "ref": ref}


def to_after_dedicate(mode: str, steps: int = 2) -> dict:
    """``.double()`` after dedicate_params re-binds the flat buffers: the same result as
    converting first (Z3 non-holders' freed copies become freed float64 copies)."""
    reshard = mode.endswith("z3")
    mesh = _mesh("flat")
    model = make_model().double()
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard)
    wrapped = DistributedDataParallel(model)
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    ref = _train_steps(wrapped, model, dm, opt, steps)
    model = make_model()
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard)
    error = None
    try:
        model.double()
    except RuntimeError as exc:
        error = str(exc)
        dm.sync_params()
        model.double()
    wrapped = DistributedDataParallel(model)
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    got = _train_steps(wrapped, model, dm, opt, steps)
    return {"got": got, "ref": ref, "error": error,
            "dtypes": sorted({str(b.flat.dtype) for b in dm.buckets})}


def train_mp(mode: str, steps: int = 3, reduce_dtype=torch.float32, output_dtype=None) -> dict:
    """bf16 mixed precision: one MixedPrecisionPolicy (``output_dtype`` as given) for
    dedicate_params and every fully_shard. ``mode``: ``z2``, ``z3``, ``hsdp-z3`` (FSDP2 per
    block and root), ``root`` (one root FSDP2 unit), ``ddp``, ``replicate`` (rest="replicate",
    nothing wraps). Returns owned params, their momentum dtypes and what forward computed in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                  output_dtype=output_dtype)
    rank = dist.get_rank()
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    model = make_model()
    reshard = mode.endswith("z3")
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard, mp_policy=policy,
                               rest="replicate" if mode == "replicate" else "wrapper")
    wrapped = model
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
    elif mode != "replicate":
        for block in model.blocks if mode != "root" else ():
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=set(dm), mp_policy=policy)
        fully_shard(model, mesh=mesh, ignored_params=set(dm), mp_policy=policy)
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    seen = []
    fc1 = model.blocks[0].mlp.fc1
    fc1.register_forward_hook(lambda m, a, out: seen.append((str(m.weight.dtype), str(out.dtype))))
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = _loss(wrapped, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = owned_params(model, dm)
    momentum = sorted({str(opt.state[p]["momentum_buffer"].dtype) for p in dm.owned() if p in opt.state})
    return {"params": params, "momentum": momentum, "seen": sorted(set(seen)), "losses": losses,
            "registered": sorted({str(p.dtype) for p in dm.params}), "rank": rank}


def readme_snippet(name: str) -> dict:
    """Run the docs/user-guide.md code block marked ``<!-- snippet: name -->`` on this rank, with
    ``model`` (TinyGPT), ``mesh`` (1-D), ``config``, ``loader`` (2 batches) and ``loss_fn``."""
    import pathlib
    import re

    import torch.nn.functional as F
    from verify.workload.model import TinyGPT

    text = (pathlib.Path(__file__).parents[3] / "docs" / "user-guide.md").read_text()
    match = re.search(rf"<!-- snippet: {re.escape(name)} -->\n```python\n(.*?)```", text, re.S)
    assert match, name
    ns = {
        "torch": torch, "dmuon": dmuon, "mesh": _mesh("flat"), "model": make_model(),
        "config": SMALL, "TinyGPT": TinyGPT, "DistributedDataParallel": DistributedDataParallel,
        "loader": [batch(0), batch(1)],
        "loss_fn": lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)),
    }
    exec(compile(match.group(1), f"docs/user-guide.md:{name}", "exec"), ns)
    dm, opt = ns["dm"], ns["opt"]
    return {"state": dm.state.name, "stepped": sum(len(s) > 0 for s in opt.state.values())}


def train_accumulate(mode: str, accumulate: bool, steps: int = 2) -> dict:
    """Gradient accumulation: the same micro-batch twice at half loss, the first inside
    ``dm.no_sync()`` (exactly the grads of one full-loss backward: halving is exact)."""
    wrapped, model, dm, opt = build(mode, wrap=False)
    for step in range(steps):
        x, y = batch(step)
        if accumulate:
            with dm.no_sync():
                (0.5 * _loss(wrapped, x, y)).backward()
            (0.5 * _loss(wrapped, x, y)).backward()
        else:
            _loss(wrapped, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": owned_params(model, dm)}


class _Reuse(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.b(self.a(torch.relu(self.a(x)))))


REUSE_STEPS, REUSE_ROWS = 3, 8


def _reuse_batch(step: int) -> torch.Tensor:
    return torch.randn(REUSE_ROWS, 8, generator=torch.Generator().manual_seed(500 + step))


def reuse_oracle() -> dict:
    """One process: torch.optim.Muon on ``a.weight`` (called twice per forward) and
    ``b.weight``, AdamW on the rest, the global batch."""
    torch.manual_seed(0)
    model = _Reuse()
    muon = torch.optim.Muon([model.a.weight, model.b.weight], lr=MUON_LR)
    adamw = torch.optim.AdamW(list(model.out.parameters()), lr=ADAMW_LR)
    for step in range(REUSE_STEPS):
        model(_reuse_batch(step)).square().mean().backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def z3_module_reuse(mode: str, coalesce: str = "block") -> dict:
    """A module called twice in one forward (``a``, then ``b`` once), DMuon + DDP, Z2 or Z3:
    the values of every param after REUSE_STEPS steps (``sync_params`` first) and the
    units of the DMuon forward broadcasts of the last step, in order (Z3 broadcasts ``a``'s
    bucket again for its second call unless its unit is the last, which stays allocated)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Reuse()
    dm = dmuon.dedicate_params(model, _mesh("flat"), params=[model.a.weight, model.b.weight],
                               reshard_after_forward=mode == "z3", coalesce=coalesce)
    wrapped = DistributedDataParallel(model)
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    spans = []
    for step in range(REUSE_STEPS):
        x = local_slice(_reuse_batch(step), rank, world)
        if step == REUSE_STEPS - 1:
            annotate.add_span_listener(spans.append)
        loss = wrapped(x).square().mean()
        annotate.remove_span_listener(spans.append)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dm.sync_params()
    return {"values": {n: p.detach().clone() for n, p in model.named_parameters()},
            "forward_broadcasts": [s.module for s in spans if s.name == "dmuon.broadcast"]}


def to_while_replicating(mode: str, move: bool, d: int = 512) -> dict:
    """HSDP: ``.double()`` right after ``step()``, while the owners' replicate broadcasts of
    two d x d matrices (1 MiB each at 512) are still in flight; then ``sync_params``. Returns
    every rank's dedicated values (float64) and how many broadcasts were pending."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d, bias=False), nn.Tanh(), nn.Linear(d, d, bias=False))
    dm = dmuon.dedicate_params(model, _mesh("hsdp"), params=["0.weight", "2.weight"],
                               reshard_after_forward=mode.endswith("z3"))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    g = torch.Generator().manual_seed(dist.get_rank())
    model(torch.randn(8 // world, d, generator=g)).square().mean().backward()
    opt.step()
    pending = sum(b._replicate is not None for b in dm.buckets)
    if move:
        model.double()
    dm.sync_params()
    return {"pending": pending, "values": {n: p.detach().double().clone() for n, p in model.named_parameters()}}
