"""Rank-side task functions for the checkpoint tests (run inside DistributedPool).

Every run trains the small GPT of ``dmuon_tasks`` (or, with ``kind="experts"``, the MoE of
``examples/experts.py``, whose experts are 3-D stacks and whose routers are plain 2-D params)
with two micro-batches per step (the first
inside ``dm.no_sync()``, and ``ddp.no_sync()`` under DDP), so a checkpoint can be taken
between micro-batches. A rank's *snapshot* is everything it is authoritative for: its owned
dedicated params and their momentum, and its local AdamW params and state (FSDP2 shards).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from tests.distributed.parity import dmuon_tasks as T
from tracer.interposer import Interposer
from verify.workload.data import local_slice

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "user-guide.md"
MICRO_BATCHES = 2


def _make(kind: str) -> torch.nn.Module:
    if kind == "gpt":
        return T.make_model()
    from examples.experts import ExpertsMLP

    torch.manual_seed(0)
    return ExpertsMLP()


def _global_batch(kind: str, step: int):
    if kind == "gpt":
        return T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
    from examples.my_model import _batch

    return _batch(0, step)  # one batch of 16 rows, split over ranks and micro-batches


class Run:
    """One model + DMuon on this rank: ``mode`` is "ddp", "z2", "z3", "hsdp-z2" or "hsdp-z3",
    optionally with ``/<hierarchy>`` (``dedicate_params(hierarchy=...)``, default "auto");
    ``kind`` "gpt" (the small GPT) or "experts" (``examples.experts.ExpertsMLP``)."""

    def __init__(self, mode: str, kind: str = "gpt"):
        mode, _, hierarchy = mode.partition("/")
        self.mode, self.kind = mode, kind
        mesh = T._mesh("hsdp" if mode.startswith("hsdp") else "flat")
        self.model = _make(kind)
        reshard = mode.endswith("z3")
        self.dm = dmuon.dedicate_params(self.model, mesh, reshard_after_forward=reshard,
                                        hierarchy=hierarchy or "auto")
        if mode == "ddp":
            self.wrapped = DistributedDataParallel(self.model)
        else:
            for block in getattr(self.model, "blocks", None) or self.model.layers:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=set(self.dm))
            fully_shard(self.model, mesh=mesh, ignored_params=set(self.dm))
            self.wrapped = self.model
        self.opt = dmuon.DMuon(self.wrapped.parameters(), dedicated=self.dm, lr=T.MUON_LR, adamw_lr=T.ADAMW_LR)

    def step(self, step: int, *, between=None, after=None) -> None:
        """One optimizer step over MICRO_BATCHES micro-batches of global batch ``step``;
        ``between()`` runs after the first micro-batch, ``after()`` right after ``opt.step()``."""
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = _global_batch(self.kind, step)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        loss = T._loss if self.kind == "gpt" else (lambda m, a, b: torch.nn.functional.mse_loss(m(a), b))
        for m in range(MICRO_BATCHES):
            last = m == MICRO_BATCHES - 1
            with contextlib.ExitStack() as stack:
                if not last:
                    stack.enter_context(self.dm.no_sync())
                    if self.mode == "ddp":
                        stack.enter_context(self.wrapped.no_sync())
                xs, ys = local_slice(x, m, MICRO_BATCHES), local_slice(y, m, MICRO_BATCHES)
                (loss(self.wrapped, xs, ys) / MICRO_BATCHES).backward()
            if not last and between is not None:
                between()
        self.opt.step()
        if after is not None:
            after()
        self.opt.zero_grad()

    def dcp_save(self, path: str, options: StateDictOptions | None = None) -> None:
        model_sd, optim_sd = get_state_dict(self.wrapped, self.opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def dcp_load(self, path: str, options: StateDictOptions | None = None) -> None:
        model_sd, optim_sd = get_state_dict(self.wrapped, self.opt, options=options)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(self.wrapped, self.opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=options)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of what this rank is authoritative for, by name."""
        owned = {id(p) for p in self.dm.owned()}
        out = {}
        for name, p in self.model.named_parameters():
            state = self.opt.state.get(p, {})
            if p in self.dm:
                if id(p) in owned:
                    out[name] = p.detach().clone()
                    out[name + ":momentum"] = state["momentum_buffer"].clone()
                continue
            out[name] = _local(p).detach().clone()
            for key, value in state.items():
                out[f"{name}:{key}"] = _local(value).clone()
        return out

    def full_view(self) -> dict:
        """Owned dedicated params and momentum, full AdamW params and moments (gathered)."""
        owned = {id(p) for p in self.dm.owned()}
        out = {"owned": {}, "momentum": {}, "adamw": {}}
        for name, p in self.model.named_parameters():
            state = self.opt.state.get(p, {})
            if p in self.dm:
                if id(p) in owned:
                    out["owned"][name] = p.detach().clone()
                    out["momentum"][name] = state["momentum_buffer"].clone()
                continue
            out["adamw"][name] = _full(p).detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out["adamw"][f"{name}:{key}"] = _full(state[key]).clone()
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _diff(a: dict, b: dict) -> list[str]:
    """Names whose tensors are not bit-identical (or present in only one)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


STEPS = 3


def dcp_resume(mode: str, root: str, kind: str = "gpt") -> dict:
    """Checkpoints with DCP right after step(), between micro-batches and twice in a row.

    Returns ``sync_elements``: per save, the elements of the collectives DMuon issued in
    phase ``checkpoint`` on this rank (measured by the interposer), ``dedicated_elements``
    (P_M), and, per check, the names that are not bit-identical to the uninterrupted run:
    ``saving_run`` (the run that saved, continued), and ``resume_<ckpt>`` (a fresh model and
    optimizer that loaded ``<ckpt>`` and trained the remaining steps; of the two saves in a
    row, the second, whose sync is a no-op, is resumed from).
    """
    ref = Run(mode, kind)
    for s in range(STEPS):
        ref.step(s)
    expected = ref.snapshot()

    saver = Run(mode, kind)
    ckpt = {name: os.path.join(root, name) for name in ("after_step", "mid", "twice_1", "twice_2")}
    sync_elements = {}

    def save(name: str) -> None:
        with Interposer() as ip:
            saver.dcp_save(ckpt[name])
        sync_elements[name] = sum(e.count for e in ip.events if e.phase == "checkpoint")

    saver.step(0, after=lambda: save("after_step"))
    saver.step(1, between=lambda: save("mid"))
    save("twice_1")
    save("twice_2")
    saver.step(2)
    out = {"sync_elements": sync_elements, "dedicated_elements": sum(p.numel() for p in saver.dm.params),
           "saving_run": _diff(saver.snapshot(), expected)}
    for name, first_step in (("after_step", 1), ("mid", 1), ("twice_2", 2)):
        resumed = Run(mode, kind)
        resumed.dcp_load(ckpt[name])
        for s in range(first_step, STEPS):
            resumed.step(s)
        out[f"resume_{name}"] = _diff(resumed.snapshot(), expected)
    return out


def plain_resume(mode: str, root: str) -> dict:
    """``torch.save(model.state_dict())`` and ``opt.state_dict()`` on every rank, load, resume.

    Returns the diff of the resumed run against an uninterrupted one; ``p.norm()`` of every
    dedicated param right after ``step()`` (a float, or the error a freed copy raises) and
    right after the save (every rank must read the owner's values); and, after one more step (Z3: non-holders freed), a submodule's own
    ``state_dict()`` (must be the owner's values) and what a submodule's own
    ``load_state_dict()`` of the saved file left in it (must be the saved values).
    """
    rank = dist.get_rank()
    ref = Run(mode)
    for s in range(2):
        ref.step(s)
    expected = ref.snapshot()

    saver = Run(mode)
    paths = (os.path.join(root, f"model{rank}.pt"), os.path.join(root, f"optim{rank}.pt"))

    norm_before_sync = {}

    def save():
        for n, p in zip(saver.dm.names, saver.dm.params):
            try:
                norm_before_sync[n] = p.norm().item()
            except RuntimeError as exc:  # a Z3 non-holder's freed copy
                norm_before_sync[n] = str(exc)
        torch.save(saver.wrapped.state_dict(), paths[0])
        torch.save(saver.opt.state_dict(), paths[1])

    saver.step(0, after=save)
    norms = {n: p.norm().item() for n, p in zip(saver.dm.names, saver.dm.params)}
    resumed = Run(mode)
    resumed.wrapped.load_state_dict(torch.load(paths[0], weights_only=False))
    resumed.opt.load_state_dict(torch.load(paths[1], weights_only=False))
    resumed.step(1)
    diff = _diff(resumed.snapshot(), expected)

    mlp, prefix = resumed.model.blocks[0].mlp, "blocks.0.mlp."
    sub_state = {k: v.clone() for k, v in mlp.state_dict().items() if k.endswith("weight")}
    resumed.step(2)
    saved = torch.load(paths[0], weights_only=False)
    mlp.load_state_dict({k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)})
    sub_loaded = {k: _local(p).detach().clone() for k, p in mlp.named_parameters() if k.endswith("weight")}
    expected_loaded = {k[len(prefix):]: _local(v) for k, v in saved.items() if k.startswith(prefix)}
    return {"norms": norms, "norm_before_sync": norm_before_sync, "diff": diff, "sub_state": sub_state,
            "sub_loaded_diff": _diff(sub_loaded, {k: expected_loaded[k] for k in sub_loaded})}


def _options(flatten: bool) -> StateDictOptions | None:
    """Default options, or torchtitan's: a flat optimizer state dict."""
    return StateDictOptions(flatten_optimizer_state_dict=True) if flatten else None


def save_for_resize(mode: str, root: str, flatten: bool, kind: str = "gpt") -> dict:
    """Train 2 steps, save with DCP; return the full view."""
    run = Run(mode, kind)
    for s in range(2):
        run.step(s)
    run.dcp_save(root, _options(flatten))
    return run.full_view()


def load_resized(mode: str, root: str, flatten: bool, kind: str = "gpt") -> dict:
    """Load a checkpoint saved at another world size; return the full view, then train a step."""
    run = Run(mode, kind)
    run.dcp_load(root, _options(flatten))
    view = run.full_view()
    run.step(2)
    view["after_step_finite"] = all(torch.isfinite(p).all().item() for p in run.dm.owned())
    return view


def fresh_get_state_dict(mode: str) -> dict:
    """DCP's get_state_dict on a fresh optimizer must not step it (no Newton–Schulz, no AdamW
    step, values unchanged) and must list every dedicated param (momentum on owners only)."""
    run = Run(mode)
    before = run.snapshot()
    _, optim_sd = get_state_dict(run.wrapped, run.opt)
    owned_ids = {id(p) for p in run.dm.owned()}
    owned = {n for n, p in zip(run.dm.names, run.dm.params) if id(p) in owned_ids}
    entries = {n: sorted(optim_sd["state"][n]) for n in run.dm.names}
    return {"ns_calls": run.opt.ns_calls, "diff": _diff(run.snapshot(), before),
            "entries": entries, "owned": sorted(owned)}


def load_errors(case: str, root: str) -> str:
    """Bad loads: the exception type and message raised on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    run = Run("z3")
    run.step(0)
    try:
        if case == "assign":
            run.wrapped.load_state_dict(run.wrapped.state_dict(), assign=True)
        elif case == "swap_tensors":
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                run.wrapped.load_state_dict(run.wrapped.state_dict())
            finally:
                torch.__future__.set_swap_module_params_on_conversion(False)
        elif case == "other_ranks_optimizer":
            torch.save(run.opt.state_dict(), os.path.join(root, f"optim{rank}.pt"))
            dist.barrier()
            other = torch.load(os.path.join(root, f"optim{(rank + 1) % world}.pt"), weights_only=False)
            run.opt.load_state_dict(other)
        else:
            raise AssertionError(case)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


def readme_snippet(mode: str, root: str) -> list[str]:
    """Run the user guide's "Checkpointing" snippet after one step (it saves, then loads into the
    same model and optimizer); the next step must equal an uninterrupted run's."""
    ref = Run(mode)
    for s in range(2):
        ref.step(s)
    run = Run(mode)
    run.step(0)
    code = readme_checkpoint_code()
    exec(compile(code, str(GUIDE), "exec"), {"model": run.wrapped, "opt": run.opt, "ckpt_dir": root})
    run.step(1)
    return _diff(run.snapshot(), ref.snapshot())


def readme_checkpoint_code() -> str:
    """The first ```python block of the "Checkpointing" section of docs/user-guide.md."""
    text = GUIDE.read_text()
    section = text.split("\n## Checkpointing", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    if match is None:
        raise AssertionError("docs/user-guide.md: no python block in the Checkpointing section")
    return match.group(1)


def sync_params_on_rank0_only(timeout_s: float) -> str:
    """``if rank == 0: dm.sync_params()`` after a Z2 step (``model.state_dict()`` on one rank
    raises before any collective: ``test_dmuon_habit_errors.py``; the explicit call is the
    collective itself). Rank 0's broadcast waits for rank 1, which never joins; rank 1 outlives
    the timeout so its groups stay up. Returns rank 0's error text."""
    import time

    wrapped, model, dm, opt = T.build("z2", rest="replicate")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _global_batch("gpt", 0)
    T._loss(wrapped, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    opt.step()
    opt.zero_grad()
    if rank != 0:
        time.sleep(timeout_s + 5)
        return ""
    try:
        dm.sync_params()
    except RuntimeError as exc:
        return str(exc)
    return "no error"
