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
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity import dmuon_tasks as T
from verify.workload.data import local_slice
from verify.workload.model import TinyGPT


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
    from dmuon.placement import layout_for

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    is_shard = layout_for(mesh).is_data_sharded  # what DedicatedParams passes
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
            warn_if_not_averaged([("embed_tokens.weight", p)], False, dp_size=2, is_shard=is_shard)
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


# ------------------------------------------------------------------ scripts' own habits
def _micro_batches(step: int, micro: int):
    """This rank's slice of global batch ``step``, cut into ``micro`` micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    return [(local_slice(x, m, micro), local_slice(y, m, micro)) for m in range(micro)]


def wrapper_accumulation(mode: str, how: str, steps: int = 2, micro: int = 2) -> dict:
    """``steps`` steps of ``micro`` micro-batches each, accumulation told by ``how``:
    ``"dm"``: ``dm.no_sync()`` together with the wrapper's own (DDP's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync``), as the guide said before; ``"flag"``: only the wrapper's
    attribute (DDP: ``ddp.require_backward_grad_sync = last``, nanoGPT's way; FSDP2:
    ``model.set_requires_gradient_sync(last)``, torchtitan's); ``"ctx"``: only DDP's
    ``with ddp.no_sync():``. Returns this rank's authoritative params and the error text."""
    import contextlib

    wrapped, model, dm, opt = T.build(mode)

    def train():
        for step in range(steps):
            for m, (xs, ys) in enumerate(_micro_batches(step, micro)):
                last = m == micro - 1
                ctx = contextlib.ExitStack()
                if mode == "ddp":
                    if how == "flag":
                        wrapped.require_backward_grad_sync = last
                    elif not last:
                        ctx.enter_context(wrapped.no_sync())
                else:
                    model.set_requires_gradient_sync(last)
                if how == "dm" and not last:
                    ctx.enter_context(dm.no_sync())
                with ctx:
                    (T._loss(wrapped, xs, ys) / micro).backward()
            opt.step()
            opt.zero_grad()
    error = T.error_text(train)
    return {"error": error, "params": T.authoritative_params(model, dm) if error == "no error" else {}}


def rank0_model_state_dict(mode: str, after: str, wait_s: float) -> dict:
    """One step, then (``after="step"``) nothing or (``"eval"``) an eval forward under
    ``no_grad`` (nanoGPT's ``estimate_loss``), then ``if rank == 0: model.state_dict()`` with
    a checkpoint wait of ``wait_s`` seconds. Rank 0: the error text and seconds taken, and on
    success its state dict's dedicated values; the other ranks wait at a barrier (on the
    default group, which the lone call cannot pair with) and return their owned params."""
    import os
    import time

    os.environ["DMUON_CHECKPOINT_WAIT_S"] = str(wait_s)
    try:
        wrapped, model, dm, opt = T.build(mode)
        (xs, ys), = _micro_batches(0, 1)
        T._loss(wrapped, xs, ys).backward()
        opt.step()
        opt.zero_grad()
        if after == "eval":
            with torch.no_grad():
                T._loss(wrapped, xs, ys)
        out = {"owned": {n: p.detach().clone() for n, p in model.named_parameters()
                         if p in dm and any(p is q for q in dm.owned())}}
        if dist.get_rank() == 0:
            t0 = time.perf_counter()
            sd = {}
            out["error"] = T.error_text(lambda: sd.update(model.state_dict()))
            out["seconds"] = time.perf_counter() - t0
            out["state"] = {k: v.clone() for k, v in sd.items() if k in set(dm.names)}
        dist.barrier()
        every = {}  # the fix the error names: the same call on every rank
        out["every_rank_error"] = T.error_text(lambda: every.update(model.state_dict()))
        out["every_rank_state"] = {k: v.clone() for k, v in every.items() if k in set(dm.names)}
        return out
    finally:
        del os.environ["DMUON_CHECKPOINT_WAIT_S"]


def rank0_optimizer_state_dict(mode: str) -> dict:
    """One step; rank 0 saves ``opt.state_dict()`` (the warnings it gives), the object goes
    to every rank as a file would (``broadcast_object_list``), and every rank loads it into a
    fresh DMuon (the error text)."""
    wrapped, model, dm, opt = T.build(mode)
    (xs, ys), = _micro_batches(0, 1)
    T._loss(wrapped, xs, ys).backward()
    opt.step()
    opt.zero_grad()
    saved = [None]
    caught = []
    if dist.get_rank() == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saved[0] = opt.state_dict()
    dist.broadcast_object_list(saved, src=0)
    wrapped2, model2, dm2, opt2 = T.build(mode)
    return {"warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "error": T.error_text(lambda: opt2.load_state_dict(saved[0]))}


def per_rank_seed_start(mode: str) -> dict[str, torch.Tensor]:
    """nanoGPT seeds every rank differently before building the model
    (``torch.manual_seed(1337 + seed_offset)``); returns this rank's dedicated params after
    ``dedicate_params`` and one forward (every copy current under Z2 / DDP; owners under Z3)."""
    torch.manual_seed(1337 + dist.get_rank())
    model = TinyGPT(T.SMALL)
    mesh = T._mesh("hsdp" if mode.startswith("hsdp") else "flat")
    dm = T.dedicate(model, mesh, reshard_after_forward=mode.endswith("z3"))
    owned = {id(p) for p in dm.owned()}
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if p in dm and id(p) in owned}


def seeded_model(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in TinyGPT(T.SMALL).named_parameters()}


def grad_scaler_owner_inf(mode: str, steps: int = 3) -> dict:
    """``torch.amp.GradScaler`` over DMuon; at step 1 an Inf is planted into one dedicated
    grad before its reduce (a hook on the param, every rank), so only its owner's reduced
    grad holds it. Returns the scale after each ``update()``, whether the step was skipped
    (the planted param unchanged on its owner), and the rest's params (replicated)."""
    wrapped, model, dm, opt = T.build(mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    name = dm.names[0]
    planted = model.get_parameter(name)
    state = {"plant": False}

    def plant(g):
        return g.clone().fill_(float("inf")) if state["plant"] else g
    planted.register_hook(plant)
    scales, skipped = [], []
    for step in range(steps):
        (xs, ys), = _micro_batches(step, 1)
        state["plant"] = step == 1
        scaler.scale(T._loss(wrapped, xs, ys)).backward()
        before = [p.detach().clone() for p in dm.owned()]
        scaler.step(opt)
        scaler.update()
        after = list(dm.owned())
        skipped.append(bool(before) and all(torch.equal(a, b) for a, b in zip(before, after)))
        scales.append(float(scaler.get_scale()))
        opt.zero_grad()
    rest = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters() if p not in dm}
    return {"scales": scales, "skipped": skipped, "rest": rest,
            "owned": T.authoritative_params(model, dm)}


def optimizer_differs(case: str) -> str:
    """Rank 1 builds DMuon differently: ``"lr"`` (lr 0.03 against 0.02), ``"adamw_betas"``,
    ``"frozen"`` (a dedicated matrix frozen before DMuon is built), ``"bad"`` (an invalid lr
    on rank 1 only: its own ValueError there, the agreement's RuntimeError elsewhere)."""
    model = T.make_model()
    mesh = T._mesh("flat")
    dm = dmuon.dedicate_params(model, mesh)
    kw = dict(lr=0.02)
    if dist.get_rank() == 1:
        if case == "lr":
            kw["lr"] = 0.03
        elif case == "adamw_betas":
            kw["adamw_betas"] = (0.9, 0.95)
        elif case == "frozen":
            model.get_parameter(dm.names[0]).requires_grad_(False)
        elif case == "bad":
            kw["lr"] = -1.0
    wrapped = DistributedDataParallel(model)
    return T.error_text(lambda: dmuon.DMuon(wrapped.parameters(), dedicated=dm, **kw))


def frozen_after_build() -> str:
    """Rank 1 freezes a dedicated matrix after DMuon is built, then trains a step: the error
    text of that step (rank 0 trains normally and returns ``"no error"``)."""
    wrapped, model, dm, opt = T.build("ddp")
    if dist.get_rank() == 1:
        model.get_parameter(dm.names[0]).requires_grad_(False)
    (xs, ys), = _micro_batches(0, 1)

    def one():
        T._loss(wrapped, xs, ys).backward()
        opt.step()
    return T.error_text(one)


def replaced_after_dedicate(mode: str) -> dict:
    """``block.mlp.fc1.weight = nn.Parameter(...)`` between ``dedicate_params`` and wrapping
    (a re-initialisation by hand), then ``fully_shard(..., ignored_params=set(dm))`` / DDP and
    DMuon, one step. The error text, and whether the new param is the one DMuon steps."""
    model = T.make_model()
    mesh = T._mesh("flat")
    dm = T.dedicate(model, mesh, reshard_after_forward=mode == "z3")
    fc1 = model.blocks[0].mlp.fc1
    torch.manual_seed(5)
    fc1.weight = nn.Parameter(torch.randn(tuple(fc1.weight.shape)) * 0.02)
    new = fc1.weight
    result = {}

    def run():
        wrapped, opt = T.root_unit(model, mesh, dm, ddp=mode == "ddp")
        (xs, ys), = _micro_batches(0, 1)
        T._loss(wrapped, xs, ys).backward()
        opt.step()
        result["adopted"] = new in dm
    result["error"] = T.error_text(run)
    return result


# ------------------------------------------------------------------ a nanoGPT-style port
NANO_STEPS, NANO_MICRO, NANO_CLIP = 3, 2, 0.5


def _lr_factor(it: int) -> float:
    """A warm-up-then-decay schedule's factor at iteration ``it`` (nanoGPT's get_lr, scaled)."""
    return (0.5, 1.0, 0.8)[it]


def nanogpt_oracle(world: int, nudge: str | None = None) -> dict:
    """One process, the global batch as ``world * NANO_MICRO`` micro-batches: torch's Muon on the
    default targets + AdamW, each group's lr scaled by the schedule, torch's
    ``clip_grad_norm_`` over every param. ``nudge``: one of ``noise_floor.NUDGES``. Returns
    ``init`` and the params after each step (``steps``), as ``noise_floor.floors`` reads a run."""
    with oracle_threads(nudge):
        return _nanogpt_oracle(world, nudge)


def _nanogpt_oracle(world: int, nudge: str | None) -> dict:
    model = nudge_init_(T.make_model(), nudge)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    named = dict(model.named_parameters())
    targets = [n for n, p in named.items() if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]
    muon = torch.optim.Muon([named[n] for n in targets], lr=T.MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in targets], lr=T.ADAMW_LR)
    micro = world * NANO_MICRO
    after = []
    for it in range(NANO_STEPS):
        for opt, base in ((muon, T.MUON_LR), (adamw, T.ADAMW_LR)):
            opt.param_groups[0]["lr"] = base * _lr_factor(it)
        x, y = T.corpus().global_batch(it, T.GLOBAL_BATCH, T.SMALL.seq_len)
        for m in range(micro):
            (T._loss(model, local_slice(x, m, micro), local_slice(y, m, micro)) / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), NANO_CLIP)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"init": init, "steps": after, "muon": targets}


