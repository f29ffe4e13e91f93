"""Rank-side tasks of the torch.compile tests: DMuon's hooks inside compiled blocks.

Public API only (``dedicate_params``, ``fully_shard``, ``DMuon``, ``nn.Module.compile``), so the
tests keep their meaning whatever the runtime's hooks look like inside.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
from tests.distributed.parity import dmuon_tasks as T
from tracer.fr.parse import dump_flight_recorder, fr_window, read_flight_recorder
from verify.workload.data import local_slice


#: The mixed-precision policy of the ``mp=True`` runs, given to DMuon and fully_shard alike.
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(mode: str, backend: str | None, mp: bool = False, whole: bool = False):
    """TinyGPT under DMuon Z2 / Z3 + FSDP2 (with :data:`BF16` on both when ``mp``); each
    block compiled in place when ``backend`` (the whole model when ``whole``)."""
    mesh = T._mesh("flat")
    model = T.make_model()
    reshard = mode == "z3"
    policy = {"mp_policy": BF16} if mp else {}
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard, **policy)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=set(dm), **policy)
    fully_shard(model, mesh=mesh, ignored_params=set(dm), **policy)
    if backend is not None and whole:
        model.compile(backend=backend)
    elif backend is not None:
        for block in model.blocks:
            # In place (module names, hence the plan and state_dict keys, stay as they are);
            # torch.compile(block) re-registered as the block is the same compiled region.
            block.compile(backend=backend)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=T.MUON_LR, adamw_lr=T.ADAMW_LR)
    return model, dm, opt


def train(mode: str, backend: str | None, steps: int, fr_dir: str, mp: bool = False,
          whole: bool = False) -> dict:
    """Train ``steps`` steps; returns the params this rank holds authoritative values of
    (owned dedicated ones, full non-dedicated ones), the losses, Dynamo's graph count, and the
    collectives of the last step as (op, count, group, root) in issue order, read from the
    Flight Recorder (C++ side; the interposer, a TorchDispatchMode, would make Dynamo skip
    the compiled frames). Needs a pool started with ``flight_recorder_env()``. ``mp`` and
    ``whole``: :func:`_build`'s.
    """
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # a forked rank on a shared 2-core machine
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, dm, opt = _build(mode, backend, mp, whole)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's "cannot trace pybind11 builtin" notes
        for step in range(steps):
            if step == steps - 1:
                before = read_flight_recorder(dump_flight_recorder(f"{fr_dir}/before", rank)).events
            x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
            loss = T._loss(model, local_slice(x, rank, world), local_slice(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    after = read_flight_recorder(dump_flight_recorder(f"{fr_dir}/after", rank)).events
    calls = [(e.op, e.count, e.group_id, e.root) for e in fr_window(before, after)]
    params = T.authoritative_params(model, dm)
    stats = torch._dynamo.utils.counters["stats"]
    return {"params": params, "losses": losses, "calls": calls,
            "graphs": stats["unique_graphs"], "frames": stats["calls_captured"]}


def graph_breaks(mode: str, mp: bool = False, whole: bool = False) -> dict:
    """``torch._dynamo.explain`` of the first block with DMuon's hooks (every rank must run it:
    the hooks issue collectives), with :data:`BF16` when ``mp`` (the block's input then in
    bf16, as FSDP2's root unit hands it on); of the whole model on a token batch when
    ``whole``. Returns graph / break counts and the distinct reasons."""
    import torch._dynamo

    torch._dynamo.reset()
    model, dm, _ = _build(mode, None, mp)
    if whole:
        target, x = model, T.corpus().global_batch(0, 2, T.SMALL.seq_len)[0]
    else:
        target = model.blocks[0]
        x = torch.randn(2, T.SMALL.seq_len, T.SMALL.d_model, dtype=torch.bfloat16 if mp else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(target)(x)
    reasons = []
    for r in explained.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f"{frame.filename.rpartition('/')[2]}:{frame.lineno} {frame.name}" if frame else "?"
        first = next((line.strip() for line in r.reason.splitlines() if "Explanation" in line),
                     r.reason.splitlines()[0])
        reasons.append(f"{where}: {first}")
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "reasons": sorted(set(reasons))}


def oracle(steps: int, backend: str | None) -> dict[str, torch.Tensor]:
    """Single process, no DMuon: torch.optim.Muon + AdamW on the full batch, blocks compiled
    with ``backend`` (``None``: eager). Eager vs inductor here is inductor's own drift."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = T.make_model()
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend)
    modules = dict(model.named_modules())
    named = dict(model.named_parameters())
    targets = [n for n, p in named.items() if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]
    muon = torch.optim.Muon([named[n] for n in targets], lr=T.MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in targets], lr=T.ADAMW_LR)
    for step in range(steps):
        x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
        T._loss(model, x, y).backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def readme_snippet(code: str) -> dict:
    """Run the user guide's torch.compile snippet on TinyGPT, then two steps; Dynamo's graph
    count and the losses."""
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    scope = {"dmuon": dmuon, "fully_shard": fully_shard, "model": T.make_model(), "mesh": T._mesh("flat")}
    exec(code, scope)  # noqa: S102 - the user guide's own snippet
    model, opt = scope["model"], scope["opt"]
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
            loss = T._loss(model, local_slice(x, rank, world), local_slice(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "losses": losses}
