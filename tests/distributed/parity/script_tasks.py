"""The training script people already have, written the FSDP2 way, on a
tiny HF Llama: ``fully_shard`` per decoder layer and at the root (``ignored_params=set(dm)``),
param groups with no weight decay on norms and embeddings, ``torch.nn.utils.clip_grad_norm_``
over ``model.parameters()``, MuonClip, a post-step hook that clamps the matrices, optionally
FSDP2's bf16 ``MixedPrecisionPolicy`` (on DMuon too) and ``layer.compile()``.

The oracle (one process) does the same arithmetic with torch alone: ``MatrixMuon``
(``torch.optim.Muon`` over every matrix) and ``torch.optim.AdamW`` with the same groups, the
grads averaged over the W ranks' batches, torch's ``clip_grad_norm_``, then QK-clip from maxima
it computes itself (``qk_clip_tasks``), then the clamp, in the order the script's post-hooks
run. Its bf16 form is the policy's arithmetic written out: fp32 masters, a bf16 copy of every
param (buffers stay fp32, as FSDP2 casts params only) that runs each rank's batch, each rank's
bf16 grads summed in fp32 and divided by W (``reduce_dtype=float32``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
from dmuon.optim.qk_clip import QKClip
from dmuon.optim.qk_clip_hf import attention_layers
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity import hf_tasks as H
from tests.distributed.parity import qk_clip_tasks as Q
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR, _mesh
from verify.modes.baselines import MatrixMuon

MAX_NORM = 0.5  # below the grad norm at every step (checked by the test): the clip bites
CLAMP = 0.05  # bites on part of the matrices' entries from step 1 on (checked by the test)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _no_decay(name: str) -> bool:
    return "norm" in name or "embed" in name


def _clamp_(params) -> int:
    """Clamp every tensor of ``params`` to [-CLAMP, CLAMP] in place; the entries it changed."""
    changed = 0
    for p in params:
        changed += int((p.abs() > CLAMP).sum())
        p.clamp_(-CLAMP, CLAMP)
    return changed


def oracle(world: int, steps: int, bf16: bool = False, nudge: str | None = None) -> dict:
    """One process (module docstring): initial params, the params after each step (``steps``)
    and after the last (``final``), the Muon params, and per step the grad norm before the clip
    and the matrix entries the clamp changed. ``nudge``: one of ``noise_floor.NUDGES``, or
    ``"halves"`` (bf16 only): each rank's bf16 grad as the mean of its batch's two halves' (the
    same arithmetic in other bf16 roundings)."""
    if nudge == "halves" and not bf16:
        raise ValueError("Invalid nudge='halves' with bf16=False. Must be a bf16 oracle.")
    halves = nudge == "halves"
    own = None if halves else nudge  # a nudge noise_floor knows
    with oracle_threads(own):
        model = nudge_init_(H.make_model("llama"), own)
        compute = H.make_model("llama") if bf16 else model  # bf16: the compute copy
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        named = dict(model.named_parameters())
        matrices = H.muon_matrices(model)
        muon = MatrixMuon([named[n] for n in matrices], list(matrices.values()), lr=MUON_LR)
        rest = [n for n in named if n not in matrices]
        adamw = torch.optim.AdamW([
            {"params": [named[n] for n in rest if not _no_decay(n)]},
            {"params": [named[n] for n in rest if _no_decay(n)], "weight_decay": 0.0},
        ], lr=ADAMW_LR)
        norms, clamped, after = [], [], []
        for step in range(steps):
            maxima: dict = {}
            handles = Q._record_maxima(compute, maxima)
            if bf16:
                _backward_bf16(model, compute, step, world, halves)
            else:
                (sum(H._loss(model, H.batch(step, r)) for r in range(world)) / world).backward()
            for h in handles:
                h.remove()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            for opt in (muon, adamw):
                opt.step()
                opt.zero_grad()
            Q._oracle_clip(model, maxima, Q.TAU, Q.ALPHA)
            with torch.no_grad():
                clamped.append(_clamp_(named[n] for n in matrices))
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return {"init": init, "steps": after, "final": after[-1], "muon": matrices,
                "norms": norms, "clamped": clamped}


def _backward_bf16(model, compute, step: int, world: int, halves: bool) -> None:
    """``model``'s grads: the mean over the W ranks of each rank's bf16 grads (``compute``, a
    bf16 copy of ``model``'s params), summed in fp32."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), compute.parameters()):
            q.data = p.detach().to(torch.bfloat16)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        ids = H.batch(step, r)
        for part in ids.chunk(2) if halves else [ids]:
            H._loss(compute, part).backward()
            for g, q in zip(grads, compute.parameters()):
                g.add_(q.grad.float(), alpha=part.shape[0] / ids.shape[0])
                q.grad = None
    for p, g in zip(model.parameters(), grads):
        p.grad = g.div_(world)


#: What ``train(..., out_dir=...)`` may plant (its docstring).
PLANTS = ("no-opt-state",)


def _build(mode: str, bf16: bool, backend: str | None):
    """The script's setup on this rank: ``(model, dm, opt, heads)`` (``heads``: the query
    heads QK-clip watches, for a ``TrafficWindow``)."""
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    mp = BF16 if bf16 else MixedPrecisionPolicy()
    z3 = mode.endswith("z3")
    model = H.make_model("llama")
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3, mp_policy=mp)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3, mp_policy=mp, ignored_params=set(dm))
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=set(dm))
    if backend is not None:
        torch._dynamo.reset()
        for layer in model.model.layers:
            layer.compile(backend=backend)
    named = dict(model.named_parameters())
    opt = dmuon.DMuon([
        {"params": [p for n, p in named.items() if not _no_decay(n)]},
        {"params": [p for n, p in named.items() if _no_decay(n)], "weight_decay": 0.0},
    ], dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    layers = attention_layers(model)
    QKClip(opt, layers, tau=Q.TAU, alpha=Q.ALPHA)

    def clamp(optimizer, args, kwargs):  # the owners' masters; DMuon refreshes every copy after
        with torch.no_grad():
            _clamp_(dm.owned())

    opt.register_step_post_hook(clamp)
    return model, dm, opt, model.config.num_attention_heads * len(layers)


def _steps(model, dm, opt, steps, clip: bool, window=None, read: bool = True) -> dict:
    """The script's steps ``steps`` on this rank (module docstring); with ``window`` (a
    ``TrafficWindow``), started before the last step and finished right after it (before this
    task reads the params and the norms: collectives of the test's own), that step tagged
    (``window``: ``"pass"``, ``"fail"`` or the error text). ``read=False``: no
    ``dm.sync_params()`` and no params read after each step (before a window: either refreshes
    DMuon's copies, which a recorded step's forward must do itself)."""
    import contextlib

    rank = dist.get_rank()
    named = dict(model.named_parameters())
    totals, full, owned_steps, outcome = [], [], [], None
    owned = {id(p) for p in dm.owned()}
    for step in steps:
        recording = window is not None and step == steps[-1]
        if recording:
            window.start()
        tag = dmuon.phase if recording else (lambda name: contextlib.nullcontext())
        with tag("forward"):  # PHASE D: the window's tags
            loss = H._loss(model, H.batch(step, rank))
        with tag("backward"):
            loss.backward()
        if clip:
            totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        if recording:
            window.step_done(loss)
            try:
                report = window.finish()
                outcome = "pass" if report is None or report["pass"] else "fail"
            except (ValueError, RuntimeError, AssertionError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
        if not read:
            continue
        dm.sync_params()
        full.append({n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in model.named_parameters()})
        owned_steps.append({n: p.detach().clone() for n, p in named.items() if id(p) in owned})
    norms = [float(t.full_tensor() if hasattr(t, "full_tensor") else t) for t in totals]
    return {"owned_steps": owned_steps, "steps": full, "norms": norms, "window": outcome}


def train(mode: str, steps: int, bf16: bool = False, backend: str | None = None,
          clip: bool = True, out_dir: str | None = None, plant: tuple[str, ...] = ()) -> dict:
    """The script on this rank, ``mode`` z2 / z3 / hsdp-z2 / hsdp-z3; ``bf16``: FSDP2's and
    DMuon's ``MixedPrecisionPolicy(bf16, reduce fp32)``; ``backend``: each decoder layer
    compiled (``layer.compile(backend=...)``); ``clip=False``: the control without torch's
    clip. Returns, after each step's ``dm.sync_params()``, the owned dedicated params
    (``owned_steps``) and every param in full on this rank (``steps``, to compare ranks;
    ``full``: after the last), the norms the clip returned, and the owned dedicated params
    once ``DMuon`` is built (``start``).

    With ``out_dir`` (``steps`` >= 4), what a real job adds: a ``TrafficWindow`` recording the
    last step (``window``: ``"pass"``, ``"fail"`` or the error text), after a step whose params
    are not read (``owned_steps`` and ``steps`` skip it; a read, like a checkpoint, refreshes
    DMuon's copies); a DCP checkpoint after step 1 (``get_state_dict`` + ``dcp.save``, every
    rank) and, after the run, a resume from it (a fresh setup, ``dcp.load`` +
    ``set_state_dict``) that runs the steps after it again: every param in full after its last
    (``resumed``). ``plant`` (controls): ``"no-opt-state"``,
    the resume loads the model's state only."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    from verify.run.record import TrafficWindow

    bad = [p for p in plant if p not in PLANTS]
    if bad or (out_dir is not None and steps < 4):
        raise ValueError(f"Invalid plant={plant!r}, steps={steps} with out_dir={out_dir!r}. Must be "
                         f"any of {PLANTS}; steps >= 4 with an out_dir.")
    model, dm, opt, heads = _build(mode, bf16, backend)
    start = {n: p.detach().clone() for n, p in model.named_parameters()
             if id(p) in {id(q) for q in dm.owned()}}
    if out_dir is None:
        out = _steps(model, dm, opt, range(steps), clip)
        del out["window"]
        return {**out, "full": out["steps"][-1], "start": start}
    ckpt = os.path.join(out_dir, "ckpt")
    window = TrafficWindow(model, dm, opt, out_dir=os.path.join(out_dir, "window"),  # PHASE D
                           qk_clip_heads=heads)
    out = _steps(model, dm, opt, range(1), clip)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    parts = [_steps(model, dm, opt, range(1, steps - 2), clip),
             _steps(model, dm, opt, range(steps - 2, steps - 1), clip, read=False),
             _steps(model, dm, opt, range(steps - 1, steps), clip, window)]
    dm.close()
    outcome = parts[-1]["window"]
    for part in parts:
        out = {k: out[k] + part[k] for k in ("owned_steps", "steps", "norms")}
    model, dm, opt, heads = _build(mode, bf16, backend)  # the resume: a fresh job's setup
    model_sd, optim_sd = get_state_dict(model, opt)
    if "no-opt-state" in plant:  # (dcp.load fills optim_sd's tensors, the optimizer's own, in place)
        dcp.load({"model": model_sd}, checkpoint_id=ckpt)
        set_model_state_dict(model, model_sd)
    else:
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    resumed = _steps(model, dm, opt, range(1, steps), clip)
    dm.close()
    return {**out, "full": out["steps"][-1], "start": start, "window": outcome,
            "resumed": resumed["steps"][-1]}