#: The modes the nanoGPT-style port runs in: DDP, FSDP2 Z2 / Z3 on a 1-D mesh, HSDP Z2 / Z3 on
#: a 2 x (W/2) ("replicate", "shard") mesh.
NANO_MODES = ("ddp", "z2", "z3", "hsdp-z2", "hsdp-z3")
#: What ``nanogpt_port`` may plant (its docstring).
NANO_PLANTS = ("one-lr", "no-opt-state", "extra-collective")


def _nano_build(mode: str, resume: dict | None = None):
    """The script's model, mesh, wrapping and optimizer for ``mode`` (:data:`NANO_MODES`):
    ``(wrapped, model, dm, opt)``. ``resume``: a saved model state dict, loaded into the bare
    model before anything is dedicated or wrapped (nanoGPT's ``init_from == 'resume'``)."""
    if mode not in NANO_MODES:
        raise ValueError(f"Invalid mode={mode!r}. Must be one of {NANO_MODES}.")
    rank, world = dist.get_rank(), dist.get_world_size()
    hsdp, z3 = mode.startswith("hsdp"), mode.endswith("z3")
    # nanoGPT seeds per rank (1337 + seed_offset; here rank 0's init is the oracle's); FSDP2
    # keeps each rank's own shard of the rest, so an FSDP2 script seeds alike (torchtitan does)
    torch.manual_seed(rank if mode == "ddp" else 0)
    model = TinyGPT(T.SMALL)
    if resume is not None:
        model.load_state_dict(resume)
    if hsdp:  # PORT: HSDP's 2-D mesh
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        # not a port line: the protocol NCCL's "auto" takes (gloo's would go flat on one unit)
        kw = {"hierarchy": "hierarchical"}
    else:
        mesh, kw = init_device_mesh("cpu", (world,)), {}
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3, **kw)  # PORT
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for block in model.blocks:  # PORT: ignored_params
            fully_shard(block, mesh=mesh, reshard_after_forward=z3, ignored_params=set(dm))
        wrapped = fully_shard(model, mesh=mesh, ignored_params=set(dm))  # PORT: ignored_params
    opt = dmuon.DMuon(wrapped.parameters(), dedicated=dm, lr=T.MUON_LR, adamw_lr=T.ADAMW_LR)  # PORT
    return wrapped, model, dm, opt


def _nano_steps(mode: str, wrapped, opt, steps, micro: int, one_lr: bool = False, before=None,
                window=None, extra: bool = False) -> list[float]:
    """The script's iterations ``steps``, each of ``micro`` micro-batches (accumulation through
    the wrapper's own flag), the lr schedule written into every group, DMuon's clip; the clip's
    norms. ``before(it)`` runs at the top of each iteration (evaluation, checkpoint, the
    window's start); with a recording ``window`` each step is tagged and marked done;
    ``extra``: one unpredicted all_reduce in the first recorded forward."""
    import contextlib

    base = {"muon": T.MUON_LR, "adamw": T.ADAMW_LR}  # PORT: one base lr per part
    norms = []
    for it in steps:
        for group in opt.param_groups:
            part = "adamw" if one_lr else group["algorithm"]
            group["lr"] = base[part] * _lr_factor(it)  # PORT: per part
        if before is not None:
            before(it)
        recording = window is not None and window.recording
        tag = dmuon.phase if recording else (lambda name: contextlib.nullcontext())
        for m, (xs, ys) in enumerate(_micro_batches(it, micro)):
            last = m == micro - 1
            if mode == "ddp":
                wrapped.require_backward_grad_sync = last
            else:
                wrapped.set_requires_gradient_sync(last)
            with tag("forward"):  # PHASE D: the window's tags
                loss = T._loss(wrapped, xs, ys) / micro
                if extra and recording:
                    dist.all_reduce(torch.ones(3))
                    extra = False
            with tag("backward"):
                loss.backward()
        norms.append(float(opt.clip_grad_norm_(NANO_CLIP)))  # PORT (DDP): DMuon's clip
        opt.step()
        opt.zero_grad(set_to_none=True)
        if recording:
            window.step_done(loss)
    return norms


def nanogpt_port(mode: str, out_dir: str, checkpoint: bool = True, plant: tuple[str, ...] = (),
                 micro: int = NANO_MICRO) -> dict:
    """nanoGPT's ``train.py`` habits with only the lines docs/porting.md lists changed
    (``# PORT``): per-rank seeds, accumulation through the wrapper's own flag, an lr schedule
    written into ``param_group['lr']``, a clip between backward and step, an eval forward under
    ``no_grad`` then a checkpoint. ``mode``: one of :data:`NANO_MODES`: ``"ddp"`` (DDP,
    rank-0-only save as nanoGPT does it) or FSDP2 / HSDP (torchtitan's
    ``set_requires_gradient_sync``; every rank calls ``state_dict``, rank 0 saves).

    Along the way: a ``TrafficWindow`` built after the optimizer, started at iteration 2, after
    two warm-up steps and the checkpoint's iteration (with ``micro`` > 1 its ``start()``
    refuses: gradient accumulation); with ``checkpoint``, a resume after the run: a fresh
    model loads the saved model state dict (nanoGPT's resume, before wrapping) and each rank
    its own ``opt{rank}.pt``, then runs iterations 1 and 2 again.

    Returns this rank's authoritative params at the start (after ``DMuon`` is built: DDP's
    and ``dedicate_params``' broadcasts done), at the end and at the end of the resumed run
    (``start``, ``params``, ``resumed``), the clip's norms, the saved model state dict (rank
    0), and the window's outcome (``window``: ``"pass"``, ``"fail"`` or the error text).

    ``plant`` (controls), any of :data:`NANO_PLANTS`: ``"one-lr"``, nanoGPT's own schedule
    line left unported (every group gets the one lr, AdamW's: the Muon matrices step a
    fraction as far); ``"no-opt-state"``, the resume without the optimizer's state (a fresh
    DMuon: the momentum and AdamW's moments lost); ``"extra-collective"``, one unpredicted
    all_reduce inside the recorded window.
    """
    import os

    from verify.run.record import TrafficWindow

    bad = [p for p in plant if p not in NANO_PLANTS]
    if bad:
        raise ValueError(f"Invalid plant={bad!r}. Must be any of {NANO_PLANTS}.")
    rank = dist.get_rank()
    wrapped, model, dm, opt = _nano_build(mode)
    start = T.authoritative_params(model, dm)
    window = TrafficWindow(wrapped, dm, opt, out_dir=os.path.join(out_dir, "window"))  # PHASE D
    ckpt = os.path.join(out_dir, "ckpt.pt")
    out = {"start": start, "saved": None, "window": None}

    def before(it: int) -> None:
        if it == 1 and checkpoint:  # estimate_loss, then the checkpoint
            wrapped.eval()
            with torch.no_grad():
                (xs, ys), = _micro_batches(it, 1)
                T._loss(wrapped, xs, ys)
            wrapped.train()
            if mode == "ddp":  # nanoGPT: if master_process: torch.save(...)
                if rank == 0:
                    out["saved"] = {k: v.clone() for k, v in model.state_dict().items()}
            else:  # PORT: every rank calls state_dict under Z3, rank 0 saves
                sd = model.state_dict()
                full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in sd.items()}
                out["saved"] = full if rank == 0 else None
            if rank == 0:
                torch.save(out["saved"], ckpt)
            with warnings.catch_warnings():  # PORT: the optimizer's state per rank
                warnings.simplefilter("ignore", dmuon.runtime.checkpoint.PartialStateWarning)
                torch.save(opt.state_dict(), os.path.join(out_dir, f"opt{rank}.pt"))
        if it == 2:  # after the warm-up steps and the checkpoint's iteration
            try:
                window.start()
            except ValueError as exc:
                out["window"] = f"ValueError: {exc}"

    one_lr = "one-lr" in plant
    out["norms"] = _nano_steps(mode, wrapped, opt, range(NANO_STEPS), micro, one_lr, before, window,
                               "extra-collective" in plant)
    if window.recording:
        try:
            report = window.finish()
            out["window"] = "pass" if report is None or report["pass"] else "fail"
        except (ValueError, RuntimeError, AssertionError) as exc:
            out["window"] = f"{type(exc).__name__}: {exc}"
    out["params"] = T.authoritative_params(model, dm)
    dm.close()  # PORT
    if checkpoint:  # resume: a fresh job's model, the checkpoint, iterations 1 and 2 again
        wrapped, model, dm, opt = _nano_build(mode, torch.load(ckpt, weights_only=False))
        if "no-opt-state" not in plant:
            opt.load_state_dict(torch.load(os.path.join(out_dir, f"opt{rank}.pt"), weights_only=False))
        _nano_steps(mode, wrapped, opt, range(1, NANO_STEPS), micro, one_lr)
        out["resumed"] = T.authoritative_params(model, dm)
        dm.close()  # PORT
    return out
